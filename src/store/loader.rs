//! Loading a module's tensors by their checkpoint names, with every problem collected into one
//! error.

use std::collections::HashSet;

use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::{backend::Backend, Tensor, TensorData};

use super::SafeTensorsReader;
use crate::error::{Error, Result};
use crate::ops::quant::{dequantize_host, MxFormat, MxTensor, MX_BLOCK};

/// Pulls tensors out of a checkpoint into modules, collecting every mismatch.
pub struct Loader<'a, B: Backend> {
    reader: &'a SafeTensorsReader,
    device: B::Device,
    used: HashSet<String>,
    problems: Vec<String>,
}

impl<'a, B: Backend> Loader<'a, B> {
    /// A loader reading from `reader` onto `device`.
    pub fn new(reader: &'a SafeTensorsReader, device: &B::Device) -> Self {
        Self {
            reader,
            device: device.clone(),
            used: HashSet::new(),
            problems: Vec::new(),
        }
    }

    /// Fetches `name` with the checkpoint shape `hf_shape`; records a problem and returns `None`
    /// when it is missing, unreadable or mis-shaped.
    fn fetch(&mut self, name: &str, hf_shape: &[usize]) -> Option<Vec<f32>> {
        match self.reader.read(name) {
            Ok(Some(t)) => {
                self.used.insert(name.to_owned());
                if t.shape != hf_shape {
                    self.problems.push(format!(
                        "wrong shape for {name} in {}: expected {hf_shape:?}, found {:?}",
                        self.reader
                            .file_of(name)
                            .map_or_else(String::new, |f| f.display().to_string()),
                        t.shape
                    ));
                    None
                } else {
                    Some(t.data)
                }
            }
            Ok(None) => {
                self.problems.push(format!(
                    "missing tensor {name} (expected shape {hf_shape:?})"
                ));
                None
            }
            Err(e) => {
                self.problems.push(e.to_string());
                None
            }
        }
    }

    /// `param` holding `data` (row-major, shape `shape`), on the loader's device, in the dtype
    /// `param` already has (Burn's default float dtype when it is still uninitialised), with its
    /// gradient requirement. A lazily initialised parameter is never initialised: its random
    /// values are not drawn, so loading a model costs the model, not twice the model.
    fn replace<const D: usize>(
        &self,
        param: Param<Tensor<B, D>>,
        data: Vec<f32>,
        shape: [usize; D],
        reorder: impl FnOnce(Tensor<B, D>) -> Tensor<B, D>,
    ) -> Param<Tensor<B, D>> {
        let data = TensorData::new(data, shape);
        let tensor = if param.is_initialized() {
            Tensor::<B, D>::from_data(data, (&self.device, param.val().dtype()))
        } else {
            Tensor::<B, D>::from_data(data, &self.device)
        };
        let id = param.id;
        param.transform_for_load(reorder(tensor), id)
    }

    /// Replaces the value of `param` (shape `[..]`) with `name` stored as `hf_shape` (same number
    /// of elements, same row-major order, e.g. `A_log [1, 1, H, 1]` for a `[H]` parameter).
    pub fn param<const D: usize>(
        &mut self,
        name: &str,
        param: Param<Tensor<B, D>>,
        hf_shape: &[usize],
    ) -> Param<Tensor<B, D>> {
        let shape = param.lazy_shape().dims::<D>();
        let Some(data) = self.fetch(name, hf_shape) else {
            return param;
        };
        self.replace(param, data, shape, |t| t)
    }

    /// A parameter stored with its own shape.
    pub fn same<const D: usize>(
        &mut self,
        name: &str,
        param: Param<Tensor<B, D>>,
    ) -> Param<Tensor<B, D>> {
        let shape = param.lazy_shape().to_vec();
        self.param(name, param, &shape)
    }

