//! Reading a checkpoint: one `.safetensors` file or a sharded folder, each tensor read from disk
//! when asked for and converted to f32.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::Dtype;

use crate::error::{Error, Result};

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

pub(super) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
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
