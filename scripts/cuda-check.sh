#!/usr/bin/env bash
# CUDA verification of the fused kernels (MoE, issue #6; KDA, issue #7): build here, run on a GPU
# machine.
#
#   scripts/cuda-check.sh build [DIR]   compile the CUDA test and bench binaries (no GPU needed:
#                                       cudarc loads the driver and NVRTC at run time) and copy the
#                                       executables, stripped, to DIR (default: cuda-bin/)
#   scripts/cuda-check.sh run [DIR]     on the GPU machine: run them from DIR in one go; logs and a
#                                       summary go to $OUT (default: ./cuda-out)
#   scripts/cuda-check.sh               both, on a machine that has the GPU and the toolchain
#
# What runs: `tests/suite/kernels_moe.rs` and `tests/suite/kernels_kda.rs` (the `kernels_moe::`
# and `kernels_kda::` tests of the suite binary) on `Cuda` (every kernel against the reference path
# on the same device, f32 ≤ 1e-5, half storage ≤ 5e-3 where supported, bit-for-bit repeatability,
# exact QB counts, KDA against the naive recurrence on the design §4.5 grid, the chunked KDA
# backward against the reference autodiff, prefill then decode,
# and a check that the kernel path ran), and the CUDA groups of the `moe` and `kda` criterion
# benches (kernel vs reference path in the same run; KDA also at H = 64, K = V = 128, T = 16384). Exit status: non-zero if any test failed.
set -euo pipefail
cd "$(dirname "$0")/.."

mode="${1:-all}"
dir="${2:-cuda-bin}"
out="${OUT:-cuda-out}"

build() {
    mkdir -p "$dir"
    # The kernels test on CUDA (+ autodiff), and the bench with its CUDA group.
    local tests benches
    tests=$(cargo test --features cuda,autodiff --test suite --no-run --message-format=json \
        | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]=="suite": print(m["executable"])')
    cp "$tests" "$dir/suite"
    for bench in moe kda; do
        benches=$(cargo bench --features cuda --bench "$bench" --no-run --message-format=json \
            | BENCH="$bench" python3 -c 'import json,os,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]==os.environ["BENCH"]: print(m["executable"])')
        cp "$benches" "$dir/bench_$bench"
    done
    strip "$dir/suite" "$dir/bench_moe" "$dir/bench_kda" 2>/dev/null || true
    ls -la "$dir"
}

run() {
    mkdir -p "$out"
    nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
    local status=0
    # One test thread: the tests share one device; the output names which dtypes were covered.
    "$dir/suite" kernels_moe:: kernels_kda:: --test-threads=1 --nocapture >"$out/kernels.log" 2>&1 || status=$?
    echo "kernel tests exit status: $status" >"$out/summary.txt"
    grep -E "^test |test result|covered" "$out/kernels.log" >>"$out/summary.txt" || true
    # Criterion: short measurement, only the CUDA groups.
    for bench in moe kda; do
        "$dir/bench_$bench" --bench cuda --warm-up-time 1 --measurement-time 5 \
            >"$out/bench_$bench.log" 2>&1 || echo "bench $bench exit status: $?" >>"$out/summary.txt"
        grep -E "cuda|time:" "$out/bench_$bench.log" >>"$out/summary.txt" || true
    done
    cat "$out/summary.txt"
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
