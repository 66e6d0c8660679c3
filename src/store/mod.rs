//! Safetensors import and export with the Hugging Face names of design §7.
//!
//! A checkpoint is read into a [`SafeTensorsReader`] (one `.safetensors` file, or a folder with a
//! `model.safetensors.index.json` for sharded checkpoints). Modules then pull their tensors by name
//! through a [`Loader`], which converts bf16/f16/f32 to the module's dtype, transposes PyTorch's
//! `[out, in]` linear weights to Burn's `[in, out]`, and records every problem (missing tensor,
//! wrong shape, unexpected tensor) so that one error lists them all. A [`Saver`] does the reverse.
//! The per-module name tables implement [`HfCheckpoint`].
//!
//! **Packed MX weights** (design §9). A [`Saver`] made with [`Saver::packing_mx`] writes each weight
//! that its module trains with MX quantisation-aware training (see
//! [`QatConfig`](crate::ops::quant::QatConfig)) as two `U8` tensors instead of `{name}`:
//! `{name}_blocks` `[out, in / 32, B]` (the element codes of each block of 32 along the input
//! dimension; `B` = 16 for MXFP4, two codes per byte with the first in the low nibble, or 32 for
//! MXFP8) and `{name}_scales` `[out, in / 32]` (E8M0 bytes, scale `2^(byte − 127)`). This is the
//! layout of Hugging Face's MXFP4 checkpoints, per matrix. The element format is recorded in the
//! file's metadata as `mx_format` (`e2m1`, `e4m3` or `e5m2`; `e2m1` when absent). A [`Loader`]
//! reads such a pair wherever `{name}` is absent, dequantising to the module's dtype.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::rc::Rc;

use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::{backend::Backend, Tensor, TensorData};
use safetensors::Dtype;

use crate::error::{Error, Result};
use crate::ops::quant::{dequantize_host, pack_rows, MxFormat, MxSpec, MxTensor, MX_BLOCK};

mod kda;
mod mla;
mod model;
mod moe;

/// A tensor on the host, in f32, with its checkpoint shape.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Shape as stored in the checkpoint.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub data: Vec<f32>,
}

/// The tensors of a checkpoint: one file or a sharded folder.
///
/// Each file's header is parsed once, when the reader opens it; a tensor's bytes are read from its
/// file (a positioned read) only when asked for, so opening a checkpoint costs its headers, and
/// loading holds one tensor's bytes at a time besides the model. (A memory mapping would not save
/// a copy, since every value is converted to f32 for its parameter, and the pages of a mapping
/// that were read stay resident, together with those the kernel maps around them, until it ends.)
#[derive(Debug)]
pub struct SafeTensorsReader {
    path: PathBuf,
    files: Vec<(PathBuf, std::fs::File)>,
    index: BTreeMap<String, Entry>,
    metadata: HashMap<String, String>,
}

/// Where a tensor lies: its file, dtype, shape and byte range in the file.
#[derive(Debug, Clone)]
struct Entry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: std::ops::Range<usize>,
}

