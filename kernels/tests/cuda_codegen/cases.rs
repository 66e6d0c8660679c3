//! The kernel configurations `kimi-burn` launches on CUDA: every kernel, each storage type it
//! runs in, each comptime branch the ops take, and the head sizes of the presets (KDA `dk` 128
//! and MLA `(d_qk, d_v)` = (192, 128) in the Kimi presets, 32 and (24, 16) in the tiny model).
//! Cube sizes are those of the launch sites on a device with 32-unit planes (CubeCL's
//! `CubeDim::new`, which the ops use for most one-unit-per-element launches, gives 32 × 8 units
//! there).

use cubecl::ir::{ElemType, FloatKind, IntKind, StorageType};
use cubecl::prelude::*;
use cubecl::wgpu::WgpuRuntime;
use kimi_burn_kernels::{
    activation as act, attention as att, attn_res as ar, cross_entropy as ce, kda, moe, mx,
    optim, qb_histogram as qb, rms_norm as rn, situ,
};
use moe::Products;

/// One kernel configuration: a label for the report, CubeCL's definition and its index type.
pub struct Case {
    pub label: String,
    pub definition: KernelDefinition,
    pub address: StorageType,
    /// Whether its products must run on the tensor cores (`wmma` in the PTX), or must not.
    pub tensor_cores: bool,
}

type Client = ComputeClient<WgpuRuntime>;

/// An array argument (no in-place aliasing: the ops never alias).
const A: ArrayCompilationArg = ArrayCompilationArg { inplace: None };
/// A scalar argument.
const S: () = ();

/// One unit per element: CubeCL's `CubeDim::new` on a 32-unit plane device.
const ELEMWISE: CubeDim = CubeDim::new_2d(32, 8);
/// Storage types of the float kernels.
const FLOATS: [FloatKind; 3] = [FloatKind::F32, FloatKind::F16, FloatKind::BF16];
/// `I` of the integer arrays: Burn's `Cuda` backend keeps its ints in i32.
const INT: IntKind = IntKind::I32;
/// KDA head sizes (`dk = dv`) and chunk sizes: the tiny model's 32, the benches' 64, the Kimi
/// presets' 128, an odd 60 (as in the tests), and the smaller chunks the ops accept.
const KDA: [(usize, usize); 6] = [(32, 64), (60, 64), (64, 16), (64, 32), (64, 64), (128, 64)];
/// MLA `(d_qk, d_v)`: the Kimi presets' (128 + 64, 128) and the tiny model's (16 + 8, 16).
const MLA: [(usize, usize); 2] = [(192, 128), (24, 16)];
/// The activations of SiTU-GLU's kernels and of the grouped matmul's GLU epilogues.
const SITU_MODES: [(&str, u32); 3] = [
    ("situ", situ::MODE_SITU),
    ("situ_capped", situ::MODE_SITU_CAPPED),
    ("swiglu", situ::MODE_SWIGLU),
];

fn float(kind: FloatKind) -> StorageType {
    ElemType::Float(kind).into()
}

fn int() -> StorageType {
    ElemType::Int(INT).into()
}

fn name(kind: FloatKind) -> &'static str {
    match kind {
        FloatKind::F16 => "f16",
        FloatKind::BF16 => "bf16",
        _ => "f32",
    }
}

fn settings(dim: CubeDim) -> KernelSettings {
    KernelSettings::default().cube_dim(dim)
}

struct Cases {
    client: Client,
    all: Vec<Case>,
}

impl Cases {
    fn push<K: CubeKernel>(&mut self, label: String, kernel: K) {
        self.push_on(label, kernel, false);
    }

    /// `push`, saying whether the kernel's products run on the tensor cores.
    fn push_on<K: CubeKernel>(&mut self, label: String, kernel: K, tensor_cores: bool) {
        let address = kernel.address_type();
        self.all.push(Case {
            label,
            definition: kernel.define(),
            address,
            tensor_cores,
        });
    }

    fn c(&self) -> Client {
        self.client.clone()
    }
}

/// Every configuration, built with `client` (its device properties only).
pub fn all(client: &Client) -> Vec<Case> {
    let mut cases = Cases {
        client: client.clone(),
        all: Vec::new(),
    };
    elementwise(&mut cases);
    rows(&mut cases);
    attention(&mut cases);
    kda_kernels(&mut cases);
    moe_kernels(&mut cases);
    cases.all
}

