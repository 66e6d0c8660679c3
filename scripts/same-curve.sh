#!/usr/bin/env bash
# train_tiny at two commits on this machine: the loss of every step side by side, and the training
# throughput of each, measured in alternation in one run.
#
#     scripts/same-curve.sh OLD [NEW] [STEPS]        NEW: HEAD, STEPS: 50
#
# Builds `examples/train_tiny` at both commits (one git worktree under target/same-curve, checked
# out at each in turn and removed at the end, built into target/same-curve/target, whose
# dependencies build on the first run only), runs each
# with the same seed and data, `--steps STEPS --checkpoint-every 0`, `REPEATS` times in alternation
# (default 2), and prints per step both losses and their absolute and relative difference, then
# the median tokens/s of steps 5 and on of every run and the ratio NEW / OLD. A second run of the same binary must give
# the same losses bit for bit (the CPU path is deterministic); the script says so if not.
#
# The two curves part wherever a change of summation order moves a token at a near-tie of two
# experts' scores to the other expert; after that the losses differ in the fourth digit. As the
# yardstick for that, OLD also runs once with the learning rate changed in its eighth digit
# (`CONTROL_LR`, default 0.010000001 against train_tiny's 0.01): the same code, one rounding
# moved, and the script prints how far that curve parts from OLD's next to how far NEW's does.
#
# `SEEDS` (default `0`) repeats all of that for several seeds (`--seed`: data and
# initialisation), each with its own control, and ends with one line per seed: where NEW's curve
# and the control's part from OLD's, how many of their steps differ by more than 1e-4, the largest
# difference, and the mean signed difference of the last ten losses (a drift of NEW's curve one way
# would show there on every seed; a parting after a near-tie goes either way). The throughput is
# the median over every run of every seed.
# Keep the machine otherwise idle for the throughput.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -lt 1 ]; then
    echo "usage: scripts/same-curve.sh OLD [NEW] [STEPS]" >&2
    exit 2
fi
old="$(git rev-parse --short "$1")"
new="$(git rev-parse --short "${2:-HEAD}")"
steps="${3:-50}"
repeats="${REPEATS:-2}"
seeds="${SEEDS:-0}"
work="target/same-curve"
# A target folder of its own, for the same reason: a build of the worktree into this checkout's
# target folder would leave the next build here looking up to date, and the other way round.
target="$(pwd)/$work/target"
mkdir -p "$work"

# One worktree for both commits, checked out in turn: cargo keeps one record of a workspace member
# whatever folder it is built from and judges it up to date by its source files' times, so a build
# in a second worktree could reuse the first one's binary (it did: two "commits" gave the same
# losses to the last digit). A checkout gives every file it changes a new time.
tree="$work/tree"
build() {
    local rev="$1"
    if [ ! -d "$tree" ]; then
        git worktree add --detach "$tree" "$rev" >/dev/null
    else
        git -C "$tree" checkout --detach --quiet "$rev"
    fi
    (cd "$tree" && CARGO_TARGET_DIR="$target" cargo build --release --example train_tiny)
    cp "$target/release/examples/train_tiny" "$work/train_tiny-$rev"
}
# The worktree goes when the script ends (the builds stay in the target folder).
trap '[ -d "$tree" ] && git worktree remove --force "$tree"' EXIT
build "$old"
build "$new"
if [ "$old" != "$new" ] && cmp -s "$work/train_tiny-$old" "$work/train_tiny-$new"; then
    echo "note: the binaries of $old and $new are identical" >&2
fi

