"""Where one steady-state step's time goes, per system: torch.profiler's top ops and page faults.

    torchrun --standalone --nproc_per_node 2 benchmarks/profile_step.py --systems DDP,zerocc-3

Builds each system as ``benchmarks/compare.py`` does (same GPT, same data),
takes ``--warmup`` steps, then times ``--steps`` steps while counting the
process's minor page faults (``getrusage``: a fault is a page the allocator
got back from the OS and touches again), and profiles one more step with
``torch.profiler`` (rank 0 prints its ops by self CPU time). Run it with and
without ``compare.py --malloc tuned``'s environment to see the allocator's
share.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare  # noqa: E402  (sets DeepSpeed's environment, puts zerocc and examples on the path)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--systems", default="DDP,zerocc-3")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(1000 + rank)
    data = [compare.model_batch(generator) for _ in range(args.warmup + args.steps + 1)]
    for name in args.systems.split(","):
        step = compare.system(name)()
        for i in range(args.warmup):
            step(*data[i])
        dist.barrier()
        times, faults = [], []
        for i in range(args.steps):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            started = time.perf_counter()
            step(*data[args.warmup + i])
            times.append(time.perf_counter() - started)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            step(*data[-1])
        if rank == 0:
            print(f"== {name}: median step {statistics.median(times) * 1e3:.1f} ms, "
                  f"minor page faults per step {statistics.median(faults):.0f} "
                  f"({statistics.median(faults) * 4096 / 2**20:.0f} MiB touched afresh)", flush=True)
            print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top), flush=True)
        del step
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