/// The one-unit-per-element kernels: sigmoid, optimiser, MX, SiTU-GLU.
fn elementwise(cs: &mut Cases) {
    for f in FLOATS {
        let (t, n) = (float(f), name(f));
        let dim = CubeDim::new_1d(act::ACTIVATION_CUBE);
        let k = act::sigmoid_forward::SigmoidForward::new(settings(dim), cs.c(), A, A, S, t);
        cs.push(format!("sigmoid_forward {n}"), k);
        let k = act::sigmoid_backward::SigmoidBackward::new(settings(dim), cs.c(), A, A, A, S, t);
        cs.push(format!("sigmoid_backward {n}"), k);
        let dim = CubeDim::new_1d(optim::OPTIM_CUBE);
        let k = optim::adamw_step::AdamwStep::new(
            settings(dim),
            cs.c(),
            A, A, A, A, A, A, A,
            S, S, S, S, S, S, S, S, S, S,
            t,
        );
        cs.push(format!("adamw_step {n}"), k);
        let k = optim::scaled_sum::ScaledSum::new(settings(dim), cs.c(), A, A, A, S, S, S, t);
        cs.push(format!("scaled_sum {n}"), k);
        let k = moe::moe_combine::MoeCombine::new(settings(ELEMWISE), cs.c(), A, A, A, S, S, S, t);
        cs.push(format!("moe_combine {n}"), k);
    }
    let k = mx::mx_fake_quant::MxFakeQuant::new(
        settings(ELEMWISE),
        cs.c(),
        A, A,
        S, S, S, S, S, S, S, S,
    );
    cs.push("mx_fake_quant".into(), k);
    for f in FLOATS {
        let (t, n) = (float(f), name(f));
        let widths: &[usize] = if f == FloatKind::F32 { &[1, 4] } else { &[1, 8] };
        for &vs in widths {
            for (m, mode) in SITU_MODES {
                for weighted in [false, true] {
                    let k = situ::situ_glu_forward::SituGluForward::new(
                        settings(ELEMWISE),
                        cs.c(),
                        A, A, A, A,
                        S, S, S, S,
                        vs,
                        mode,
                        weighted,
                        t,
                    );
                    cs.push(format!("situ_glu_forward {n} x{vs} {m} weighted={weighted}"), k);
                }
                let k = situ::situ_glu_backward::SituGluBackward::new(
                    settings(ELEMWISE),
                    cs.c(),
                    A, A, A, A, A,
                    S, S, S,
                    vs,
                    mode,
                    t,
                );
                cs.push(format!("situ_glu_backward {n} x{vs} {m}"), k);
                let k = situ::situ_glu_backward_weighted::SituGluBackwardWeighted::new(
                    settings(CubeDim::new_1d(situ::WEIGHTED_BACKWARD_CUBE)),
                    cs.c(),
                    A, A, A, A, A, A, A,
                    S, S, S, S,
                    vs,
                    mode,
                    situ::WEIGHTED_BACKWARD_CUBE,
                    t,
                );
                cs.push(format!("situ_glu_backward_weighted {n} x{vs} {m}"), k);
            }
        }
    }
}
/// One unit per row: the norms, Attention Residuals, cross-entropy, and KDA's short
/// convolution, gated norm and column sums.
fn rows(cs: &mut Cases) {
    for f in FLOATS {
        let (t, n) = (float(f), name(f));
        let dim = CubeDim::new_1d(rn::RMS_NORM_CUBE);
        let k = rn::rms_norm_forward::RmsNormForward::new(
            settings(dim),
            cs.c(),
            A, A, A,
            S, S, S,
            t,
        );
        cs.push(format!("rms_norm_forward {n}"), k);
        let k = rn::rms_norm_backward::RmsNormBackward::new(
            settings(dim),
            cs.c(),
            A, A, A, A, A,
            S, S, S,
            t,
        );
        cs.push(format!("rms_norm_backward {n}"), k);
        let dim = CubeDim::new_1d(ar::ATTN_RES_CUBE);
        let k = ar::attn_res_forward::AttnResForward::new(
            settings(dim),
            cs.c(),
            A, A, A, A,
            S, S, S, S,
            t,
        );
        cs.push(format!("attn_res_forward {n}"), k);
        let k = ar::attn_res_backward::AttnResBackward::new(
            settings(dim),
            cs.c(),
            A, A, A, A, A, A, A, A,
            S, S, S, S,
            t,
        );
        cs.push(format!("attn_res_backward {n}"), k);
        let dim = CubeDim::new_1d(ce::CROSS_ENTROPY_CUBE);
        let k = ce::cross_entropy_partials::CrossEntropyPartials::new(
            settings(dim),
            cs.c(),
            A, A, A,
            S, S, S,
            t,
        );
        cs.push(format!("cross_entropy_partials {n}"), k);
        let k = ce::cross_entropy_finish::CrossEntropyFinish::new(
            settings(dim),
            cs.c(),
            A, A, A, A, A, A,
            S, S, S, S, S,
            [t, int()],
        );
        cs.push(format!("cross_entropy_finish {n}"), k);
        let k = ce::cross_entropy_backward::CrossEntropyBackward::new(
            settings(dim),
            cs.c(),
            A, A, A, A, A,
            S, S, S, S, S,
            [t, int()],
        );
        cs.push(format!("cross_entropy_backward {n}"), k);
        let dim = CubeDim::new_1d(kda::NORM_CUBE);
        let k = kda::rms_norm_gated_forward::RmsNormGatedForward::new(
            settings(dim),
            cs.c(),
            A, A, A, A,
            S, S, S,
            t,
        );
        cs.push(format!("rms_norm_gated_forward {n}"), k);
        let k = kda::rms_norm_gated_backward::RmsNormGatedBackward::new(
            settings(dim),
            cs.c(),
            A, A, A, A, A, A, A,
            S, S, S,
            t,
        );
        cs.push(format!("rms_norm_gated_backward {n}"), k);
        // The short convolution of the KDA layers: kernel width 4 (`short_conv_kernel_size`),
        // with and without a decode tail.
        for tail in [false, true] {
            let w = 4;
            let k = kda::short_conv_forward::ShortConvForward::new(
                settings(ELEMWISE),
                cs.c(),
                A, A, A, A, A, A,
                S, S,
                w, tail, t,
            );
            cs.push(format!("short_conv_forward {n} tail={tail}"), k);
            let k = kda::short_conv_tail::ShortConvTail::new(
                settings(ELEMWISE),
                cs.c(),
                A, A, A, A,
                S, S,
                w, tail, t,
            );
            cs.push(format!("short_conv_tail {n} tail={tail}"), k);
            let k = kda::short_conv_backward_input::ShortConvBackwardInput::new(
                settings(ELEMWISE),
                cs.c(),
                A, A, A, A, A, A, A, A,
                S, S, S,
                w, tail, t,
            );
            cs.push(format!("short_conv_backward_input {n} tail={tail}"), k);
            let k = kda::short_conv_backward_weight::ShortConvBackwardWeight::new(
                settings(ELEMWISE),
                cs.c(),
                A, A, A, A, A, A, A,
                S, S,
                w, tail, t,
            );
            cs.push(format!("short_conv_backward_weight {n} tail={tail}"), k);
        }
    }
    let k = kda::column_sum::ColumnSum::new(settings(ELEMWISE), cs.c(), A, A, S, S, S);
    cs.push("column_sum".into(), k);
}

