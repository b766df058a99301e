"""What one bucket's collectives cost on gloo, against what zerocc's gloo passes put in their place.

    torchrun --standalone --nproc_per_node 2 benchmarks/gloo_collectives.py --mib 4

Times, interleaved over ``--rounds`` rounds of ``--calls`` calls each, the
functional collectives zerocc's programs issue (``torch.ops._c10d_functional``
and their ``wait_tensor``) on one flat fp32 bucket: all_reduce (DDP's),
reduce_scatter_tensor (gloo runs it as an all-reduce of the whole bucket),
all_to_all_single followed by the sum of the received chunks over the ranks
(``passes/scatter_by_all_to_all.py``), all_gather_into_tensor, and the sends
and receives into place that replace it (``zerocc::all_gather_by_send_recv``,
``passes/gather_by_send_recv.py``). Prints, on
rank 0, the median wall-clock time per call and the median CPU time per call
of the whole process (every thread: gloo's transfer threads too), and checks
that the all-to-all's sum equals the reduce-scatter, and the sends and
receives the all-gather, bit for bit.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from zerocc import ops  # noqa: E402

c10d = torch.ops._c10d_functional


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=float, default=4.0, help="bucket size")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    rows = int(args.mib * 2**20) // 4 // world
    bucket = torch.randn(rows * world, generator=torch.Generator().manual_seed(rank))
    shard = bucket[:rows].clone()

    def all_to_all_sum():
        received = c10d.wait_tensor(c10d.all_to_all_single(bucket, [rows] * world, [rows] * world, group))
        return received.view(world, rows).sum(0)

    variants = {
        "all_reduce": lambda: c10d.wait_tensor(c10d.all_reduce(bucket, "sum", group)),
        "reduce_scatter_tensor": lambda: c10d.wait_tensor(c10d.reduce_scatter_tensor(bucket, "sum", world, group)),
        "all_to_all_single + sum": all_to_all_sum,
        "all_gather_into_tensor": lambda: c10d.wait_tensor(c10d.all_gather_into_tensor(shard, world, group)),
        "all_gather_by_send_recv": lambda: c10d.wait_tensor(ops.all_gather_by_send_recv(shard, world, group, 1)),
    }
    same = torch.equal(c10d.wait_tensor(c10d.reduce_scatter_tensor(bucket, "sum", world, group)), all_to_all_sum())
    same &= torch.equal(variants["all_gather_into_tensor"](), variants["all_gather_by_send_recv"]())
    wall = {name: [] for name in variants}
    cpu = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, call in variants.items():
            dist.barrier()
            started, cpu_started = time.perf_counter(), cpu_seconds()
            for _ in range(args.calls):
                call()
            cpu[name].append((cpu_seconds() - cpu_started) / args.calls)
            wall[name].append((time.perf_counter() - started) / args.calls)
    if rank == 0:
        print(f"{world} gloo ranks, one {args.mib:g} MiB fp32 bucket, median of {args.rounds} rounds of "
              f"{args.calls} calls; replacements equal the originals bit for bit: {same}")
        print("| collective | wall ms / call | CPU ms / call / rank |")
        print("|---|---:|---:|")
        for name in variants:
            print(f"| {name} | {statistics.median(wall[name]) * 1e3:.2f} | {statistics.median(cpu[name]) * 1e3:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
