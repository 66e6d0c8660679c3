#!/usr/bin/env python3
"""What one pool thread does while the other waits for work: the serial part of a CPU profile.

    perf record -F 400 --call-graph dwarf,16384 -o perf.data -- <program> ...
    perf script -i perf.data -F tid,time,ip,sym > samples.txt
    scripts/serial_profile.py samples.txt [CATEGORY]

While a computation of `on_cpu_pool` runs, a pool thread without work waits in
`ops::backend::pool::keep_awake` instead of sleeping. A profile by symbol shows that wait as time
of its own; this script shows what it waits *for*. It takes the two threads with the most samples
(a 2-core machine's pool; the program's main thread sleeps meanwhile), pairs every sample of one
with the other's sample nearest in time (within 2 ms), and counts, among the pairs where exactly
one thread waits, what the working thread was doing: the fraction of the wall-clock time that
ran on one thread, and its parts by the first crate frame of the call chain (`ops::…` for a host
kernel, `burn ops in nn::…` for Burn's tensor ops called from a module, `gemm in …` for matrix
products, `burn autodiff backward` for Burn's own backward steps).

With CATEGORY (one of the printed names), the leaf functions and the calls above them within that
part instead. Benchmark-only, like the other Python scripts here: nothing builds or tests with it.
"""
import bisect
import collections
import re
import signal
import sys

WAIT = "keep_awake"
WINDOW_S = 0.002
# A sample's first line, "TID TIME:" (perf pads the thread id with spaces to a common width);
# its frames follow on lines of their own, indented with a tab.
HEADER = re.compile(r"^\s*\d+\s+\d+\.\d+:\s*$")


def read(path):
    """The samples of `perf script -F tid,time,ip,sym`: (tid, time, frames, leaf first)."""
    samples, cur = [], None
    with open(path, errors="replace") as f:
        for line in f:
            if not line.strip():
                if cur:
                    samples.append(cur)
                cur = None
            elif HEADER.match(line):
                parts = line.split()
                cur = (parts[0], float(parts[1].rstrip(":")), [])
            elif cur is not None:
                parts = line.strip().split(None, 1)
                if len(parts) > 1:
                    cur[2].append(parts[1])
    if cur:
        samples.append(cur)
    return samples


def waiting(frames):
    return any(WAIT in f for f in frames[:4])


def crate_frame(frames, skip):
    """The first frame of the crate not in `skip` (helpers every kernel goes through)."""
    for f in frames:
        if "kimi_burn::" in f and not any(s in f for s in skip):
            return f
    return None


def category(frames):
    joined = " ".join(frames)
    helpers = ("backend::pool", "backend::host", "backend::simd", "backend::matmul")
    if any("gemm_" in f for f in frames[:8]):
        f = crate_frame(frames, helpers + ("ops::linear",))
        m = f and re.search(r"kimi_burn::([a-z_]+::[a-z_]+)", f)
        return "gemm in " + (m.group(1) if m else "?")
    f = crate_frame(frames, helpers)
    if f and "kimi_burn::ops::" in f:
        return "ops::" + re.search(r"kimi_burn::ops::([a-z_]+(::[a-z_]+)?)", f).group(1)
    if "burn_autodiff" in joined and "backward" in joined:
        return "burn autodiff backward"
    if f:
        m = re.search(r"kimi_burn::(nn::[a-z_]+|model|optim|train|data)", f)
        if m:
            return "burn ops in " + m.group(1)
        return "other in kimi_burn::" + re.search(r"kimi_burn::([a-z_]+)", f).group(1)
    return "other: " + (re.sub(r"<.*", "", frames[0])[:40] if frames else "?")


def short(frame):
    return re.sub(r"<.*", "", frame)[:70]


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet under `| head`
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    samples = read(sys.argv[1])
    want = sys.argv[2] if len(sys.argv) == 3 else None
    threads = [t for t, _ in collections.Counter(s[0] for s in samples).most_common(2)]
    if len(threads) < 2:
        sys.exit("fewer than two threads in the profile")
    by = {t: sorted((s for s in samples if s[0] == t), key=lambda s: s[1]) for t in threads}
    pairs, serial = 0, collections.Counter()
    for x, y in (threads, threads[::-1]):
        times = [s[1] for s in by[y]]
        for s in by[x]:
            i = bisect.bisect_left(times, s[1])
            near = [by[y][j] for j in (i - 1, i) if 0 <= j < len(times)]
            o = min(near, key=lambda c: abs(c[1] - s[1]))
            if abs(o[1] - s[1]) > WINDOW_S:
                continue
            pairs += 1
            if waiting(s[2]) and not waiting(o[2]):
                cat = category(o[2])
                if want is None:
                    serial[cat] += 1
                elif cat == want:
                    frames = o[2]
                    serial[(short(frames[0]), " < ".join(short(f) for f in frames[1:4]))] += 1
    total = sum(serial.values())
    if want is None:
        # Each instant is counted twice (once per thread), and one thread waits in the serial ones.
        print(f"{pairs} paired samples; one thread waits in {total}: "
              f"{200 * total / max(pairs, 1):.0f}% of the wall-clock time ran on one thread")
        for cat, n in serial.most_common(30):
            print(f"{100 * n / max(total, 1):5.1f}%  {cat}")
    else:
        print(f"{total} serial samples in {want!r}: leaf | the calls above it")
        for (leaf, above), n in serial.most_common(30):
            print(f"{n:5d}  {leaf} | {above}")


if __name__ == "__main__":
    main()