/// Fills `buf` from `file` at `offset` (a positioned read: the reader needs no `&mut`).
fn read_at(file: &std::fs::File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
    }
    #[cfg(windows)]
    {
        let mut done = 0;
        while done < buf.len() {
            let n = std::os::windows::fs::FileExt::seek_read(
                file,
                &mut buf[done..],
                offset + done as u64,
            )?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            done += n;
        }
        Ok(())
    }
    #[cfg(not(any(unix, windows)))]
    {
        use std::io::{Read, Seek};
        let mut f = file;
        f.seek(std::io::SeekFrom::Start(offset))?;
        f.read_exact(buf)
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl SafeTensorsReader {
    /// Opens `path`: a `.safetensors` file, or a folder holding `model.safetensors.index.json`
    /// (sharded) or a single `model.safetensors`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let files: Vec<PathBuf> = if path.is_dir() {
            let index = path.join("model.safetensors.index.json");
            if index.exists() {
                let text = std::fs::read_to_string(&index).map_err(io_err(&index))?;
                let json: serde_json::Value =
                    serde_json::from_str(&text).map_err(|source| Error::Json {
                        path: index.clone(),
                        source,
                    })?;
                let map = json
                    .get("weight_map")
                    .and_then(|m| m.as_object())
                    .ok_or_else(|| Error::SafeTensors {
                        path: index.clone(),
                        reason: "no \"weight_map\" object".into(),
                    })?;
                let mut shards: Vec<String> = map
                    .values()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect();
                shards.sort();
                shards.dedup();
                for shard in &shards {
                    let file = path.join(shard);
                    if !file.is_file() {
                        let mut names: Vec<&str> = map
                            .iter()
                            .filter(|(_, v)| v.as_str() == Some(shard.as_str()))
                            .map(|(k, _)| k.as_str())
                            .collect();
                        names.sort_unstable();
                        return Err(Error::SafeTensors {
                            path: file,
                            reason: format!(
                                "missing shard: model.safetensors.index.json maps {} tensors to it \
                                 (first: {})",
                                names.len(),
                                names.first().copied().unwrap_or("none")
                            ),
                        });
                    }
                }
                shards.into_iter().map(|s| path.join(s)).collect()
            } else {
                vec![path.join("model.safetensors")]
            }
        } else {
            vec![path.to_path_buf()]
        };
        let mut reader = Self {
            path: path.to_path_buf(),
            files: Vec::new(),
            index: BTreeMap::new(),
            metadata: HashMap::new(),
        };
        for file in files {
            reader.add_file(file)?;
        }
        Ok(reader)
    }

    /// Parses the header of one `.safetensors` file and indexes its tensors.
    fn add_file(&mut self, file: PathBuf) -> Result<()> {
        use std::io::Read;
        let bad = |reason: String| Error::SafeTensors {
            path: file.clone(),
            reason,
        };
        let mut handle = std::fs::File::open(&file).map_err(io_err(&file))?;
        let file_len = handle.metadata().map_err(io_err(&file))?.len();
        let mut len = [0u8; 8];
        handle.read_exact(&mut len).map_err(io_err(&file))?;
        let header_len = u64::from_le_bytes(len);
        if header_len > file_len.saturating_sub(8) || header_len > 100 << 20 {
            return Err(bad(format!(
                "a header of {header_len} bytes in a file of {file_len}: not a safetensors file"
            )));
        }
        let mut header = vec![0u8; header_len as usize];
        handle.read_exact(&mut header).map_err(io_err(&file))?;
        let header: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&header).map_err(|e| bad(format!("unreadable header: {e}")))?;
        let start = 8 + header_len;
        let at = self.files.len();
        for (name, info) in header {
            if name == "__metadata__" {
                if let Some(m) = info.as_object() {
                    for (k, v) in m {
                        if let Some(v) = v.as_str() {
                            self.metadata.insert(k.clone(), v.to_owned());
                        }
                    }
                }
                continue;
            }
            let field = |key: &str| {
                info.get(key)
                    .cloned()
                    .ok_or_else(|| bad(format!("tensor {name} has no {key:?} in the header")))
            };
            let dtype: Dtype = serde_json::from_value(field("dtype")?)
                .map_err(|e| bad(format!("tensor {name}: unknown dtype ({e})")))?;
            let shape: Vec<usize> = serde_json::from_value(field("shape")?)
                .map_err(|e| bad(format!("tensor {name}: bad shape ({e})")))?;
            let [a, b]: [u64; 2] = serde_json::from_value(field("data_offsets")?)
                .map_err(|e| bad(format!("tensor {name}: bad data_offsets ({e})")))?;
            let bits = shape.iter().product::<usize>() as u64 * dtype.bitsize() as u64;
            if a > b || start + b > file_len || (b - a) * 8 != bits {
                return Err(bad(format!(
                    "tensor {name} ({dtype:?}, shape {shape:?}) has data_offsets [{a}, {b}], \
                     which do not fit its size or the file ({file_len} bytes)"
                )));
            }
            self.index.insert(
                name,
                Entry {
                    file: at,
                    dtype,
                    shape,
                    bytes: (start + a) as usize..(start + b) as usize,
                },
            );
        }
        self.files.push((file, handle));
        Ok(())
    }

    /// The file or folder the checkpoint was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file holding `name`, if present.
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        self.index.get(name).map(|e| self.files[e.file].0.as_path())
    }

    /// Every tensor name in the checkpoint, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// The stored shape of `name`, if present.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.index.get(name).map(|e| e.shape.clone())
    }

    /// Whether the checkpoint holds `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// A value of the files' `__metadata__` (merged over the shards).
    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.metadata.get(key).map(String::as_str)
    }

    /// The entry of `name`, its file and its bytes (read now).
    fn raw(&self, name: &str) -> Option<Result<(&Entry, &Path, Vec<u8>)>> {
        let e = self.index.get(name)?;
        let (path, file) = &self.files[e.file];
        let mut bytes = vec![0u8; e.bytes.len()];
        Some(
            read_at(file, &mut bytes, e.bytes.start as u64)
                .map(|()| (e, path.as_path(), bytes))
                .map_err(io_err(path)),
        )
    }

    /// Reads `name` as raw bytes with its shape when it is stored as `U8`; `Ok(None)` when absent.
    pub fn read_u8(&self, name: &str) -> Result<Option<(Vec<usize>, Vec<u8>)>> {
        let Some(raw) = self.raw(name) else {
            return Ok(None);
        };
        let (e, path, raw) = raw?;
        if e.dtype != Dtype::U8 {
            return Err(Error::SafeTensors {
                path: path.to_path_buf(),
                reason: format!(
                    "tensor {name} has dtype {:?}; packed MX tensors are U8",
                    e.dtype
                ),
            });
        }
        Ok(Some((e.shape.clone(), raw)))
    }

    /// Reads `name` as f32 (from f32, f16 or bf16 on disk); `Ok(None)` when absent.
    pub fn read(&self, name: &str) -> Result<Option<HostTensor>> {
        let Some(raw) = self.raw(name) else {
            return Ok(None);
        };
        let (e, path, raw) = raw?;
        let data: Vec<f32> = match e.dtype {
            Dtype::F32 => raw
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::F16 => raw
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::BF16 => raw
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(Error::SafeTensors {
                    path: path.to_path_buf(),
                    reason: format!(
                        "tensor {name} has dtype {other:?}; only F32, F16 and BF16 are supported"
                    ),
                })
            }
        };
        Ok(Some(HostTensor {
            shape: e.shape.clone(),
            data,
        }))
    }
}

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