/// MLA's expanded attention, forward and both backward passes, with and without padding: the
/// per-row kernels at the heads they take (`dqk + dv ≤ 64`: the tiny model's and the widest), the tiled
/// kernels at MLA's heads and at the widest the op takes (256).
fn attention(cs: &mut Cases) {
    let rows = CubeDim::new_1d(att::ATTENTION_CUBE);
    let tiled = CubeDim::new_1d(att::TILED_CUBE);
    for f in FLOATS {
        let (t, n) = (float(f), name(f));
        for pad in [false, true] {
            for (dqk, dv) in [(24, 16), (32, 32)] {
                let label = format!("{n} dqk={dqk} dv={dv} pad={pad}");
                let k = att::attention_forward::AttentionForward::new(
                    settings(rows),
                    cs.c(),
                    A, A, A, A, A, A,
                    S, S, S, S,
                    dqk, dv, pad, [t, int()],
                );
                cs.push(format!("attention_forward {label}"), k);
                let k = att::attention_backward_query::AttentionBackwardQuery::new(
                    settings(rows),
                    cs.c(),
                    A, A, A, A, A, A, A, A, A,
                    S, S, S, S,
                    dqk, dv, pad, [t, int()],
                );
                cs.push(format!("attention_backward_query {label}"), k);
                let k = att::attention_backward_key::AttentionBackwardKey::new(
                    settings(rows),
                    cs.c(),
                    A, A, A, A, A, A, A, A, A,
                    S, S, S, S,
                    dqk, dv, pad, [t, int()],
                );
                cs.push(format!("attention_backward_key {label}"), k);
            }
            for (dqk, dv) in MLA.into_iter().chain([(256, 256)]) {
                let label = format!("{n} dqk={dqk} dv={dv} pad={pad}");
                let k = att::attention_tiled_forward::AttentionTiledForward::new(
                    settings(tiled),
                    cs.c(),
                    A, A, A, A, A, A,
                    S, S, S, S,
                    dqk, dv, pad, [t, int()],
                );
                cs.push(format!("attention_tiled_forward {label}"), k);
                let k = att::attention_tiled_backward_query::AttentionTiledBackwardQuery::new(
                    settings(tiled),
                    cs.c(),
                    A, A, A, A, A, A, A, A, A,
                    S, S, S, S,
                    dqk, dv, pad, [t, int()],
                );
                cs.push(format!("attention_tiled_backward_query {label}"), k);
                let k = att::attention_tiled_backward_key::AttentionTiledBackwardKey::new(
                    settings(tiled),
                    cs.c(),
                    A, A, A, A, A, A, A, A, A,
                    S, S, S, S,
                    dqk, dv, pad, [t, int()],
                );
                cs.push(format!("attention_tiled_backward_key {label}"), k);
            }
        }
    }
}

