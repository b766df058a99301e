"""Where compile time goes: seconds per phase of a compiled step and of a plan (issue 21).

    python benchmarks/compile_time.py step --model 5m|98m [--world-size 2] [--stage 3]
    python benchmarks/compile_time.py plan [--layers 36] [--world-size 1024]
    python benchmarks/compile_time.py budget --model 5m|98m [--fraction 0.85] [--world-size 2]
    python benchmarks/compile_time.py cache --model 5m|98m [--world-size 2]

``step``: the example GPT (``examples/gpt.py``; 5m: its defaults, 6 layers
of d_model 256, 5.03M parameters; 98m: 12 layers of d_model 768, vocabulary
8192, 98M parameters), sequence 128, 2 sequences per rank, AdamW, trained on
``--world-size`` gloo processes on this machine. Rank 0 prints the first,
second and third step's seconds (the first two compile the first-step and
the steady-state programs) and a table per compiled program of seconds per
phase (``step.compile_stats``, ``zerocc/compile_stats.py``). ``--groups
layerwise``: the param groups of layer-wise learning-rate decay (a group
per block and per decayed or undecayed parameters, and the embeddings':
26 for the 98m), as fine-tuning scripts build them.

``cache``: the compile cache on disk (``cache_dir``, zerocc/disk_cache.py):
``step`` twice, each in new processes, over one new cache folder: the
first run compiles and stores, the second loads. Prints both runs' steps
and the warm first step as a multiple of the steady step (issue 21's
target: at most 1.2x).

``plan``: one fresh ``zerocc.plan`` (capture included) of the ZeRO paper's
GPT shape (d_model 4096, sequence 1024; 36 layers: 7.66B parameters with
``plan_scaling.py``'s vocabulary) at stage 3 on the meta device, and its
seconds per phase. The depth sweep is ``benchmarks/plan_scaling.py``.

``budget``: what a ``memory_budget`` costs a compile (issue 19's target: at
most 1.5x an unbudgeted one). ``zerocc.plan`` of the step's GPT at
``--world-size`` ranks, stage 3, default options, once without a budget
(after one warm-up plan) and once with ``--fraction`` of that plan's
planned peak as the budget; prints both times, their ratio, how many
candidate plans ``place_remat`` measured and the seconds per phase of each;
then the plan without a budget on a device offering 10x that peak
(``device_memory``: what ``compile`` does on a roomy GPU).
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zerocc  # noqa: E402
from gpt import GPT  # noqa: E402

MODELS = {
    "5m": dict(),   # examples/gpt.py's defaults: the benchmark GPT
    "98m": dict(vocab=8192, d_model=768, layers=12, heads=12, seq=128),
}
SEQUENCES_PER_RANK = 2


def phase_table(records) -> str:
    """One markdown table: a row per phase, a column of seconds per compiled program."""
    phases: list[str] = []
    for record in records:
        phases += [phase for phase in record.seconds if phase not in phases]
    lines = ["| phase | " + " | ".join(f"{r.program} s" for r in records) + " |",
             "|---|" + "---:|" * len(records)]
    for phase in phases:
        lines.append(f"| {phase} | " + " | ".join(f"{r.seconds.get(phase, 0.0):.2f}" for r in records) + " |")
    lines.append("| **total** | " + " | ".join(f"**{r.total:.2f}**" for r in records) + " |")
    return "\n".join(lines)


def layerwise(model, lr=1e-4, decay=0.8) -> list[dict]:
    """A param group per block and per decayed (weights) or undecayed (biases, norms) parameters, the deeper
    blocks' lr larger: layer-wise learning-rate decay."""
    groups: dict = {}
    for name, param in model.named_parameters():
        layer = int(name.split(".")[1]) if name.startswith("blocks.") else -1
        groups.setdefault((layer, param.dim() > 1), []).append(param)
    layers = max(layer for layer, _ in groups) + 1
    return [{"params": params, "lr": lr * decay ** (layers - layer), "weight_decay": 0.1 if decayed else 0.0}
            for (layer, decayed), params in groups.items()]


