//! The chunked KDA kernels on every CubeCL backend: the forward (optionally keeping the per-chunk
//! states and `Vn` for the backward) and the backward (design §4.3).

use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime};
use cubecl::{calculate_cube_count_elemwise, CubeCount, CubeDim};
use kimi_burn_kernels::kda as kkda;

use super::kernels::KdaKernelInput;
use crate::ops::backend::cube::{contiguous_as, empty, f32_scalar, per_row, u32_buffer};

type T<R> = CubeTensor<R>;
type Input<R> = KdaKernelInput<CubeBackend<R, f32, i32, u32>>;
/// `[A_qk, A_kk, W, U]` of every chunk: the within-chunk matrices and the solve.
pub(super) type Within<R> = [T<R>; 4];
/// `(states, vn, within)`: what the forward keeps for the backward (`within` when asked).
pub(super) type Saved<R> = (T<R>, T<R>, Option<Within<R>>);

/// `t` in f32, contiguous.
pub(super) fn f32_contiguous<R: CubeRuntime>(t: T<R>) -> T<R> {
    contiguous_as(t, DType::F32)
}

pub(super) fn dims4<R: CubeRuntime>(t: &T<R>) -> [usize; 4] {
    crate::ops::backend::cube::dims(t, "KDA kernels take [B, T, H, X] tensors")
}

/// `S_0` as a contiguous f32 buffer the kernels may update in place, or zeros. The caller's own
/// buffer when nothing else holds it (the decode loop hands its state over), else a copy: `cast`
/// and `into_contiguous` may hand back a buffer that another tensor still reads.
pub(super) fn state_buffer<R: CubeRuntime>(
    like: &T<R>,
    h0: Option<T<R>>,
    shape: [usize; 4],
) -> T<R> {
    if let Some(s) = &h0 {
        if s.dtype == DType::F32
            && s.can_mut()
            && s.is_contiguous()
            && s.is_contiguous_buffer()
            && s.shape().dims::<4>() == shape
        {
            return s.clone();
        }
    }
    let out = empty(like, shape, DType::F32);
    let len = shape.iter().product::<usize>();
    if len == 0 {
        return out;
    }
    let copy = h0.is_some();
    let src = match h0 {
        Some(s) => f32_contiguous(s),
        None => f32_scalar(like, 0.0),
    };
    let dim = CubeDim::new(&like.client, len);
    // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
    unsafe {
        kkda::init_state::launch_unchecked::<R>(
            &like.client,
            calculate_cube_count_elemwise(&like.client, len, dim),
            dim,
            src.into_array_arg(),
            out.clone().into_array_arg(),
            len,
            copy,
        )
    };
    out
}

/// Where each chunk lies: first token and length per chunk, first chunk per sequence. Chunks
/// never cross a sequence boundary.
struct ChunkTable {
    tok: Vec<u32>,
    len: Vec<u32>,
    seq_chunk: Vec<u32>,
}

fn chunk_table(seq_starts: &[usize], chunk: usize) -> ChunkTable {
    let mut table = ChunkTable {
        tok: Vec::new(),
        len: Vec::new(),
        seq_chunk: vec![0],
    };
    for w in seq_starts.windows(2) {
        let mut t = w[0];
        while t < w[1] {
            let l = chunk.min(w[1] - t);
            table.tok.push(t as u32);
            table.len.push(l as u32);
            t += l;
        }
        table.seq_chunk.push(table.tok.len() as u32);
    }
    table
}

/// The inputs in f32, the chunk table on the device and everything the forward kernels compute
/// before the sequential pass (recomputed by the backward).
struct Work<R: CubeRuntime> {
    q: T<R>,
    k: T<R>,
    v: T<R>,
    g: T<R>,
    beta: T<R>,
    /// `[b, t, h, kd, vd, n]`.
    dims: [usize; 6],
    chunk: usize,
    chunks: usize,
    /// The most chunks of one sequence.
    longest: usize,
    tok: T<R>,
    len: T<R>,
    seq_chunk: T<R>,
    qe: T<R>,
    we: T<R>,
    ke: T<R>,
    qp: T<R>,
    kp: T<R>,
    ks: T<R>,
    decay: T<R>,
    sub_decay: T<R>,
    a_qk: T<R>,
    a_kk: T<R>,
    w: T<R>,
    u: T<R>,
}

