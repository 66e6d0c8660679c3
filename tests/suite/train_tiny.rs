//! `examples/train_tiny`'s `--resume` option check: a checkpoint records the options of its run,
//! and a resume with other ones is refused, naming each.

use clap::Parser;

#[path = "../../examples/train_tiny/args.rs"]
#[allow(dead_code)]
mod args;
#[path = "../../examples/train_tiny/options.rs"]
mod options;

fn parse(flags: &[&str]) -> args::Args {
    args::Args::parse_from(std::iter::once("train_tiny").chain(flags.iter().copied()))
}

#[test]
fn a_resume_with_other_options_is_refused_naming_them() {
    let saved = options::run_options(&parse(&["--batch", "16", "--accum", "2"]));
    // The same run, also on another backend, into another folder, with other checkpoints.
    let same = parse(&[
        "--accum",
        "2",
        "--resume",
        "--checkpoint-every",
        "7",
        "--out",
        "elsewhere",
    ]);
    assert_eq!(options::check_options(&saved, &same), Ok(()));
    let other = parse(&[
        "--batch", "8", "--accum", "2", "--qat", "mxfp4", "--steps", "900", "--resume",
    ]);
    let err = options::check_options(&saved, &other).unwrap_err();
    for part in [
        "--batch 16 (now 8)",
        "--qat none (now mxfp4)",
        "--steps 600 (now 900)",
    ] {
        assert!(err.contains(part), "{part} in: {err}");
    }
    assert!(!err.contains("--accum"), "{err}");
    // Each recorded option, changed alone, is refused.
    for (flag, value) in [
        ("--devices", "2"),
        ("--lr", "0.02"),
        ("--seed", "1"),
        ("--optimiser", "adamw"),
        ("--balancer", "sign"),
        ("--short-fraction", "0.5"),
    ] {
        let changed = parse(&["--accum", "2", flag, value]);
        let err = options::check_options(&saved, &changed).unwrap_err();
        assert!(err.contains(flag), "{flag}: {err}");
    }
    // A checkpoint written before options were recorded is taken as it is.
    assert_eq!(
        options::check_options(&serde_json::Value::Null, &other),
        Ok(())
    );
}
