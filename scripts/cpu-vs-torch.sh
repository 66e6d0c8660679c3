#!/usr/bin/env bash
# The crate's CPU benches against the PyTorch baselines, in one run on one machine, as a ratio table.
#
#     scripts/cpu-vs-torch.sh [path/to/torch_blocks.py]
#
# Runs, back to back: a plain f32 matmul rate (the machine's limit, `benches/matmul.rs`), the
# KDA and MoE benches on `NdArray<f32>` (criterion), then `torch_blocks.py kda` and `... moe`
# (PyTorch on the CPU, same thread count, eager and `torch.compile`), and prints
# `kimi-burn / PyTorch` per block against the faster PyTorch variant, under a line with the commit
# and the CPU (model, L2 and L3 caches). Needs Python 3 with `torch`,
# `numpy` and `einops` (benchmark-only: the crate's build and tests never need Python). The
# baseline script is looked for in `$TORCH_BLOCKS`, the argument, or `../shared/baselines/`.
#
# Keep the machine otherwise idle: on a small VM a busy neighbour moves both sides by 1.5x and
# more. `THREADS` (default: all cores) is given to PyTorch; the crate uses rayon's pool, one thread
# per core.
set -euo pipefail
cd "$(dirname "$0")/.."

torch_blocks="${1:-${TORCH_BLOCKS:-../shared/baselines/torch_blocks.py}}"
if [ ! -f "$torch_blocks" ]; then
    echo "torch_blocks.py not found (give its path as the argument or in TORCH_BLOCKS)" >&2
    exit 1
fi
threads="${THREADS:-$(nproc)}"
out="${OUT_DIR:-target/cpu-vs-torch}"
mkdir -p "$out"
# Criterion keeps old estimates: remove them so that a bench that did not run shows as missing.
rm -rf target/criterion/{matmul_rate,moe_forward_products,chunk_kda_fwd_ndarray,chunk_kda_fwd_bwd_ndarray,fused_recurrent_kda_decode_token_ndarray,fused_recurrent_kda_decode_token_b16_ndarray,latent_moe_n64_k8_d512_l256_4096tok}

cargo bench --bench matmul --bench kda --bench moe --no-run
criterion=(--warm-up-time 2 --measurement-time 6)
cargo bench --bench matmul -- "${criterion[@]}" | tee "$out/matmul.txt"
cargo bench --bench kda -- "${criterion[@]}" '^(chunk_kda_fwd|chunk_kda_fwd_bwd)/ndarray/|^fused_recurrent_kda_decode_token(_b16)?/ndarray$' | tee "$out/kda.txt"
cargo bench --bench moe -- "${criterion[@]}" latent_moe | tee "$out/moe.txt"
python3 "$torch_blocks" kda --threads "$threads" --skip-fla --runs 7 --warmup 2 >"$out/torch_kda.csv" 2>"$out/torch_kda.err"
python3 "$torch_blocks" moe --threads "$threads" --runs 7 --warmup 2 >"$out/torch_moe.csv" 2>"$out/torch_moe.err"
# The machine beside the numbers: this script has run on 2-core VMs with a 32 MiB and a 480 MiB
# last-level cache, which moves the KDA ratios per 4x T and the MoE forward against its matmul time.
{
    echo "commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- || echo ' (with uncommitted changes)'), $(nproc) threads"
    if command -v lscpu >/dev/null; then
        lscpu | grep -E '^(Model name|L2 cache|L3 cache):' | sed 's/  */ /g' || true
    fi
    echo
} | tee "$out/table.md"
python3 scripts/cpu_vs_torch_table.py target/criterion "$out/torch_kda.csv" "$out/torch_moe.csv" | tee -a "$out/table.md"
