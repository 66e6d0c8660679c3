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
