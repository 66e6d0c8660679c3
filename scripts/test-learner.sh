#!/usr/bin/env bash
# The burn-train integration (feature `learner`), kept out of scripts/test.sh to hold its time
# budget: the suite's Learner test (one epoch through `SupervisedTraining` equals the crate's own
# loop bit for bit) and a short run of `examples/learner`.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --features learner --test suite learner
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cargo run --features learner --example learner -- --epochs 1 --sequences 256 --batch 32 --out "$out" | tail -n 12
# burn-train's checkpoints of the epoch: the model's and the optimiser's.
for record in model optim; do
    compgen -G "$out/checkpoint/$record-1.*" >/dev/null || { echo "no $record checkpoint in $out/checkpoint" >&2; exit 1; }
done