impl<R: CubeRuntime> Work<R> {
    fn scratch(&self, shape: Vec<usize>) -> T<R> {
        empty(&self.q, shape, DType::F32)
    }

    /// Cube count and dim for one unit per element of `units`.
    fn elemwise(&self, units: usize) -> (CubeCount, CubeDim) {
        let dim = CubeDim::new(&self.q.client, units.max(1));
        (
            calculate_cube_count_elemwise(&self.q.client, units.max(1), dim),
            dim,
        )
    }

    /// Value columns per cube of the sequential passes.
    fn vt(&self) -> usize {
        let kd = self.dims[3];
        kkda::recurrent_columns(kd).min(kkda::chunk_state_columns(kd, self.chunk))
    }
}

/// Gate sums, within-chunk matrices and the triangular solve (three launches; only the first
/// when the forward kept `within`). `None` when there is nothing to compute.
///
/// Long on purpose: it allocates every scratch buffer the three launches share and launches them
/// in order; split, the pieces would pass the same dozen buffers back and forth.
fn prepare<R: CubeRuntime>(
    input: &Input<R>,
    chunk: usize,
    within: Option<Within<R>>,
) -> Option<Work<R>> {
    assert!(
        chunk.is_multiple_of(kkda::SUB) && chunk * chunk >= kkda::INTRA_CUBE as usize,
        "KDA chunk kernels: chunk size {chunk} must be 16, 32 or 64"
    );
    let q = f32_contiguous(input.q.clone());
    let k = f32_contiguous(input.k.clone());
    let v = f32_contiguous(input.v.clone());
    let g = f32_contiguous(input.g.clone());
    let beta = f32_contiguous(input.beta.clone());
    let [b, t, h, kd] = dims4(&q);
    let vd = dims4(&v)[3];
    let n = input.seq_starts.len() - 1;
    let table = chunk_table(&input.seq_starts, chunk);
    let chunks = table.tok.len();
    if chunks * h * vd * kd == 0 {
        return None;
    }
    let longest = table
        .seq_chunk
        .windows(2)
        .map(|w| (w[1] - w[0]) as usize)
        .max()
        .unwrap_or(0);
    let tokens = b * t;
    let scratch = |shape: Vec<usize>| empty(&q, shape, DType::F32);
    let kept = within.is_some();
    let [a_qk, a_kk, w, u] = within.map(|w| w.map(f32_contiguous)).unwrap_or_else(|| {
        [
            scratch(vec![chunks, h, chunk, chunk]),
            scratch(vec![chunks, h, chunk, chunk]),
            scratch(vec![chunks, h, chunk, kd]),
            scratch(vec![chunks, h, chunk, vd]),
        ]
    });
    let work = Work {
        dims: [b, t, h, kd, vd, n],
        chunk,
        chunks,
        longest,
        tok: u32_buffer(&q, &table.tok),
        len: u32_buffer(&q, &table.len),
        seq_chunk: u32_buffer(&q, &table.seq_chunk),
        qe: scratch(vec![tokens, h, kd]),
        we: scratch(vec![tokens, h, kd]),
        ke: scratch(vec![tokens, h, kd]),
        qp: scratch(vec![tokens, h, kd]),
        kp: scratch(vec![tokens, h, kd]),
        ks: scratch(vec![tokens, h, kd]),
        decay: scratch(vec![chunks, h, kd]),
        sub_decay: scratch(vec![chunks, h, chunk / kkda::SUB, kd]),
        a_qk,
        a_kk,
        w,
        u,
        q,
        k,
        v,
        g,
        beta,
    };
    let client = work.q.client.clone();
    let (count, dim) = work.elemwise(chunks * h * kd);
    // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
    unsafe {
        kkda::kda_chunk_gates::launch_unchecked::<R>(
            &client,
            count,
            dim,
            work.q.clone().into_array_arg(),
            work.k.clone().into_array_arg(),
            work.g.clone().into_array_arg(),
            work.tok.clone().into_array_arg(),
            work.len.clone().into_array_arg(),
            work.qe.clone().into_array_arg(),
            work.we.clone().into_array_arg(),
            work.ke.clone().into_array_arg(),
            work.qp.clone().into_array_arg(),
            work.kp.clone().into_array_arg(),
            work.ks.clone().into_array_arg(),
            work.decay.clone().into_array_arg(),
            work.sub_decay.clone().into_array_arg(),
            chunks,
            h,
            kd,
            chunk,
        )
    };
    if kept {
        return Some(work);
    }
    // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
    unsafe {
        kkda::kda_chunk_intra::launch_unchecked::<R>(
            &client,
            per_row(&work.q, chunks * h),
            CubeDim::new_1d(kkda::INTRA_CUBE),
            work.q.clone().into_array_arg(),
            work.k.clone().into_array_arg(),
            work.g.clone().into_array_arg(),
            work.beta.clone().into_array_arg(),
            work.qp.clone().into_array_arg(),
            work.kp.clone().into_array_arg(),
            work.ks.clone().into_array_arg(),
            work.sub_decay.clone().into_array_arg(),
            work.tok.clone().into_array_arg(),
            work.len.clone().into_array_arg(),
            work.a_qk.clone().into_array_arg(),
            work.a_kk.clone().into_array_arg(),
            chunks,
            h,
            kd,
            chunk,
        )
    };
    // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
    unsafe {
        kkda::kda_chunk_solve::launch_unchecked::<R>(
            &client,
            solve_grid(&work.q, solve_blocks(kd + vd), chunks * h),
            CubeDim::new_1d(kkda::SOLVE_CUBE),
            work.we.clone().into_array_arg(),
            work.v.clone().into_array_arg(),
            work.beta.clone().into_array_arg(),
            work.a_kk.clone().into_array_arg(),
            work.tok.clone().into_array_arg(),
            work.len.clone().into_array_arg(),
            work.w.clone().into_array_arg(),
            work.u.clone().into_array_arg(),
            chunks,
            h,
            solve_blocks(kd + vd),
            kd,
            vd,
            chunk,
        )
    };
    Some(work)
}

