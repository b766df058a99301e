"""Many steps of the benchmark GPT under zerocc, every loss printed exactly: the heap-corruption check.

    MALLOC_CHECK_=3 MALLOC_PERTURB_=165 torchrun --standalone --nproc_per_node 2 benchmarks/long_run.py \\
        --system zerocc-3+pools --steps 300

Trains ``examples/gpt.py``'s ``GPT()`` with AdamW on fixed random batches
(``--system`` as in ``compare.py``: ``zerocc-<stage>[+pools]``) and prints,
on rank 0, each step's loss as ``float.hex`` and at the end a hash of all of
them. Under ``MALLOC_PERTURB_`` glibc fills every freed block with a byte
pattern (and every new one with its complement), so a value read after its
memory was freed (or written before it was allocated) changes the losses:
two runs, with and without perturbation, print the same hash unless
something uses freed memory. ``MALLOC_CHECK_=3`` aborts on a corrupted heap.
With ``--measure`` each step runs under zerocc's LiveBytesTracker dispatch mode
(``runtime/memory.py``), the weak references one crash was suspected of.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, ".."))
import zerocc  # noqa: E402
from gpt import GPT, random_batch  # noqa: E402
from zerocc.runtime.memory import LiveBytesTracker  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--system", default="zerocc-3", help="zerocc-<stage>[+pools]")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batches", type=int, default=8, help="distinct batches, cycled")
    parser.add_argument("--measure", action="store_true", help="every step under runtime/memory.py LiveBytesTracker")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 32-wide GPT on 16 tokens (for valgrind)")
    args = parser.parse_args()
    match = re.fullmatch(r"zerocc-([0-3])(\+pools)?", args.system)
    if match is None:
        raise SystemExit(f"--system: zerocc-<stage>[+pools], got {args.system!r}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    # Under valgrind every instruction is emulated: the tiny model keeps a step to seconds.
    shape = dict(vocab=64, seq=16) if args.tiny else {}
    model = GPT(d_model=32, layers=2, heads=2, **shape) if args.tiny else GPT()
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=int(match[1]),
                          memory_pools=match[2] is not None)
    generator = torch.Generator().manual_seed(1000 + rank)
    data = [random_batch(generator, 4, **shape) for _ in range(args.batches)]
    digest = hashlib.sha256()
    started = time.perf_counter()
    for i in range(args.steps):
        if args.measure:
            with LiveBytesTracker():
                loss = step(*data[i % len(data)])
        else:
            loss = step(*data[i % len(data)])
        text = float(loss).hex()
        digest.update(text.encode())
        if rank == 0:
            print(f"step {i} loss {text}", flush=True)
    if rank == 0:
        print(f"{args.system} {args.steps} steps in {time.perf_counter() - started:.0f} s, "
              f"losses sha256 {digest.hexdigest()[:16]}, MALLOC_CHECK_={os.environ.get('MALLOC_CHECK_')} "
              f"MALLOC_PERTURB_={os.environ.get('MALLOC_PERTURB_')}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
