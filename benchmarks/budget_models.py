"""The memory budget on models other than the benchmark GPT: planned against measured peaks, and training unchanged.

For each model and stage: the step without a budget (its steady-state ``planned_peak_bytes`` is the reference
peak), then the step under ``memory_budget`` at fractions of that peak. Each run trains ``--steps`` steps
seeded alike and records the steady state's planned and measured peaks, whether the plan and the measurement fit
the budget, whether losses and parameters equal the unbudgeted step's bit for bit, and the error raised, if any.
World 1 also compares the unbudgeted step against eager PyTorch bit for bit.

    PYTHONPATH=. python benchmarks/budget_models.py --models llama vit --stages 0 3 --out /tmp/budget.jsonl
    PYTHONPATH=. torchrun --standalone --nproc_per_node 2 benchmarks/budget_models.py --models llama --out ...

Writes one JSON line per run (rank 0 only); ``--table`` prints the markdown table of a JSON-lines file.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import zerocc
from zerocc.errors import MemoryBudgetError

FRACTIONS = (1.2, 0.9, 0.7, 0.5, 0.05)   # the last: a budget nothing reaches (model states alone exceed it)


def _models():
    from tests import architectures, zoo

    def keyword(name):
        return zoo.ZOO[name].build, lambda steps, rows: zoo.batches(name, steps, rows=rows), True

    def positional(name):
        return (lambda: architectures.build_architecture(name),
                lambda steps, rows: architectures.architecture_batches(name, steps, rows), False)

    return {"llama": keyword("llama"), "mixtral": keyword("mixtral"), "qwen2_moe": keyword("qwen2_moe"),
            "vit": keyword("vit"), "hf_resnet": keyword("resnet"), "t5": keyword("t5"),
            "resnet_bn": positional("resnet"), "unet": positional("unet")}


def _call(target, batch, keyword):
    out = target(**batch) if keyword else target(*batch)
    return out.loss if hasattr(out, "loss") else out


def _slice(batch, rank, world, keyword):
    def part(t):
        return t.chunk(world)[rank] if isinstance(t, torch.Tensor) else t
    return {k: part(v) for k, v in batch.items()} if keyword else tuple(part(t) for t in batch)


def _eager(build, data, keyword):
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for number, batch in enumerate(data):
        torch.manual_seed(100 + number)
        optimizer.zero_grad(set_to_none=True)
        loss = _call(model, batch, keyword)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses, dict(model.state_dict())


def _train(build, data, keyword, stage, **options):
    model = build()
    start = time.perf_counter()
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=stage, **options)
    losses, report = [], None
    for number, batch in enumerate(data):
        torch.manual_seed(100 + number)
        losses.append(step(**batch) if keyword else step(*batch))
        report = step.report()
    return step, losses, report, time.perf_counter() - start


def _equal(losses, state, want_losses, want_state):
    return all(torch.equal(a, b) for a, b in zip(losses, want_losses)) and \
        all(torch.equal(state[k], v) for k, v in want_state.items())


def sweep(name, stages, fractions, steps, rows, options):
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    build, make_batches, keyword = _models()[name]
    data = [_slice(b, rank, world, keyword) for b in make_batches(steps, rows * world)]
    for stage in stages:
        base = {"model": name, "world": world, "stage": stage, **{k: str(v) for k, v in options.items()}}
        try:
            step, losses, report, seconds = _train(build, data, keyword, stage, **options)
        except Exception as error:   # noqa: BLE001 (the table records it)
            yield {**base, "fraction": None, "error": f"{type(error).__name__}: {str(error)[:300]}"}
            continue
        reference_state = step.full_state_dict()
        eager_equal = None
        if world == 1 and not options:
            eager_equal = _equal(losses, reference_state, *_eager(build, data, keyword))
        peak = report["planned_peak_bytes"] or report["live_peak_bytes"]
        yield {**base, "fraction": None, "budget": None, "planned": peak, "measured": report["measured_peak_bytes"],
               "equal_eager": eager_equal, "seconds": round(seconds, 1)}
        for fraction in fractions:
            budget = int(peak * fraction)
            row = {**base, "fraction": fraction, "budget": budget}
            try:
                got, got_losses, got_report, seconds = _train(build, data, keyword, stage, memory_budget=budget,
                                                              **options)
            except MemoryBudgetError as error:
                yield {**row, "error": f"MemoryBudgetError: {str(error)[:400]}",
                       "smallest": error.smallest_peak_bytes}
                continue
            except Exception as error:   # noqa: BLE001
                yield {**row, "error": f"{type(error).__name__}: {str(error)[:400]}"}
                continue
            planned = got_report["planned_peak_bytes"] or got_report["live_peak_bytes"]
            plan = got.remat_plan
            yield {**row, "planned": planned, "measured": got_report["measured_peak_bytes"],
                   "plan_fits": planned <= budget, "fits": got_report["measured_peak_bytes"] <= budget,
                   "equal_unbudgeted": _equal(got_losses, got.full_state_dict(), losses, reference_state),
                   "recomputed": len(plan.recomputed) if plan is not None else 0,
                   "bucket_bytes": got.shard_plan.bucket_bytes if got.shard_plan is not None else None,
                   "seconds": round(seconds, 1)}


def table(path):
    rows = [json.loads(line) for line in open(path)]
    print("| model | world | stage | options | fraction | budget | planned | measured | measured/planned | plan fits | "
          "fits | bit for bit | note |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        options = ", ".join(f"{k}={r[k]}" for k in ("param_dtype", "grad_accumulation", "memory_pools") if k in r)
        planned, measured = r.get("planned"), r.get("measured")
        ratio = f"{measured / planned:.3f}" if planned and measured else ""
        equal = r.get("equal_eager") if r["fraction"] is None else r.get("equal_unbudgeted")
        note = r.get("error", "")[:120].replace("|", "/").replace("\n", " ")
        print(f"| {r['model']} | {r['world']} | {r['stage']} | {options} | {r['fraction'] or 'none'} | "
              f"{r.get('budget') or ''} | {planned or ''} | {measured or ''} | {ratio} | {r.get('plan_fits', '')} | "
              f"{r.get('fits', '')} | {'' if equal is None else equal} | {note} |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=list(_models()))
    parser.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3])
    parser.add_argument("--fractions", nargs="+", type=float, default=list(FRACTIONS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rows", type=int, default=2, help="batch rows per rank")
    parser.add_argument("--param-dtype", default=None)
    parser.add_argument("--grad-accumulation", type=int, default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--table", default=None, help="print the table of this JSON-lines file and exit")
    args = parser.parse_args()
    if args.table:
        return table(args.table)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    options = {}
    if args.param_dtype:
        options["param_dtype"] = getattr(torch, args.param_dtype)
    if args.grad_accumulation:
        options["grad_accumulation"] = args.grad_accumulation
    out = open(args.out, "a") if args.out and (not dist.is_initialized() or dist.get_rank() == 0) else None
    for name in args.models:
        for row in sweep(name, args.stages, args.fractions, args.steps, args.rows, options):
            if out is not None:
                out.write(json.dumps(row) + "\n")
                out.flush()
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(json.dumps(row), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
