//! Loop bodies for the host kernels that compile to SIMD code.
//!
//! The host kernels are built for the baseline CPU of the target (SSE2 on x86-64) and run on
//! whatever CPU the user has, so their hot loops are `pulp` [`WithSimd`] bodies run through
//! [`dispatch`]: one copy per instruction set (AVX-512, AVX2+FMA, …) chosen at run time. The
//! helpers here are `#[inline(always)]` so that each copy compiles them with its own instruction
//! set.
//!
//! Every helper works lane by lane on `[f32; LANES]` blocks with the same operation order on every
//! instruction set (Rust never contracts `a * b + c` into a fused multiply-add on its own), so the
//! host kernels give bit-identical results on every CPU.

// Without a CPU backend (ndarray, flex) no backend reaches the host kernels: compiled, unused.
#![cfg_attr(
    not(any(feature = "ndarray", feature = "flex")),
    allow(dead_code, unused_imports)
)]

use std::mem::MaybeUninit;

pub(crate) use pulp::{Scalar, Simd, WithSimd};

/// Runs `op` with the widest SIMD instruction set this CPU has (AVX-512, AVX2+FMA, or one lane at
/// a time), chosen at run time.
#[inline]
pub(crate) fn dispatch<Op: WithSimd>(op: Op) -> Op::Output {
    pulp::Arch::new().dispatch(op)
}

/// The lanes of `S` at the start of `x` (which must hold at least that many).
#[inline(always)]
pub(crate) fn load<S: Simd>(x: &[f32]) -> S::f32s {
    bytemuck::pod_read_unaligned(bytemuck::cast_slice(&x[..S::F32_LANES]))
}

/// Writes the lanes `v` at the start of `x` (which must hold at least that many).
#[inline(always)]
pub(crate) fn store<S: Simd>(x: &mut [f32], v: S::f32s) {
    x[..S::F32_LANES].copy_from_slice(bytemuck::cast_slice(std::slice::from_ref(&v)));
}

/// The offsets that the prefetches of `len` floats request: one every 64 bytes and the last
/// element.
#[inline(always)]
fn line_offsets(len: usize) -> impl Iterator<Item = usize> {
    (0..len).step_by(16).chain(len.checked_sub(1))
}

/// Asks the CPU to bring `x` into its caches ahead of use: a request every 64 bytes and one for
/// the last element (a row that does not start on a line boundary ends on one line more); a hint
/// that never faults and changes no result (a no-op off x86-64).
///
/// The host kernels walk `[B, T, H, X]` tensors one head at a time, so each token's row sits
/// `H · X` floats after the previous one: with the usual `H · X · 4` of 1 KiB or more, a 4 KiB page
/// holds a handful of rows, and the hardware's stream prefetchers (which stop at page boundaries)
/// leave every few tokens waiting on main memory once the tensors outgrow the last-level cache.
#[inline(always)]
pub(crate) fn prefetch(x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for at in line_offsets(x.len()) {
        // SAFETY: a prefetch is a hint with no architectural effect; the address is in bounds.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                x[at..].as_ptr().cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

/// Asks the CPU to bring the `len` floats at `ptr` into its caches ready to be written
/// (`PREFETCHW`, a request every 64 bytes and one for the last element): a store to a line that is
/// not in the cache first reads the line from memory, and a kernel that writes rows `H · X` floats
/// apart meets that read on every row once its outputs outgrow the last-level cache. A hint: never
/// faults, whatever the address, and changes no result. A read prefetch where the CPU lacks
/// `PREFETCHW` (CPUID `8000_0001h`, ECX bit 8); a no-op off x86-64.
#[inline(always)]
pub(crate) fn prefetch_write(ptr: *const f32, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let write = has_prefetchw();
        for at in line_offsets(len) {
            let line = ptr.wrapping_add(at);
            // SAFETY: a prefetch is a hint with no architectural effect that never faults, and
            // `PREFETCHW` runs only where CPUID reports it. (`_MM_HINT_ET0` would compile to a
            // plain `PREFETCHT0` without the `prfchw` target feature, hence the assembly.)
            unsafe {
                if write {
                    std::arch::asm!(
                        "prefetchw [{}]",
                        in(reg) line,
                        options(nostack, preserves_flags, readonly)
                    );
                } else {
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                        line.cast(),
                    );
                }
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (ptr, len);
}

/// Whether the CPU runs `PREFETCHW` (CPUID `8000_0001h`, ECX bit 8), asked once per process.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn has_prefetchw() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        use std::arch::x86_64::__cpuid;
        // SAFETY: every x86-64 CPU has CPUID and its extended leaf 8000_0000h.
        #[allow(unused_unsafe)]
        let (max, ecx) = unsafe { (__cpuid(0x8000_0000).eax, __cpuid(0x8000_0001).ecx) };
        max >= 0x8000_0001 && ecx & (1 << 8) != 0
    })
}

