//! Training checkpoints that survive a kill: the model (parameters with their ids, and every MoE
//! layer's balance bias), the optimiser's state and the loop's own state (step, data generator
//! position and whatever the caller adds), so that a resumed run continues bit for bit.
//!
//! A checkpoint is a folder `step-NNNNNNNN` under the checkpoint directory, holding
//! `model.mpk`, `optimizer.mpk` (Burn's named MessagePack records at full precision) and
//! `state.json`. It is written under a temporary name and renamed, and the text file `latest`
//! naming it is replaced the same way, so a kill at any moment leaves `latest` naming a complete
//! checkpoint (or no `latest` at all before the first one). Older checkpoints are then removed.
//!
//! The balancers need little more: a checkpoint is taken between optimiser steps, after
//! [`update_balance`](KimiForCausalLM::update_balance), when their counts are empty and the bias
//! (saved with the model) is all their state, except for QB with drift compensation, whose drift
//! memory ([`KimiForCausalLM::drift_memory`]) goes into `balance.json` beside the model.
//! Checkpoints without that file load with the drift forgotten.

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::optim::Optimizer;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder, Recorder};
use burn::tensor::backend::{AutodiffBackend, Backend};
use serde::{Deserialize, Serialize};

use crate::data::SeededRng;
use crate::error::{Error, Result};
use crate::model::KimiForCausalLM;

/// The file of a checkpoint that holds the balancers' drift memory.
const BALANCE_FILE: &str = "balance.json";

/// The training loop's state at a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoopState {
    /// Optimiser steps completed.
    pub step: usize,
    /// The training data generator's state after those steps ([`SeededRng::state`]).
    pub rng: u64,
    /// Whatever else the caller needs to continue (metrics windows, a schedule's state).
    #[serde(default)]
    pub extra: serde_json::Value,
}

impl LoopState {
    /// The state after `step` steps with data generator `rng`.
    pub fn new(step: usize, rng: &SeededRng) -> Self {
        Self {
            step,
            rng: rng.state(),
            extra: serde_json::Value::Null,
        }
    }

    /// The data generator, where it stood.
    pub fn rng(&self) -> SeededRng {
        SeededRng::from_state(self.rng)
    }
}

/// A directory of checkpoints (see the module docs).
#[derive(Debug, Clone)]
pub struct Checkpoints {
    dir: PathBuf,
}

type Rec = NamedMpkFileRecorder<FullPrecisionSettings>;

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn record_error(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Checkpoint(format!("{}: {e}", path.display()))
}

