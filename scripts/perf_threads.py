#!/usr/bin/env python3
"""Per-thread summary of a `perf script -F tid,time,ip,sym,dso` dump (gzip or plain), as `scripts/device-cuda.sh`
step `perf` writes it: each thread's on-CPU seconds (samples over the sampling rate) and its top symbols, and for
the threads whose lives lie inside a window (the spine reader is a new thread per forward pass) the split of their
time into waiting in the driver (libcuda and clock_gettime: spinning on copies' events), the kernel, libc and the
program's own code.

    python3 scripts/perf_threads.py perf_script.txt.gz --hz 299 [--after SECONDS [--min-cpu 1]] [--top 12]
        [--until SECONDS] [--timeline STEP]

`--until` keeps only the samples of the first SECONDS (the open, when it ran first: `bench-decode`'s `open_s`).
`--timeline STEP` prints, for every STEP seconds, the CPUs the main thread (the first sampled) and all other threads
kept busy and their top symbols: where an open waits, and on whom (docs/performance-log.md, session 25).
"""
import argparse
import collections
import gzip
import re


def samples(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        for line in f:
            parts = line.split()
            try:
                tid, t = int(parts[0]), float(parts[1].rstrip(":"))
            except (IndexError, ValueError):
                continue
            yield tid, t, re.sub(r"\+0x[0-9a-f]+", "", " ".join(parts[3:]))


def kind(sym):
    if "libcuda" in sym or "vdso" in sym:
        return "driver wait"
    if "kallsyms" in sym:
        return "kernel"
    if "libc.so" in sym:
        return "libc"
    return "program"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump")
    ap.add_argument("--hz", type=float, default=299.0, help="perf record's -F")
    ap.add_argument("--after", type=float, default=0.0,
                    help="only threads born this many seconds after the first sample (the decode's readers)")
    ap.add_argument("--min-cpu", type=float, default=1.0,
                    help="with --after: only threads with at least this many seconds on CPU (the readers)")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--until", type=float, default=None,
                    help="only samples taken this many seconds after the first one or earlier")
    ap.add_argument("--timeline", type=float, default=None, metavar="STEP",
                    help="busy CPUs and top symbols of the main thread and the others, every STEP seconds")
    args = ap.parse_args()
    rows = list(samples(args.dump))
    if not rows:
        raise SystemExit("no samples")
    t0 = min(r[1] for r in rows)
    if args.until is not None:
        rows = [r for r in rows if r[1] - t0 <= args.until]
    life = {}
    for tid, t, _ in rows:
        lo, hi = life.get(tid, (t, t))
        life[tid] = (min(lo, t), max(hi, t))
    counts = collections.Counter(r[0] for r in rows)
    print(f"{len(rows)} samples over {max(r[1] for r in rows) - t0:.1f} s")
    for tid, n in counts.most_common(args.top):
        syms = collections.Counter(r[2].split(" (")[0] for r in rows if r[0] == tid)
        lo, hi = life[tid]
        print(f"thread {tid}: {n / args.hz:.2f} s on CPU, alive {lo - t0:.1f}-{hi - t0:.1f} s; "
              + "; ".join(f"{s[:60]} {k / args.hz:.2f}" for s, k in syms.most_common(4)))
    if args.timeline:
        timeline(rows, t0, args.timeline, args.hz)
    born = [tid for tid, (lo, _) in life.items()
            if lo - t0 >= args.after and counts[tid] / args.hz >= args.min_cpu]
    if args.after > 0 and born:
        # Threads that each run one pass: the summary is per thread, that is per forward pass.
        by_kind = collections.Counter(kind(s) for tid, _, s in rows if tid in born)
        print(f"{len(born)} threads born after {args.after} s with {args.min_cpu} s or more on CPU, per thread:")
        for k, n in by_kind.most_common():
            print(f"  {k}: {n / args.hz / len(born):.3f} s")


def timeline(rows, t0, step, hz):
    """Per `step` seconds: busy CPUs (samples over rate and step) of the main thread, whose sample comes first, and
    of all the others, each with its three top symbols (a symbol perf could not name stands for its library)."""
    main_tid = min(rows, key=lambda r: r[1])[0]
    bins = collections.defaultdict(lambda: (collections.Counter(), collections.Counter()))
    for tid, t, sym in rows:
        name, _, dso = sym.partition(" (")
        if name.startswith("[unknown]"):
            name = dso.rstrip(")").split("/")[-1]
        bins[int((t - t0) / step)][0 if tid == main_tid else 1][name] += 1
    print(f"timeline, {step} s a row: busy CPUs of the main thread {main_tid} | of the other threads")
    last = max(bins)
    for b in range(last + 1):
        main, others = bins[b] if b in bins else (collections.Counter(), collections.Counter())
        busy = lambda c: sum(c.values()) / hz / step
        top = lambda c: ", ".join(f"{k[:24]} {v}" for k, v in c.most_common(3))
        print(f"{b * step:7.2f} s  {busy(main):4.2f} {top(main):<60} | {busy(others):5.2f} {top(others)}")


if __name__ == "__main__":
    main()
