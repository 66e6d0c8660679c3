//! The Kimi tokenizer against golden encodings of OpenAI's `tiktoken` (Python) on a small BPE in
//! Kimi's format (`tests/fixtures/tokenizer`, written by `scripts/make_test_tokenizer.py`).

use std::path::{Path, PathBuf};

use kimi_burn::tokenizer::{Tokenizer, NUM_SPECIAL_TOKENS};
use kimi_burn::Error;
use rand::Rng;

use crate::common::rng;

pub(crate) fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
}

fn golden() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture().join("golden.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Every golden text encodes to tiktoken's ids (special tokens, Han runs, contractions in both
/// cases, digit groups, whitespace runs, emoji) and decodes back.
#[test]
fn encodings_match_tiktoken() {
    let tok = Tokenizer::from_dir(fixture()).unwrap();
    let golden = golden();
    assert_eq!(
        tok.num_base_tokens() as u64,
        golden["num_base_tokens"].as_u64().unwrap()
    );
    assert_eq!(tok.vocab_size(), tok.num_base_tokens() + NUM_SPECIAL_TOKENS);
    let cases = golden["encodings"].as_array().unwrap();
    assert!(cases.len() >= 8);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(tok.encode(text, true), want, "{text:?}");
        assert_eq!(tok.decode(&want).unwrap(), text);
    }
}

/// The special ids follow the BPE's: named ones from `tokenizer_config.json`, the rest reserved;
/// BOS and EOS come from its `bos_token` / `eos_token`. Without `allow_special` a special name is
/// plain text.
#[test]
fn special_tokens_follow_the_bpe() {
    let tok = Tokenizer::from_dir(fixture()).unwrap();
    let n = tok.num_base_tokens() as u32;
    assert_eq!(tok.bos_id(), Some(n));
    assert_eq!(tok.eos_id(), Some(n + 1));
    assert_eq!(tok.special_id("<|im_end|>"), Some(n + 2));
    let reserved = format!("<|reserved_token_{}|>", n + 100);
    assert_eq!(tok.special_id(&reserved), Some(n + 100));
    assert_eq!(tok.encode("[EOS]", true), vec![n + 1]);
    let plain = tok.encode("[EOS]", false);
    assert!(plain.iter().all(|&id| id < n), "{plain:?}");
    assert_eq!(tok.decode(&plain).unwrap(), "[EOS]");
    assert_eq!(tok.decode(&[n + 100]).unwrap(), reserved);
    let err = tok.decode(&[n + NUM_SPECIAL_TOKENS as u32]).unwrap_err();
    assert!(err.to_string().contains(&(n + 256).to_string()), "{err}");
}

/// Streaming gives the same text as decoding everything at once, also when tokens cut characters
/// apart (single bytes of multi-byte characters, invalid sequences, a character cut at the end).
#[test]
fn the_stream_decoder_equals_decoding_at_once() {
    let tok = Tokenizer::from_dir(fixture()).unwrap();
    let mut r = rng(91);
    let mut sequences: Vec<Vec<u32>> = vec![
        // "线性" byte by byte: the single-byte tokens are the bytes themselves in this BPE.
        "线性注意力".bytes().map(u32::from).collect(),
        // A character cut at the end.
        "ok 🦀".bytes().take(5).map(u32::from).collect(),
        // A continuation byte alone, then text.
        vec![0x80, 104, 105],
    ];
    for _ in 0..50 {
        let len = r.random_range(1..40);
        sequences.push(
            (0..len)
                .map(|_| r.random_range(0..tok.vocab_size() as u32))
                .collect(),
        );
    }
    for ids in sequences {
        let mut stream = tok.stream();
        let mut text = String::new();
        for &id in &ids {
            text.push_str(&stream.push(id).unwrap());
        }
        text.push_str(&stream.finish());
        assert_eq!(text, tok.decode(&ids).unwrap(), "{ids:?}");
    }
}

/// A copy of the fixture in a fresh folder, with `edit` applied.
fn broken(tag: &str, edit: impl FnOnce(&Path)) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kimi-burn-tok-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["tiktoken.model", "tokenizer_config.json"] {
        std::fs::copy(fixture().join(f), dir.join(f)).unwrap();
    }
    edit(&dir);
    dir
}

/// Applies `edit` to the folder's `tokenizer_config.json`.
fn edit_config(dir: &Path, edit: &dyn Fn(&mut serde_json::Value)) {
    let path = dir.join("tokenizer_config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut json);
    std::fs::write(&path, json.to_string()).unwrap();
}

/// Malformed files are errors naming the file and what is wrong.
#[test]
fn malformed_tokenizer_files_are_clear_errors() {
    let check = |tag: &str, edit: &dyn Fn(&Path), file: &str, needle: &str| {
        let dir = broken(tag, edit);
        let err = Tokenizer::from_dir(&dir).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(&dir.join(file).display().to_string()) && msg.contains(needle),
            "{tag}: {msg}"
        );
        std::fs::remove_dir_all(&dir).ok();
    };
    let model = |dir: &Path| dir.join("tiktoken.model");
    check(
        "line",
        &|d| {
            let text = std::fs::read_to_string(model(d)).unwrap();
            std::fs::write(model(d), text.replacen('\n', "\n%%% not-a-rank\n", 3)).unwrap();
        },
        "tiktoken.model",
        "line 2",
    );
    check(
        "rank",
        &|d| {
            let text = std::fs::read_to_string(model(d)).unwrap();
            std::fs::write(model(d), format!("{text}QUJD 7\n")).unwrap();
        },
        "tiktoken.model",
        "rank 7",
    );
    check(
        "missing",
        &|d| std::fs::remove_file(model(d)).unwrap(),
        "tiktoken.model",
        "No such file",
    );
    check(
        "added",
        &|d| {
            edit_config(d, &|json| {
                json["added_tokens_decoder"]["5"] = serde_json::json!({"content": "<|bad|>"})
            })
        },
        "tokenizer_config.json",
        "<|bad|>",
    );
    check(
        "eos",
        &|d| edit_config(d, &|json| json["eos_token"] = serde_json::json!("</s>")),
        "tokenizer_config.json",
        "</s>",
    );
    // The error type says which kind of problem it is.
    let dir = broken("kind", |d| {
        std::fs::write(model(d), "QQ== 0\n").unwrap();
    });
    assert!(matches!(
        Tokenizer::from_dir(&dir).unwrap_err(),
        Error::Tokenizer { .. }
    ));
    std::fs::remove_dir_all(&dir).ok();
}
