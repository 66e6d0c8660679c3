#!/usr/bin/env python3
"""Which compilation units the downstream project's build shares with the crate's test build.

`scripts/test.sh` builds the test binaries, then the downstream project (`downstream/`) in the
same target folder. Cargo reuses a unit (one crate compiled one way) when both builds ask for it
with the same package, features, profile settings and dependencies; everything above a crate whose
features differ is compiled again. This script asks cargo for both builds' unit graphs (no
compiling; `-Z unstable-options` through `RUSTC_BOOTSTRAP=1`), prints the downstream units the test
build lacks, and for the lowest of them (all their dependencies shared) the features each build
gives them: those are the causes to fix (the feature `shared-downstream-units`, or the downstream
project's dependencies).

Run it from the repository root after `cargo package` has unpacked the crates into
`target/package/` (the first steps of `scripts/test.sh`). Development only; CI does not run it.
"""

import hashlib
import json
import os
import subprocess
import sys

FEATURES = "wgpu,autodiff,tokenizer,collective,shared-instances,shared-downstream-units"


def unit_graph(args):
    env = dict(os.environ, RUSTC_BOOTSTRAP="1")
    out = subprocess.run(
        ["cargo", *args, "--unit-graph", "-Z", "unstable-options"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)["units"]


def package(unit):
    """`name@version` (a local package's folder differs between the builds: never shared)."""
    return unit["pkg_id"].split("#")[-1]


def keys(units):
    """A key per unit that is equal in both builds exactly when cargo can reuse the unit."""
    memo = {}

    def key(i):
        if i not in memo:
            u = units[i]
            profile = {k: v for k, v in u["profile"].items() if k != "name"}
            deps = sorted(key(d["index"]) for d in u["dependencies"])
            text = json.dumps(
                [u["pkg_id"], u["target"]["kind"], u["target"]["name"], u["mode"],
                 sorted(u["features"]), profile, deps],
                sort_keys=True,
            )
            memo[i] = hashlib.sha1(text.encode()).hexdigest()
        return memo[i]

    return [key(i) for i in range(len(units))]


def main():
    test = unit_graph(["test", "--workspace", "--features", FEATURES, "--no-run"])
    down = unit_graph(["build", "--manifest-path", "downstream/Cargo.toml",
                       "-p", "downstream-fusion", "--target-dir", "target"])
    test_keys = set(keys(test))
    down_keys = keys(down)
    unshared = [i for i, k in enumerate(down_keys) if k not in test_keys]
    print(f"downstream units: {len(down)}, compiled again: {len(unshared)}")
    features = {}
    for u in test:
        name = (package(u), u["target"]["name"], u["mode"])
        features.setdefault(name, set()).add(tuple(sorted(u["features"])))
    for i in unshared:
        u = down[i]
        name = (package(u), u["target"]["name"], u["mode"])
        lowest = all(down_keys[d["index"]] in test_keys for d in u["dependencies"])
        local = u["pkg_id"].startswith("path+")
        cause = "  <- local package: always compiled again" if local else "  <- cause"
        print(f"  {' '.join(name)}" + (cause if lowest else ""))
        if lowest and not local:
            print(f"      downstream: {sorted(u['features'])}")
            for f in sorted(features.get(name, [])):
                print(f"      test build: {list(f)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
