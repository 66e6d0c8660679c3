#!/usr/bin/env bash
# CUDA verification of every CubeCL kernel and the CUDA benchmarks: build here, run on a GPU machine.
#
#   scripts/cuda-check.sh build [DIR]   compile the CUDA test, bench and example binaries (no GPU
#                                       needed: cudarc loads the driver and NVRTC at run time) and
#                                       copy them, stripped and xz-compressed, to DIR (default:
#                                       cuda-bin/)
#   scripts/cuda-check.sh run [DIR] [PART]
#                                       on the GPU machine: run them from DIR; the summary
#                                       (summary-PART.txt, written as the run goes) and the logs
#                                       (logs-PART.tar.gz) go to $OUT (default: ./cuda-out). PART:
#                                       `tests` (about 5 minutes on an H200), `bench` (every bench
#                                       group below, most wanted first), `all` (both), or a comma-
#                                       separated list of groups: `moe` (the MoE bench and its
#                                       kernels' shares), `train` (train_tiny plain and under fusion,
#                                       and one step's kernels), `kda`, `attention`, `loss`
#   Time: the whole `run` keeps within BUDGET_S seconds (default 540, for a command limited to
#   600): every step's timeout is cut to what is left, a step that no longer fits is skipped (the
#   summary says which), and the logs are packed in any case. Rerun the skipped groups by name.
#   scripts/cuda-check.sh               both, on a machine that has the GPU and the toolchain
#
# Before spending GPU time: `scripts/cuda-codegen.sh` compiles every kernel configuration for
# sm_80 and sm_90a with NVRTC on any machine with a CUDA toolkit, no GPU needed.
#
# What runs, all on `Cuda` (a build with `cuda` and without `wgpu` runs the suite's GPU tests on
# CUDA: `tests/common` makes `Gpu` the CUDA backend there):
# - first the tensor-core checks of the grouped matmuls (`kernels_moe::dispatch::half_storage_*`
#   for f16/bf16, `kernels_moe::dispatch::tensor_core_paths_match_reference` for TF32),
#   then the suite's kernel tests: `kernels_moe::` and `kernels_kda::` (every MoE and KDA kernel
#   against the reference path on the same device, f32 ≤ 1e-5 — design §0's f16 tolerance where
#   Burn's own matmul, TF32 on CUDA, ran on one side — f16 and bf16 storage, bit-for-bit
#   repeatability, exact QB counts, KDA against the naive recurrence on the design §4.5 grid, the
#   chunked backward against the reference autodiff, prefill then decode, the kernel path checked),
#   the attention, RMSNorm and Attention-Residuals kernels (`::kernel::`), MXFP quantisation, and
#   every generic check of the suite that also runs on wgpu (`::wgpu`, whole-model logits and
#   gradients against ndarray on both paths);
# - the CUDA groups of the `moe` bench (kernel vs reference path; the layer forward against the sum
#   of its matmuls at a data-centre shape) and of the `kda` bench (also H = 64, K = V = 128,
#   T = 16384) and of the `attention` bench (MLA's causal attention, kernels against the plain form
#   at the tiny model's heads and at d_qk = 192, d_v = 128 up to 4096 tokens) and of the `loss`
#   bench (the cross-entropy kernels against the tensor ops, up to 4096 rows of Kimi's 163 840
#   logits), built in the dev profile (dependencies at opt-level 3, the crate at 1: the time
#   is the device's);
# - each kernel's share of the KDA forward and forward + backward at the target shape, of the
#   MoE layer forward with the tensor cores on and off, and of MLA's attention forward + backward
#   at 4096 tokens (CubeCL's profiler on short bench runs);
# - `train_tiny --backend cuda`: tokens/s of the tiny model's training step (also under Burn's
#   fusion backend, `--backend cuda-fusion`), and a CubeCL profile of 2 and of 6 steps (the
#   difference over 4 is one step's kernels).
# Exit status: non-zero if any test failed.
set -euo pipefail
cd "$(dirname "$0")/.."