/// The width of the lane blocks: one AVX-512 register, two AVX2 registers, four SSE registers.
pub(crate) const LANES: usize = 16;

/// `exp(x)` for every element, in place, to within 2 ulp of `f32::exp` for `x ≥ −87.3`; below
/// that (where `exp` is subnormal or zero) the result is 0, above 88 it is `+∞`. NaN stays NaN.
///
/// `2ⁿ·e^r` from the range reduction of [`exp_reduced`].
#[inline(always)]
pub(crate) fn exp_in_place(x: &mut [f32]) {
    let (blocks, tail) = x.as_chunks_mut::<LANES>();
    for block in blocks {
        for v in block.iter_mut() {
            *v = exp_lane(*v);
        }
    }
    for v in tail {
        *v = exp_lane(*v);
    }
}

/// The range reduction of [`exp_lane`] for `x ∈ [−87.3, 88]`: `x = n·ln 2 + r`, `|r| ≤ ln 2 / 2`,
/// with `n` rounded by the `1.5·2^23` trick (no rounding instruction needed); returns `(P(r), r,
/// 2ⁿ)` with `e^r = 1 + r·P(r)` (Taylor to degree 7: truncation error below 1e-8 relative) and
/// `2ⁿ` built in the exponent bits.
#[inline(always)]
fn exp_reduced(x: f32) -> (f32, f32, f32) {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2^23
    let t = x.mul_add(LOG2_E, ROUND);
    let n = t - ROUND;
    let bits = t.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let mut p = 1.0f32 / 5040.0;
    p = p.mul_add(r, 1.0 / 720.0);
    p = p.mul_add(r, 1.0 / 120.0);
    p = p.mul_add(r, 1.0 / 24.0);
    p = p.mul_add(r, 1.0 / 6.0);
    p = p.mul_add(r, 0.5);
    p = p.mul_add(r, 1.0);
    let scale = f32::from_bits(((bits + 127) as u32) << 23);
    (p, r, scale)
}

/// `x`, or `+0` where `|x|` is below `f32`'s normal range (a subnormal): a gradient that small is
/// below every tolerance of the crate, and on x86 CPUs (which run without flush-to-zero unless a
/// program sets it) every instruction that reads or writes a subnormal costs a microcode assist
/// of about a hundred cycles. A host kernel whose outputs can underflow writes them through this,
/// so that neither it nor the products that read them later pay that: in `train_tiny` the KDA
/// gate's input gradient of one layer came out about 5% subnormal (a channel whose gate had
/// saturated), and the weight gradient of the projection before it, a product of 8 M
/// multiply-adds, took 5–6.5 ms per step instead of about 0.1 ms.
#[inline(always)]
pub(crate) fn flush_subnormal(x: f32) -> f32 {
    if x.abs() < f32::MIN_POSITIVE {
        0.0
    } else {
        x
    }
}

/// The lowest argument whose `exp` the lane functions compute (below it the result is 0).
const EXP_LOW: f32 = -87.3;

/// One lane of [`exp_in_place`]; branch-free so that the loops around it vectorise.
///
/// NaN stays NaN without a select of its own: the clamp keeps a NaN (`f32::clamp`), every
/// product and sum with it is NaN, and neither comparison below holds for it.
#[inline(always)]
pub(crate) fn exp_lane(x: f32) -> f32 {
    const HIGH: f32 = 88.0;
    let (p, r, scale) = exp_reduced(x.clamp(EXP_LOW, HIGH));
    let y = p.mul_add(r, 1.0) * scale;
    // Outside [EXP_LOW, HIGH] the clamped value is wrong on purpose and replaced here.
    let y = if x < EXP_LOW { 0.0 } else { y };
    if x > HIGH {
        f32::INFINITY
    } else {
        y
    }
}