/// Column blocks of the solve kernels for `columns` columns.
fn solve_blocks(columns: usize) -> usize {
    columns.div_ceil(kkda::SOLVE_CUBE as usize)
}

/// `col_blocks` cubes of the solve kernels per chunk·head, spread over the hardware grid.
fn solve_grid<R: CubeRuntime>(like: &T<R>, col_blocks: usize, chunk_heads: usize) -> CubeCount {
    per_row(like, col_blocks * chunk_heads)
}

/// Chunked forward: `(o, S_T, (states, vn, within))`, the last when `save` (what the backward
/// needs: the state entering every chunk and `Vn`, and with `keep_within` the within-chunk
/// matrices and the solve, which the backward then does not recompute).
pub(super) fn forward<R: CubeRuntime>(
    input: Input<R>,
    chunk: usize,
    save: bool,
    keep_within: bool,
) -> (T<R>, T<R>, Option<Saved<R>>) {
    let [b, t, h, _] = dims4(&input.q);
    let [_, _, _, kd] = dims4(&input.k);
    let vd = dims4(&input.v)[3];
    let n = input.seq_starts.len() - 1;
    let like = input.q.clone();
    let work = prepare(&input, chunk, None);
    let state = state_buffer(&like, input.initial_state, [n, h, kd, vd]);
    let out = empty(&like, [b, t, h, vd], DType::F32);
    let Some(work) = work else {
        let saved = save.then(|| {
            let none = |cols: usize| empty(&like, [0, h, chunk, cols], DType::F32);
            (
                empty(&like, [0, h, kd, vd], DType::F32),
                none(vd),
                keep_within.then(|| [none(chunk), none(chunk), none(kd), none(vd)]),
            )
        });
        return (out, state, saved);
    };
    let client = work.q.client.clone();
    let chunks = work.chunks;
    let states = work.scratch(vec![chunks, h, kd, vd]);
    let vn = work.scratch(vec![chunks, h, chunk, vd]);
    let vt = work.vt();
    let window = kkda::chunk_state_window(kd, vt, chunk);
    for lo in (0..work.longest).step_by(window) {
        // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
        unsafe {
            kkda::kda_chunk_state::launch_unchecked::<R>(
                &client,
                per_row(&work.q, vd.div_ceil(vt) * n * h),
                CubeDim::new_1d(kkda::STATE_CUBE),
                work.ke.clone().into_array_arg(),
                work.decay.clone().into_array_arg(),
                work.w.clone().into_array_arg(),
                work.u.clone().into_array_arg(),
                work.tok.clone().into_array_arg(),
                work.len.clone().into_array_arg(),
                work.seq_chunk.clone().into_array_arg(),
                state.clone().into_array_arg(),
                states.clone().into_array_arg(),
                vn.clone().into_array_arg(),
                h,
                vd.div_ceil(vt),
                n * h,
                vd,
                lo,
                window,
                kd,
                vt,
                chunk,
            )
        };
    }
    let cols = kkda::tile_columns(vd);
    let tiles = vd.div_ceil(cols);
    // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
    unsafe {
        kkda::kda_chunk_output::launch_unchecked::<R>(
            &client,
            per_row(&work.q, chunks * h * tiles),
            CubeDim::new_1d(kkda::tile_units(chunk, cols)),
            work.qe.clone().into_array_arg(),
            work.a_qk.clone().into_array_arg(),
            states.clone().into_array_arg(),
            vn.clone().into_array_arg(),
            work.tok.clone().into_array_arg(),
            work.len.clone().into_array_arg(),
            out.clone().into_array_arg(),
            chunks,
            h,
            vd,
            tiles,
            kd,
            chunk,
            cols,
        )
    };
    let within = keep_within.then_some([work.a_qk, work.a_kk, work.w, work.u]);
    (out, state, save.then_some((states, vn, within)))
}