/// KDA: the recurrent decode kernel and every launch of the chunked forward and backward, per
/// head size and chunk size (all f32: the ops convert).
fn kda_kernels(cs: &mut Cases) {
    for copy in [false, true] {
        let k = kda::init_state::InitState::new(settings(ELEMWISE), cs.c(), A, A, S, copy);
        cs.push(format!("init_state copy={copy}"), k);
    }
    for kd in [32, 60, 64, 128] {
        let vt = kda::recurrent_columns(kd);
        let k = kda::kda_recurrent::KdaRecurrent::new(
            settings(CubeDim::new_1d(vt as u32)),
            cs.c(),
            A, A, A, A, A, A, A, A,
            S, S, S, S, S, S,
            kd, vt,
        );
        cs.push(format!("kda_recurrent dk={kd} vt={vt}"), k);
    }
    for (kd, chunk) in KDA {
        let vt = kda::recurrent_columns(kd).min(kda::chunk_state_columns(kd, chunk));
        let label = format!("dk={kd} chunk={chunk}");
        let state = CubeDim::new_1d(kda::STATE_CUBE);
        let k = kda::kda_chunk_gates::KdaChunkGates::new(
            settings(ELEMWISE),
            cs.c(),
            A, A, A, A, A, A, A, A, A, A, A, A, A,
            S, S, S,
            chunk,
        );
        cs.push(format!("kda_chunk_gates {label}"), k);
        let k = kda::kda_chunk_intra::KdaChunkIntra::new(
            settings(CubeDim::new_1d(kda::INTRA_CUBE)),
            cs.c(),
            A, A, A, A, A, A, A, A, A, A, A, A,
            S, S, S,
            chunk,
        );
        cs.push(format!("kda_chunk_intra {label}"), k);
        let k = kda::kda_chunk_solve::KdaChunkSolve::new(
            settings(CubeDim::new_1d(kda::SOLVE_CUBE)),
            cs.c(),
            A, A, A, A, A, A, A, A,
            S, S, S, S, S,
            chunk,
        );
        cs.push(format!("kda_chunk_solve {label}"), k);
        let k = kda::kda_chunk_state::KdaChunkState::new(
            settings(state),
            cs.c(),
            A, A, A, A, A, A, A, A, A, A,
            S, S, S, S, S, S,
            kd, vt, chunk,
        );
        cs.push(format!("kda_chunk_state {label} vt={vt}"), k);
        let cols = kda::tile_columns(kd);
        let k = kda::kda_chunk_output::KdaChunkOutput::new(
            settings(CubeDim::new_1d(kda::tile_units(chunk, cols))),
            cs.c(),
            A, A, A, A, A, A, A,
            S, S, S, S,
            kd, chunk, cols,
        );
        cs.push(format!("kda_chunk_output {label} cols={cols}"), k);
        let k = kda::kda_chunk_dvn_intra::KdaChunkDvnIntra::new(
            settings(CubeDim::new_1d(kda::tile_units(chunk, cols))),
            cs.c(),
            A, A, A, A, A,
            S, S, S, S,
            chunk, cols,
        );
        cs.push(format!("kda_chunk_dvn_intra {label} cols={cols}"), k);
        let k = kda::kda_chunk_state_do::KdaChunkStateDo::new(
            settings(CubeDim::new_1d(kda::tile_units(cols, cols))),
            cs.c(),
            A, A, A, A, A,
            S, S, S, S, S, S,
            cols, cols,
        );
        cs.push(format!("kda_chunk_state_do {label} rows=cols={cols}"), k);
        let k = kda::kda_chunk_state_backward::KdaChunkStateBackward::new(
            settings(state),
            cs.c(),
            A, A, A, A, A, A, A, A, A,
            S, S, S, S, S, S,
            kd, vt, chunk,
        );
        cs.push(format!("kda_chunk_state_backward {label} vt={vt}"), k);
        let k = kda::kda_chunk_state_products::KdaChunkStateProducts::new(
            settings(CubeDim::new_1d(kda::tile_units(chunk, cols))),
            cs.c(),
            A, A, A, A, A, A, A, A, A, A, A,
            S, S, S, S,
            kd, chunk, cols,
        );
        cs.push(format!("kda_chunk_state_products {label} cols={cols}"), k);
        let k = kda::kda_chunk_aqk_backward::KdaChunkAqkBackward::new(
            settings(CubeDim::new_1d(kda::tile_units(chunk, chunk))),
            cs.c(),
            A, A, A, A, A,
            S, S, S,
            chunk,
        );
        cs.push(format!("kda_chunk_aqk_backward {label}"), k);
        let k = kda::kda_chunk_solve_backward::KdaChunkSolveBackward::new(
            settings(CubeDim::new_1d(kda::SOLVE_CUBE)),
            cs.c(),
            A, A, A, A, A, A,
            S, S, S, S, S,
            chunk,
        );
        cs.push(format!("kda_chunk_solve_backward {label}"), k);
        let k = kda::kda_chunk_akk_backward::KdaChunkAkkBackward::new(
            settings(CubeDim::new_1d(kda::tile_units(chunk, chunk))),
            cs.c(),
            A, A, A, A, A, A,
            S, S, S, S,
            chunk,
        );
        cs.push(format!("kda_chunk_akk_backward {label}"), k);
        let k = kda::kda_chunk_intra_backward::KdaChunkIntraBackward::new(
            settings(ELEMWISE),
            cs.c(),
            A, A, A, A, A, A, A, A, A, A, A, A, A, A, A,
            S, S,
            kd, chunk,
        );
        cs.push(format!("kda_chunk_intra_backward {label}"), k);
        let k = kda::kda_chunk_gates_backward::KdaChunkGatesBackward::new(
            settings(ELEMWISE),
            cs.c(),
            A, A, A, A, A, A, A, A, A, A, A, A, A, A, A, A,
            S, S, S,
            chunk,
        );
        cs.push(format!("kda_chunk_gates_backward {label}"), k);
        let k = kda::kda_chunk_rows_backward::KdaChunkRowsBackward::new(
            settings(ELEMWISE),
            cs.c(),
            A, A, A, A, A, A, A, A, A, A, A,
            S, S, S, S,
            chunk,
        );
        cs.push(format!("kda_chunk_rows_backward {label}"), k);
    }
}

