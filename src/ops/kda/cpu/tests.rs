//! The host KDA recurrence against the naive recurrence and its autodiff gradients, and its
//! schedule's helpers.

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{backend::Backend, Distribution, Tensor};

use crate::ops::kda::{cpu_kda, host_kernel_applies, naive_recurrent_kda, KdaOptions};

type B = Autodiff<NdArray<f32>>;

struct Case {
    dims: [usize; 5],
    l2norm: bool,
    scale: Option<f64>,
    seqs: Option<Vec<usize>>,
    extreme: bool,
    /// An initial state (with its gradient) and the final state in the loss.
    state: bool,
}

impl Case {
    fn new(dims: [usize; 5]) -> Self {
        Self {
            dims,
            l2norm: true,
            scale: None,
            seqs: None,
            extreme: false,
            state: false,
        }
    }
}

fn host<const D: usize>(x: Tensor<B, D>) -> Vec<f32> {
    x.into_data().to_vec().expect("f32")
}

fn grad<const D: usize>(
    x: &Tensor<B, D>,
    grads: &<B as burn::tensor::backend::AutodiffBackend>::Gradients,
) -> Vec<f32> {
    x.grad(grads)
        .expect("gradient")
        .into_data()
        .to_vec()
        .expect("f32")
}

/// The random inputs of a case (q, k, v, g, β, S_0) and the output and state gradients
/// (`dO`, `dS_T`) that the loss projects onto.
struct Draw {
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    g: Tensor<B, 4>,
    beta: Tensor<B, 3>,
    h0: Tensor<B, 4>,
    d_o: Tensor<B, 4>,
    d_s: Tensor<B, 4>,
}

fn draw(case: &Case) -> Draw {
    let device = Default::default();
    let [b, t, h, kd, vd] = case.dims;
    B::seed(&device, t as u64);
    let normal = |s: [usize; 4]| Tensor::<B, 4>::random(s, Distribution::Normal(0.0, 1.0), &device);
    let q = normal([b, t, h, kd]);
    let k = normal([b, t, h, kd]);
    let v = normal([b, t, h, vd]);
    // log σ(x) gates, a tenth of them −1000 in the extreme case.
    let mut g = normal([b, t, h, kd]).neg().exp().log1p().neg();
    if case.extreme {
        let mask = Tensor::<B, 4>::random([b, t, h, kd], Distribution::Uniform(0.0, 1.0), &device)
            .lower_elem(0.1);
        g = g.mask_fill(mask, -1000.0);
    }
    let beta = Tensor::<B, 3>::random([b, t, h], Distribution::Uniform(0.0, 1.0), &device);
    let n = case.seqs.as_ref().map_or(b, |cu| cu.len() - 1);
    let (h0, d_o, d_s) = (
        normal([n, h, kd, vd]),
        normal([b, t, h, vd]),
        normal([n, h, kd, vd]),
    );
    Draw {
        q,
        k,
        v,
        g,
        beta,
        h0,
        d_o,
        d_s,
    }
}

/// The output (and final state) of KDA on the drawn inputs and the gradients of the drawn
/// projection of them, from the host kernel or from the naive recurrence's autodiff.
fn outputs(case: &Case, x: &Draw, host_kernel: bool) -> Vec<Vec<f32>> {
    let seqs: Option<Vec<(usize, usize)>> = case
        .seqs
        .as_ref()
        .map(|cu| cu.windows(2).map(|w| (w[0], w[1] - w[0])).collect());
    let Draw {
        q,
        k,
        v,
        g,
        beta,
        h0,
        d_o,
        d_s,
    } = x;
    let (q, k, v, g, beta, h0) = (
        q.clone().require_grad(),
        k.clone().require_grad(),
        v.clone().require_grad(),
        g.clone().require_grad(),
        beta.clone().require_grad(),
        h0.clone().require_grad(),
    );
    let mut opts = KdaOptions::default().with_qk_l2norm(case.l2norm);
    opts.scale = case.scale;
    opts.cu_seqlens = case.seqs.clone();
    if case.state {
        opts = opts.with_initial_state(h0.clone()).with_final_state(true);
    }
    let (o, s) = if host_kernel {
        assert!(host_kernel_applies(&q, &k, &v, &g, &beta, &opts));
        cpu_kda(&q, &k, &v, &g, &beta, opts, seqs.clone())
    } else {
        naive_recurrent_kda(
            q.clone(),
            k.clone(),
            v.clone(),
            g.clone(),
            beta.clone(),
            opts,
        )
    };
    assert_eq!(s.is_some(), case.state, "a final state exactly when asked");
    let mut loss = o.clone().mul(d_o.clone()).sum();
    let mut out = vec![host(o)];
    if let Some(s) = s {
        loss = loss.add(s.clone().mul(d_s.clone()).sum());
        out.push(host(s));
    }
    let grads = loss.backward();
    out.extend([
        grad(&q, &grads),
        grad(&k, &grads),
        grad(&v, &grads),
        grad(&g, &grads),
        grad(&beta, &grads),
    ]);
    if case.state {
        out.push(grad(&h0, &grads));
    }
    out
}

