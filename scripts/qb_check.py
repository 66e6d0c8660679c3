#!/usr/bin/env python3
"""The expert-load check of `train_tiny` runs, as BENCHMARKS states it (markdown rows).

    qb_check.py [--from STEP] [--bound B] runs/<dir>/metrics.csv ...

For every run: the steps where training accuracy first reaches 0.9 and 0.99, then per MoE layer
the max violation of each step's batch (the whole step's pooled batch with --accum / --devices)
from step STEP on (default 180, the curriculum switch of the default run) as mean / 95th
percentile / max / steps above B (default 0.3), the steps above B in any layer once MQAR is
learned (accuracy >= 0.99 from the step named), and whether an expert died. Standard library
only; reads the CSV that train_tiny appends as it runs, so it also works on a run in progress.
"""
import argparse
import csv
import re


def first_step(rows, accuracy):
    """The first step whose training accuracy reaches `accuracy` (None if none does)."""
    return next((r["step"] for r in rows if r["accuracy"] >= accuracy), None)


def summary(values, bound):
    """mean / 95th percentile / max / count above `bound`, as the BENCHMARKS tables print it."""
    if not values:
        return "–"
    ordered = sorted(values)
    p95 = ordered[int(0.95 * (len(ordered) - 1))]
    above = sum(v > bound for v in values)
    return f"{sum(values) / len(values):.2f} / {p95:.2f} / {ordered[-1]:.2f} / {above}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", nargs="+", help="metrics.csv files of train_tiny runs")
    parser.add_argument("--from", dest="start", type=int, default=180)
    parser.add_argument("--bound", type=float, default=0.3)
    args = parser.parse_args()
    for path in args.metrics:
        with open(path, newline="") as f:
            raw = list(csv.DictReader(f))
        if not raw:
            print(f"{path}: no rows yet")
            continue
        layers = sorted(
            int(m.group(1))
            for m in (re.fullmatch(r"moe(\d+)_max_violation", k) for k in raw[0])
            if m
        )
        rows = [
            {
                "step": int(r["step"]),
                "accuracy": float(r["accuracy"]),
                "violation": [float(r[f"moe{l}_max_violation"]) for l in layers],
                "dead": [int(r[f"moe{l}_dead_experts"]) for l in layers],
            }
            for r in raw
        ]
        learned = first_step(rows, 0.99)
        late = [r for r in rows if r["step"] >= args.start]
        cells = [summary([r["violation"][i] for r in late], args.bound) for i in range(len(layers))]
        if learned is None:
            tail = "not learned"
        else:
            over = [r["step"] for r in rows if r["step"] >= learned and max(r["violation"]) > args.bound]
            total = sum(r["step"] >= learned for r in rows)
            tail = f"{len(over)} of {total} ({', '.join(map(str, over))})" if over else f"**0** of {total}"
        died = any(any(d) for d in (r["dead"] for r in late))
        print(
            f"| {path} | {first_step(rows, 0.9)} / {learned} | "
            + " | ".join(cells)
            + f" | {tail} | {'an expert died' if died else 'none dead'} | last step {rows[-1]['step']} |"
        )
    print(
        f"(columns: accuracy >= 0.9 / >= 0.99 at step; per layer from step {args.start} on: mean / "
        f"95th percentile / max / steps above {args.bound}; steps above it once learned; dead experts)"
    )


if __name__ == "__main__":
    main()
