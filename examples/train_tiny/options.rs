//! `--resume`: the options a checkpoint records, compared with those of the run that resumes it.

use clap::ValueEnum;

use super::args::Args;

/// The options that make a run what it is (its data, model, schedule and optimiser), by flag,
/// as a checkpoint records them for `--resume` to compare ([`check_options`]). Left out: what
/// only says where or how it runs (`--backend`, `--out`, `--node` and its addresses,
/// `--checkpoint-every`, `--check-replicas`, `--test-sequences`, `--init`, whose weights the
/// checkpoint replaces).
pub(crate) fn run_options(args: &Args) -> serde_json::Value {
    fn name<T: ValueEnum>(v: &T) -> String {
        v.to_possible_value()
            .map_or_else(String::new, |v| v.get_name().to_string())
    }
    fn opt<T: ToString>(v: &Option<T>) -> String {
        v.as_ref().map_or_else(|| "unset".into(), T::to_string)
    }
    let options: serde_json::Map<String, serde_json::Value> = [
        ("--task", name(&args.task)),
        ("--steps", args.steps.to_string()),
        ("--batch", args.batch.to_string()),
        ("--accum", args.accum.to_string()),
        ("--devices", args.devices.to_string()),
        ("--nodes", args.nodes.to_string()),
        ("--seq-len", args.seq_len.to_string()),
        ("--pairs", args.pairs.to_string()),
        ("--filler", name(&args.filler)),
        ("--filler-tokens", opt(&args.filler_tokens)),
        ("--short-fraction", args.short_fraction.to_string()),
        ("--vocab", args.vocab.to_string()),
        ("--pattern", name(&args.pattern)),
        ("--balancer", name(&args.balancer)),
        ("--qb-bins", opt(&args.qb_bins)),
        ("--qb-smoothing", opt(&args.qb_smoothing)),
        ("--calibrate", args.calibrate.to_string()),
        ("--optimiser", name(&args.optimiser)),
        ("--lr", args.lr.to_string()),
        ("--seed", args.seed.to_string()),
        ("--reroute", args.reroute.to_string()),
        ("--load-window", args.load_window.to_string()),
        ("--qat", name(&args.qat)),
    ]
    .into_iter()
    .map(|(flag, value)| (flag.to_string(), value.into()))
    .collect();
    options.into()
}

/// `--resume`: the options of this run against those the checkpoint's run recorded
/// ([`run_options`]); an error lists every one that differs. A checkpoint without them (written
/// before they were recorded) is taken as it is.
pub(crate) fn check_options(saved: &serde_json::Value, args: &Args) -> Result<(), String> {
    let Some(saved) = saved.as_object() else {
        return Ok(());
    };
    let now = run_options(args);
    let differ: Vec<String> = now
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(flag, value)| {
            let was = saved.get(flag)?;
            (was != value).then(|| {
                let show = |v: &serde_json::Value| v.as_str().unwrap_or("?").to_string();
                format!("{flag} {} (now {})", show(was), show(value))
            })
        })
        .collect();
    if differ.is_empty() {
        return Ok(());
    }
    Err(format!(
        "--resume continues a run with the options it started with; the checkpoint's run had {}",
        differ.join(", ")
    ))
}