/// Output, final state and the gradients of q, k, v, g, β, S_0 against the naive recurrence's
/// autodiff.
fn check(case: Case) {
    let x = draw(&case);
    let (want, got) = (outputs(&case, &x, false), outputs(&case, &x, true));
    let names: &[&str] = if case.state {
        &["o", "S_T", "dq", "dk", "dv", "dg", "dbeta", "dS_0"]
    } else {
        &["o", "dq", "dk", "dv", "dg", "dbeta"]
    };
    assert_eq!(want.len(), names.len());
    for (name, (w, g)) in names.iter().zip(want.iter().zip(&got)) {
        let scale = w.iter().fold(1.0f32, |m, x| m.max(x.abs()));
        let err = w
            .iter()
            .zip(g)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            err <= 2e-5 * scale,
            "{name}: max error {err} (max |want| {scale}) at dims {:?}, l2norm {}",
            case.dims,
            case.l2norm
        );
    }
}

#[test]
fn matches_the_naive_recurrence_and_its_gradients() {
    // Several checkpoint spans, the last one partial; unnormalised q, k of any scale.
    check(Case::new([2, 150, 2, 8, 5]));
    check(Case {
        l2norm: false,
        scale: Some(0.3),
        ..Case::new([1, 70, 1, 6, 4])
    });
    check(Case {
        scale: Some(2.0),
        extreme: true,
        ..Case::new([1, 40, 2, 4, 4])
    });
    // Widths that fill the SIMD lane blocks, with and without a remainder.
    check(Case::new([1, 45, 2, 32, 16]));
    check(Case::new([1, 20, 1, 16, 37]));
}

#[test]
fn initial_and_final_states_and_their_gradients() {
    check(Case {
        state: true,
        ..Case::new([2, 70, 2, 8, 16])
    });
    check(Case {
        state: true,
        l2norm: false,
        extreme: true,
        ..Case::new([1, 1, 3, 16, 5])
    });
}

#[test]
fn tokens_of_no_sequence_get_zero_outputs_and_gradients() {
    use crate::ops::backend::host::{HostArray, HostData, HostOp};
    // T = 6, B = H = 1, K = V = 3; the packed spans leave tokens 0 and 5 to no sequence.
    let (t, kd) = (6, 3);
    let array = |shape: Vec<usize>, seed: usize, f: fn(f32) -> f32| {
        let n = shape.iter().product();
        let data = (0..n)
            .map(|i| f(((i * 7 + seed) % 11) as f32 * 0.1 - 0.5))
            .collect();
        HostArray {
            data: HostData::Owned(data),
            shape,
        }
    };
    let row = vec![1, t, 1, kd];
    let same = |x: f32| x;
    let inputs = [
        array(row.clone(), 1, same),
        array(row.clone(), 2, same),
        array(row.clone(), 3, same),
        array(row.clone(), 4, |g| -g.abs()),
        array(vec![1, t, 1], 5, f32::abs),
        array(vec![1, 1, kd, kd], 6, same),
    ];
    let op = super::KdaRecurrence {
        scale: 0.5,
        l2norm: true,
        seqs: Some(vec![(1, 2), (3, 2)]),
        initial_state: false,
        final_state: false,
    };
    // In tests a `Fresh` output starts full of NaN, so a row that nothing writes would show.
    let (o, saved) = op.forward(&inputs, true);
    let rows = |x: &HostArray, w: usize| -> Vec<Vec<f32>> {
        x.data.chunks(w).map(<[f32]>::to_vec).collect()
    };
    let o_rows = rows(&o, kd);
    for (tk, r) in o_rows.iter().enumerate() {
        let outside = tk == 0 || tk == t - 1;
        assert_eq!(r.iter().all(|&x| x == 0.0), outside, "o row {tk}: {r:?}");
    }
    let grads = op.backward(&inputs, &saved.expect("saved"), &array(row, 7, same));
    for (i, d) in grads[..5].iter().enumerate() {
        let w = if i == 4 { 1 } else { kd };
        for (tk, r) in rows(d, w).iter().enumerate() {
            let outside = tk == 0 || tk == t - 1;
            assert!(
                r.iter().all(|x| x.is_finite()),
                "gradient {i} row {tk}: {r:?}"
            );
            if outside {
                assert!(r.iter().all(|&x| x == 0.0), "gradient {i} row {tk}: {r:?}");
            }
        }
    }
}