/// `(exp(a), expm1(a))` for `a ≤ 0` (the gates' and activations' arguments) from one range
/// reduction, branch-free: with `a = n·ln 2 + r` and `e^r − 1 = r·P(r)` as in [`exp_lane`],
/// `expm1(a) = 2ⁿ·r·P(r) + (2ⁿ − 1)` and `exp(a) = 2ⁿ·r·P(r) + 2ⁿ`. For `|a| < ln 2 / 2` (`n = 0`,
/// `r = a`) the first is `r·P(r)` itself: no cancellation near 0. Below −87.3 the results are 0
/// and −1; NaN stays NaN.
///
/// The NaN select is redundant (the arithmetic carries a NaN, as in [`exp_lane`]) but kept: the
/// SiTU-GLU gradient loop, its one hot caller, ran 4% slower without it (1.64 → 1.71 ns per
/// element in cache; the generated code was not examined).
#[inline(always)]
pub(crate) fn exp_expm1_nonpositive_lane(a: f32) -> (f32, f32) {
    let (e, m) = exp_expm1_nonpositive_lean_lane(a);
    let (e, m) = if a < EXP_LOW { (0.0, -1.0) } else { (e, m) };
    if a.is_nan() {
        (a, a)
    } else {
        (e, m)
    }
}

/// [`exp_expm1_nonpositive_lane`] without its two selects, for callers that cannot tell the
/// difference (six vector instructions of about thirty fewer): below −87.3 `exp` is `e^{−87.3}`
/// (≈ 1.3e−38, among f32's smallest normal numbers) instead of 0, and `expm1` is −1 all the same
/// (the sum rounds to it). NaN stays NaN, through the arithmetic.
#[inline(always)]
pub(crate) fn exp_expm1_nonpositive_lean_lane(a: f32) -> (f32, f32) {
    let (p, r, scale) = exp_reduced(a.clamp(EXP_LOW, 0.0));
    let pm1 = p * r;
    (pm1.mul_add(scale, scale), pm1.mul_add(scale, scale - 1.0))
}

/// `ln(1 + y)` for `y ∈ [0, 1]` (softplus's tail `log1p(e^{−|x|})`), branch-free, to within 2 ulp:
/// with `s = y / (2 + y) ∈ [0, 1/3]`, `ln(1 + y) = 2·atanh(s) = 2s·(1 + s²/3 + s⁴/5 + … + s¹²/13)`,
/// whose truncation is below 2e−8 relative (the next term is `s¹⁴/15 ≤ 9⁻⁷/15`). No subtraction:
/// tiny `y` keep their precision. NaN stays NaN.
#[inline(always)]
pub(crate) fn ln_1p_unit_lane(y: f32) -> f32 {
    let s = y / (2.0 + y);
    let s2 = s * s;
    let mut p = 1.0f32 / 13.0;
    p = p.mul_add(s2, 1.0 / 11.0);
    p = p.mul_add(s2, 1.0 / 9.0);
    p = p.mul_add(s2, 1.0 / 7.0);
    p = p.mul_add(s2, 1.0 / 5.0);
    p = p.mul_add(s2, 1.0 / 3.0);
    p = p.mul_add(s2, 1.0);
    2.0 * s * p
}

/// Elements per task when an elementwise map runs on rayon's pool.
const MAP_CHUNK: usize = 1 << 16;

/// A scalar function of `N` floats for [`map`]. `apply` must be `#[inline(always)]` and built
/// from branch-free `#[inline(always)]` arithmetic ([`exp_lane`], selects) so that the loop
/// around it vectorises (a closure would not do: the compiler may leave it a call per element).
pub(crate) trait Elementwise<const N: usize>: Copy + Send + Sync {
    /// The value at one element.
    fn apply(&self, x: [f32; N]) -> f32;
}

/// `f` applied to every element (of the `N` inputs together), compiled for the widest SIMD of
/// this CPU ([`dispatch`]) and spread over rayon's pool for large inputs, into a new buffer.
pub(crate) fn map<const N: usize, F: Elementwise<N>>(inputs: [&[f32]; N], f: F) -> Vec<f32> {
    let [out] = map_many(inputs, One(f));
    out
}