for seed in $seeds; do
    for r in $(seq 1 "$repeats"); do
        for rev in "$old" "$new"; do
            echo "seed $seed, run $r: $rev" >&2
            "$work/train_tiny-$rev" --steps "$steps" --checkpoint-every 0 --seed "$seed" \
                --out "$work/run-$rev-s$seed-$r" >"$work/run-$rev-s$seed-$r.log" 2>&1 ||
                { echo "train_tiny at $rev failed: see $work/run-$rev-s$seed-$r.log" >&2; exit 1; }
        done
    done
    echo "seed $seed, control: $old --lr ${CONTROL_LR:-0.010000001}" >&2
    "$work/train_tiny-$old" --steps "$steps" --checkpoint-every 0 --seed "$seed" \
        --lr "${CONTROL_LR:-0.010000001}" --out "$work/run-$old-s$seed-control" \
        >"$work/run-$old-s$seed-control.log" 2>&1 ||
        { echo "the control run failed: see $work/run-$old-s$seed-control.log" >&2; exit 1; }
done

python3 - "$work" "$old" "$new" "$repeats" $seeds <<'EOF'
import csv, statistics, sys

work, old, new, repeats = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
seeds = sys.argv[5:]


def rows(rev, seed, r):
    with open(f"{work}/run-{rev}-s{seed}-{r}/metrics.csv") as f:
        return list(csv.DictReader(f))


def losses(x):
    return [float(row["loss"]) for row in x]


def parting(x, y):
    """The first step where y's loss differs from x's by more than 1e-5 ("never"), the steps
    over 1e-4, the largest difference, and the mean signed difference y − x of the last ten."""
    d = [b - a for a, b in zip(losses(x), losses(y))]
    first = next((str(i) for i, v in enumerate(d) if abs(v) > 1e-5), "never")
    return f"{first}, {sum(abs(v) > 1e-4 for v in d)}, {max(map(abs, d)):.1e}, {statistics.mean(d[-10:]):+.1e}"


def speed(x):
    return statistics.median(float(row["tokens_per_s"]) for row in x[5:])


speeds = {old: [], new: []}
summary = []
for seed in seeds:
    runs = {rev: [rows(rev, seed, r) for r in range(1, repeats + 1)] for rev in (old, new)}
    for rev, rs in runs.items():
        speeds[rev] += [speed(x) for x in rs]
        for r, x in enumerate(rs[1:], 2):
            if losses(x) != losses(rs[0]):
                print(f"{rev}, seed {seed}: run {r} gave other losses than run 1 (not deterministic)")
    a, b = runs[old][0], runs[new][0]
    print(f"seed {seed}:")
    print()
    print(f"| step | loss {old} | loss {new} | abs. difference | rel. difference |")
    print("|---|---|---|---|---|")
    over, worst_abs, worst_rel = [], 0.0, 0.0
    for x, y in zip(a, b):
        la, lb = float(x["loss"]), float(y["loss"])
        d = abs(la - lb)
        rel = d / abs(la)
        worst_abs, worst_rel = max(worst_abs, d), max(worst_rel, rel)
        if d > 1e-4:
            over.append(x["step"])
        print(f"| {x['step']} | {la:.6f} | {lb:.6f} | {d:.1e} | {rel:.1e} |")
    print()
    print(f"steps with |difference| > 1e-4: {len(over)} of {len(a)} ({', '.join(over) or 'none'});"
          f" largest {worst_abs:.1e} absolute, {worst_rel:.1e} relative")
    print()
    summary.append((seed, parting(a, b), parting(a, rows(old, seed, "control"))))

print(f"Against {old}'s curve, per seed: the step where the curve parts (over 1e-5), the steps over"
      f" 1e-4 (of {len(a)}), the largest difference, the mean signed difference of the last ten"
      " steps.")
print()
print(f"| seed | {new} | {old} with the control learning rate |")
print("|---|---|---|")
for seed, n, c in summary:
    print(f"| {seed} | {n} | {c} |")
print()
print(f"median tokens/s of steps 5 and on, per run: {old} {', '.join(f'{s:.0f}' for s in speeds[old])};"
      f" {new} {', '.join(f'{s:.0f}' for s in speeds[new])}")
print(f"{new} / {old}: {statistics.median(speeds[new]) / statistics.median(speeds[old]):.2f}x")
EOF