/// Where the values of a tensor to write come from: already on the host, or read from the model
/// (one tensor at a time) when the file is written.
#[derive(Clone)]
enum Values {
    Host(Rc<Vec<f32>>),
    Model(Rc<dyn Fn() -> Vec<f32>>),
}

impl Values {
    /// The values of `tensor` (a parameter or a view of one: holding it costs nothing).
    fn from_tensor<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Self {
        Self::Model(Rc::new(move || {
            crate::sync::read(tensor.clone()).iter::<f32>().collect()
        }))
    }

    fn get(&self) -> std::borrow::Cow<'_, [f32]> {
        match self {
            Self::Host(v) => std::borrow::Cow::Borrowed(v.as_slice()),
            Self::Model(f) => std::borrow::Cow::Owned(f()),
        }
    }
}

/// One tensor of the checkpoint to be written: its shape on disk and how to produce its bytes.
#[derive(Clone)]
struct Planned {
    shape: Vec<usize>,
    kind: Kind,
}

#[derive(Clone)]
enum Kind {
    /// Floats, written in the file's float dtype.
    Float(Values),
    /// One half of a packed MX `[out, in]` matrix (see the module docs).
    Mx {
        values: Values,
        d_in: usize,
        spec: MxSpec,
        scales: bool,
    },
}

impl Planned {
    fn bytes(&self, dtype: StoreDtype) -> u64 {
        let n = self.shape.iter().product::<usize>();
        match self.kind {
            Kind::Float(_) => (n * dtype.size()) as u64,
            Kind::Mx { .. } => n as u64,
        }
    }

    fn dtype(&self, dtype: StoreDtype) -> Dtype {
        match self.kind {
            Kind::Float(_) => dtype.safetensors(),
            Kind::Mx { .. } => Dtype::U8,
        }
    }

