#!/usr/bin/env python3
"""Where a program's threads wait off a CPU: a `perf sched timehist -g` dump (gzip or plain), as `scripts/device-cuda.sh` step
`offcpu` writes it, summed by the kernel stack each thread went to sleep in. `perf` samples (cpu-clock) see only time
on a CPU; a second in which no thread of an open is on a CPU (docs/performance-log.md, session 25) needs this.

    python3 scripts/offcpu_waits.py offcpu.txt.gz --comm deltafin [--until SECONDS] [--top 8] [--long MS]

Each row of the dump is one run of a task on a CPU: its wait before that run (the time it was off a CPU, asleep or
preempted) and the stack it left the CPU in at the end of the run. A wait is charged to the stack of the same task's
previous row, the place it left the CPU. The main thread is the task whose thread id is its process id; `--until` keeps the waits that began within the
first SECONDS of the program's first row; `--long` lists each wait of at least MS milliseconds with its start.
"""
import argparse
import collections
import gzip
import re

ROW = re.compile(r"^\s*(\d+\.\d+)\s+\[\d+\]\s+(\S+)\[(\d+)(?:/(\d+))?\]\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*(.*)$")


def rows(path):
    """(time s, comm, tid, pid, wait ms, stack) of every row."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        for line in f:
            m = ROW.match(line)
            if not m:
                continue
            t, comm, tid, pid, wait, _delay, _run, stack = m.groups()
            tid = int(tid)
            yield float(t), comm, tid, int(pid) if pid else tid, float(wait), stack.strip()


def reason(stack, frames):
    """The first `frames` functions of a stack (`a <- b <- c`), or `?` when perf gave none."""
    parts = [p.strip() for p in stack.split("<-") if p.strip()]
    return " <- ".join(parts[:frames]) if parts else "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump")
    ap.add_argument("--comm", default="deltafin", help="the program's command name (its threads may rename)")
    ap.add_argument("--until", type=float, default=None, help="only waits that began this early (seconds)")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--frames", type=int, default=4, help="stack frames that name a place")
    ap.add_argument("--long", type=float, default=None, metavar="MS", help="list every wait at least this long")
    args = ap.parse_args()
    all_rows = list(rows(args.dump))
    pid = next((p for _, c, _, p, _, _ in all_rows if c.startswith(args.comm)), None)
    if pid is None:
        raise SystemExit(f"no task of {args.comm!r} in the dump")
    mine = [r for r in all_rows if r[3] == pid]
    t0 = mine[0][0]
    last_stack = {}
    waits = {"main": collections.Counter(), "others": collections.Counter()}
    long_waits = []
    for t, _, tid, _, wait, stack in mine:
        began = t - t0 - wait / 1e3
        if tid in last_stack and (args.until is None or began <= args.until):
            place = reason(last_stack[tid], args.frames)
            waits["main" if tid == pid else "others"][place] += wait
            if args.long is not None and wait >= args.long:
                long_waits.append((began, tid, wait, place))
        last_stack[tid] = stack
    for who, counter in waits.items():
        total = sum(counter.values())
        print(f"{who}: {total / 1e3:.2f} s off a CPU" + (" (summed over threads)" if who == "others" else ""))
        for place, ms in counter.most_common(args.top):
            print(f"  {ms / 1e3:7.3f} s  {place}")
    if long_waits:
        print(f"waits of {args.long} ms or more (start s, thread, ms, where):")
        for began, tid, wait, place in sorted(long_waits):
            print(f"  {began:7.3f}  {tid}{' (main)' if tid == pid else ''}  {wait:8.1f}  {place}")


if __name__ == "__main__":
    main()
