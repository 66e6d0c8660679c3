#!/usr/bin/env bash
# The full test suite: every unit, integration and doc test, on ndarray and on a real wgpu device.
#
# The wgpu tests need a Vulkan driver. Without a GPU, Mesa's software driver (lavapipe) is the
# device: this script installs it (Debian/Ubuntu, as root) when no Vulkan driver is present.
# The wgpu tests fail, never skip, when no adapter can be found.
set -euo pipefail
cd "$(dirname "$0")/.."

have_vulkan_driver() {
    compgen -G "/usr/share/vulkan/icd.d/*.json" >/dev/null || compgen -G "/etc/vulkan/icd.d/*.json" >/dev/null
}

if ! have_vulkan_driver; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
        echo "No Vulkan driver found: installing Mesa's software Vulkan driver (mesa-vulkan-drivers)."
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mesa-vulkan-drivers >/dev/null
    else
        echo "No Vulkan driver found. Install one, e.g. Mesa's software driver on Debian/Ubuntu:" >&2
        echo "    sudo apt-get install mesa-vulkan-drivers" >&2
        echo "(Fedora: mesa-vulkan-drivers; Arch: vulkan-swrast), then run this script again." >&2
        exit 1
    fi
fi

# lavapipe is slow on big dispatches; tests keep their shapes small.
# One test at a time: Burn 0.21's autodiff keeps every graph in one process-wide table and prunes
# it after each backward, and a prune racing another thread's graph construction can drop a node
# that thread still needs (seen as a missing parameter gradient in a parallel run). Setting
# RUST_TEST_THREADS overrides this.
# `shared-instances`: the library generates the training stack's generic instances once and
# the test and example binaries link them (Cargo.toml says more); it cuts the build by about ten
# minutes on two cores. `shared-downstream-units`: Burn's and CubeCL's crates get the features
# Burn's defaults give them in the downstream project below, whose build then reuses them.
features=wgpu,autodiff,tokenizer,collective,shared-instances,shared-downstream-units

# Each step's wall time, for CI's log: the whole script has a budget (40 minutes on two cores).
step_start=$SECONDS
step_done() {
    echo "test.sh: $1 took $((SECONDS - step_start)) s (total $SECONDS s)"
    step_start=$SECONDS
}

# The test binaries are built here and run further down without cargo: `cargo test` would take
# cargo's lock on the build folder, which the downstream project's build holds meanwhile. On
# lavapipe the suite keeps about one of two cores busy, and that build (the crates whose features
# Burn's defaults change, about two minutes alone) uses the other. Extra arguments go to the build
# (`--timings`, say). Every test binary runs, also after one has failed; the script then fails.
mkdir -p target
cargo test --workspace --features "$features" --no-run --message-format json-render-diagnostics \
    "$@" >target/test-binaries.json
# Each test binary with its package folder, where cargo would run it.
sed -n 's/.*"manifest_path":"\([^"]*\)".*"profile":{[^}]*"test":true[^}]*}.*"executable":"\([^"]*\)".*/\1 \2/p' \
    target/test-binaries.json >target/test-binaries.txt
[ -s target/test-binaries.txt ] || { echo "no test binaries in cargo's output" >&2; exit 1; }
step_done "build"

cargo test --workspace --features "$features" --doc
step_done "doc tests"

# Data parallelism over two processes (burn-collective's global mode, its orchestrator on
# localhost): both nodes must end with the same parameters and biases as two replicas in one
# process. Built with the test build's features and profile, so it reuses its dependencies.
PROFILE=dev FEATURES="$features" scripts/two_process.sh
step_done "two processes"

# Both crates as crates.io would receive them: `cargo package` packs each (kimi-burn depends on the
# packed kimi-burn-kernels by version) without building them; the downstream project below builds
# and runs the packed sources (its Cargo.toml patches the crates.io names with them). Verifying the
# packages here as well would build both crates and Burn's stack once more, with yet another
# feature set: about nine minutes of a clean two-core run. The archives are unpacked with fresh
# modification times (tar's `-m`), so that cargo rebuilds the crates whenever they change.
# `0.1.0`: the version in both Cargo.toml files and in downstream/Cargo.toml's patches.
cargo package --workspace --allow-dirty --no-verify
for krate in kimi-burn-kernels kimi-burn; do
    rm -rf "target/package/$krate-0.1.0"
    tar -xzmf "target/package/$krate-0.1.0.crate" -C target/package
done
step_done "package"

# The crate as a Burn project uses it (downstream/), from the packed sources: Burn's default
# features on, where `burn::backend::Wgpu` is `Fusion<CubeBackend<…>>`. It trains a few steps on
# lavapipe and fails unless every fused op ran its kernel. (The suite's wgpu tests run on the plain
# `CubeBackend`, `Wgpu` with Burn's defaults off, and check the `Fusion` backend against it.)
# Built in the background while the tests run, in the same target folder: it reuses the test
# build's units for every crate below `burn-cubecl` and `burn-core` (the feature
# `shared-downstream-units` and the downstream project's own dependencies line up the features of
# both builds).
downstream=(--manifest-path downstream/Cargo.toml -p downstream-fusion --target-dir target)
cargo build "${downstream[@]}" >target/downstream-build.log 2>&1 &
build_pid=$!
trap 'kill "$build_pid" 2>/dev/null || true' EXIT

# The list comes in on descriptor 3, so that nothing a test runs can read it from stdin.
failed=()
while read -r manifest binary <&3; do
    echo "     Running $binary"
    (cd "$(dirname "$manifest")" && RUST_TEST_THREADS="${RUST_TEST_THREADS:-1}" "$binary" </dev/null) ||
        failed+=("$binary")
done 3<target/test-binaries.txt
step_done "tests"
if [ ${#failed[@]} -gt 0 ]; then
    printf 'test binary failed: %s\n' "${failed[@]}" >&2
    exit 1
fi

if ! wait "$build_pid"; then
    cat target/downstream-build.log >&2
    echo "the downstream project did not build" >&2
    exit 1
fi
trap - EXIT
# About ten when it reuses the test build's units; a few hundred when a feature difference
# between the two builds has come back (`scripts/shared-units.py` finds it).
echo "test.sh: the downstream build compiled $(grep -c '^ *Compiling' target/downstream-build.log) units"
step_done "downstream build (after the tests)"
cargo run "${downstream[@]}"
step_done "downstream fusion"