    /// The bytes on disk; reads the values from the model now.
    fn encode(&self, name: &str, dtype: StoreDtype) -> std::result::Result<Vec<u8>, String> {
        match &self.kind {
            Kind::Float(v) => Ok(dtype.encode(&v.get())),
            Kind::Mx {
                values,
                d_in,
                spec,
                scales,
            } => {
                let data = values.get();
                if let Some(bad) = data.iter().find(|v| !v.is_finite()) {
                    return Err(format!(
                        "{name}: {bad} cannot be stored in MX (no block scale)"
                    ));
                }
                let (codes, s) = pack_rows(&data, *d_in, spec.format, spec.rule);
                Ok(if *scales { s } else { codes })
            }
        }
    }
}

/// Collects the tensors of a model under their Hugging Face names and writes them as safetensors
/// files, one tensor at a time.
///
/// Adding a module's tensors records where their values are, not the values: a file is written
/// tensor by tensor, each read from the model (and converted, transposed or MX-packed) only when
/// its turn comes, so saving a model needs one tensor's worth of host memory on top of the model,
/// not a second copy of it. (A `Saver` therefore keeps the model's tensors alive until it is
/// dropped; it is meant to be filled and written at once.)
#[derive(Default)]
pub struct Saver {
    tensors: BTreeMap<String, Planned>,
    pack_mx: bool,
    mx_format: Option<MxFormat>,
    problems: Vec<String>,
}

impl std::fmt::Debug for Saver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Saver")
            .field("tensors", &self.tensors.len())
            .field("pack_mx", &self.pack_mx)
            .field("mx_format", &self.mx_format)
            .field("problems", &self.problems)
            .finish()
    }
}

impl Saver {
    /// An empty saver.
    pub fn new() -> Self {
        Self::default()
    }

    /// A saver that writes the weights trained with MX QAT packed (see the module docs).
    pub fn packing_mx() -> Self {
        Self {
            pack_mx: true,
            ..Self::default()
        }
    }

    /// Whether QAT-trained weights are written packed.
    pub fn packs_mx(&self) -> bool {
        self.pack_mx
    }

    /// Adds a bias-free linear layer packed in MX storage along its input dimension:
    /// `{name}_blocks` and `{name}_scales` (see the module docs). The input width must be a
    /// multiple of 32 and every weight of one file must share one format ([`write`](Self::write)
    /// reports it otherwise).
    pub fn mx_linear<B: Backend>(&mut self, name: &str, layer: &Linear<B>, spec: MxSpec) {
        let [d_in, d_out] = layer.weight.dims();
        let values = Values::from_tensor(layer.weight.val().transpose());
        self.matrix(name, values, [d_out, d_in], Some(spec));
    }

    /// Adds stacked matrices `w: [n, in, out]` (Burn's layout per matrix) as `n` PyTorch-style
    /// `[out, in]` tensors named `names[e]`, packed as MX when `pack` is given.
    ///
    /// # Panics
    /// If `names.len() != n`.
    pub fn stacked_linear<B: Backend>(
        &mut self,
        names: &[String],
        w: Tensor<B, 3>,
        pack: Option<MxSpec>,
    ) {
        let [n, d_in, d_out] = w.dims();
        assert_eq!(names.len(), n, "one name per stacked matrix");
        for (e, name) in names.iter().enumerate() {
            // Cut out when written: a slice taken now could be a copy, held until then.
            let w = w.clone();
            let values = Values::Model(Rc::new(move || {
                let m = w.clone().narrow(0, e, 1).reshape([d_in, d_out]).transpose();
                crate::sync::read(m).iter::<f32>().collect()
            }));
            self.matrix(name, values, [d_out, d_in], pack);
        }
    }

    /// Adds one `[out, in]` matrix (row-major `values`), packed as MX along `in` when `pack` is
    /// given.
    fn matrix(
        &mut self,
        name: &str,
        values: Values,
        [d_out, d_in]: [usize; 2],
        pack: Option<MxSpec>,
    ) {
        let Some(spec) = pack else {
            self.tensors.insert(
                name.to_owned(),
                Planned {
                    shape: vec![d_out, d_in],
                    kind: Kind::Float(values),
                },
            );
            return;
        };
        if d_in % MX_BLOCK != 0 {
            self.problems.push(format!(
                "{name}: packed MX storage needs an input width that is a multiple of {MX_BLOCK}, got {d_in}"
            ));
            return;
        }
        if *self.mx_format.get_or_insert(spec.format) != spec.format {
            self.problems.push(format!(
                "{name}: one file holds one MX format, got {:?} after {:?}",
                spec.format, self.mx_format
            ));
            return;
        }
        let nb = d_in / MX_BLOCK;
        let per_block = match spec.format {
            MxFormat::Fp4E2M1 => MX_BLOCK / 2,
            _ => MX_BLOCK,
        };
        for (suffix, shape, scales) in [
            ("blocks", vec![d_out, nb, per_block], false),
            ("scales", vec![d_out, nb], true),
        ] {
            self.tensors.insert(
                format!("{name}_{suffix}"),
                Planned {
                    shape,
                    kind: Kind::Mx {
                        values: values.clone(),
                        d_in,
                        spec,
                        scales,
                    },
                },
            );
        }
    }