/// [`map_many_into`] into `M` new buffers. They are not zeroed first: the map writes every
/// element, and a zeroing pass would be one more pass over memory as long as the outputs.
pub(crate) fn map_many<const N: usize, const M: usize, F: ElementwiseMany<N, M>>(
    inputs: [&[f32]; N],
    f: F,
) -> [Vec<f32>; M] {
    let len = inputs.iter().map(|x| x.len()).min().unwrap_or(0);
    let mut outs: [Vec<f32>; M] = std::array::from_fn(|_| Vec::with_capacity(len));
    map_many_uninit(
        outs.each_mut().map(|o| &mut o.spare_capacity_mut()[..len]),
        inputs,
        f,
    );
    for o in &mut outs {
        // SAFETY: `map_many_uninit` wrote each of the first `len` elements.
        unsafe { o.set_len(len) };
    }
    outs
}

/// [`map`] into `out` (as long as the shortest input): [`map_many_into`] with one output.
pub(crate) fn map_into<const N: usize, F: Elementwise<N>>(
    out: &mut [f32],
    inputs: [&[f32]; N],
    f: F,
) {
    map_many_into([out], inputs, One(f));
}

/// An [`Elementwise`] function as an [`ElementwiseMany`] with one output.
#[derive(Clone, Copy)]
struct One<F>(F);

impl<const N: usize, F: Elementwise<N>> ElementwiseMany<N, 1> for One<F> {
    #[inline(always)]
    fn apply(&self, x: [f32; N]) -> [f32; 1] {
        [self.0.apply(x)]
    }
}

/// `M` scalar functions of the same `N` floats for [`map_many_into`], computed together (a
/// gradient's two halves, or a value and its gradient, that share their transcendentals);
/// `#[inline(always)]` as for [`Elementwise`].
pub(crate) trait ElementwiseMany<const N: usize, const M: usize>:
    Copy + Send + Sync
{
    /// The `M` values at one element.
    fn apply(&self, x: [f32; N]) -> [f32; M];
}

/// [`map_into`] for a function with `M` outputs, into `outs` (each as long as the shortest
/// input).
pub(crate) fn map_many_into<const N: usize, const M: usize, F: ElementwiseMany<N, M>>(
    outs: [&mut [f32]; M],
    inputs: [&[f32]; N],
    f: F,
) {
    // SAFETY: `MaybeUninit<f32>` has the layout of `f32`, and `map_many_uninit` writes only
    // initialised values, so the slices hold valid `f32`s throughout.
    let outs = outs.map(|o| unsafe { &mut *(o as *mut [f32] as *mut [MaybeUninit<f32>]) });
    map_many_uninit(outs, inputs, f);
}

/// [`map_many_into`] into outputs that may be uninitialised: every element of each output up to
/// the shortest input's length is written.
fn map_many_uninit<const N: usize, const M: usize, F: ElementwiseMany<N, M>>(
    outs: [&mut [MaybeUninit<f32>]; M],
    inputs: [&[f32]; N],
    f: F,
) {
    use rayon::prelude::*;
    let len = inputs.iter().map(|x| x.len()).min().unwrap_or(0);
    for o in &outs {
        assert!(
            o.len() >= len,
            "map_many_into: an output of {} for inputs of {len}",
            o.len()
        );
    }
    let run = |start: usize, outs: [&mut [MaybeUninit<f32>]; M]| {
        dispatch(MapMany {
            inputs,
            start,
            outs,
            f,
        })
    };
    let outs = outs.map(|o| &mut o[..len]);
    if len < 2 * MAP_CHUNK {
        run(0, outs);
        return;
    }
    let mut chunks = outs.map(|o| o.chunks_mut(MAP_CHUNK));
    let jobs: Vec<[&mut [MaybeUninit<f32>]; M]> = (0..len.div_ceil(MAP_CHUNK))
        .map(|_| std::array::from_fn(|j| chunks[j].next().unwrap_or_else(|| unreachable!())))
        .collect();
    jobs.into_par_iter()
        .enumerate()
        .for_each(|(i, outs)| run(i * MAP_CHUNK, outs));
}

