//! [`KdaKernels`] on Burn's `Fusion` backends: each method recorded in the fusion stream as one
//! custom operation that runs the inner backend's method (see [`crate::ops::backend::fusion`]).

use burn::tensor::backend::Backend;
use burn::tensor::DType;
use burn_fusion::{Fusion, FusionBackend};

use crate::ops::backend::fusion::{call, dims, outs, Args, Ft, Inputs, Out, Prim};
use crate::ops::kda::{KdaChunkGrads, KdaChunkSaved, KdaChunkWithin, KdaKernelInput, KdaKernels};

/// The tensors of a [`KdaKernelInput`] in the order [`inner_kda_input`] reads them.
fn kda_inputs<B: FusionBackend>(input: KdaKernelInput<Fusion<B>>) -> Inputs<B::FusionRuntime> {
    Inputs::new()
        .float(input.q)
        .float(input.k)
        .float(input.v)
        .float(input.g)
        .float(input.beta)
        .float_opt(input.initial_state)
}

fn inner_kda_input<B: Backend>(
    a: &mut Args<B>,
    has_state: bool,
    seq_starts: Vec<usize>,
) -> KdaKernelInput<B> {
    KdaKernelInput {
        q: a.float(),
        k: a.float(),
        v: a.float(),
        g: a.float(),
        beta: a.float(),
        initial_state: a.float_if(has_state),
        seq_starts,
    }
}

/// `(o, S_T)` of a KDA forward: `[B, T, H, V]` and `[N, H, K, V]`, f32.
fn kda_outputs<B: FusionBackend>(input: &KdaKernelInput<Fusion<B>>) -> Vec<Out> {
    let [b, t, h, kd] = dims::<_, 4>(&input.q);
    let vd = dims::<_, 4>(&input.v)[3];
    let n = input.seq_starts.len() - 1;
    vec![
        Out::new([b, t, h, vd], DType::F32),
        Out::new([n, h, kd, vd], DType::F32),
    ]
}

impl<B: FusionBackend + KdaKernels> KdaKernels for Fusion<B> {
    fn kda_recurrent_forward(input: KdaKernelInput<Self>) -> (Ft<B>, Ft<B>) {
        let has_state = input.initial_state.is_some();
        let starts = input.seq_starts.clone();
        let declared = kda_outputs(&input);
        let [o, s] = outs(call::<B>(
            "kimi_burn::kda_recurrent_forward",
            kda_inputs(input),
            declared,
            move |mut a| {
                let input = inner_kda_input::<B>(&mut a, has_state, starts.clone());
                let (o, s) = B::kda_recurrent_forward(input);
                vec![Prim::Float(o), Prim::Float(s)]
            },
        ));
        (o, s)
    }

    fn kda_chunk_forward(input: KdaKernelInput<Self>, chunk: usize) -> (Ft<B>, Ft<B>) {
        let has_state = input.initial_state.is_some();
        let starts = input.seq_starts.clone();
        let declared = kda_outputs(&input);
        let [o, s] = outs(call::<B>(
            "kimi_burn::kda_chunk_forward",
            kda_inputs(input),
            declared,
            move |mut a| {
                let input = inner_kda_input::<B>(&mut a, has_state, starts.clone());
                let (o, s) = B::kda_chunk_forward(input, chunk);
                vec![Prim::Float(o), Prim::Float(s)]
            },
        ));
        (o, s)
    }

    fn kda_chunk_forward_saving(
        input: KdaKernelInput<Self>,
        chunk: usize,
        keep_within: bool,
    ) -> (Ft<B>, Ft<B>, KdaChunkSaved<Self>) {
        let has_state = input.initial_state.is_some();
        let starts = input.seq_starts.clone();
        let [_, _, h, kd] = dims::<_, 4>(&input.q);
        let vd = dims::<_, 4>(&input.v)[3];
        // Chunks never cross a sequence: each sequence contributes ⌈len / chunk⌉.
        let chunks: usize = starts
            .windows(2)
            .map(|w| (w[1] - w[0]).div_ceil(chunk))
            .sum();
        let mut declared = kda_outputs(&input);
        declared.push(Out::new([chunks, h, kd, vd], DType::F32));
        declared.push(Out::new([chunks, h, chunk, vd], DType::F32));
        if keep_within {
            for cols in [chunk, chunk, kd, vd] {
                declared.push(Out::new([chunks, h, chunk, cols], DType::F32));
            }
        }
        let mut out = call::<B>(
            "kimi_burn::kda_chunk_forward_saving",
            kda_inputs(input),
            declared,
            move |mut a| {
                let input = inner_kda_input::<B>(&mut a, has_state, starts.clone());
                let (o, s, saved) = B::kda_chunk_forward_saving(input, chunk, keep_within);
                let within = saved.within.map(|w| w.into_array()).into_iter().flatten();
                [o, s, saved.states, saved.vn]
                    .into_iter()
                    .chain(within)
                    .map(Prim::Float)
                    .collect()
            },
        )
        .into_iter();
        let mut next = || out.next().expect("declared output");
        let (o, s, states, vn) = (next(), next(), next(), next());
        let within =
            keep_within.then(|| KdaChunkWithin::from_array([next(), next(), next(), next()]));
        (o, s, KdaChunkSaved { states, vn, within })
    }