    /// Adds `tensor` under `name` with the checkpoint shape `hf_shape` (same element count).
    ///
    /// # Panics
    /// If the element counts differ.
    pub fn tensor<B: Backend, const D: usize>(
        &mut self,
        name: &str,
        tensor: Tensor<B, D>,
        hf_shape: &[usize],
    ) {
        assert_eq!(
            tensor.shape().num_elements(),
            hf_shape.iter().product::<usize>(),
            "{name}: {:?} stored as {hf_shape:?}",
            tensor.dims()
        );
        self.tensors.insert(
            name.to_owned(),
            Planned {
                shape: hf_shape.to_vec(),
                kind: Kind::Float(Values::from_tensor(tensor)),
            },
        );
    }

    /// Adds a parameter under its own shape.
    pub fn same<B: Backend, const D: usize>(&mut self, name: &str, param: &Param<Tensor<B, D>>) {
        let shape = param.dims().to_vec();
        self.tensor(name, param.val(), &shape);
    }

    /// Adds a bias-free linear layer PyTorch-style, `[out, in]`.
    pub fn linear<B: Backend>(&mut self, name: &str, layer: &Linear<B>) {
        let [d_in, d_out] = layer.weight.dims();
        self.tensor(name, layer.weight.val().transpose(), &[d_out, d_in]);
    }

    /// Adds a host vector.
    pub fn vector(&mut self, name: &str, data: Vec<f32>) {
        self.tensors.insert(
            name.to_owned(),
            Planned {
                shape: vec![data.len()],
                kind: Kind::Float(Values::Host(Rc::new(data))),
            },
        );
    }

