//! Real MX storage: element codes and E8M0 block scales (design §9).

use burn::tensor::{backend::Backend, Tensor, TensorData};

use super::scalar::{self, decode, encode, quantize_element, scale_by, scale_exponent};
use super::{MxFormat, MxScaleRule, MX_BLOCK};
use crate::error::{Error, Result};

/// A tensor in MX storage.
///
/// Layout: the quantised axis is swapped with the last one (`swap_dims(axis, D − 1)`), giving
/// `rows` rows of `len` values in row-major order; each row is cut into blocks of 32 (the last one
/// shorter when `len` is not a multiple of 32). `scales` holds one E8M0 byte per block
/// (`2^(byte − 127)`), row by row; `codes` one byte per element for FP8, and two per byte for FP4
/// (the first element in the low nibble; an odd total leaves the last high nibble zero).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MxTensor {
    /// The element format.
    pub format: MxFormat,
    /// The tensor's shape.
    pub shape: Vec<usize>,
    /// The quantised axis.
    pub axis: usize,
    /// Element codes.
    pub codes: Vec<u8>,
    /// E8M0 block scales.
    pub scales: Vec<u8>,
}

impl MxTensor {
    /// Bytes of storage (codes and scales).
    pub fn size_bytes(&self) -> usize {
        self.codes.len() + self.scales.len()
    }
}

/// The shape with `axis` swapped with the last one, and `(rows, len)`.
fn moved_last(shape: &[usize], axis: usize) -> (Vec<usize>, usize, usize) {
    let mut moved = shape.to_vec();
    let last = moved.len() - 1;
    moved.swap(axis, last);
    let len = moved[last];
    let rows = shape.iter().product::<usize>() / len.max(1);
    (moved, rows, len)
}

/// Quantises `x` to MX storage in blocks of 32 along `axis` (one host read of `x`).
///
/// Errors on a bad axis and on NaN or infinities (a block scale is undefined then).
pub fn quantize_mx<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    format: MxFormat,
    rule: MxScaleRule,
    axis: usize,
) -> Result<MxTensor> {
    if axis >= D {
        return Err(Error::argument(
            "axis",
            format!("must be below the rank {D}, got {axis}"),
        ));
    }
    let shape = x.dims().to_vec();
    let values: Vec<f32> = crate::sync::read(x.swap_dims(axis, D - 1))
        .iter::<f32>()
        .collect();
    if let Some(bad) = values.iter().find(|v| !v.is_finite()) {
        return Err(Error::NonFinite {
            what: "quantize_mx input".into(),
            detail: format!("{bad}: an MX block scale is undefined"),
        });
    }
    let (_, _, len) = moved_last(&shape, axis);
    let (codes, scales) = pack_rows(&values, len, format, rule);
    Ok(MxTensor {
        format,
        shape,
        axis,
        codes,
        scales,
    })
}

/// Element codes and E8M0 scales of finite `values` in rows of `len`, blocks of 32 from each row's
/// start (FP4 codes two per byte, the first in the low nibble).
pub(crate) fn pack_rows(
    values: &[f32],
    len: usize,
    format: MxFormat,
    rule: MxScaleRule,
) -> (Vec<u8>, Vec<u8>) {
    let e = format.elem();
    let mut codes = Vec::with_capacity(values.len());
    let mut scales = Vec::new();
    if len > 0 {
        for row in values.chunks(len) {
            for block in row.chunks(MX_BLOCK) {
                let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let s = scale_exponent(amax, format, rule).unwrap_or(0);
                scales.push((s + 127) as u8);
                codes.extend(
                    block
                        .iter()
                        .map(|&v| encode(quantize_element(scale_by(v, -s), e), e)),
                );
            }
        }
    }
    let codes = match format {
        MxFormat::Fp4E2M1 => codes
            .chunks(2)
            .map(|p| p[0] | p.get(1).map_or(0, |hi| hi << 4))
            .collect(),
        _ => codes,
    };
    (codes, scales)
}

/// The values of MX storage as an f32 tensor of `mx.shape`: `dequantize_mx(quantize_mx(x)) ==
/// mx_fake_quant(x)` bit for bit.
///
/// Errors when the storage does not fit its shape and format (code or scale count, a rank other
/// than `D`, a scale byte of 255, which E8M0 reserves for NaN).
pub fn dequantize_mx<B: Backend, const D: usize>(
    mx: &MxTensor,
    device: &B::Device,
) -> Result<Tensor<B, D>> {
    if mx.shape.len() != D || mx.axis >= D {
        return Err(Error::shape(
            "MxTensor",
            format!("rank {D} with the axis below it"),
            (mx.shape.clone(), mx.axis),
        ));
    }
    let (moved, values) = dequantize_host(mx)?;
    let moved_tensor = Tensor::<B, D>::from_data(
        TensorData::new(values, moved),
        (device, burn::tensor::DType::F32),
    );
    Ok(moved_tensor.swap_dims(mx.axis, D - 1))
}

/// The values of MX storage on the host, in the layout with the quantised axis last (that layout's
/// shape first). Checks as [`dequantize_mx`].
pub(crate) fn dequantize_host(mx: &MxTensor) -> Result<(Vec<usize>, Vec<f32>)> {
    if mx.axis >= mx.shape.len() {
        return Err(Error::shape(
            "MxTensor",
            "an axis below the rank",
            (mx.shape.clone(), mx.axis),
        ));
    }
    let (moved, rows, len) = moved_last(&mx.shape, mx.axis);
    let n = rows * len;
    let blocks_per_row = len.div_ceil(MX_BLOCK);
    let code_bytes = match mx.format {
        MxFormat::Fp4E2M1 => n.div_ceil(2),
        _ => n,
    };
    if mx.codes.len() != code_bytes || mx.scales.len() != rows * blocks_per_row {
        return Err(Error::shape(
            "MxTensor codes, scales",
            format!(
                "{code_bytes} code bytes and {} scales",
                rows * blocks_per_row
            ),
            (mx.codes.len(), mx.scales.len()),
        ));
    }
    if mx.scales.contains(&255) {
        return Err(Error::NonFinite {
            what: "MxTensor scales".into(),
            detail: "E8M0 byte 255 is NaN".into(),
        });
    }
    let e = mx.format.elem();
    let code = |i: usize| match mx.format {
        MxFormat::Fp4E2M1 => (mx.codes[i / 2] >> (4 * (i % 2))) & 0x0f,
        _ => mx.codes[i],
    };
    let values: Vec<f32> = (0..n)
        .map(|i| {
            let (row, col) = (i / len, i % len);
            let s = mx.scales[row * blocks_per_row + col / MX_BLOCK] as i32 - 127;
            scalar::scale_by(decode(code(i), e), s) + 0.0
        })
        .collect();
    Ok((moved, values))
}
