#!/usr/bin/env bash
# CUDA verification of every CubeCL kernel and the CUDA benchmarks: build here, run on a GPU machine.
#
#   scripts/cuda-check.sh build [DIR]   compile the CUDA test, bench and example binaries (no GPU
#                                       needed: cudarc loads the driver and NVRTC at run time) and
#                                       copy them, stripped and xz-compressed, to DIR (default:
#                                       cuda-bin/)
#   scripts/cuda-check.sh run [DIR]     on the GPU machine: run them from DIR in one go; logs and a
#                                       summary go to $OUT (default: ./cuda-out)
#   scripts/cuda-check.sh               both, on a machine that has the GPU and the toolchain
#
# What runs, all on `Cuda` (a build with `cuda` and without `wgpu` runs the suite's GPU tests on
# CUDA: `tests/common` makes `Gpu` the CUDA backend there):
# - the suite's kernel tests: `kernels_moe::` and `kernels_kda::` (every MoE and KDA kernel against
#   the reference path on the same device, f32 ≤ 1e-5, f16 and bf16 storage, bit-for-bit
#   repeatability, exact QB counts, KDA against the naive recurrence on the design §4.5 grid, the
#   chunked backward against the reference autodiff, prefill then decode, the kernel path checked),
#   the attention, RMSNorm and Attention-Residuals kernels (`::kernel::`), MXFP quantisation, and
#   every generic check of the suite that also runs on wgpu (`::wgpu`, whole-model logits and
#   gradients against ndarray on both paths);
# - the CUDA groups of the `moe` bench (kernel vs reference path; the layer forward against the sum
#   of its matmuls at a data-centre shape) and of the `kda` bench (also H = 64, K = V = 128,
#   T = 16384), built in the dev profile (dependencies at opt-level 3, the crate at 1: the time
#   is the device's);
# - `train_tiny --backend cuda`: tokens/s of the tiny model's training step, and a CubeCL profile
#   of 2 and of 6 steps (the difference over 4 is one step's kernels).
# Exit status: non-zero if any test failed.
set -euo pipefail
cd "$(dirname "$0")/.."

mode="${1:-all}"
dir="${2:-cuda-bin}"
out="${OUT:-cuda-out}"
features=cuda,autodiff,shared-instances

# The executable of cargo target `$1` from cargo's JSON messages on stdin.
executable() {
    TARGET="$1" python3 -c 'import json,os,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]==os.environ["TARGET"]: print(m["executable"])'
}

build() {
    mkdir -p "$dir"
    # One feature set and one profile for everything, so the library compiles once.
    cp "$(cargo test --features "$features" --test suite --no-run --message-format=json | executable suite)" "$dir/suite"
    for bench in moe kda; do
        cp "$(cargo bench --profile dev --features "$features" --bench "$bench" --no-run --message-format=json \
            | executable "$bench")" "$dir/bench_$bench"
    done
    cp "$(cargo build --features "$features" --example train_tiny --message-format=json | executable train_tiny)" \
        "$dir/train_tiny"
    strip "$dir/suite" "$dir/bench_moe" "$dir/bench_kda" "$dir/train_tiny"
    xz -T0 -6 -f "$dir/suite" "$dir/bench_moe" "$dir/bench_kda" "$dir/train_tiny"
    ls -la "$dir"
}

run() {
    # Everything is written under $out/w, then packed into $out/logs.tar.gz beside the summary.
    local final="$out" bin
    mkdir -p "$final"
    out="$final/w"
    mkdir -p "$out"
    bin=$(mktemp -d)
    for f in "$dir"/*; do
        local name
        name=$(basename "${f%.xz}")
        case "$f" in
        *.xz) python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$f" "$bin/$name" ;;
        *) cp "$f" "$bin/$name" ;;
        esac
        chmod +x "$bin/$name"
    done
    nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
    local status=0
    timeout 150 "$bin/suite" kernels_moe:: kernels_kda:: ::kernel:: ::wgpu on_wgpu_matches \
        half_inputs_on_wgpu the_kernel_matches_the_host_loop --test-threads=8 >"$out/kernels.log" 2>&1 || status=$?
    echo "kernel tests exit status: $status" >"$out/summary.txt"
    grep -E "^test .*(FAILED|ignored)|^failures|panicked|test result" "$out/kernels.log" >>"$out/summary.txt" || true
    # Criterion: short measurements, only the CUDA groups.
    for bench in moe kda; do
        timeout "$([ "$bench" = moe ] && echo 60 || echo 90)" "$bin/bench_$bench" --bench cuda --warm-up-time 0.5 --measurement-time 2 \
            >"$out/bench_$bench.log" 2>&1 || echo "bench $bench exit status: $?" >>"$out/summary.txt"
        grep -E "^cuda|time:" "$out/bench_$bench.log" >>"$out/summary.txt" || true
    done
    # The tiny model's training step; then one step's kernels from the profile (6 minus 2 steps).
    local tt=(--backend cuda --checkpoint-every 0 --short-fraction 0 --test-sequences 16)
    timeout 45 "$bin/train_tiny" "${tt[@]}" --steps 40 --out "$out/tt40" >"$out/train_tiny.log" 2>&1 ||
        echo "train_tiny exit status: $?" >>"$out/summary.txt"
    tail -n 5 "$out/train_tiny.log" >>"$out/summary.txt" || true
    for steps in 2 6; do
        CUBECL_DEBUG_LOG="$out/profile_$steps.log" CUBECL_DEBUG_OPTION=profile timeout 30 \
            "$bin/train_tiny" "${tt[@]}" --steps "$steps" --out "$out/tt$steps" >/dev/null 2>&1 ||
            echo "profile $steps exit status: $?" >>"$out/summary.txt"
    done
    cp "$out/summary.txt" "$final/summary.txt"
    (cd "$out" && tar czf "$final/logs.tar.gz" .) && rm -rf "$out"
    cat "$final/summary.txt"
    return "$status"
}

case "$mode" in
build) build ;;
run) run ;;
all) build && run ;;
*)
    echo "usage: $0 [build|run|all] [DIR]" >&2
    exit 2
    ;;
esac