    /// Every tensor name that will be written (packed MX weights as their `_blocks` / `_scales`
    /// pair), sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The shape `name` will have in the file.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|t| t.shape.as_slice())
    }

    /// Reads `name` as it will be written in f32 (`None` for packed MX halves and absent names).
    pub fn read(&self, name: &str) -> Option<HostTensor> {
        match &self.tensors.get(name)?.kind {
            Kind::Float(v) => Some(HostTensor {
                shape: self.tensors[name].shape.clone(),
                data: v.get().into_owned(),
            }),
            Kind::Mx { .. } => None,
        }
    }

    /// Writes everything to one `.safetensors` file: floats as f32, packed MX weights as `U8`
    /// with the format in the metadata. Fails with every problem a packed weight had.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        self.check()?;
        let names: Vec<&str> = self.names().collect();
        self.write_file(path.as_ref(), &names, StoreDtype::F32)
    }

    /// Writes everything into the folder `dir` as Hugging Face does: floats in `dtype`, one file
    /// `model.safetensors` when it fits in `max_shard_bytes`, else shards
    /// `model-00001-of-0000N.safetensors` of at most that size (a larger tensor gets a shard of
    /// its own) and `model.safetensors.index.json` with the `weight_map` and the total size.
    /// Tensors are read from the model and written one at a time. Returns the files written.
    pub fn write_sharded(
        &self,
        dir: impl AsRef<Path>,
        dtype: StoreDtype,
        max_shard_bytes: u64,
    ) -> Result<Vec<PathBuf>> {
        self.check()?;
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let mut shards: Vec<Vec<&str>> = vec![Vec::new()];
        let mut size = 0u64;
        let mut total = 0u64;
        for (name, t) in &self.tensors {
            let bytes = t.bytes(dtype);
            total += bytes;
            let last = shards.last_mut().expect("one shard at least");
            if !last.is_empty() && size + bytes > max_shard_bytes {
                shards.push(vec![name]);
                size = bytes;
            } else {
                last.push(name);
                size += bytes;
            }
        }
        if shards.len() == 1 {
            let path = dir.join("model.safetensors");
            self.write_file(&path, &shards[0], dtype)?;
            return Ok(vec![path]);
        }
        let n = shards.len();
        let mut written = Vec::with_capacity(n + 1);
        let mut weight_map = serde_json::Map::new();
        for (i, names) in shards.iter().enumerate() {
            let file = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
            let path = dir.join(&file);
            self.write_file(&path, names, dtype)?;
            for name in names {
                weight_map.insert((*name).to_owned(), serde_json::Value::String(file.clone()));
            }
            written.push(path);
        }
        let index = serde_json::json!({
            "metadata": { "total_size": total },
            "weight_map": weight_map,
        });
        let path = dir.join("model.safetensors.index.json");
        let text = serde_json::to_string_pretty(&index).map_err(|source| Error::Json {
            path: path.clone(),
            source,
        })?;
        std::fs::write(&path, text).map_err(io_err(&path))?;
        written.push(path);
        Ok(written)
    }

    fn check(&self) -> Result<()> {
        if self.problems.is_empty() {
            Ok(())
        } else {
            Err(Error::Checkpoint(self.problems.join("\n")))
        }
    }

    /// One safetensors file holding `names`, in that order: the header first (every shape and
    /// offset is known without the values), then each tensor's bytes as it is read from the
    /// model. A file that cannot be finished is removed.
    fn write_file(&self, path: &Path, names: &[&str], dtype: StoreDtype) -> Result<()> {
        let result = self.try_write_file(path, names, dtype);
        if result.is_err() {
            let _ = std::fs::remove_file(path);
        }
        result
    }

    fn try_write_file(&self, path: &Path, names: &[&str], dtype: StoreDtype) -> Result<()> {
        use std::io::Write;
        let st_err = |reason: String| Error::SafeTensors {
            path: path.to_path_buf(),
            reason,
        };
        let mut header = serde_json::Map::new();
        let mut metadata = serde_json::Map::new();
        metadata.insert("format".into(), "pt".into());
        if let Some(f) = self.mx_format {
            let name = match f {
                MxFormat::Fp4E2M1 => "e2m1",
                MxFormat::Fp8E4M3 => "e4m3",
                MxFormat::Fp8E5M2 => "e5m2",
            };
            metadata.insert("mx_format".into(), name.into());
        }
        header.insert("__metadata__".into(), serde_json::Value::Object(metadata));
        let mut offset = 0u64;
        for &name in names {
            let t = &self.tensors[name];
            let end = offset + t.bytes(dtype);
            header.insert(
                name.to_owned(),
                serde_json::json!({
                    "dtype": t.dtype(dtype),
                    "shape": t.shape,
                    "data_offsets": [offset, end],
                }),
            );
            offset = end;
        }
        let mut text = serde_json::to_string(&header).map_err(|e| st_err(e.to_string()))?;
        // The data starts 8-byte aligned: the header is padded with spaces.
        while text.len() % 8 != 0 {
            text.push(' ');
        }
        let file = std::fs::File::create(path).map_err(io_err(path))?;
        let mut out = std::io::BufWriter::new(file);
        let io = io_err(path);
        out.write_all(&(text.len() as u64).to_le_bytes())
            .and_then(|()| out.write_all(text.as_bytes()))
            .map_err(io)?;
        for &name in names {
            let t = &self.tensors[name];
            let bytes = t.encode(name, dtype).map_err(st_err)?;
            if bytes.len() as u64 != t.bytes(dtype) {
                return Err(st_err(format!(
                    "{name}: {} bytes for the shape {:?}, expected {}",
                    bytes.len(),
                    t.shape,
                    t.bytes(dtype)
                )));
            }
            out.write_all(&bytes).map_err(io_err(path))?;
        }
        out.flush().map_err(io_err(path))
    }
}

/// The float dtype a checkpoint is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum StoreDtype {
    /// 32-bit floats, exact.
    #[default]
    F32,
    /// bfloat16 (rounded to nearest, ties to even): half the size, what published checkpoints use.
    Bf16,
}

