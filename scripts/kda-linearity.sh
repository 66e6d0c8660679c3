#!/usr/bin/env bash
# How KDA's time on the CPU grows with T: the `kda` bench's forward and forward + backward groups
# on `NdArray<f32>` at T = 512, 2048 and 8192, run ROUNDS times (default 8), and the time per 4× T
# of each round and of the medians: the plain groups (one set of inputs, reused from call to call)
# and the `…_cold` groups (inputs out of every cache).
#
#     scripts/kda-linearity.sh [ROUNDS]
#
# One criterion run of each size is not enough on a small shared VM: the ratio of one run lands
# anywhere between about 3.9 and 5.3 there. The medians over several rounds are steadier, and the
# per-round range shows how far to trust them. Every round measures all sizes back to back
# (`--warm-up-time 2 --measurement-time 3`), so a neighbour's load hits the sizes of one round
# alike. Keep the machine otherwise idle.
#
# The plain groups' ratio from 2048 to 8192 also compares two cache regimes: one call's inputs and
# output (10 MiB at 2048) stay in a 32 MiB last-level cache between calls, those of 8192 (40 MiB)
# do not. The cold groups read every call's inputs from main memory at all three lengths, as a
# training step does, so their ratio is the time per token's alone.
#
# Last, `benches/kda_cpu_time.rs` with the same number of rounds: the time per token split into
# the process's own CPU time (user), the kernel's on its behalf (system) and page faults, which
# tells the op's growth with T from the kernel zeroing pages that the allocator handed back.
set -euo pipefail
cd "$(dirname "$0")/.."

rounds="${1:-8}"
out="${OUT_DIR:-target/kda-linearity}"
mkdir -p "$out"
rm -f "$out"/round-*.json
cargo bench --bench kda --bench kda_cpu_time --no-run
for r in $(seq 1 "$rounds"); do
    echo "round $r of $rounds" >&2
    cargo bench --bench kda -- --warm-up-time 2 --measurement-time 3 \
        '^chunk_kda_fwd(_bwd)?(_cold)?/ndarray/(512|2048|8192)$' >"$out/round-$r.txt" 2>&1
    python3 - "$r" "$out" <<'EOF'
import json, sys

r, out = sys.argv[1], sys.argv[2]
times = {}
for group in ("chunk_kda_fwd_ndarray", "chunk_kda_fwd_bwd_ndarray", "chunk_kda_fwd_cold_ndarray",
              "chunk_kda_fwd_bwd_cold_ndarray"):
    for t in (512, 2048, 8192):
        path = f"target/criterion/{group}/{t}/new/estimates.json"
        times[f"{group}/{t}"] = json.load(open(path))["median"]["point_estimate"] / 1e6
json.dump(times, open(f"{out}/round-{r}.json", "w"))
EOF
done

python3 - "$out" "$rounds" <<'EOF'
import json, statistics, sys

out, rounds = sys.argv[1], int(sys.argv[2])
runs = [json.load(open(f"{out}/round-{r}.json")) for r in range(1, rounds + 1)]
print("| bench | T = 512 | T = 2048 | T = 8192 | 512 → 2048 | 2048 → 8192 |")
print("|---|---|---|---|---|---|")
for group, name in (("chunk_kda_fwd_ndarray", "forward"),
                    ("chunk_kda_fwd_bwd_ndarray", "forward + backward"),
                    ("chunk_kda_fwd_cold_ndarray", "forward, cold inputs"),
                    ("chunk_kda_fwd_bwd_cold_ndarray", "forward + backward, cold inputs")):
    ms = [statistics.median(x[f"{group}/{t}"] for x in runs) for t in (512, 2048, 8192)]
    per_round = [(x[f"{group}/2048"] / x[f"{group}/512"], x[f"{group}/8192"] / x[f"{group}/2048"])
                 for x in runs]
    print(f"| {name}, median of {rounds} rounds (ms) | {ms[0]:.2f} | {ms[1]:.2f} | {ms[2]:.2f} "
          f"| {ms[1] / ms[0]:.2f}× | {ms[2] / ms[1]:.2f}× |")
    print(f"| {name}, per round: median (range) | | | "
          f"| {statistics.median(a for a, _ in per_round):.2f}× "
          f"({min(a for a, _ in per_round):.2f}–{max(a for a, _ in per_round):.2f}) "
          f"| {statistics.median(b for _, b in per_round):.2f}× "
          f"({min(b for _, b in per_round):.2f}–{max(b for _, b in per_round):.2f}) |")
EOF

echo
cargo bench --bench kda_cpu_time -- --rounds "$rounds" 2>/dev/null | tee "$out/cpu-time.txt"