mode="${1:-all}"
dir="${2:-cuda-bin}"
part="${3:-all}"
out="${OUT:-cuda-out}"
# The bench groups of `run`, most wanted first; `groups`, `deadline` and `summary` are set there.
bench_groups=moe,train,kda,attention,loss
groups=""
deadline=0
summary=/dev/null
features=cuda,autodiff,shared-instances
# cudarc picks its CUDA API version from `nvcc` at build time, or the newest it knows (13.4) where
# there is none. Binaries built for a newer API than the GPU machine's driver may ask it for entry
# points it lacks, so pin the version to the driver's (CUDA 13.0 for driver 580) unless set.
export CUDARC_CUDA_VERSION="${CUDARC_CUDA_VERSION:-13000}"

# The executable of cargo target `$1` from cargo's JSON messages on stdin.
executable() {
    TARGET="$1" python3 -c 'import json,os,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]==os.environ["TARGET"]: print(m["executable"])'
}

build() {
    mkdir -p "$dir"
    # One feature set and one profile for everything, so the library compiles once. With rustc's
    # local ThinLTO back on (Cargo.toml switches it off for the dev profile to shorten the test
    # build; the code then runs about 15% slower), as when BENCHMARKS.md's CUDA numbers were taken.
    export CARGO_PROFILE_DEV_LTO=false
    cp "$(cargo test --features "$features" --test suite --no-run --message-format=json | executable suite)" "$dir/suite"
    for bench in moe kda attention loss; do
        cp "$(cargo bench --profile dev --features "$features" --bench "$bench" --no-run --message-format=json \
            | executable "$bench")" "$dir/bench_$bench"
    done
    cp "$(cargo build --features "$features" --example train_tiny --message-format=json | executable train_tiny)" \
        "$dir/train_tiny"
    local bins=("$dir/suite" "$dir/bench_moe" "$dir/bench_kda" "$dir/bench_attention" "$dir/bench_loss" "$dir/train_tiny")
    strip "${bins[@]}"
    xz -T0 -6 -f "${bins[@]}"
    ls -la "$dir"
    # What a device call carries is at most 64 MiB with the working tree (a few MiB).
    local size
    size=$(du -cb "$dir"/*.xz | tail -n 1 | cut -f 1)
    echo "compressed binaries: $((size / 1048576)) MiB"
    if [ "$size" -gt $((58 * 1048576)) ]; then
        echo "cuda-check: the binaries take $((size / 1048576)) MiB, over the 58 MiB that leave room for the tree" >&2
        return 1
    fi
}

# cudarc opens NVRTC (`libnvrtc.so.13`) at run time and CubeCL compiles its kernels with CUDA's
# headers: where the loader does not find the library, look for it in the usual places (the CUDA
# toolkit, NVIDIA's Python wheels) and add its folder to LD_LIBRARY_PATH; CUDA_PATH names the toolkit.
cuda_libraries() {
    local major="${CUDARC_CUDA_VERSION:0:2}" d
    # Left to CubeCL's own search (/usr/local/cuda, /opt/cuda, beside nvcc) unless set or present.
    if [ -z "${CUDA_PATH:-}" ] && [ -d /usr/local/cuda ]; then
        export CUDA_PATH=/usr/local/cuda
    fi
    if ! ldconfig -p | grep -q "libnvrtc.so.$major"; then
        for d in $(find "${CUDA_PATH:-/usr/local/cuda}/" /usr/local /opt /usr/lib -name "libnvrtc.so.$major*" -printf '%h\n' 2>/dev/null | sort -u); do
            LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        done
        export LD_LIBRARY_PATH
    fi
    echo "CUDA_PATH=${CUDA_PATH:-} LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
}

# The failing tests' messages as they happen (`--nocapture`), so that a run stopped by its timeout
# still says why; and one training step's kernel times from the two profiles: the launches of the
# 6-step run past those of the 2-step run, over 4, without first launches (their time includes
# NVRTC's compilation).
step_profile() {
    python3 - "$1" "$2" <<'PY'
import collections, re, sys
def launches(path):
    unit = {"ms": 1e-3, "µs": 1e-6, "ns": 1e-9, "s": 1.0}
    out = []
    for line in open(path, errors="replace"):
        m = re.match(r"\| ([0-9.]+)(ms|µs|ns|s)\s*\| (\S+)", line)
        if m:
            out.append((float(m.group(1)) * unit[m.group(2)], m.group(3)))
    return out
short, long = launches(sys.argv[1]), launches(sys.argv[2])
seen = {name for _, name in short}
time, count, compiled = collections.defaultdict(float), collections.Counter(), 0.0
for t, name in long[len(short):]:
    if name not in seen or t > 0.005:
        seen.add(name)
        compiled += t
        continue
    time[name] += t
    count[name] += 1
print(f"one step: {sum(time.values()) / 4 * 1e3:.1f} ms of kernels in {sum(count.values()) / 4:.0f} launches"
      f" (left out: {compiled:.2f} s of first or > 5 ms launches)")
for name in sorted(time, key=time.get, reverse=True)[:25]:
    print(f"{time[name] / 4 * 1e3:9.2f} ms {count[name] / 4:6.0f}  {name}")
PY
}

# Every kernel's share of a CubeCL profile log (`CUBECL_DEBUG_OPTION=profile`): time, launches
# and share per kernel name over all launches but each name's first (its time includes NVRTC's
# compilation).
kernel_shares() {
    python3 - "$1" <<'PY'
import collections, re, sys
unit = {"ms": 1e-3, "µs": 1e-6, "ns": 1e-9, "s": 1.0}
time, count, seen = collections.defaultdict(float), collections.Counter(), set()
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"\| ([0-9.]+)(ms|µs|ns|s)\s*\| (\S+)", line)
    if not m:
        continue
    name = m.group(3)
    if name not in seen:
        seen.add(name)
        continue
    time[name] += float(m.group(1)) * unit[m.group(2)]
    count[name] += 1
total = sum(time.values()) or 1.0
print(f"{total * 1e3:.1f} ms of kernels in {sum(count.values())} launches (first launches left out)")
for name in sorted(time, key=time.get, reverse=True)[:20]:
    print(f"{100 * time[name] / total:6.1f}% {time[name] * 1e3:10.2f} ms {count[name]:6d}  {name}")
PY
}

# profile_bench LABEL BENCH FILTER: a short criterion run of the benches of `bench_BENCH` that
# FILTER selects, profiled; the kernels' shares go to the summary.
profile_bench() {
    local log="$out/profile_$1.log" limit
    limit=$(within 45 "profile $1") || return 0
    CUBECL_DEBUG_LOG="$log" CUBECL_DEBUG_OPTION=profile timeout "$limit" \
        "$bin/bench_$2" --bench --profile-time 2 "$3" >/dev/null 2>&1 ||
        echo "profile $1 exit status: $?" >>"$summary"
    echo "kernel shares, $1 ($3):" >>"$summary"
    if [ -s "$log" ]; then
        kernel_shares "$log" >>"$summary" 2>&1 || true
    else
        echo "no profile written" >>"$summary"
    fi
}

# within SECONDS WHAT: SECONDS, or less where the run's budget (BUDGET_S) has less left, keeping
# 20 s for packing the logs; fails (and says so in the summary) when under 10 s would be left.
within() {
    local left=$((deadline - SECONDS - 20))
    if [ "$left" -lt 10 ]; then
        echo "skipped (budget spent): $2" >>"$summary"
        return 1
    fi
    if [ "$left" -lt "$1" ]; then
        echo "$left"
    else
        echo "$1"
    fi
}

# wants GROUP: whether this run's PART includes GROUP.
wants() {
    case ",$groups," in
    *",$1,"*) return 0 ;;
    *) return 1 ;;
    esac
}

# split_run JOBS SECONDS LOG ARGS…: the suite's tests that ARGS select (filters, `--skip`), shared
# round-robin among JOBS processes of one test thread each, all started at once, each stopped after
# SECONDS; their output appended to LOG one process after the other. Non-zero if any process was.
split_run() {
    local jobs=$1 limit log=$3
    limit=$(within "$2" "tests: $*") || return 1
    shift 3
    local list
    list=$(mktemp -d)
    "$bin/suite" --list "$@" 2>/dev/null | sed -n 's/: test$//p' >"$list/all"
    if [ ! -s "$list/all" ]; then
        # No test selected is a failure, not a pass: a GPU check must not vanish silently.
        echo "split_run: no test matches $*" >>"$log"
        rm -rf "$list"
        return 1
    fi
    split -n "r/$jobs" "$list/all" "$list/part."
    local pids=() part rc=0
    for part in "$list"/part.*; do
        [ -s "$part" ] || continue
        # shellcheck disable=SC2046 # one argument per test name (names have no spaces)
        timeout "$limit" "$bin/suite" --exact $(cat "$part") --test-threads=1 --nocapture \
            >"$part.log" 2>&1 &
        pids+=($!)
    done
    for part in "${pids[@]}"; do
        wait "$part" || rc=$?
    done
    cat "$list"/part.*.log >>"$log" 2>/dev/null || true
    rm -rf "$list"
    return "$rc"
}

run() {
    # The summary goes to $OUT/summary-PART.txt as the run goes, so that a run stopped from
    # outside still brings it back; the logs are written beside the compilation cache and packed
    # into $OUT/logs-PART.tar.gz at the end (at most 8 files come back from $OUT).
    local final bin work status=0 tag g
    deadline=$((SECONDS + ${BUDGET_S:-540}))
    case "$part" in
    all) groups="tests,$bench_groups" ;;
    bench) groups=$bench_groups ;;
    *) groups=$part ;;
    esac
    for g in ${groups//,/ }; do
        case ",tests,$bench_groups," in
        *",$g,"*) ;;
        *)
            echo "cuda-check: unknown part '$g': tests, bench, all, or groups among $bench_groups" >&2
            return 2
            ;;
        esac
    done
    tag=${part//,/_}
    final=$(realpath -m "$out")
    mkdir -p "$final"
    summary="$final/summary-$tag.txt"
    : >"$summary"
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
    # NVRTC compiles every kernel variant once per process, about 0.1 s each (about 30 s before
    # train_tiny's first step): keep compiled kernels and autotune results on disk, in one folder
    # for every call on this machine, so the processes after the first (also those of a later
    # `run … bench`) reuse them.
    work="${TMPDIR:-/tmp}/kimi-burn-cuda-check"
    out="$work/logs-$tag"
    rm -rf "$out"
    mkdir -p "$out"
    nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
    cuda_libraries >>"$out/nvidia-smi.txt"
    printf '[compilation]\ncache = "local"\n\n[autotune]\ncache = "local"\n' >"$work/cubecl.toml"
    cd "$work"
    if wants tests; then
        # First the checks that decide a default (the tensor-core path of the grouped matmuls,
        # `tensor_cores_enabled`), so that they run whatever happens to the rest; then the rest:
        # about 5 minutes on an H200 as 12 threads of one process, most of it NVRTC and Burn's
        # matmul autotune (as 8 processes, which share the compilation cache folder, not yet timed).
        # Every process runs its tests one at a time: Burn 0.21's autodiff sweeps every graph of the
        # process at the end of each backward and can free steps of a graph another thread is still
        # building (tracel-ai/burn#5573), so a gradient test beside others in one process can lose
        # a gradient for that alone (seen on lavapipe: `kernels_kda::layer::training_gradients_…`
        # failed in two of four runs of this list at 12 threads, never at one). Processes in
        # parallel instead.
        local first=(kernels_moe::dispatch::half_storage kernels_moe::dispatch::tensor_core_paths)
        : >"$out/kernels.log"
        split_run 3 150 "$out/kernels.log" "${first[@]}" || status=$?
        split_run 8 420 "$out/kernels.log" kernels_moe:: kernels_kda:: ::kernel:: ::wgpu \
            on_wgpu_matches half_inputs_on_wgpu the_kernel_matches_the_host_loop adamw_kernel \
            scaled_sum_kernel the_optimiser_on_the_gpu gpu_sigmoid_kernels \
            --skip "${first[0]}" --skip "${first[1]}" ||
            status=$?
        echo "kernel tests exit status: $status" >>"$summary"
        grep -E "^test .*(FAILED|ignored)|panicked|exceeds|^assertion|test result" "$out/kernels.log" >>"$summary" || true
        # From the `test result` lines: with --nocapture a test's own output can split its `ok` line.
        awk '/^test result:/ { for (i = 1; i < NF; i++) if ($(i + 1) ~ /^passed;?$/) n += $i }
            END { print n + 0 " tests passed" }' "$out/kernels.log" >>"$summary"
    fi
    # The bench groups, most wanted first (criterion: short measurements, only the CUDA groups).
    if wants moe; then
        # The layer forward against the sum of its matmuls (#19: at most 1.3×), then each kernel's
        # share of the layer forward with the tensor cores on and off (CubeCL's profile: every
        # launch synced and timed, on a short criterion run).
        bench_group moe 90
        profile_bench moe_tensor_cores moe layer_forward_tensor_cores
        profile_bench moe_scalar moe 'layer_forward$'
    fi
    if wants train; then
        # The tiny model's training step, plain and under Burn's fusion backend (what `Cuda` is in
        # a project with Burn's default features: the plain step was bound by its 2864 launches);
        # then one step's kernels from the profile (6 minus 2 steps).
        local tt=(--backend cuda --checkpoint-every 0 --short-fraction 0 --test-sequences 16)
        train_tiny train_tiny 60 "${tt[@]}" --steps 40 --out "$out/tt40"
        train_tiny train_tiny_fusion 60 --backend cuda-fusion "${tt[@]:2}" --steps 40 --out "$out/tt40f"
        local steps limit
        for steps in 2 6; do
            limit=$(within 60 "train_tiny profile of $steps steps") || continue
            CUBECL_DEBUG_LOG="$out/profile_$steps.log" CUBECL_DEBUG_OPTION=profile timeout "$limit" \
                "$bin/train_tiny" "${tt[@]}" --steps "$steps" --out "$out/tt$steps" >/dev/null 2>&1 ||
                echo "profile $steps exit status: $?" >>"$summary"
        done
        if [ -s "$out/profile_2.log" ] && [ -s "$out/profile_6.log" ]; then
            step_profile "$out/profile_2.log" "$out/profile_6.log" >>"$summary" 2>&1 || true
        fi
    fi
    if wants kda; then
        # Where the time goes at the data-centre shapes: each kernel's share of the KDA forward and
        # forward + backward at H = 64, K = V = 128, T = 16384.
        bench_group kda 150
        profile_bench kda_fwd kda chunk_kda_fwd_h64_k128_state/cuda-kernel
        profile_bench kda_fwd_bwd kda chunk_kda_fwd_bwd_h64_k128_state/cuda-kernel
    fi
    if wants attention; then
        bench_group attention 75
        profile_bench attention attention mla_1x16x4096_192x128/forward_backward/kernel
    fi
    if wants loss; then
        bench_group loss 75
    fi
    cd - >/dev/null
    (cd "$out" && tar czf "$final/logs-$tag.tar.gz" .)
    cat "$summary"
    return "$status"
}

# bench_group BENCH SECONDS: the CUDA group of `bench_BENCH`, its times to the summary.
bench_group() {
    local limit
    limit=$(within "$2" "bench $1") || return 0
    timeout "$limit" "$bin/bench_$1" --bench cuda --warm-up-time 1 --measurement-time 2 \
        >"$out/bench_$1.log" 2>&1 || echo "bench $1 exit status: $?" >>"$summary"
    grep -E "^Benchmarking .*: Analyzing|time:" "$out/bench_$1.log" |
        sed 's/^Benchmarking \(.*\): Analyzing/\1/' >>"$summary" || true
}

# train_tiny LOG SECONDS ARGS…: one train_tiny run, the end of its output to the summary.
train_tiny() {
    local log=$1 limit
    limit=$(within "$2" "$log") || return 0
    shift 2
    timeout "$limit" "$bin/train_tiny" "$@" >"$out/$log.log" 2>&1 ||
        echo "$log exit status: $?" >>"$summary"
    tail -n 5 "$out/$log.log" >>"$summary" || true
}

case "$mode" in
build) build ;;
run) run ;;
all) build && run ;;
*)
    echo "usage: $0 [build|run|all] [DIR] [tests|bench|all]" >&2
    exit 2
    ;;
esac