impl StoreDtype {
    fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
        }
    }

    fn safetensors(self) -> Dtype {
        match self {
            Self::F32 => Dtype::F32,
            Self::Bf16 => Dtype::BF16,
        }
    }

    fn encode(self, data: &[f32]) -> Vec<u8> {
        match self {
            Self::F32 => data.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Self::Bf16 => data
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
        }
    }
}

/// A module's table of checkpoint names (design §7): how to load it from and save it to a
/// Hugging Face checkpoint under a name prefix such as `model.layers.3.`.
pub trait HfCheckpoint<B: Backend>: Sized {
    /// Replaces this module's tensors with those under `prefix`.
    fn load_hf(self, prefix: &str, loader: &mut Loader<'_, B>) -> Self;
    /// Adds this module's tensors under `prefix`.
    fn save_hf(&self, prefix: &str, saver: &mut Saver);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reader_accepts_f32_f16_and_bf16_and_rejects_other_dtypes() {
        let values = [1.5f32, -0.25, 3.0, 1e-3, -7.75, 0.0];
        let f32_bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let f16_bytes: Vec<u8> = values
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect();
        let bf16_bytes: Vec<u8> = values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        let i32_bytes: Vec<u8> = [1i32, 2].iter().flat_map(|v| v.to_le_bytes()).collect();
        let views = vec![
            (
                "a.f32",
                safetensors::tensor::TensorView::new(Dtype::F32, vec![2, 3], &f32_bytes).unwrap(),
            ),
            (
                "b.f16",
                safetensors::tensor::TensorView::new(Dtype::F16, vec![2, 3], &f16_bytes).unwrap(),
            ),
            (
                "c.bf16",
                safetensors::tensor::TensorView::new(Dtype::BF16, vec![6], &bf16_bytes).unwrap(),
            ),
            (
                "d.i32",
                safetensors::tensor::TensorView::new(Dtype::I32, vec![2], &i32_bytes).unwrap(),
            ),
        ];
        let path = std::env::temp_dir().join(format!(
            "kimi-burn-dtypes-{}.safetensors",
            std::process::id()
        ));
        safetensors::serialize_to_file(views, None, &path).unwrap();
        let reader = SafeTensorsReader::open(&path).unwrap();
        assert_eq!(
            reader.names().collect::<Vec<_>>(),
            ["a.f32", "b.f16", "c.bf16", "d.i32"]
        );
        let a = reader.read("a.f32").unwrap().unwrap();
        assert_eq!((a.shape, a.data), (vec![2, 3], values.to_vec()));
        let b = reader.read("b.f16").unwrap().unwrap();
        let c = reader.read("c.bf16").unwrap().unwrap();
        for (i, v) in values.iter().enumerate() {
            // Exact up to the precision of the stored type (both round-trip these values closely).
            assert!(
                (b.data[i] - v).abs() <= 1e-3 * v.abs().max(1.0),
                "f16 {i}: {} vs {v}",
                b.data[i]
            );
            assert!(
                (c.data[i] - v).abs() <= 1e-2 * v.abs().max(1.0),
                "bf16 {i}: {} vs {v}",
                c.data[i]
            );
        }
        assert_eq!(c.shape, vec![6]);
        let err = reader.read("d.i32").unwrap_err().to_string();
        assert!(err.contains("d.i32") && err.contains("I32"), "{err}");
        assert!(reader.read("missing").unwrap().is_none());
        std::fs::remove_file(&path).ok();
    }

    /// A file whose data stops short of what its header announces is refused when it is opened,
    /// naming the file (the mapping is never read out of range).
    #[test]
    fn a_truncated_file_is_an_error_at_open() {
        let values: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let view = safetensors::tensor::TensorView::new(Dtype::F32, vec![4], &values).unwrap();
        let path = std::env::temp_dir().join(format!(
            "kimi-burn-truncated-{}.safetensors",
            std::process::id()
        ));
        safetensors::serialize_to_file(vec![("w", view)], None, &path).unwrap();
        assert_eq!(
            SafeTensorsReader::open(&path)
                .unwrap()
                .read("w")
                .unwrap()
                .unwrap()
                .data,
            [1.0, 2.0, 3.0, 4.0]
        );
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 4]).unwrap();
        let err = SafeTensorsReader::open(&path).unwrap_err().to_string();
        assert!(err.contains("kimi-burn-truncated"), "{err}");
        std::fs::remove_file(&path).ok();
    }
}