/// The loop of [`map_many_into`] over one chunk.
struct MapMany<'a, const N: usize, const M: usize, F> {
    inputs: [&'a [f32]; N],
    start: usize,
    outs: [&'a mut [MaybeUninit<f32>]; M],
    f: F,
}

impl<const N: usize, const M: usize, F: ElementwiseMany<N, M>> WithSimd for MapMany<'_, N, M, F> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _: S) {
        let Self {
            inputs,
            start,
            outs,
            f,
        } = self;
        // Every slice exactly `len` long, so the indexing below needs no bounds checks (which
        // would keep the loop from vectorising).
        let len = outs.iter().map(|o| o.len()).min().unwrap_or(0);
        let inputs = inputs.map(|x| &x[start..start + len]);
        let mut outs = outs.map(|o| &mut o[..len]);
        for i in 0..len {
            let y = f.apply(inputs.map(|x| x[i]));
            for (o, y) in outs.iter_mut().zip(y) {
                o[i] = MaybeUninit::new(y);
            }
        }
    }
}

/// `x[j] = f([x[j], inputs[0][j], …, inputs[N − 1][j]])` for every element of `x` (each input at
/// least as long as `x`; `K` is `N + 1`), on the calling thread, within a [`WithSimd`] body.
///
/// For the short loops over one row inside a kernel, where [`map_into`] (a dispatch and a
/// possible split over the pool per call) would cost more than the row. The elements go in
/// blocks of [`LANES`], each block read whole into locals before any of it is written, so the
/// loop vectorises without the compiler having to prove that `x` and the inputs do not overlap:
/// the plain indexed loops these replace (`x[j] += a[j] * b[j]` over a row) compiled to one
/// scalar element at a time. Each element gets the same operations as in the scalar loop.
#[inline(always)]
pub(crate) fn update<const N: usize, const K: usize, F: Elementwise<K>>(
    x: &mut [f32],
    inputs: [&[f32]; N],
    f: F,
) {
    const { assert!(K == N + 1, "update: K must be N + 1") };
    let n = x.len();
    let inputs = inputs.map(|s| &s[..n]);
    let heads = inputs.map(|s| s.as_chunks::<LANES>().0);
    let (blocks, tail) = x.as_chunks_mut::<LANES>();
    let done = blocks.len() * LANES;
    // Plain loops, no closures around `apply`: the compiler need not inline a closure, and a
    // call per element would not vectorise.
    for (b, block) in blocks.iter_mut().enumerate() {
        let mut ins = [[0.0f32; LANES]; N];
        for k in 0..N {
            ins[k] = heads[k][b];
        }
        let cur = *block;
        let mut out = [0.0f32; LANES];
        for l in 0..LANES {
            let mut args = [0.0f32; K];
            args[0] = cur[l];
            for k in 0..N {
                args[k + 1] = ins[k][l];
            }
            out[l] = f.apply(args);
        }
        *block = out;
    }
    for (j, v) in tail.iter_mut().enumerate() {
        let mut args = [0.0f32; K];
        args[0] = *v;
        for k in 0..N {
            args[k + 1] = inputs[k][done + j];
        }
        *v = f.apply(args);
    }
}

/// `outs[m][j] = f(inputs[0][j], …)[m]` for every element of the shortest input (each output at
/// least that long), on the calling thread, within a [`WithSimd`] body: [`update`] for outputs
/// that are only written (the blocks of the inputs read whole before any output is written).
#[inline(always)]
pub(crate) fn write<const N: usize, const M: usize, F: ElementwiseMany<N, M>>(
    outs: [&mut [f32]; M],
    inputs: [&[f32]; N],
    f: F,
) {
    let n = inputs.iter().map(|s| s.len()).min().unwrap_or(0);
    let outs = outs.map(|o| &mut o[..n]);
    let heads = inputs.map(|s| s[..n].as_chunks::<LANES>().0);
    let blocks = n / LANES;
    for b in 0..blocks {
        let mut ins = [[0.0f32; LANES]; N];
        for k in 0..N {
            ins[k] = heads[k][b];
        }
        let mut vals = [[0.0f32; LANES]; M];
        for l in 0..LANES {
            let mut args = [0.0f32; N];
            for k in 0..N {
                args[k] = ins[k][l];
            }
            let v = f.apply(args);
            for m in 0..M {
                vals[m][l] = v[m];
            }
        }
        for m in 0..M {
            outs[m][b * LANES..(b + 1) * LANES].copy_from_slice(&vals[m]);
        }
    }
    for j in blocks * LANES..n {
        let mut args = [0.0f32; N];
        for k in 0..N {
            args[k] = inputs[k][j];
        }
        let v = f.apply(args);
        for m in 0..M {
            outs[m][j] = v[m];
        }
    }
}