/// With an output gradient that nothing else holds, `dv` is written over it (the same
/// buffer) and every gradient has the bits of the backward that reads a shared output
/// gradient; with the final states in the loss, or with tokens of no sequence, the backward
/// leaves the output gradient alone.
#[test]
fn the_value_gradient_is_written_over_an_output_gradient_nothing_else_holds() {
    use crate::ops::backend::host::{HostArray, HostData, HostOp};
    // V = 21: blocks of 4 and 1 registers and single columns on every instruction set.
    let [b, t, h, kd, vd] = [2, 37, 3, 16, 21];
    let array = |shape: Vec<usize>, seed: u64, f: fn(f32) -> f32| {
        let n = shape.iter().product();
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let data = (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                f((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
            })
            .collect();
        HostArray {
            data: HostData::Owned(data),
            shape,
        }
    };
    let same = |x: f32| x;
    // Packed sequences take one row (B = 1) and have a state each.
    for (final_state, seqs, in_place) in [
        (false, None, true),
        (true, None, false),
        (false, Some(vec![(0, 30), (30, 7)]), true),
        (false, Some(vec![(1, 30)]), false),
    ] {
        let (b, n) = match &seqs {
            Some(spans) => (1, spans.len()),
            None => (b, b),
        };
        let inputs = [
            array(vec![b, t, h, kd], 1, same),
            array(vec![b, t, h, kd], 2, same),
            array(vec![b, t, h, vd], 3, same),
            array(vec![b, t, h, kd], 4, |g| -g.abs()),
            array(vec![b, t, h], 5, f32::abs),
            array(vec![n, h, kd, vd], 6, same),
        ];
        let op = super::KdaRecurrence {
            scale: 0.25,
            l2norm: true,
            seqs: seqs.clone(),
            initial_state: true,
            final_state,
        };
        let (o, saved) = op.forward(&inputs, true);
        let saved = saved.expect("saved");
        let grad = array(o.shape.clone(), 7, same);
        let want = op.backward(&inputs, &saved, &grad);
        let owned = grad.clone();
        let at = owned.data.as_ptr();
        let got = op.backward_owned(&inputs, &saved, owned);
        let case = format!("final_state {final_state}, sequences {seqs:?}");
        assert_eq!(got[2].data.as_ptr() == at, in_place, "{case}: dv in place");
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(w.shape, g.shape, "{case}: gradient {i}");
            let bits = |x: &HostArray| x.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(w), bits(g), "{case}: gradient {i}");
        }
    }
}

#[test]
fn packed_sequences_restart_the_state() {
    check(Case {
        seqs: Some(vec![0, 1, 65, 130, 140]),
        ..Case::new([1, 140, 2, 4, 3])
    });
    check(Case {
        seqs: Some(vec![0, 33, 40]),
        state: true,
        ..Case::new([1, 40, 2, 16, 16])
    });
}

/// The buffer of an ndarray `f32` tensor, for telling whether an op wrote in place.
/// Runs `f` on a rayon pool of `threads` threads: the groups of heads that run together are
/// sized by the pool ([`super::KdaRecurrence::groups`]), so each size is a different walk.
fn in_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("a thread pool")
        .install(f)
}

#[test]
fn heads_run_in_groups_of_any_size_as_one_at_a_time() {
    // One thread: all four heads of a sequence in one group; three: groups of two.
    for threads in [1, 3] {
        in_pool(threads, || {
            check(Case::new([2, 150, 4, 8, 5]));
            check(Case {
                state: true,
                ..Case::new([3, 37, 4, 16, 16])
            });
        });
    }
}

