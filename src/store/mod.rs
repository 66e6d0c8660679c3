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

mod kda;
mod loader;
mod mla;
mod model;
mod moe;
mod reader;
mod saver;

use burn::tensor::backend::Backend;

pub use loader::Loader;
pub use reader::{HostTensor, SafeTensorsReader};
pub use saver::{Saver, StoreDtype};

use reader::io_err;

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
    use safetensors::Dtype;

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
