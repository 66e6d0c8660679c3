//! What the crate moves onto rayon's pool on the CPU backends (`ops::backend::on_cpu_pool`: the
//! model's forward, `accumulate_gradients`, the optimiser step) behaves as if it ran on the
//! caller's thread: the caller's kernel switch reaches it, and its device reads count for the
//! caller. Each test compares a call from the test's own thread (which the crate moves to the
//! pool) with the same call made on a pool thread, where the crate runs it in place.

use crate::common::*;
use crate::train::small_mqar;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use kimi_burn::data::{Batch, SeededRng, Task};
use kimi_burn::model::KimiForCausalLM;
use kimi_burn::ops::with_kernels;
use kimi_burn::sync::count_reads;
use kimi_burn::train::accumulate_gradients;

/// `f` on a thread of rayon's pool.
fn on_a_pool_thread<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| {
        assert!(rayon::current_thread_index().is_some());
        f()
    })
}

fn bits(t: Tensor<Cpu, 3>) -> Vec<u32> {
    t.into_data()
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// The tiny model on `B`, a batch of two MQAR sequences drawn with `seed`, and its input ids.
fn tiny_model<B: Backend>(seed: u64) -> (KimiForCausalLM<B>, Batch, Tensor<B, 2, Int>) {
    let device = Default::default();
    let (task, config) = small_mqar();
    let model = config.try_init(&device).expect("tiny preset");
    let batch = task.sample_batch(2, &mut SeededRng::new(seed));
    let (ids, _) = batch.to_tensors::<B>(&device);
    (model, batch, ids)
}

#[test]
fn the_kernel_switch_reaches_a_forward_on_the_pool() {
    let (model, _, ids) = tiny_model::<Cpu>(3);
    let host = bits(model.forward(ids.clone()));
    let reference = on_a_pool_thread(|| bits(with_kernels(false, || model.forward(ids.clone()))));
    // The two paths round differently somewhere in the model, so the comparison below can tell
    // which one ran.
    assert_ne!(
        host, reference,
        "host kernels and tensor ops gave the same bits"
    );
    let switched_off_here = bits(with_kernels(false, || model.forward(ids.clone())));
    assert_eq!(
        switched_off_here, reference,
        "with_kernels(false) on the caller's thread did not reach the forward on the pool"
    );
}

#[test]
fn reads_on_the_pool_count_for_the_caller() {
    let device = Default::default();
    let (model, batch, ids) = tiny_model::<CpuAd>(4);
    let forward = || model.try_forward(ids.clone(), None, None).expect("forward");
    let (_, here) = count_reads(forward);
    let (_, there) = on_a_pool_thread(|| count_reads(forward));
    // The token-id range check reads the ids back on the CPU backends.
    assert!(there >= 1, "no read counted on the pool thread itself");
    assert_eq!(
        here, there,
        "the forward's reads on the pool were not counted for the caller"
    );

    let step = || accumulate_gradients(&model, &batch, 1, batch.scored(), &device).expect("step");
    let (a, here) = count_reads(step);
    let (b, there) = on_a_pool_thread(|| count_reads(step));
    assert!(there >= 1);
    assert_eq!(
        here, there,
        "the step's reads on the pool were not counted for the caller"
    );
    assert_eq!(
        a.loss.to_bits(),
        b.loss.to_bits(),
        "the step's loss depends on the thread"
    );
}
