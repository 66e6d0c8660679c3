#!/usr/bin/env python3
"""Prints the kimi-burn / PyTorch ratio table of scripts/cpu-vs-torch.sh (markdown).

    cpu_vs_torch_table.py <criterion dir> <torch kda csv> <torch moe csv>

Each crate number is the median of its criterion estimate; each PyTorch number the faster of the
eager and compiled (or dispatch) variants of the same block in the CSVs of torch_blocks.py.
"""
import csv
import json
import os
import sys

crit, kda_csv, moe_csv = sys.argv[1:4]


def rust_ms(path):
    """Median of a criterion benchmark in ms (None if it did not run)."""
    f = os.path.join(crit, path, "new", "estimates.json")
    if not os.path.exists(f):
        return None
    return json.load(open(f))["median"]["point_estimate"] / 1e6


def torch_rows(path):
    return list(csv.DictReader(open(path))) if os.path.exists(path) else []


torch = torch_rows(kda_csv) + torch_rows(moe_csv)


def torch_best(block, config_part, suffix):
    """(ms, variant) of the fastest matching PyTorch variant."""
    rows = [r for r in torch if r["block"] == block and config_part in r["config"]
            and r["variant"].endswith(suffix)]
    if not rows:
        return None, None
    best = min(rows, key=lambda r: float(r["median_ms"]))
    return float(best["median_ms"]), best["variant"]


rows = []
for t in (512, 2048, 8192):
    rows.append((f"`chunk_kda` forward, T = {t}", f"chunk_kda_fwd_ndarray/{t}",
                 ("kda", f"-T{t}-", "_fwd"), 0.67))
    rows.append((f"`chunk_kda` forward + backward, T = {t}", f"chunk_kda_fwd_bwd_ndarray/{t}",
                 ("kda", f"-T{t}-", "_fwdbwd"), 0.67))
for b, suffix in ((1, ""), (16, "_b16")):
    rows.append((f"`fused_recurrent_kda` decode step, B = {b}",
                 f"fused_recurrent_kda_decode_token{suffix}_ndarray",
                 ("kda_decode", f"B{b}-", ""), 0.67))
moe = "latent_moe_n64_k8_d512_l256_4096tok"
rows.append(("Stable LatentMoE forward", f"{moe}/forward", ("moe", "latent", "_fwd"), 1.0))
rows.append(("Stable LatentMoE forward + backward", f"{moe}/forward_backward",
             ("moe", "latent", "_fwdbwd"), 1.0))

print("| block (bench) | kimi-burn | PyTorch, best (variant) | kimi-burn / PyTorch | target |")
print("|---|---|---|---|---|")
for name, path, (block, cfg, suffix), target in rows:
    ours = rust_ms(path)
    theirs, variant = torch_best(block, cfg, suffix)
    fmt = lambda ms: "—" if ms is None else (f"{ms * 1e3:.1f} µs" if ms < 1 else f"{ms:.1f} ms")
    ratio = "—" if ours is None or theirs is None else f"{ours / theirs:.2f}"
    print(f"| {name} | {fmt(ours)} | {fmt(theirs)} ({variant or '—'}) | {ratio} | ≤ {target} |")

# Time per 4x T (target: at most 4.4x), the crate's and PyTorch's best variant.
print()
for label, group, suffix in (("forward", "chunk_kda_fwd_ndarray", "_fwd"),
                             ("forward + backward", "chunk_kda_fwd_bwd_ndarray", "_fwdbwd")):
    ours = [rust_ms(f"{group}/{t}") for t in (512, 2048, 8192)]
    theirs = [torch_best("kda", f"-T{t}-", suffix)[0] for t in (512, 2048, 8192)]
    growth = lambda xs: ("—" if None in xs else
                         " then ".join(f"{b / a:.2f}x" for a, b in zip(xs, xs[1:])))
    print(f"KDA {label}, time per 4x T (512 -> 2048 -> 8192): kimi-burn {growth(ours)}, "
          f"PyTorch {growth(theirs)} (target <= 4.4x)")

# The MoE forward against the time of its matrix products at the measured matmul rate.
rates = []
for shape in ("4096x512x512", "4096x256x2048"):
    ms = rust_ms(f"matmul_rate/gemm/{shape}")
    if ms is not None:
        m, k, n = map(int, shape.split("x"))
        rates.append(2 * m * k * n / (ms / 1e3))
if rates:
    rate = max(rates)
    # n 64, k 8, d 512, l 256, m_e 256, one shared expert of 512, 4096 tokens: W_down, the
    # experts' gate, up and down on the 4096 * 8 routed rows, W_up, the shared expert, the router.
    tok, d, l, me, k, shared, n = 4096, 512, 256, 256, 8, 512, 64
    flops = 2 * (tok * d * l + tok * k * 3 * l * me + tok * l * d + 3 * tok * d * shared
                 + tok * d * n)
    floor_ms = flops / rate * 1e3
    fwd = rust_ms(f"{moe}/forward")
    print()
    print(f"f32 matmul rate (gemm, best of {len(rates)} shapes): {rate / 1e9:.0f} GFLOP/s; "
          f"the MoE forward's {flops / 1e9:.2f} GFLOP take {floor_ms:.1f} ms at that rate")
    if fwd is not None:
        print(f"MoE forward / matmul time: {fwd / floor_ms:.2f} (target ≤ 1.25)")
    products = rust_ms("moe_forward_products/gemm")
    if products is not None:
        print(f"the same products at their real shapes (moe_forward_products): {products:.1f} ms, "
              f"{products / floor_ms:.2f} x the matmul time"
              + ("" if fwd is None else f"; the forward takes {fwd / products:.2f} x that"))