/// `acc + a · b` for `[acc, a, b]`: the multiply-add of [`update`] (not fused: the product is
/// rounded first, as in the scalar loops).
#[derive(Debug, Clone, Copy)]
pub(crate) struct AddProduct;

impl Elementwise<3> for AddProduct {
    #[inline(always)]
    fn apply(&self, [acc, a, b]: [f32; 3]) -> f32 {
        acc + a * b
    }
}

/// `acc + s · x` for `[acc, x]` ([`update`]), and `s · x` for `[x]` ([`write`](fn@write)).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scaled(pub f32);

impl Elementwise<2> for Scaled {
    #[inline(always)]
    fn apply(&self, [acc, x]: [f32; 2]) -> f32 {
        acc + self.0 * x
    }
}

impl ElementwiseMany<1, 1> for Scaled {
    #[inline(always)]
    fn apply(&self, [x]: [f32; 1]) -> [f32; 1] {
        [self.0 * x]
    }
}

/// `Σ a_j b_j`, summed lane by lane in blocks of [`LANES`], then across the lanes.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (ab, at) = a[..n].as_chunks::<LANES>();
    let (bb, bt) = b[..n].as_chunks::<LANES>();
    let mut acc = [0.0f32; LANES];
    for (x, y) in ab.iter().zip(bb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in at.iter().zip(bt) {
        tail += x * y;
    }
    hsum(&acc) + tail
}

/// Elements (1 MiB) from which [`max`] splits its pass over rayon's pool: a pass over memory that
/// the public KDA ops' gate check makes on the calling thread while the pool waits (2 MiB at
/// T = 2048 of the benches, 8 MiB at 8192).
const MAX_PARALLEL: usize = 1 << 18;

/// The largest element of `x` (`−∞` when empty), NaN when any element is NaN; in parts on
/// rayon's pool for long inputs (the same result: the largest of the parts' largest).
pub(crate) fn max(x: &[f32]) -> f32 {
    use rayon::prelude::*;
    if x.len() >= MAX_PARALLEL {
        return x
            .par_chunks(MAX_PARALLEL / 4)
            .map(max_serial)
            .reduce(|| f32::NEG_INFINITY, max_of);
    }
    max_serial(x)
}

/// The larger of `m` and `v`, NaN when either is NaN (`m < v` and `v ≠ v` are both false for a
/// NaN `m`).
#[inline(always)]
fn max_of(m: f32, v: f32) -> f32 {
    if m < v || v.is_nan() {
        v
    } else {
        m
    }
}

/// [`max`] on the calling thread.
fn max_serial(x: &[f32]) -> f32 {
    struct Max<'a>(&'a [f32]);
    impl WithSimd for Max<'_> {
        type Output = f32;
        #[inline(always)]
        fn with_simd<S: Simd>(self, _simd: S) -> f32 {
            max_in(self.0)
        }
    }
    dispatch(Max(x))
}

/// [`max`] of a row, lane by lane in blocks of [`LANES`], on the calling thread: for the loops
/// inside a [`WithSimd`] body (a softmax's row, say).
#[inline(always)]
pub(crate) fn max_in(x: &[f32]) -> f32 {
    // Per lane: NaN once seen stays.
    let (blocks, tail) = x.as_chunks::<LANES>();
    let mut m = [f32::NEG_INFINITY; LANES];
    for block in blocks {
        for l in 0..LANES {
            m[l] = max_of(m[l], block[l]);
        }
    }
    m.into_iter()
        .chain(tail.iter().copied())
        .fold(f32::NEG_INFINITY, max_of)
}

/// The sum of the lanes, pairwise (the same order on every instruction set).
#[inline(always)]
pub(crate) fn hsum(acc: &[f32; LANES]) -> f32 {
    let mut h = [0.0f32; LANES / 2];
    for l in 0..LANES / 2 {
        h[l] = acc[l] + acc[l + LANES / 2];
    }
    let mut q = [0.0f32; LANES / 4];
    for l in 0..LANES / 4 {
        q[l] = h[l] + h[l + LANES / 4];
    }
    (q[0] + q[2]) + (q[1] + q[3])
}

#[cfg(test)]
mod tests;