#[test]
fn grouping_changes_no_bit() {
    // One thread: each sequence's heads in one group; 64: every head its own group.
    for case in [
        Case::new([2, 150, 4, 8, 5]),
        Case {
            state: true,
            ..Case::new([3, 37, 4, 16, 16])
        },
    ] {
        let x = draw(&case);
        let grouped = in_pool(1, || outputs(&case, &x, true));
        let alone = in_pool(64, || outputs(&case, &x, true));
        for (a, b) in grouped.iter().zip(&alone) {
            assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
        }
        assert_eq!(grouped.len(), alone.len());
    }
}

#[test]
fn groups_are_consecutive_heads_of_one_sequence() {
    use super::{KdaRecurrence, GROUP_STATE_BYTES};
    let op = |seqs: Option<Vec<(usize, usize)>>| KdaRecurrence {
        scale: 1.0,
        l2norm: true,
        seqs,
        initial_state: false,
        final_state: false,
    };
    // Group sizes for pools of 1, 2, 3, 5 and 16 threads: the heads of a sequence split
    // evenly over the threads, never more than a sequence's heads, and at most 512 KiB of
    // states (eight of 128 × 128).
    let cases = [
        ((1, 4, 4096), [4, 2, 1, 1, 1]),
        ((2, 4, 4096), [4, 4, 2, 1, 1]),
        ((16, 4, 4096), [4, 4, 4, 4, 4]),
        ((1, 64, 16384), [8, 8, 8, 8, 4]),
    ];
    assert_eq!(GROUP_STATE_BYTES, 512 << 10);
    for (t, threads) in [1, 2, 3, 5, 16].into_iter().enumerate() {
        in_pool(threads, || {
            for ((b, h, kv), sizes) in cases {
                let op = op(None);
                let jobs = op.jobs(b, 100, h);
                let groups = op.groups(&jobs, h, kv);
                // A partition of the jobs, in order.
                let flat: Vec<usize> = groups.iter().flat_map(|g| g.clone()).collect();
                assert_eq!(flat, (0..jobs.len()).collect::<Vec<_>>());
                let size = groups[0].len();
                assert_eq!(size, sizes[t], "b {b}, h {h}, kv {kv}, {threads} threads");
                for g in &groups {
                    let first = &jobs[g.start];
                    assert!(!g.is_empty() && g.len() <= size);
                    for (i, job) in jobs[g.clone()].iter().enumerate() {
                        assert_eq!((job.b, job.seq, job.start, job.len), {
                            (first.b, first.seq, first.start, first.len)
                        });
                        assert_eq!(job.h, first.h + i, "consecutive heads");
                    }
                }
                // Every thread has a group whenever there are enough heads.
                assert!(groups.len() >= threads.min(b * h / size.max(1)));
            }
            // Packed sequences differ in length: one job per group.
            let op = op(Some(vec![(0, 10), (10, 90)]));
            let jobs = op.jobs(1, 100, 4);
            assert!(op.groups(&jobs, 4, 64).iter().all(|g| g.len() == 1));
        });
    }
}

#[test]
fn prefetches_ask_for_the_token_the_group_reads_that_many_steps_later() {
    use super::forward::ahead;
    use super::{INTERLEAVE, PREFETCH_AHEAD};
    for n in 1..4 {
        for len in [1, 3, 5, INTERLEAVE, INTERLEAVE + 1, 2 * INTERLEAVE + 7] {
            // The order of `ForwardGroup`: each block's tokens of every job in turn.
            let mut order = Vec::new();
            for lo in (0..len).step_by(INTERLEAVE) {
                let hi = (lo + INTERLEAVE).min(len);
                for g in 0..n {
                    order.extend((lo..hi).map(|i| (lo, hi, g, i)));
                }
            }
            for (p, &(lo, hi, g, i)) in order.iter().enumerate() {
                let later = order.get(p + PREFETCH_AHEAD).map(|&(_, _, g, i)| (g, i));
                let got = ahead(n, len, lo, hi, g, i);
                assert_eq!(got, later, "n {n}, len {len}, job {g}, token {i}");
            }
        }
    }
}

#[test]
fn pieces_cover_the_buffer_once_in_order() {
    use super::piece;
    for len in [0, 1, 5, 64, 4096, 4097] {
        for of in [1, 3, 31, 32] {
            let mut end = 0;
            for k in 0..of + 2 {
                let r = piece(k, of, len);
                assert!(
                    r.start == end || r.is_empty(),
                    "len {len}, of {of}, piece {k}"
                );
                assert!(r.len() <= len.div_ceil(of), "len {len}, of {of}, piece {k}");
                end = end.max(r.end);
                if k >= of {
                    assert!(r.is_empty(), "len {len}, of {of}, piece {k}");
                }
            }
            assert_eq!(end, len, "len {len}, of {of}");
        }
    }
}