    /// The values of the packed MX pair `{name}_blocks` / `{name}_scales` of a `[out, in]` weight
    /// (see the module docs).
    fn fetch_mx(&mut self, name: &str, [d_out, d_in]: [usize; 2]) -> Option<Vec<f32>> {
        let format = match self.reader.metadata("mx_format").unwrap_or("e2m1") {
            "e2m1" => MxFormat::Fp4E2M1,
            "e4m3" => MxFormat::Fp8E4M3,
            "e5m2" => MxFormat::Fp8E5M2,
            other => {
                self.problems.push(format!(
                    "{name}_blocks: unknown mx_format {other:?} in the file metadata"
                ));
                return None;
            }
        };
        let per_block = match format {
            MxFormat::Fp4E2M1 => MX_BLOCK / 2,
            _ => MX_BLOCK,
        };
        let nb = d_in.div_ceil(MX_BLOCK);
        let mut part = |suffix: &str, shape: Vec<usize>| {
            let key = format!("{name}_{suffix}");
            match self.reader.read_u8(&key) {
                Ok(Some((s, bytes))) if s == shape => {
                    self.used.insert(key);
                    Some(bytes)
                }
                Ok(Some((s, _))) => {
                    self.problems.push(format!(
                        "wrong shape for {key}: expected {shape:?}, found {s:?}"
                    ));
                    None
                }
                Ok(None) => {
                    self.problems
                        .push(format!("missing tensor {key} (expected shape {shape:?})"));
                    None
                }
                Err(e) => {
                    self.problems.push(e.to_string());
                    None
                }
            }
        };
        let codes = part("blocks", vec![d_out, nb, per_block]);
        let scales = part("scales", vec![d_out, nb]);
        let mx = MxTensor {
            format,
            shape: vec![d_out, d_in],
            axis: 1,
            codes: codes?,
            scales: scales?,
        };
        match dequantize_host(&mx) {
            Ok((_, values)) => Some(values),
            Err(e) => {
                self.problems.push(format!("{name}: {e}"));
                None
            }
        }
    }

    /// The `[out, in]` matrix `name`, stored as it is or packed as MX.
    fn fetch_matrix(&mut self, name: &str, [d_out, d_in]: [usize; 2]) -> Option<Vec<f32>> {
        let packed = !self.reader.contains(name) && self.reader.contains(&format!("{name}_blocks"));
        if packed {
            self.fetch_mx(name, [d_out, d_in])
        } else {
            self.fetch(name, &[d_out, d_in])
        }
    }

    /// Stacked matrices `param: [n, in, out]` from `n` PyTorch-style `[out, in]` tensors
    /// `names[e]` (each stored as it is or packed as MX); unchanged when any is missing or
    /// mis-shaped (the problems are recorded).
    ///
    /// # Panics
    /// If `names.len() != n`.
    pub fn stacked_linear(
        &mut self,
        names: &[String],
        param: Param<Tensor<B, 3>>,
    ) -> Param<Tensor<B, 3>> {
        let [n, d_in, d_out] = param.lazy_shape().dims::<3>();
        assert_eq!(names.len(), n, "one name per stacked matrix");
        let mut data = vec![0.0f32; n * d_in * d_out];
        let mut complete = true;
        for (e, name) in names.iter().enumerate() {
            match self.fetch_matrix(name, [d_out, d_in]) {
                Some(m) => {
                    // [out, in] → [in, out] into slot e.
                    let slot = &mut data[e * d_in * d_out..(e + 1) * d_in * d_out];
                    for o in 0..d_out {
                        for i in 0..d_in {
                            slot[i * d_out + o] = m[o * d_in + i];
                        }
                    }
                }
                None => complete = false,
            }
        }
        if !complete {
            return param;
        }
        self.replace(param, data, [n, d_in, d_out], |t| t)
    }

    /// A bias-free linear layer stored PyTorch-style as `name` with shape `[out, in]`, or packed
    /// as MX blocks and scales (see the module docs).
    pub fn linear(&mut self, name: &str, mut layer: Linear<B>) -> Linear<B> {
        let [d_in, d_out] = layer.weight.lazy_shape().dims::<2>();
        let Some(data) = self.fetch_matrix(name, [d_out, d_in]) else {
            return layer;
        };
        layer.weight = self.replace(layer.weight, data, [d_out, d_in], |t| t.transpose());
        layer
    }

    /// A host vector (e.g. the balance bias) stored as `name` with `len` elements.
    pub fn vector(&mut self, name: &str, len: usize) -> Option<Vec<f32>> {
        self.fetch(name, &[len])
    }

    /// Fails with every recorded problem, plus every tensor of the checkpoint no module asked for
    /// (when `strict`).
    pub fn finish(self, strict: bool) -> Result<()> {
        let mut problems = self.problems;
        if strict {
            for name in self.reader.names() {
                if !self.used.contains(name) {
                    let shape = self.reader.shape(name).unwrap_or_default();
                    problems.push(format!("unexpected tensor {name} with shape {shape:?}"));
                }
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(Error::Checkpoint(format!(
                "{} ({} problems):\n{}",
                self.reader.path().display(),
                problems.len(),
                problems.join("\n")
            )))
        }
    }
}