def train(rank: int, world_size: int, model_name: str, stage: int, port: int, cache_dir: str | None = None,
          results: str | None = None, groups: str = "one") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = GPT(**MODELS[model_name])
    optimizer = torch.optim.AdamW(model.parameters() if groups == "one" else layerwise(model), lr=1e-4)
    step = zerocc.compile(model, optimizer, stage=stage, **({"cache_dir": cache_dir} if cache_dir else {}))
    generator = torch.Generator().manual_seed(rank)
    seq, vocab = model.wpe.num_embeddings, model.wte.num_embeddings
    seconds = []
    for _ in range(3):
        tokens = torch.randint(0, vocab, (SEQUENCES_PER_RANK, seq + 1), generator=generator)
        dist.barrier()
        started = time.perf_counter()
        step(tokens[:, :-1], tokens[:, 1:])
        seconds.append(time.perf_counter() - started)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters()) if stage == 0 else step.report()["param_count"]
        print(f"GPT {model_name} ({params / 1e6:.1f}M parameters), stage {stage}, {world_size} gloo ranks, "
              f"{SEQUENCES_PER_RANK} x {seq} tokens per rank, {len(optimizer.param_groups)} param group(s)")
        print(f"first step {seconds[0]:.2f} s, second {seconds[1]:.2f} s, third (steady) {seconds[2]:.2f} s; "
              f"compile_seconds {step.compile_seconds:.2f}\n")
        if cache_dir:
            print(f"compile cache: {step.report()['compile_cache']}")
        if hasattr(step, "compile_stats"):   # absent before zerocc/compile_stats.py: totals only
            print(phase_table(step.compile_stats), flush=True)
        if results:
            with open(results, "w") as file:
                file.write(" ".join(map(str, seconds)))
    dist.destroy_process_group()


def cache(model_name: str, stage: int, world_size: int, port: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        runs = []
        for name in ("cold (compiles, stores)", "warm (loads)"):
            print(f"\n## {name}\n", flush=True)
            results = os.path.join(folder, "seconds")
            mp.spawn(train, args=(world_size, model_name, stage, port, os.path.join(folder, "cache"), results),
                     nprocs=world_size)
            with open(results) as file:
                runs.append([float(v) for v in file.read().split()])
            port += 1
    (cold, warm) = runs
    print(f"\nfirst step: cold {cold[0]:.2f} s, warm {warm[0]:.2f} s; steady {warm[2]:.2f} s; "
          f"warm first step / steady step {warm[0] / warm[2]:.2f}x")


def plan(layers: int, world_size: int) -> None:
    from plan_scaling import plan_once
    planned, seconds = plan_once(layers, world_size)
    print(f"zerocc.plan: {layers} layers, {planned.report()['param_count'] / 1e9:.2f}B parameters, stage 3, "
          f"{world_size} ranks: {seconds:.1f} s\n")
    if getattr(planned, "compile_stats", None) is not None:
        print(phase_table([planned.compile_stats]), flush=True)


def budget(model_name: str, fraction: float, world_size: int) -> None:
    torch.manual_seed(0)
    model = GPT(**MODELS[model_name])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.zeros(SEQUENCES_PER_RANK, model.wpe.num_embeddings, dtype=torch.long)

    def timed(memory_budget, device_memory=None):
        started = time.perf_counter()
        planned = zerocc.plan(model, optimizer, stage=3, world_size=world_size, example_inputs=(tokens, tokens),
                              memory_budget=memory_budget, device_memory=device_memory)
        return planned, time.perf_counter() - started
    timed(None)   # warm-up: first-call costs (imports, dispatch caches) land on neither side
    free, free_seconds = timed(None)
    peak = free.memory_plan.planned_peak_bytes
    budgeted, budgeted_seconds = timed(int(peak * fraction))
    remat = budgeted.remat_plan
    print(f"zerocc.plan, GPT {model_name}, stage 3, {world_size} ranks: no budget {free_seconds:.2f} s "
          f"(planned peak {peak / 1e6:.1f} MB); budget {fraction} of it {budgeted_seconds:.2f} s "
          f"({budgeted_seconds / free_seconds:.2f}x; peak {budgeted.memory_plan.planned_peak_bytes / 1e6:.1f} MB, "
          f"{remat.evaluations} plans measured of {remat.candidates} candidates)")
    # without a budget, on a device with room for the fastest plan (zerocc/device_budget.py): checked, not measured
    roomy, roomy_seconds = timed(None, device_memory=peak * 10)
    print(f"no budget, a device offering 10x that peak: {roomy_seconds:.2f} s ({roomy_seconds / free_seconds:.2f}x; "
          f"peak {roomy.memory_plan.planned_peak_bytes / 1e6:.1f} MB, fastest plan "
          f"{roomy.remat_plan.unbounded_schedule})\n")
    if getattr(budgeted, "compile_stats", None) is not None:
        print(phase_table([free.compile_stats, budgeted.compile_stats, roomy.compile_stats]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("step", "plan", "budget", "cache"))
    parser.add_argument("--model", choices=sorted(MODELS), default="5m")
    parser.add_argument("--world-size", type=int)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--port", type=int, default=29517)
    parser.add_argument("--fraction", type=float, default=0.85)
    parser.add_argument("--groups", choices=("one", "layerwise"), default="one")
    args = parser.parse_args()
    if args.part == "step":
        world_size = args.world_size or 2
        mp.spawn(train, args=(world_size, args.model, args.stage, args.port, None, None, args.groups), nprocs=world_size)
    elif args.part == "cache":
        cache(args.model, args.stage, args.world_size or 2, args.port)
    elif args.part == "budget":
        budget(args.model, args.fraction, args.world_size or 2)
    else:
        plan(args.layers, args.world_size or 1024)


if __name__ == "__main__":
    main()