    fn kda_chunk_backward(
        input: KdaKernelInput<Self>,
        chunk: usize,
        saved: KdaChunkSaved<Self>,
        grad_o: Ft<B>,
        grad_state: Option<Ft<B>>,
    ) -> KdaChunkGrads<Self> {
        let has_state = input.initial_state.is_some();
        let has_grad_state = grad_state.is_some();
        let starts = input.seq_starts.clone();
        let [_, _, h, kd] = dims::<_, 4>(&input.q);
        let vd = dims::<_, 4>(&input.v)[3];
        let n = starts.len() - 1;
        let f32_like = |t: &Ft<B>| Out::new(t.shape.clone(), DType::F32);
        let declared = vec![
            f32_like(&input.q),
            f32_like(&input.k),
            f32_like(&input.v),
            f32_like(&input.g),
            f32_like(&input.beta),
            Out::new([n, h, kd, vd], DType::F32),
        ];
        let has_within = saved.within.is_some();
        let within = saved.within.map(|w| w.into_array()).into_iter().flatten();
        let inputs = within.fold(
            kda_inputs(input).float(saved.states).float(saved.vn),
            Inputs::float,
        );
        let inputs = inputs.float(grad_o).float_opt(grad_state);
        let [q, k, v, g, beta, initial_state] = outs(call::<B>(
            "kimi_burn::kda_chunk_backward",
            inputs,
            declared,
            move |mut a| {
                let input = inner_kda_input::<B>(&mut a, has_state, starts.clone());
                let saved = KdaChunkSaved {
                    states: a.float(),
                    vn: a.float(),
                    within: has_within
                        .then(|| KdaChunkWithin::from_array([(); 4].map(|_| a.float()))),
                };
                let grad_o = a.float();
                let grad_state = a.float_if(has_grad_state);
                let g = B::kda_chunk_backward(input, chunk, saved, grad_o, grad_state);
                [g.q, g.k, g.v, g.g, g.beta, g.initial_state]
                    .into_iter()
                    .map(Prim::Float)
                    .collect()
            },
        ));
        KdaChunkGrads {
            q,
            k,
            v,
            g,
            beta,
            initial_state,
        }
    }

    fn rms_norm_gated_forward(o: Ft<B>, z: Ft<B>, weight: Ft<B>, eps: f64) -> Ft<B> {
        let declared = vec![Out::like(&o)];
        let inputs = Inputs::new().float(o).float(z).float(weight);
        let [y] = outs(call::<B>(
            "kimi_burn::rms_norm_gated_forward",
            inputs,
            declared,
            move |mut a| {
                let (o, z, w) = (a.float(), a.float(), a.float());
                vec![Prim::Float(B::rms_norm_gated_forward(o, z, w, eps))]
            },
        ));
        y
    }

    fn rms_norm_gated_backward(
        o: Ft<B>,
        z: Ft<B>,
        weight: Ft<B>,
        grad: Ft<B>,
        eps: f64,
    ) -> (Ft<B>, Ft<B>, Ft<B>) {
        let declared = vec![Out::like(&o), Out::like(&z), Out::like(&weight)];
        let inputs = Inputs::new().float(o).float(z).float(weight).float(grad);
        let [d_o, dz, dw] = outs(call::<B>(
            "kimi_burn::rms_norm_gated_backward",
            inputs,
            declared,
            move |mut a| {
                let (o, z, w, g) = (a.float(), a.float(), a.float(), a.float());
                let (d_o, dz, dw) = B::rms_norm_gated_backward(o, z, w, g, eps);
                vec![Prim::Float(d_o), Prim::Float(dz), Prim::Float(dw)]
            },
        ));
        (d_o, dz, dw)
    }

    fn short_conv_forward(
        x: Ft<B>,
        weight: Ft<B>,
        tail: Option<Ft<B>>,
        seq_starts: Vec<usize>,
    ) -> (Ft<B>, Ft<B>) {
        let [_, p] = dims::<_, 2>(&x);
        let w = dims::<_, 2>(&weight)[1];
        let n = seq_starts.len() - 1;
        let declared = vec![Out::like(&x), Out::new([n, p, w - 1], x.dtype)];
        let has_tail = tail.is_some();
        let inputs = Inputs::new().float(x).float(weight).float_opt(tail);
        let [y, new_tail] = outs(call::<B>(
            "kimi_burn::short_conv_forward",
            inputs,
            declared,
            move |mut a| {
                let (x, w) = (a.float(), a.float());
                let tail = a.float_if(has_tail);
                let (y, t) = B::short_conv_forward(x, w, tail, seq_starts.clone());
                vec![Prim::Float(y), Prim::Float(t)]
            },
        ));
        (y, new_tail)
    }

    fn short_conv_backward(
        x: Ft<B>,
        weight: Ft<B>,
        tail: Option<Ft<B>>,
        seq_starts: Vec<usize>,
        dy: Ft<B>,
    ) -> (Ft<B>, Ft<B>, Option<Ft<B>>) {
        let mut declared = vec![Out::like(&x), Out::like(&weight)];
        declared.extend(tail.as_ref().map(Out::like));
        let has_tail = tail.is_some();
        let inputs = Inputs::new()
            .float(x)
            .float(weight)
            .float_opt(tail)
            .float(dy);
        let mut out = call::<B>(
            "kimi_burn::short_conv_backward",
            inputs,
            declared,
            move |mut a| {
                let (x, w) = (a.float(), a.float());
                let tail = a.float_if(has_tail);
                let dy = a.float();
                let (dx, dw, dt) = B::short_conv_backward(x, w, tail, seq_starts.clone(), dy);
                let mut v = vec![Prim::Float(dx), Prim::Float(dw)];
                v.extend(dt.map(Prim::Float));
                v
            },
        )
        .into_iter();
        let (dx, dw) = (out.next().unwrap(), out.next().unwrap());
        (dx, dw, out.next())
    }
}
