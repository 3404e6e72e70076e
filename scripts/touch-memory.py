#!/usr/bin/env python3
"""Touches GIB GiB of new memory (one byte per 4 KiB page, huge pages advised), prints the rate, and frees it.

In a virtual machine whose host backs guest memory lazily, memory the guest has not used lately comes at the host's
pace; right after this, the kernel hands the freed pages to the next process, already backed. Used before the open
benchmark in docs/PERFORMANCE.md ("Open").   usage: scripts/touch-memory.py GIB
"""
import mmap
import sys
import time

gib = float(sys.argv[1]) if len(sys.argv) > 1 else 15.0
n = int(gib * (1 << 30)) // 4096 * 4096
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
if hasattr(mmap, "MADV_HUGEPAGE"):
    m.madvise(mmap.MADV_HUGEPAGE)
start = time.monotonic()
for at in range(0, n, 4096):
    m[at] = 1
secs = time.monotonic() - start
m.close()
print(f"touched {n / 1e9:.2f} GB of new memory in {secs:.2f} s: {n / secs / 1e9:.2f} GB/s", file=sys.stderr)
