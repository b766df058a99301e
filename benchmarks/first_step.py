"""What a run pays before it trains: first, second and steady step of zerocc (cold and warm cache) and FSDP2.

    python benchmarks/first_step.py --model 98m|705m [--systems FSDP2,zerocc-cold,zerocc-warm] [--steps 3]

Issue 21's targets, as ratios within one run: zerocc-3's first step (compile
included) at most 1.2x FSDP2's first step; with a warm compile cache
(``cache_dir``, zerocc/disk_cache.py) the first step at most 1.2x the steady
step. Each system runs in its own new processes (2 gloo ranks, ``mp.spawn``)
one after the other, so a warm run finds only what the cold run wrote to disk.
``zerocc-cold`` compiles into a new cache folder and stores; ``zerocc-warm``
loads from it. FSDP2 wraps every block and the root (``fully_shard``,
reshard after forward). Every system trains ``compare.py``'s GPT of
``--model`` with AdamW; each step is timed on rank 0 between barriers. The
model's construction is not timed (the same for every system); building the
step (``zerocc.compile`` or ``fully_shard`` and the optimizer) is.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare  # noqa: E402
import zerocc  # noqa: E402

SYSTEMS = ("FSDP2", "zerocc-cold", "zerocc-warm")


def _build(name: str, model, cache_dir: str):
    if name == "FSDP2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return compare.eager_step(model, compare.make_optimizer(model.parameters()))
    return zerocc.compile(model, compare.make_optimizer(model.parameters()), stage=3, cache_dir=cache_dir)


def run(rank: int, world_size: int, name: str, model_name: str, steps: int, port: int, cache_dir: str,
        results: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    compare.select_model(model_name)
    model = compare.make_model()
    dist.barrier()
    started = time.perf_counter()
    step = _build(name, model, cache_dir)
    build_seconds = time.perf_counter() - started
    generator = torch.Generator().manual_seed(rank)
    seconds = []
    for _ in range(steps):
        tokens, targets = compare.model_batch(generator)
        dist.barrier()
        started = time.perf_counter()
        step(tokens, targets)
        seconds.append(time.perf_counter() - started)
    if rank == 0:
        outcome = "-"
        if isinstance(step, zerocc.CompiledStep):
            report = step.report()
            phases = ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in report["compile_seconds_by_phase"].items()
                               if seconds >= 0.1)
            outcome = f"{report['compile_cache']}; compile {report['compile_seconds']:.2f} s: {phases}"
        with open(results, "w") as file:
            file.write(" ".join(map(str, [build_seconds, *seconds])) + "\n" + outcome)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(compare.MODELS), default="98m")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--port", type=int, default=29531)
    args = parser.parse_args()
    names = args.systems.split(",")
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}: choose from {', '.join(SYSTEMS)}")
    if args.steps < 2:   # the table's columns: the first, the second and the steady step
        parser.error("--steps: at least 2 (a first and a second step)")
    if "zerocc-warm" in names and "zerocc-cold" not in names:
        raise SystemExit("zerocc-warm loads what zerocc-cold stored in this run: list zerocc-cold before it")
    compare.select_model(args.model)
    with torch.device("meta"):
        params = sum(p.numel() for p in compare.make_model().parameters())
    print(f"GPT {args.model} ({params / 1e6:.1f}M parameters), {args.world_size} gloo ranks, "
          f"{compare.BATCH[0]} x {compare.MODEL.get('seq', 128)} tokens per rank, AdamW; "
          f"load average {os.getloadavg()[0]:.1f}\n", flush=True)
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        for index, name in enumerate(names):
            results = os.path.join(folder, f"{name}.txt")
            mp.spawn(run, args=(args.world_size, name, args.model, args.steps, args.port + index,
                                os.path.join(folder, "cache"), results), nprocs=args.world_size)
            with open(results) as file:
                numbers, outcome = file.read().split("\n", 1)
            rows[name] = ([float(v) for v in numbers.split()], outcome)
            build, first, *rest = rows[name][0]
            print(f"{name}: build {build:.2f} s, steps " + ", ".join(f"{s:.2f}" for s in [first, *rest]) +
                  f" s ({outcome})", flush=True)
    fsdp_first = rows["FSDP2"][0][1] if "FSDP2" in rows else None
    print("\n| system | build s | first step s | second step s | steady step s | first / steady | "
          "build + first / FSDP2's |\n|---|---:|---:|---:|---:|---:|---:|")
    for name, ((build, first, second, *rest), _) in rows.items():
        steady = rest[-1] if rest else second
        versus = f"{(build + first) / (rows['FSDP2'][0][0] + fsdp_first):.2f}" if fsdp_first else "-"
        print(f"| {name} | {build:.2f} | {first:.2f} | {second:.2f} | {steady:.2f} | {first / steady:.2f} | "
              f"{versus} |")
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