/// Routing, the dispatch plan, and the grouped matmuls in every form the MoE layer launches:
/// plain (forward second layer, input gradients, with accumulation), the fused first layer
/// (`EPILOGUE_GLU`, with and without saving the projections) and its backward, each SiTU-GLU
/// mode, on the scalar path and, for f16 and bf16, on the tensor cores.
fn moe_kernels(cs: &mut Cases) {
    for k_top in [2, 8] {
        for histogram in [false, true] {
            for masked in [false, true] {
                let k = qb::route_top_k::RouteTopK::new(
                    settings(ELEMWISE),
                    cs.c(),
                    A, A, A, A, A,
                    S, S, S, S, S,
                    k_top, true, histogram, masked, int(),
                );
                cs.push(
                    format!("route_top_k k={k_top} histogram={histogram} masked={masked}"),
                    k,
                );
            }
        }
    }
    for masked in [false, true] {
        let k = moe::moe_block_ranks::MoeBlockRanks::new(
            settings(CubeDim::new_1d(moe::PLAN_BLOCK)),
            cs.c(),
            A, A, A, A,
            S, S, S,
            masked, int(),
        );
        cs.push(format!("moe_block_ranks masked={masked}"), k);
        let k = moe::moe_place::MoePlace::new(
            settings(ELEMWISE),
            cs.c(),
            A, A, A, A, A, A, A, A, A,
            S, S, S,
            masked, int(),
        );
        cs.push(format!("moe_place masked={masked}"), k);
    }
    let k = moe::moe_block_scan::MoeBlockScan::new(settings(ELEMWISE), cs.c(), A, A, A, S, S);
    cs.push("moe_block_scan".into(), k);
    let k = moe::moe_offsets::MoeOffsets::new(settings(CubeDim::new_1d(1)), cs.c(), A, A, A, S);
    cs.push("moe_offsets".into(), k);
    let k = moe::moe_pair_gather::MoePairGather::new(settings(ELEMWISE), cs.c(), A, A, A, S);
    cs.push("moe_pair_gather".into(), k);

    let launches = grouped_launches();
    for f in FLOATS {
        let (t, n) = (float(f), name(f));
        // The matrix units in TF32 on f32 storage, in f16/bf16 on half storage. Their emulation
        // (a testing mode) is compiled for f32 and f16 too, to check that it has no matrix
        // instructions.
        let all: &[Products] = match f {
            FloatKind::F32 => &[
                Products::Scalar,
                Products::MatrixUnitsTf32,
                Products::EmulatedTf32,
            ],
            FloatKind::F16 => &[Products::Scalar, Products::MatrixUnits, Products::Emulated],
            _ => &[Products::Scalar, Products::MatrixUnits],
        };
        for &products in all {
            let mma = products.blocks() && !products.emulated();
            let path = match products {
                Products::Scalar => "scalar",
                Products::MatrixUnits => "tensor cores",
                Products::MatrixUnitsTf32 => "tensor cores tf32",
                Products::Emulated | Products::EmulatedTf32 => "emulated tensor cores",
            };
            let (x, y) = moe::grouped_matmul_cube(products);
            let dim = CubeDim::new_2d(x, y);
            for (gather_a, gather_b) in [(false, true), (true, false)] {
                let k = moe::grouped_matmul_wgrad::GroupedMatmulWgrad::new(
                    settings(dim),
                    cs.c(),
                    A, A, A, A, A,
                    S, S,
                    gather_a, gather_b, products, t,
                );
                let gather = format!("gather=({gather_a},{gather_b})");
                cs.push_on(format!("grouped_matmul_wgrad {n} {path} {gather}"), k, mma);
            }
            for (label, g) in &launches {
                let k = moe::grouped_matmul::GroupedMatmul::new(
                    settings(dim),
                    cs.c(),
                    A, A, A, A, A, A, A, A, A, A, A, A, A,
                    S, S, S, S, S, S,
                    g.gather, g.transposed, g.accumulate, g.epilogue, g.mode, g.save, products, t,
                );
                cs.push_on(format!("grouped_matmul {n} {path} {label}"), k, mma);
            }
        }
    }
}

