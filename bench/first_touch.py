#!/usr/bin/env python3
"""How fast this host gives a process fresh memory: the first touch of a large anonymous mapping.

The host tier's arena is that kind of memory, and a 7 B model's Adam state on the host is about
100 GiB of it, so the first touch bounds the time to the first step (bench/first_step.py). Maps
N GiB on 2 MiB boundaries, huge pages (MADV_HUGEPAGE) or not, populates it with
MADV_POPULATE_WRITE from T threads, each on its share, then times torch's bf16 -> fp32 copy into
a quarter of it, now resident (what widening the masters costs once the pages exist).

    python3 bench/first_touch.py 75 1 16    # GiB, huge pages (1/0), threads
"""

import ctypes
import sys
import threading
import time

import torch

MADV_HUGEPAGE, MADV_POPULATE_WRITE, PAGE = 14, 23, 1 << 21


def main() -> None:
    gib, huge, threads = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    n = int(gib * (1 << 30)) // PAGE * PAGE
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    raw = libc.mmap(None, n + PAGE, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
    if raw in (None, ctypes.c_void_p(-1).value):
        sys.exit(f"mmap of {n + PAGE} bytes failed (errno {ctypes.get_errno()})")
    base = (raw + PAGE - 1) // PAGE * PAGE
    if huge and libc.madvise(base, n, MADV_HUGEPAGE) != 0:
        sys.exit(f"MADV_HUGEPAGE failed (errno {ctypes.get_errno()})")
    share = n // threads // PAGE * PAGE
    errors: list[int] = []

    def populate(k: int) -> None:
        first = base + k * share
        last = base + n if k == threads - 1 else first + share
        if libc.madvise(first, last - first, MADV_POPULATE_WRITE) != 0:
            errors.append(ctypes.get_errno())

    start = time.perf_counter()
    workers = [threading.Thread(target=populate, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - start
    if errors:
        sys.exit(f"MADV_POPULATE_WRITE failed (errno {errors[0]}): the kernel may lack it (5.14+)")
    q = n // 4 // 4 * 4
    dst = torch.frombuffer((ctypes.c_uint8 * q).from_address(base), dtype=torch.float32)
    src = torch.ones(q // 4, dtype=torch.bfloat16)
    start = time.perf_counter()
    dst.copy_(src)
    widen = time.perf_counter() - start
    print(f"populate {n / 2**30:.1f} GiB, huge pages {bool(huge)}, {threads} threads: "
          f"{seconds:.2f} s ({n / seconds / 1e9:.1f} GB/s); widen {q // 4 / 1e9:.2f} G elements "
          f"bf16 -> fp32 into resident memory: {widen:.2f} s ({q / widen / 1e9:.1f} GB/s written)")


if __name__ == "__main__":
    main()