#[test]
fn the_backward_asks_for_the_span_it_takes_next() {
    use super::backward::next_span;
    for n in 1..4 {
        for spans in 1..4 {
            // The order of `BackwardGroup`: the spans from the last, every job in turn.
            let order: Vec<_> = (0..spans)
                .rev()
                .flat_map(|c| (0..n).map(move |g| (g, c)))
                .collect();
            for (p, &(g, c)) in order.iter().enumerate() {
                let next = order.get(p + 1).copied();
                assert_eq!(next_span(n, g, c), next, "n {n}, job {g}, span {c}");
            }
        }
    }
}

fn buffer(x: &Tensor<NdArray<f32>, 4>) -> *const f32 {
    match x.clone().into_primitive().tensor() {
        burn::backend::ndarray::NdArrayTensor::F32(storage) => storage.view().as_ptr(),
        _ => unreachable!("an f32 tensor"),
    }
}

/// A decode loop on the plain backend that hands its state over: the state is updated in
/// place (same buffer), token by token, and agrees with one naive recurrence over all the
/// tokens; a state the caller keeps a handle to is never written.
#[test]
fn a_handed_over_state_is_updated_in_place() {
    type P = NdArray<f32>;
    let device = Default::default();
    let [b, t, h, kd, vd] = [3, 5, 2, 16, 8];
    P::seed(&device, 7);
    let normal = |s: [usize; 4]| Tensor::<P, 4>::random(s, Distribution::Normal(0.0, 1.0), &device);
    let (q, k, v) = (
        normal([b, t, h, kd]),
        normal([b, t, h, kd]),
        normal([b, t, h, vd]),
    );
    let g = normal([b, t, h, kd]).neg().exp().log1p().neg();
    let beta = Tensor::<P, 3>::random([b, t, h], Distribution::Uniform(0.0, 1.0), &device);
    let h0 = normal([b, h, kd, vd]);
    let opts = || {
        KdaOptions::default()
            .with_qk_l2norm(true)
            .with_final_state(true)
    };
    let (want_o, want_s) = naive_recurrent_kda(
        q.clone(),
        k.clone(),
        v.clone(),
        g.clone(),
        beta.clone(),
        opts().with_initial_state(h0.clone()),
    );
    let want_s = want_s.expect("asked for");

    let kept = h0.clone().into_data();
    // Fresh values (not `h0` itself) so that nothing else holds the buffer.
    let mut state = h0.clone().add_scalar(0.0);
    let start = buffer(&state);
    let mut outs = Vec::new();
    for i in 0..t {
        let token = |x: &Tensor<P, 4>| x.clone().narrow(1, i, 1);
        let (o, s) = crate::ops::kda::fused_recurrent_kda(
            token(&q),
            token(&k),
            token(&v),
            token(&g),
            beta.clone().narrow(1, i, 1),
            opts().with_initial_state(state),
        );
        state = s.expect("asked for");
        assert_eq!(
            buffer(&state),
            start,
            "token {i}: the state moved to a new buffer"
        );
        outs.push(o);
    }
    let got_o = Tensor::cat(outs, 1);
    let close = |name: &str, got: Tensor<P, 4>, want: Tensor<P, 4>| {
        let scale = want.clone().abs().max().into_scalar().max(1.0);
        let err = (got - want).abs().max().into_scalar();
        assert!(
            err <= 2e-5 * scale,
            "{name}: max error {err} (scale {scale})"
        );
    };
    close("o", got_o, want_o);
    close("final state", state, want_s);

    // A handle the caller keeps: the op writes a new buffer and leaves the old one alone.
    let (_, s) = crate::ops::kda::fused_recurrent_kda(
        q.clone().narrow(1, 0, 1),
        k.clone().narrow(1, 0, 1),
        v.clone().narrow(1, 0, 1),
        g.clone().narrow(1, 0, 1),
        beta.clone().narrow(1, 0, 1),
        opts().with_initial_state(h0.clone()),
    );
    assert_ne!(buffer(&s.expect("asked for")), buffer(&h0));
    assert_eq!(h0.into_data(), kept, "a shared initial state was written");
}
