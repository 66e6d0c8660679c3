//! The optimiser's updates on the CPU host kernels: one pass over each parameter, writing into the
//! buffers of the parameter and the moments when nothing else holds them, instead of a tensor op
//! (a pass and a fresh buffer) per arithmetic step.
//!
//! Each element is computed with the operations of the tensor-op form in its order, each rounded
//! to f32 (Rust contracts nothing into fused multiply-adds), so the results are those of the
//! reference bit for bit, and so Burn's `AdamW`'s on the CPU backends.

// Without a CPU backend (ndarray, flex) no backend reaches the host kernels: compiled, unused.
#![cfg_attr(
    not(any(feature = "ndarray", feature = "flex")),
    allow(dead_code, unused_imports)
)]

use rayon::prelude::*;

use super::AdamWScalars;
use crate::ops::backend::host::{HostArray, HostData};
use crate::ops::backend::simd::{dispatch, Simd, WithSimd};
use crate::ops::norm::host::MIN_PARALLEL;

/// Elements per task on rayon's pool.
const CHUNK: usize = 1 << 16;

/// The values of `x` to write in place: its own buffer when nothing else holds it, a copy
/// otherwise.
fn writable(x: &mut HostArray) -> &mut [f32] {
    if x.data.unique_mut().is_none() {
        x.data = HostData::Owned(x.data.to_vec());
    }
    x.data
        .unique_mut()
        .unwrap_or_else(|| unreachable!("an owned buffer is unique"))
}

/// One AdamW step over a chunk of elements, in place.
struct AdamWChunk<'a> {
    s: AdamWScalars,
    param: &'a mut [f32],
    grad: &'a [f32],
    m1: &'a mut [f32],
    m2: &'a mut [f32],
}

impl WithSimd for AdamWChunk<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _: S) {
        let Self {
            s,
            param,
            grad,
            m1,
            m2,
        } = self;
        let n = param.len();
        let (grad, m1, m2) = (&grad[..n], &mut m1[..n], &mut m2[..n]);
        // Where the tensor-op form skips a product by 1 (`keep == 1`), multiplying gives the same
        // bits: `x · 1 = x` exactly.
        let keep = s.keep;
        for i in 0..n {
            let g = grad[i];
            let a = m1[i] * s.beta1 + g * s.f1;
            let b = m2[i] * s.beta2 + (g * g) * s.f2;
            let delta = (a / s.c1) / ((b / s.c2).sqrt() + s.eps);
            param[i] = param[i] * keep - delta * s.lr;
            m1[i] = a;
            m2[i] = b;
        }
    }
}

/// [`adamw_update`](super::adamw_update) on the host: `[param, grad, m1, m2]` → `[param, m1, m2]`
/// after the step, written into the inputs' buffers where nothing else holds them.
pub(crate) fn adamw(
    s: AdamWScalars,
    [mut param, grad, mut m1, mut m2]: [HostArray; 4],
) -> [HostArray; 3] {
    {
        let (p, a, b) = (writable(&mut param), writable(&mut m1), writable(&mut m2));
        let g = &grad.data[..];
        let chunk = |(((param, grad), m1), m2)| {
            dispatch(AdamWChunk {
                s,
                param,
                grad,
                m1,
                m2,
            })
        };
        if p.len() >= MIN_PARALLEL {
            p.par_chunks_mut(CHUNK)
                .zip(g.par_chunks(CHUNK))
                .zip(a.par_chunks_mut(CHUNK))
                .zip(b.par_chunks_mut(CHUNK))
                .for_each(chunk);
        } else {
            chunk((((p, g), a), b));
        }
    }
    [param, m1, m2]
}

/// `a·x + b·y` over a chunk, into `out` (which may be `x`'s own buffer: `x` is then `None`).
struct ScaledSumChunk<'a> {
    a: f32,
    b: f32,
    x: Option<&'a [f32]>,
    y: &'a [f32],
    out: &'a mut [f32],
}

impl WithSimd for ScaledSumChunk<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _: S) {
        let Self { a, b, x, y, out } = self;
        let n = out.len();
        let y = &y[..n];
        // Where the tensor-op form skips a product by a factor of exactly 1, multiplying gives
        // the same bits: `x · 1 = x` exactly.
        match x {
            Some(x) => {
                let x = &x[..n];
                for i in 0..n {
                    out[i] = x[i] * a + y[i] * b;
                }
            }
            None => {
                for i in 0..n {
                    out[i] = out[i] * a + y[i] * b;
                }
            }
        }
    }
}

/// [`scaled_sum`](super::scaled_sum) on the host: `a·x + b·y` into `x`'s buffer when nothing else
/// holds it, a new one otherwise.
pub(crate) fn scaled_sum(a: f32, b: f32, [mut x, y]: [HostArray; 2]) -> [HostArray; 1] {
    let yv = &y.data[..];
    let in_place = x.data.unique_mut().is_some();
    let mut fresh = Vec::new();
    let (xv, out): (Option<&[f32]>, &mut [f32]) = if in_place {
        let out = x
            .data
            .unique_mut()
            .unwrap_or_else(|| unreachable!("checked above"));
        (None, out)
    } else {
        fresh = vec![0.0f32; x.data.len()];
        (Some(&x.data[..]), &mut fresh[..])
    };
    let chunk = |(i, out): (usize, &mut [f32])| {
        let span = i * CHUNK..i * CHUNK + out.len();
        dispatch(ScaledSumChunk {
            a,
            b,
            x: xv.map(|x| &x[span.clone()]),
            y: &yv[span],
            out,
        })
    };
    if out.len() >= MIN_PARALLEL {
        out.par_chunks_mut(CHUNK).enumerate().for_each(chunk);
    } else {
        chunk((0, out));
    }
    if in_place {
        [x]
    } else {
        [HostArray {
            data: fresh.into(),
            shape: x.shape,
        }]
    }
}
