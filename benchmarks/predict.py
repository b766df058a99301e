"""How far the cost model's step time is from a measured one (issue 19: "state the prediction's error").

    torchrun --standalone --nproc_per_node 2 benchmarks/predict.py [--models 5m,98m] [--steps 6]
    python benchmarks/predict.py --models 5m            # world size 1

Every rank measures this machine (``zerocc.measure_hardware()``: matmul and
elementwise rates, per-op overhead, the group's all-gather latency and
bandwidth), then for each model and configuration compiles the example GPT
(``examples/gpt.py``; batches as ``benchmarks/compare.py``'s), runs two
steps, times ``--steps`` more (the median, the slowest rank's) and asks
``step.predicted_step_time(profile)`` (``zerocc/analysis/step_time.py``)
for the last program. Rank 0 prints a table: measured, predicted, the error
``predicted / measured - 1`` and what the prediction is made of.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import zerocc  # noqa: E402
from gpt import GPT  # noqa: E402

MODELS = {"5m": (dict(), 4), "98m": (dict(vocab=8192, d_model=768, layers=12, heads=12, seq=128), 2)}
# (label, compile keywords): the default plans, and at stage 3 the fastest (every forward gather kept)
CONFIGURATIONS = [("stage 0", dict(stage=0)), ("stage 1", dict(stage=1)), ("stage 3", dict(stage=3)),
                  ("stage 3, fastest plan", dict(stage=3, memory_budget=10**12)),
                  ("stage 3, no memory pools", dict(stage=3, memory_pools=False))]


def measure(model_name: str, options: dict, steps: int, world: int, rank: int):
    config, sequences = MODELS[model_name]
    torch.manual_seed(0)
    model = GPT(**config)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-4), **options)
    generator = torch.Generator().manual_seed(1 + rank)
    vocab, seq = model.wte.num_embeddings, model.wpe.num_embeddings
    data = [torch.randint(0, vocab, (sequences, seq + 1), generator=generator) for _ in range(steps + 2)]
    for tokens in data[:2]:
        step(tokens[:, :-1], tokens[:, 1:])
    times = []
    for tokens in data[2:]:
        if world > 1:
            dist.barrier()
        started = time.perf_counter()
        step(tokens[:, :-1], tokens[:, 1:])
        times.append(time.perf_counter() - started)
    seconds = torch.tensor([statistics.median(times)])
    if world > 1:
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return step, float(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="5m,98m")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    profile = zerocc.measure_hardware(device="cpu")
    rows = []
    for model_name in args.models.split(","):
        for label, options in CONFIGURATIONS:
            if world == 1 and options.get("memory_budget"):
                continue   # one rank gathers nothing: the same plan as stage 3
            step, measured = measure(model_name, options, args.steps, world, rank)
            predicted = step.predicted_step_time(profile)
            rows.append((model_name, label, measured, predicted))
            if rank == 0:
                print(f"{model_name} {label}: measured {measured * 1e3:.1f} ms; {predicted}", flush=True)
            del step
    if rank == 0:
        lines = [f"# Predicted against measured step time, {world} gloo rank(s)", "",
                 f"`{'torchrun --standalone --nproc_per_node ' + str(world) if world > 1 else 'python'} "
                 f"benchmarks/predict.py {' '.join(sys.argv[1:])}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
                 f"torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}.", "",
                 f"Profile: {profile.name}: matmul {profile.matmul_flops_per_s / 1e9:.1f} GFLOP/s, memory "
                 f"{profile.memory_bytes_per_s / 1e9:.1f} GB/s, {profile.op_overhead_s * 1e6:.1f} us per op, link "
                 f"{profile.link_latency_s * 1e6:.0f} us + {profile.link_bytes_per_s / 1e9:.2f} GB/s, "
                 f"compute beside communication {profile.overlap:.0%}.", "",
                 "| model | configuration | measured ms | predicted ms | error | compute ms | communication ms | exposed ms |",
                 "|---|---|---:|---:|---:|---:|---:|---:|"]
        for model_name, label, measured, predicted in rows:
            lines.append(f"| {model_name} | {label} | {measured * 1e3:.1f} | {predicted.seconds * 1e3:.1f} | "
                         f"{predicted.seconds / measured - 1:+.0%} | {predicted.compute_seconds * 1e3:.1f} | "
                         f"{predicted.communication_seconds * 1e3:.1f} | {predicted.exposed_seconds * 1e3:.1f} |")
        errors = [abs(p.seconds / m - 1) for _, _, m, p in rows]
        lines += ["", f"Mean absolute error {statistics.mean(errors):.0%}, largest {max(errors):.0%}."]
        text = "\n".join(lines) + "\n"
        print(text)
        if args.out:
            with open(args.out, "w") as handle:
                handle.write(text)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
