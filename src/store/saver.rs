//! Writing a checkpoint: a model's tensors collected under their checkpoint names and written one
//! at a time, in f32, bf16 or packed MX.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::{backend::Backend, Tensor};
use safetensors::Dtype;

use super::{io_err, HostTensor};
use crate::error::{Error, Result};
use crate::ops::quant::{pack_rows, MxFormat, MxSpec, MX_BLOCK};

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
    /// Floats, written in f32 in every file.
    F32(Values),
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
            Kind::F32(_) => (n * 4) as u64,
            Kind::Mx { .. } => n as u64,
        }
    }

    fn dtype(&self, dtype: StoreDtype) -> Dtype {
        match self.kind {
            Kind::Float(_) => dtype.safetensors(),
            Kind::F32(_) => Dtype::F32,
            Kind::Mx { .. } => Dtype::U8,
        }
    }

    /// The bytes on disk; reads the values from the model now.
    fn encode(&self, name: &str, dtype: StoreDtype) -> std::result::Result<Vec<u8>, String> {
        match &self.kind {
            Kind::Float(v) => Ok(dtype.encode(&v.get())),
            Kind::F32(v) => Ok(StoreDtype::F32.encode(&v.get())),
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

    /// Adds a host vector, written in f32 whatever the file's float dtype: it holds the QB bias,
    /// an f32 precision island (design §0) whose bf16 rounding would move expert selections.
    pub fn vector(&mut self, name: &str, data: Vec<f32>) {
        self.tensors.insert(
            name.to_owned(),
            Planned {
                shape: vec![data.len()],
                kind: Kind::F32(Values::Host(Rc::new(data))),
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
            Kind::Float(v) | Kind::F32(v) => Some(HostTensor {
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
    /// Tensors are read from the model and written one at a time. The weight files of an earlier
    /// save into `dir` that this one does not overwrite (a single file, an index, other shards)
    /// are removed afterwards, so that no reader finds the old weights. Returns the files written.
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
            let written = vec![path];
            remove_stale_weights(dir, &written)?;
            return Ok(written);
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
        remove_stale_weights(dir, &written)?;
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

/// Removes the weight files of an earlier save from `dir` that `written` does not hold: a
/// `model.safetensors`, a `model.safetensors.index.json` and shards `model-NNNNN-of-NNNNN.safetensors`.
/// A reader takes the index over a single file (this crate's) or the single file over the index
/// (Hugging Face's), so leaving either would load the old weights. Other files stay.
fn remove_stale_weights(dir: &Path, written: &[PathBuf]) -> Result<()> {
    let is_weights = |name: &str| {
        name == "model.safetensors"
            || name == "model.safetensors.index.json"
            || name
                .strip_prefix("model-")
                .and_then(|n| n.strip_suffix(".safetensors"))
                .and_then(|n| n.split_once("-of-"))
                .is_some_and(|(i, n)| {
                    [i, n]
                        .iter()
                        .all(|p| p.len() == 5 && p.bytes().all(|b| b.is_ascii_digit()))
                })
    };
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let path = entry.map_err(io_err(dir))?.path();
        let stale = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(is_weights)
            && path.is_file()
            && !written.contains(&path);
        if stale {
            std::fs::remove_file(&path).map_err(io_err(&path))?;
        }
    }
    Ok(())
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
