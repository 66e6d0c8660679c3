//! The tokenizer of Kimi model folders: a tiktoken-style byte-level BPE (feature `tokenizer`).
//!
//! A Kimi model folder ships `tiktoken.model`, one BPE token per line (its bytes in base64, a
//! space, its rank, which is its id), and `tokenizer_config.json`, whose `added_tokens_decoder`
//! names the special tokens. Special tokens take the 256 ids right after the BPE's; an id there
//! without an entry is reserved and called `<|reserved_token_{id}|>`. Text is first split with
//! Kimi's pattern ([`KIMI_PATTERN`]: runs of Han characters, words with their contractions, up to
//! three digits, punctuation, whitespace) and each piece is merged by rank. The BPE itself is the
//! maintained `tiktoken-rs` crate's; this module reads the files and streams the decoding.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use base64::Engine;
use tiktoken_rs::{CoreBPE, Rank};

use crate::error::{Error, Result};

/// Kimi's pre-tokenisation pattern (as `tokenization_kimi.py` defines it; it intersects character
/// classes with `&&`, which the regex engine of `tiktoken-rs` supports).
pub const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// How many ids after the BPE's are special (named or reserved).
pub const NUM_SPECIAL_TOKENS: usize = 256;

/// A Kimi tokenizer: the BPE of `tiktoken.model` plus the special tokens.
pub struct Tokenizer {
    bpe: CoreBPE,
    num_base: usize,
    special_names: Vec<String>,
    bos: Option<u32>,
    eos: Option<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("num_base_tokens", &self.num_base)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

fn bad(path: &Path, reason: impl Into<String>) -> Error {
    Error::Tokenizer {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

impl Tokenizer {
    /// Reads `dir/tiktoken.model` and, when present, `dir/tokenizer_config.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config = dir.join("tokenizer_config.json");
        Self::from_files(
            dir.join("tiktoken.model"),
            config.is_file().then_some(config),
        )
    }

    /// Reads the BPE ranks from `model` (`tiktoken.model`) and the special tokens, BOS and EOS
    /// from `config` (`tokenizer_config.json`; without one every special id is reserved).
    pub fn from_files(model: impl AsRef<Path>, config: Option<PathBuf>) -> Result<Self> {
        let model = model.as_ref();
        let text = std::fs::read_to_string(model).map_err(|source| Error::Io {
            path: model.to_path_buf(),
            source,
        })?;
        let mut ranks: Vec<(Vec<u8>, Rank)> = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            let parsed = line.split_once(' ').and_then(|(b64, rank)| {
                let bytes = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
                Some((bytes, rank.trim().parse::<Rank>().ok()?))
            });
            match parsed {
                Some(entry) => ranks.push(entry),
                None => {
                    return Err(bad(
                        model,
                        format!(
                            "line {}: expected `<base64 bytes> <rank>`, got {line:?}",
                            n + 1
                        ),
                    ))
                }
            }
        }
        let num_base = ranks.len();
        if num_base < 256 {
            return Err(bad(
                model,
                format!("{num_base} tokens: a byte-level BPE has at least the 256 single bytes"),
            ));
        }
        let mut seen = vec![false; num_base];
        for (bytes, rank) in &ranks {
            match seen.get_mut(*rank as usize) {
                Some(s) if !*s => *s = true,
                _ => {
                    return Err(bad(
                        model,
                        format!(
                            "rank {rank} (token {bytes:?}) is repeated or outside 0..{num_base}: \
                             the ranks must be the ids 0..{num_base}, each once"
                        ),
                    ))
                }
            }
        }
        let mut named: HashMap<u32, String> = HashMap::new();
        let (mut bos, mut eos) = (None, None);
        if let Some(config) = &config {
            let text = std::fs::read_to_string(config).map_err(|source| Error::Io {
                path: config.clone(),
                source,
            })?;
            let json: serde_json::Value =
                serde_json::from_str(&text).map_err(|source| Error::Json {
                    path: config.clone(),
                    source,
                })?;
            if let Some(added) = json.get("added_tokens_decoder").and_then(|a| a.as_object()) {
                for (id, entry) in added {
                    let id: u32 = id.parse().map_err(|_| {
                        bad(
                            config,
                            format!("added_tokens_decoder: id {id:?} is not a number"),
                        )
                    })?;
                    let content =
                        entry
                            .get("content")
                            .and_then(|c| c.as_str())
                            .ok_or_else(|| {
                                bad(config, format!("added_tokens_decoder.{id}: no \"content\""))
                            })?;
                    if !(num_base..num_base + NUM_SPECIAL_TOKENS).contains(&(id as usize)) {
                        return Err(bad(
                            config,
                            format!(
                                "added token {content:?} has id {id}, outside the special ids \
                                 {num_base}..{}",
                                num_base + NUM_SPECIAL_TOKENS
                            ),
                        ));
                    }
                    named.insert(id, content.to_owned());
                }
            }
            // `bos_token` / `eos_token`: a string, or an object with `content`.
            let token = |key: &str| -> Result<Option<u32>> {
                let Some(v) = json.get(key) else {
                    return Ok(None);
                };
                let Some(name) = v
                    .as_str()
                    .or_else(|| v.get("content").and_then(|c| c.as_str()))
                else {
                    return Ok(None);
                };
                named
                    .iter()
                    .find(|(_, n)| n.as_str() == name)
                    .map(|(id, _)| Some(*id))
                    .ok_or_else(|| {
                        bad(
                            config,
                            format!("{key} {name:?} is not among the added tokens"),
                        )
                    })
            };
            bos = token("bos_token")?;
            eos = token("eos_token")?;
        }
        let special_names: Vec<String> = (0..NUM_SPECIAL_TOKENS)
            .map(|i| {
                let id = (num_base + i) as u32;
                named
                    .get(&id)
                    .cloned()
                    .unwrap_or_else(|| format!("<|reserved_token_{id}|>"))
            })
            .collect();
        let mut encoder = tiktoken_rs_map();
        encoder.extend(ranks);
        let mut specials = tiktoken_rs_map();
        specials.extend(
            special_names
                .iter()
                .enumerate()
                .map(|(i, n)| (n.clone(), (num_base + i) as Rank)),
        );
        let bpe = CoreBPE::new(encoder, specials, KIMI_PATTERN)
            .map_err(|e| bad(model, format!("cannot build the BPE: {e}")))?;
        Ok(Self {
            bpe,
            num_base,
            special_names,
            bos,
            eos,
        })
    }

    /// BPE tokens plus special ids: the smallest vocabulary a model needs for this tokenizer.
    pub fn vocab_size(&self) -> usize {
        self.num_base + NUM_SPECIAL_TOKENS
    }

    /// The number of BPE tokens (ids `0..n`); the special ids follow.
    pub fn num_base_tokens(&self) -> usize {
        self.num_base
    }

    /// The beginning-of-sequence id named by `bos_token`, if any.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// The end-of-sequence id named by `eos_token`, if any.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// The id of a special token by name (`[EOS]`, `<|im_end|>`, `<|reserved_token_…|>`).
    pub fn special_id(&self, name: &str) -> Option<u32> {
        self.special_names
            .iter()
            .position(|n| n == name)
            .map(|i| (self.num_base + i) as u32)
    }

    /// Encodes `text`. With `allow_special`, special-token names in the text become their ids;
    /// without, they are ordinary text.
    pub fn encode(&self, text: &str, allow_special: bool) -> Vec<u32> {
        if allow_special {
            self.bpe.encode_with_special_tokens(text)
        } else {
            self.bpe.encode_ordinary(text)
        }
    }

    /// The bytes of `ids` (special tokens as their names). Errors on an id outside the vocabulary.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        self.bpe.decode_bytes(ids).map_err(|e| {
            Error::argument(
                "ids",
                format!(
                    "token {} is outside the tokenizer's {} ids",
                    e.token,
                    self.vocab_size()
                ),
            )
        })
    }

    /// The text of `ids`; bytes that are not valid UTF-8 (a sequence cut inside a character)
    /// become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }

    /// A decoder that turns ids into text one at a time, for streaming.
    pub fn stream(&self) -> StreamDecoder<'_> {
        StreamDecoder {
            tokenizer: self,
            pending: Vec::new(),
        }
    }
}

/// An empty map of the hash type `tiktoken-rs` takes (inferred at the call).
fn tiktoken_rs_map<K: std::hash::Hash + Eq, V, S: Default>() -> std::collections::HashMap<K, V, S> {
    std::collections::HashMap::with_hasher(S::default())
}

/// Streams decoded text: a token may end inside a multi-byte character, so bytes are held back
/// until they complete one. The concatenation of every [`push`](Self::push) and the final
/// [`finish`](Self::finish) equals [`Tokenizer::decode`] of all the ids.
#[derive(Debug)]
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    pending: Vec<u8>,
}

impl StreamDecoder<'_> {
    /// The text that `id` completes (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.pending
            .extend(self.tokenizer.decode_bytes(std::slice::from_ref(&id))?);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return Ok(out);
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    // Valid UTF-8 by `valid_up_to`.
                    out.push_str(std::str::from_utf8(&self.pending[..good]).unwrap_or_default());
                    match e.error_len() {
                        // An invalid sequence: U+FFFD, as a lossy decode writes it.
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..good + bad);
                        }
                        // An incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..good);
                            return Ok(out);
                        }
                    }
                }
            }
        }
    }

    /// What is left: an incomplete character at the end of the stream, as U+FFFD.
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
}