/// The comptime switches of one `grouped_matmul` launch.
struct Grouped {
    gather: bool,
    transposed: bool,
    accumulate: bool,
    epilogue: u32,
    mode: u32,
    save: bool,
}

/// Each grouped launch of the MoE layer (`kimi_burn::ops::moe`'s dispatch), labelled.
fn grouped_launches() -> Vec<(String, Grouped)> {
    let plain = |gather, transposed, accumulate| Grouped {
        gather,
        transposed,
        accumulate,
        epilogue: moe::EPILOGUE_PLAIN,
        mode: situ::MODE_SWIGLU,
        save: false,
    };
    let mut launches = vec![
        ("gate/up".to_string(), plain(true, false, false)),
        ("down".to_string(), plain(false, false, false)),
        ("d_act".to_string(), plain(true, true, false)),
        ("dx".to_string(), plain(false, true, false)),
        ("dx accumulate".to_string(), plain(false, true, true)),
    ];
    for (m, mode) in SITU_MODES {
        for save in [false, true] {
            let glu = Grouped {
                gather: true,
                transposed: false,
                accumulate: false,
                epilogue: moe::EPILOGUE_GLU,
                mode,
                save,
            };
            launches.push((format!("glu {m} save={save}"), glu));
        }
        let backward = Grouped {
            gather: true,
            transposed: true,
            accumulate: false,
            epilogue: moe::EPILOGUE_GLU_BACKWARD,
            mode,
            save: false,
        };
        launches.push((format!("glu backward {m}"), backward));
    }
    launches
}