impl Checkpoints {
    /// Checkpoints in `dir` (created on the first save).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Writes a checkpoint of `model`, `optim` and `state`, makes it the latest and removes the
    /// older ones. Returns its folder.
    pub fn save<B, O>(
        &self,
        model: &KimiForCausalLM<B>,
        optim: &O,
        state: &LoopState,
    ) -> Result<PathBuf>
    where
        B: AutodiffBackend,
        O: Optimizer<KimiForCausalLM<B>, B>,
    {
        std::fs::create_dir_all(&self.dir).map_err(io(&self.dir))?;
        let name = format!("step-{:08}", state.step);
        let tmp = self.dir.join(format!("{name}.tmp"));
        let done = self.dir.join(&name);
        let aside = self.dir.join(format!("{name}{ASIDE}"));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
        }
        std::fs::create_dir(&tmp).map_err(io(&tmp))?;
        let recorder = Rec::new();
        model
            .clone()
            .save_file(tmp.join("model"), &recorder)
            .map_err(|e| record_error(&tmp, e))?;
        Recorder::<B>::record(&recorder, optim.to_record(), tmp.join("optimizer"))
            .map_err(|e| record_error(&tmp, e))?;
        let json = serde_json::to_vec_pretty(state).map_err(|e| record_error(&tmp, e))?;
        write_synced(&tmp.join("state.json"), &json)?;
        let drift = model.drift_memory();
        if drift.iter().any(Option::is_some) {
            let json = serde_json::to_vec(&drift).map_err(|e| record_error(&tmp, e))?;
            write_synced(&tmp.join(BALANCE_FILE), &json)?;
        }
        for file in ["model.mpk", "optimizer.mpk"] {
            sync_file(&tmp.join(file))?;
        }
        // An earlier save of this step (which `latest` may name) gives way only now that the new
        // one is complete: it moves aside, where `latest` still finds it, for the two renames.
        if done.exists() {
            if aside.exists() {
                std::fs::remove_dir_all(&aside).map_err(io(&aside))?;
            }
            std::fs::rename(&done, &aside).map_err(io(&aside))?;
        }
        std::fs::rename(&tmp, &done).map_err(io(&done))?;
        let latest_tmp = self.dir.join("latest.tmp");
        write_synced(&latest_tmp, name.as_bytes())?;
        std::fs::rename(&latest_tmp, self.dir.join("latest")).map_err(io(&self.dir))?;
        if aside.exists() {
            std::fs::remove_dir_all(&aside).map_err(io(&aside))?;
        }
        self.remove_older_than(&name)?;
        Ok(done)
    }

    /// The latest complete checkpoint's folder, if any.
    pub fn latest(&self) -> Result<Option<PathBuf>> {
        let pointer = self.dir.join("latest");
        match std::fs::read_to_string(&pointer) {
            Ok(name) => {
                let folder = self.dir.join(name.trim());
                let aside = self.dir.join(format!("{}{ASIDE}", name.trim()));
                if folder.is_dir() {
                    Ok(Some(folder))
                } else if aside.is_dir() {
                    // A save of the same step stopped between its renames: the earlier copy.
                    Ok(Some(aside))
                } else {
                    Err(Error::Checkpoint(format!(
                        "{} names {}, which is missing",
                        pointer.display(),
                        folder.display()
                    )))
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io(&pointer)(e)),
        }
    }

    /// The loop state of checkpoint `folder`.
    pub fn state(folder: &Path) -> Result<LoopState> {
        let path = folder.join("state.json");
        let text = std::fs::read(&path).map_err(io(&path))?;
        serde_json::from_slice(&text).map_err(|source| Error::Json { path, source })
    }

    /// `model` (built from the same config) with the parameters, ids, biases and drift memory of
    /// checkpoint `folder`.
    pub fn load_model<B: Backend>(
        folder: &Path,
        model: KimiForCausalLM<B>,
        device: &B::Device,
    ) -> Result<KimiForCausalLM<B>> {
        let model = model
            .load_file(folder.join("model"), &Rec::new(), device)
            .map_err(|e| record_error(folder, e))?;
        let path = folder.join(BALANCE_FILE);
        let drift = match std::fs::read(&path) {
            Ok(text) => serde_json::from_slice(&text).map_err(|source| Error::Json {
                path: path.clone(),
                source,
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                vec![None; model.drift_memory().len()]
            }
            Err(e) => return Err(io(&path)(e)),
        };
        model
            .set_drift_memory(drift)
            .map_err(|e| Error::Checkpoint(format!("{}: {e}", path.display())))?;
        Ok(model)
    }

    /// `optim` with the state of checkpoint `folder` (for the model of
    /// [`load_model`](Self::load_model): the states are keyed by parameter id).
    pub fn load_optimizer<B, O>(folder: &Path, optim: O, device: &B::Device) -> Result<O>
    where
        B: AutodiffBackend,
        O: Optimizer<KimiForCausalLM<B>, B>,
    {
        let record = Recorder::<B>::load(&Rec::new(), folder.join("optimizer"), device)
            .map_err(|e| record_error(folder, e))?;
        Ok(optim.load_record(record))
    }

    fn remove_older_than(&self, keep: &str) -> Result<()> {
        for entry in std::fs::read_dir(&self.dir).map_err(io(&self.dir))? {
            let entry = entry.map_err(io(&self.dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with("step-") && name.as_str() < keep {
                let path = entry.path();
                std::fs::remove_dir_all(&path).map_err(io(&path))?;
            }
        }
        Ok(())
    }
}

/// The suffix of a checkpoint folder set aside while a new save of its step replaces it.
const ASIDE: &str = ".old";

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(io(path))?;
    sync_file(path)
}

fn sync_file(path: &Path) -> Result<()> {
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io(path))
}
