#!/usr/bin/env bash
# Kills `train_tiny` with SIGKILL between two checkpoints, resumes it, and checks that the resumed
# run ends with the uninterrupted run's model file byte for byte and the same metrics rows (the
# tokens/s column aside). With `--devices 2` as first argument the runs are data parallel (needs
# the `collective` feature, which this script builds).
#
#     scripts/kill_resume.sh              # one device
#     scripts/kill_resume.sh --devices 2  # two replicas
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release --features collective --example train_tiny
bin=target/release/examples/train_tiny
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
args=(--steps 30 --checkpoint-every 10 --batch 4 --test-sequences 16 "$@")

"$bin" "${args[@]}" --out "$work/whole" >"$work/whole.log"

# Kill once the run has logged step 24: after the checkpoint of step 20, before the one of step 30.
"$bin" "${args[@]}" --out "$work/killed" >"$work/killed.log" &
pid=$!
logged() { if [ -f "$work/killed/metrics.csv" ]; then wc -l <"$work/killed/metrics.csv"; else echo 0; fi; }
while [ "$(logged)" -lt 25 ]; do
    kill -0 "$pid" 2>/dev/null || { echo "the run ended before it could be killed" >&2; exit 1; }
    sleep 0.05
done
kill -KILL "$pid"
wait "$pid" 2>/dev/null || true
echo "killed after $(($(logged) - 1)) logged steps; latest checkpoint: $(cat "$work/killed/checkpoints/latest")"

"$bin" "${args[@]}" --out "$work/killed" --resume >"$work/resumed.log"
cmp "$work/whole/model.safetensors" "$work/killed/model.safetensors"
diff <(cut -d, -f1-3,5- "$work/whole/metrics.csv") <(cut -d, -f1-3,5- "$work/killed/metrics.csv")
echo "the resumed run ends bit-identical to the uninterrupted one"
