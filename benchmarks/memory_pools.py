"""Memory with pools (arenas) against plain allocation: the example GPT at stages 0-3, per rank.

    python benchmarks/memory_pools.py [--world-size 2] [--layers 6] [--batch 4] [--steps 4]

Every (stage, memory_pools) pair runs in fresh processes (one per rank, gloo),
so each process's resident-set high-water mark (``ru_maxrss``) is its own.
Rank 0's ``step.report()`` of the steady-state program gives planned, lower
bound and measured peaks (tensor bytes, ``zerocc/runtime/memory.py``); the
resident set is what the CPU allocator really took from the OS, compilation
and the Python interpreter included (the same in both columns). Prints a
markdown table; the losses of the two runs of a stage must be equal bit for
bit, and the script says so.
"""
from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, ".."))
import zerocc  # noqa: E402
from gpt import GPT, random_batch  # noqa: E402


def _rank(rank, world_size, port, folder, stage, memory_pools, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        model = GPT(layers=args.layers)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        step = zerocc.compile(model, optimizer, stage=stage, memory_pools=memory_pools)
        generator = torch.Generator().manual_seed(1)
        losses, seconds = [], []
        for _ in range(args.steps):
            tokens, targets = random_batch(generator, args.batch * world_size)
            mine = slice(rank * args.batch, (rank + 1) * args.batch)
            dist.barrier()
            started = time.perf_counter()
            losses.append(step(tokens[mine], targets[mine]).item())
            seconds.append(time.perf_counter() - started)
        report = step.report()
        report["losses"] = losses
        report["step_seconds"] = statistics.median(seconds[2:]) if len(seconds) > 2 else seconds[-1]
        report["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        torch.save(report, os.path.join(folder, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(stage, memory_pools, args):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank, args=(args.world_size, port, folder, stage, memory_pools, args), nprocs=args.world_size)
        return torch.load(os.path.join(folder, "rank0.pt"), weights_only=False)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--stages", default="0,1,2,3")
    args = parser.parse_args()

    rows = []
    for stage in [int(s) for s in args.stages.split(",")]:
        plain = run(stage, False, args)
        pools = run(stage, True, args)
        rows.append((stage, plain, pools))
        print(f"stage {stage} done", file=sys.stderr, flush=True)

    print(f"GPT ({args.layers} layers), AdamW, {args.batch} sequences per rank, world size {args.world_size}, "
          f"rank 0, steady-state program; bytes\n")
    print("| stage | pools | planned peak | lower bound | measured peak | measured / planned | arenas | unplanned "
          "| live peak (plan) | RSS high-water | step s | losses equal |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for stage, plain, pools in rows:
        equal = plain["losses"] == pools["losses"]
        for name, r in (("off", plain), ("on", pools)):
            print(f"| {stage} | {name} | {r['planned_peak_bytes']:,} | {r['lower_bound_bytes']:,} "
                  f"| {r['measured_peak_bytes']:,} | {r['measured_peak_bytes'] / r['planned_peak_bytes']:.4f} "
                  f"| {r['arena_bytes']:,} | {r['unplanned_bytes']:,} | {r['live_peak_bytes']:,} "
                  f"| {r['max_rss_bytes']:,} | {r['step_seconds']:.3f} | {'yes' if equal else 'NO'} |")


if __name__ == "__main__":
    main()