/// Chunked backward from the forward's `(states, vn, within)`: `[dq, dk, dv, dg, dβ, dS_0]` in
/// f32 (the shapes of `q, k, v, g, β` and `[N, H, K, V]`). Without `within` it recomputes the
/// within-chunk matrices and the solve.
///
/// Long on purpose: it is the launch sequence of the KDA chunked backward (recompute the
/// within-chunk work, the reverse state pass in windows, the within-chunk gradients, the gate
/// cumulative-sum backward), each launch reading the buffers of the ones before; the order is the
/// algorithm, and design §4.3 describes it step by step.
pub(super) fn backward<R: CubeRuntime>(
    input: Input<R>,
    chunk: usize,
    (states, vn, within): Saved<R>,
    grad_o: T<R>,
    grad_state: Option<T<R>>,
) -> [T<R>; 6] {
    let [b, t, h, _] = dims4(&input.q);
    let kd = dims4(&input.k)[3];
    let vd = dims4(&input.v)[3];
    let n = input.seq_starts.len() - 1;
    let like = input.q.clone();
    let d_state = state_buffer(&like, grad_state, [n, h, kd, vd]);
    let zeros = |shape: [usize; 4]| state_buffer(&like, None, shape);
    let Some(work) = prepare(&input, chunk, within) else {
        let dbeta = zeros([b, t, h, 1]);
        return [
            zeros([b, t, h, kd]),
            zeros([b, t, h, kd]),
            zeros([b, t, h, vd]),
            zeros([b, t, h, kd]),
            CubeBackend::<R, f32, i32, u32>::float_reshape(dbeta, Shape::new([b, t, h])),
            d_state,
        ];
    };
    let client = work.q.client.clone();
    let chunks = work.chunks;
    let tokens = b * t;
    let grad_o = f32_contiguous(grad_o);
    let states = f32_contiguous(states);
    let vn = f32_contiguous(vn);

    // The reverse pass's terms that do not depend on the state, for every chunk at once: `A_qkᵀ
    // dO` into `d_vn`, `(q ⊙ exp(G))ᵀ dO` into `d_after`; the pass adds the rest over them.
    let d_after = work.scratch(vec![chunks, h, kd, vd]);
    let d_vn = work.scratch(vec![chunks, h, chunk, vd]);
    let cols = kkda::tile_columns(vd);
    let col_tiles = vd.div_ceil(cols);
    // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
    unsafe {
        kkda::kda_chunk_dvn_intra::launch_unchecked::<R>(
            &client,
            per_row(&work.q, chunks * h * col_tiles),
            CubeDim::new_1d(kkda::tile_units(chunk, cols)),
            work.a_qk.clone().into_array_arg(),
            grad_o.clone().into_array_arg(),
            work.tok.clone().into_array_arg(),
            work.len.clone().into_array_arg(),
            d_vn.clone().into_array_arg(),
            chunks,
            h,
            vd,
            col_tiles,
            chunk,
            cols,
        )
    };
    let rows = kkda::tile_columns(kd);
    let row_tiles = kd.div_ceil(rows);
    // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
    unsafe {
        kkda::kda_chunk_state_do::launch_unchecked::<R>(
            &client,
            per_row(&work.q, chunks * h * row_tiles * col_tiles),
            CubeDim::new_1d(kkda::tile_units(rows, cols)),
            work.qe.clone().into_array_arg(),
            grad_o.clone().into_array_arg(),
            work.tok.clone().into_array_arg(),
            work.len.clone().into_array_arg(),
            d_after.clone().into_array_arg(),
            chunks,
            h,
            kd,
            vd,
            row_tiles,
            col_tiles,
            rows,
            cols,
        )
    };

    // The reverse sequential pass.
    let vt = work.vt();
    let window = kkda::chunk_state_window(kd, vt, chunk);
    for lo in (0..work.longest).step_by(window) {
        // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
        unsafe {
            kkda::kda_chunk_state_backward::launch_unchecked::<R>(
                &client,
                per_row(&work.q, vd.div_ceil(vt) * n * h),
                CubeDim::new_1d(kkda::STATE_CUBE),
                work.ke.clone().into_array_arg(),
                work.decay.clone().into_array_arg(),
                work.w.clone().into_array_arg(),
                work.tok.clone().into_array_arg(),
                work.len.clone().into_array_arg(),
                work.seq_chunk.clone().into_array_arg(),
                d_state.clone().into_array_arg(),
                d_after.clone().into_array_arg(),
                d_vn.clone().into_array_arg(),
                h,
                vd.div_ceil(vt),
                n * h,
                vd,
                lo,
                window,
                kd,
                vt,
                chunk,
            )
        };
    }

    // Per-chunk products with the states.
    let dqe = work.scratch(vec![tokens, h, kd]);
    let dke = work.scratch(vec![tokens, h, kd]);
    let dw = work.scratch(vec![chunks, h, chunk, kd]);
    let ddecay = work.scratch(vec![chunks, h, kd]);
    let cols = kkda::tile_columns(kd);
    let tiles = kd.div_ceil(cols);
    // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
    unsafe {
        kkda::kda_chunk_state_products::launch_unchecked::<R>(
            &client,
            per_row(&work.q, chunks * h * tiles),
            CubeDim::new_1d(kkda::tile_units(chunk, cols)),
            grad_o.clone().into_array_arg(),
            states.into_array_arg(),
            d_after.into_array_arg(),
            vn.clone().into_array_arg(),
            d_vn.clone().into_array_arg(),
            work.tok.clone().into_array_arg(),
            work.len.clone().into_array_arg(),
            dqe.clone().into_array_arg(),
            dw.clone().into_array_arg(),
            dke.clone().into_array_arg(),
            ddecay.clone().into_array_arg(),
            chunks,
            h,
            vd,
            tiles,
            kd,
            chunk,
            cols,
        )
    };
    let d_aqk = work.scratch(vec![chunks, h, chunk, chunk]);
    // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
    unsafe {
        kkda::kda_chunk_aqk_backward::launch_unchecked::<R>(
            &client,
            per_row(&work.q, chunks * h),
            CubeDim::new_1d(kkda::tile_units(chunk, chunk)),
            grad_o.into_array_arg(),
            vn.into_array_arg(),
            work.tok.clone().into_array_arg(),
            work.len.clone().into_array_arg(),
            d_aqk.clone().into_array_arg(),
            chunks,
            h,
            vd,
            chunk,
        )
    };

    // Through the triangular solve.
    let zw = work.scratch(vec![chunks, h, chunk, kd]);
    let zu = work.scratch(vec![chunks, h, chunk, vd]);
    // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
    unsafe {
        kkda::kda_chunk_solve_backward::launch_unchecked::<R>(
            &client,
            solve_grid(&work.q, solve_blocks(kd + vd), chunks * h),
            CubeDim::new_1d(kkda::SOLVE_CUBE),
            work.a_kk.clone().into_array_arg(),
            dw.into_array_arg(),
            d_vn.into_array_arg(),
            work.len.clone().into_array_arg(),
            zw.clone().into_array_arg(),
            zu.clone().into_array_arg(),
            chunks,
            h,
            solve_blocks(kd + vd),
            kd,
            vd,
            chunk,
        )
    };
    let d_akk = work.scratch(vec![chunks, h, chunk, chunk]);
    // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
    unsafe {
        kkda::kda_chunk_akk_backward::launch_unchecked::<R>(
            &client,
            per_row(&work.q, chunks * h),
            CubeDim::new_1d(kkda::tile_units(chunk, chunk)),
            zw.clone().into_array_arg(),
            zu.clone().into_array_arg(),
            work.w.clone().into_array_arg(),
            work.u.clone().into_array_arg(),
            work.len.clone().into_array_arg(),
            d_akk.clone().into_array_arg(),
            chunks,
            h,
            kd,
            vd,
            chunk,
        )
    };

    // Through the within-chunk matrices and the gate factors.
    let rq = work.scratch(vec![tokens, h, kd]);
    let rk = work.scratch(vec![tokens, h, kd]);
    let cc = work.scratch(vec![tokens, h, kd]);
    // One unit per four key channels.
    let (count, dim) = work.elemwise(chunks * h * chunk * kd.div_ceil(4));
    // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
    unsafe {
        kkda::kda_chunk_intra_backward::launch_unchecked::<R>(
            &client,
            count,
            dim,
            work.q.clone().into_array_arg(),
            work.k.clone().into_array_arg(),
            work.g.clone().into_array_arg(),
            work.beta.clone().into_array_arg(),
            work.qp.clone().into_array_arg(),
            work.kp.clone().into_array_arg(),
            work.ks.clone().into_array_arg(),
            work.sub_decay.clone().into_array_arg(),
            d_aqk.into_array_arg(),
            d_akk.into_array_arg(),
            work.tok.clone().into_array_arg(),
            work.len.clone().into_array_arg(),
            rq.clone().into_array_arg(),
            rk.clone().into_array_arg(),
            cc.clone().into_array_arg(),
            chunks,
            h,
            kd,
            chunk,
        )
    };
    let dq = work.scratch(vec![b, t, h, kd]);
    let dk = work.scratch(vec![b, t, h, kd]);
    let dg = work.scratch(vec![b, t, h, kd]);
    let (count, dim) = work.elemwise(chunks * h * kd);
    // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
    unsafe {
        kkda::kda_chunk_gates_backward::launch_unchecked::<R>(
            &client,
            count,
            dim,
            work.q.clone().into_array_arg(),
            work.k.clone().into_array_arg(),
            work.g.clone().into_array_arg(),
            work.beta.clone().into_array_arg(),
            rq.into_array_arg(),
            rk.clone().into_array_arg(),
            cc.into_array_arg(),
            dqe.into_array_arg(),
            zw.clone().into_array_arg(),
            dke.into_array_arg(),
            ddecay.into_array_arg(),
            work.tok.clone().into_array_arg(),
            work.len.clone().into_array_arg(),
            dq.clone().into_array_arg(),
            dk.clone().into_array_arg(),
            dg.clone().into_array_arg(),
            chunks,
            h,
            kd,
            chunk,
        )
    };
    let dbeta = work.scratch(vec![b, t, h]);
    let dv = work.scratch(vec![b, t, h, vd]);
    let (count, dim) = work.elemwise(chunks * h * chunk);
    // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
    unsafe {
        kkda::kda_chunk_rows_backward::launch_unchecked::<R>(
            &client,
            count,
            dim,
            work.k.clone().into_array_arg(),
            work.v.clone().into_array_arg(),
            work.beta.clone().into_array_arg(),
            work.we.clone().into_array_arg(),
            rk.into_array_arg(),
            zw.into_array_arg(),
            zu.into_array_arg(),
            work.tok.clone().into_array_arg(),
            work.len.clone().into_array_arg(),
            dbeta.clone().into_array_arg(),
            dv.clone().into_array_arg(),
            chunks,
            h,
            kd,
            vd,
            chunk,
        )
    };
    [dq, dk, dv, dg, dbeta, d_state]
}
