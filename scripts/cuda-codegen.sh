#!/usr/bin/env bash
# Every CubeCL kernel, in each configuration kimi-burn launches on CUDA, translated to CUDA C++
# and compiled by NVRTC to machine code for the A100 (sm_80) and the H100/H200 (sm_90a). No GPU
# needed. It fails on a kernel that does not compile, computes in f64, or whose cube needs more
# registers or shared memory than a multiprocessor has, and unless the tensor-core grouped
# matmuls, and only they, have tensor-core instructions in their PTX. It prints each kernel's
# registers, spills and shared memory (kernels/tests/cuda_codegen.rs).
#
#   scripts/cuda-codegen.sh [extra cargo test arguments]
#
# Needs:
# - a CUDA include folder with `crt/mma.h` (a CUDA toolkit's; the `nvidia-cuda-runtime` wheel
#   alone lacks `crt/`): `$CUDA_PATH/include`, CUDA_PATH defaulting to /usr/local/cuda;
# - NVRTC (`libnvrtc.so.*`, CUDA 12 or 13): in NVRTC_LIB_DIR if set, else `$CUDA_PATH/lib64` or
#   `$CUDA_PATH/lib`, else wherever the dynamic loader finds it;
# - a Vulkan driver (lavapipe will do: `scripts/test.sh` installs it). The kernel definitions come
#   from a wgpu client; nothing is launched.
#
# Environment: KIMI_CUDA_ARCHS (comma-separated; default sm_80,sm_90a; also sm_86, sm_89,
# sm_100a, sm_120), KIMI_CUDA_DUMP=DIR (write every kernel's CUDA source there).
set -euo pipefail
cd "$(dirname "$0")/.."

export CUDA_PATH="${CUDA_PATH:-/usr/local/cuda}"
if [ ! -f "$CUDA_PATH/include/crt/mma.h" ]; then
    echo "cuda-codegen: no CUDA headers at $CUDA_PATH/include (crt/mma.h is missing)." >&2
    echo "Set CUDA_PATH to a CUDA toolkit (the folder holding include/)." >&2
    exit 1
fi

lib="${NVRTC_LIB_DIR:-}"
if [ -z "$lib" ]; then
    for candidate in "$CUDA_PATH/lib64" "$CUDA_PATH/lib"; do
        if compgen -G "$candidate/libnvrtc.so*" >/dev/null; then
            lib="$candidate"
            break
        fi
    done
fi
if [ -n "$lib" ]; then
    export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

cargo test -p kimi-burn-kernels --features cuda-codegen --test cuda_codegen "$@" -- --nocapture
