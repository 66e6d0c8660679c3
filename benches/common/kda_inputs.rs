//! The inputs of the KDA benches (`kda`, `kda_cpu_time`), made one way for both, as the tests and
//! `../shared/baselines/torch_blocks.py` make them: unit-norm queries and keys, `logsigmoid(randn)`
//! gates, uniform `β`, a random initial state and a fixed random output gradient.

use burn::tensor::{backend::Backend, Distribution, Tensor};

/// One call's inputs: `q`, `k`, `v`, `g`, `dout` `[B, T, H, K]` (V = K), `β` `[B, T, H]`, `h0`
/// `[B, H, K, K]`.
pub struct Inputs<B: Backend> {
    pub q: Tensor<B, 4>,
    pub k: Tensor<B, 4>,
    pub v: Tensor<B, 4>,
    pub g: Tensor<B, 4>,
    pub beta: Tensor<B, 3>,
    pub h0: Tensor<B, 4>,
    pub dout: Tensor<B, 4>,
}

/// The inputs at `[batch, t, h, k]`, from the backend's seed 0.
pub fn inputs<B: Backend>([batch, t, h, k]: [usize; 4], device: &B::Device) -> Inputs<B> {
    B::seed(device, 0);
    let normal =
        |shape: [usize; 4]| Tensor::<B, 4>::random(shape, Distribution::Normal(0.0, 1.0), device);
    let unit = |x: Tensor<B, 4>| x.clone().div(x.square().sum_dim(3).sqrt());
    let gate = normal([batch, t, h, k]).neg().exp().log1p().neg();
    Inputs {
        q: unit(normal([batch, t, h, k])),
        k: unit(normal([batch, t, h, k])),
        v: normal([batch, t, h, k]),
        g: gate,
        beta: Tensor::random([batch, t, h], Distribution::Uniform(0.0, 1.0), device),
        h0: normal([batch, h, k, k]),
        dout: normal([batch, t, h, k]),
    }
}
