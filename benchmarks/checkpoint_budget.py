"""Peak memory against step time: zerocc's memory_budget next to torch.utils.checkpoint per block by hand.

The baseline is the usual one: eager PyTorch with the first ``n`` blocks of
the GPT (``examples/gpt.py``) wrapped in ``checkpoint(block, x,
use_reentrant=False)``, n = 0 .. layers. (zerocc also trains that model as
written, ``zerocc/model_recomputation.py``; here it gets the unwrapped one
and a budget, to compare its planner's choice with the hand placement.) Each
side is compared with its own run without recomputation, at the same number
of bytes saved:

  - eager, n blocks checkpointed: peak P_n (measured: every live storage,
    parameters, gradients and optimizer state included), step time T_n;
  - zerocc, ``memory_budget = Z_0 - (P_0 - P_n)``, Z_0 being zerocc's own
    peak without a budget: the planner must save what checkpointing n blocks
    saved. Peaks are the memory plan's live peak and the measured peak of the
    steady-state program.

Recompute time is each side's step time less its own time without
recomputation. Every configuration (both sides, every n) is built first,
then timed in ``--rounds`` interleaved rounds, one step of each per round
(the order reversed every other round); a configuration's times are its
fastest step (the least disturbed) and its median step (what load on the
machine does to it, the same for every configuration). Timing each configuration in its own block of steps, one after
the other, let a burst of load elsewhere on this shared two-core machine, or
the process's drift (the allocator's state after each compile), land on some
configurations only: that measured eager's checkpointing of 4.8-12.1 extra
GFLOP as free (-0.007 to +0.005 s) and zerocc's recomputation of layer norms
and GELUs alone (no matmul FLOPs) as +0.09 s, where interleaved rounds give
both a cost in line with what they recompute. Minor page faults per step
(``getrusage``: pages the allocator got back from the OS and touches afresh)
are reported too: both sides touch less fresh memory as they save more.
Writes a markdown table and a PNG (bytes saved against extra step time).

    PYTHONPATH=. python benchmarks/checkpoint_budget.py --layers 6 --rounds 20 --out benchmarks/checkpoint_budget
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

import zerocc
from examples.gpt import GPT, random_batch
from zerocc.errors import MemoryBudgetError
from zerocc.runtime.memory import LiveBytesTracker


class CheckpointedGPT(GPT):
    """The GPT with its first ``checkpointed`` blocks under ``torch.utils.checkpoint``."""

    def __init__(self, checkpointed: int = 0, **settings):
        super().__init__(**settings)
        self.checkpointed = checkpointed

    def forward(self, tokens, targets):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for index, block in enumerate(self.blocks):
            x = checkpoint.checkpoint(block, x, use_reentrant=False) if index < self.checkpointed else block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def _time_interleaved(steps: dict, rounds: int) -> dict:
    """Each step's fastest time and median minor page faults over ``rounds`` rounds of one step of each."""
    times: dict = {key: [] for key in steps}
    faults: dict = {key: [] for key in steps}
    order = list(steps)
    for round_ in range(rounds):
        for key in order if round_ % 2 == 0 else reversed(order):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            started = time.perf_counter()
            steps[key]()
            times[key].append(time.perf_counter() - started)
            faults[key].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    # the fastest: the least disturbed step (other jobs share this machine's two cores)
    return {key: (min(times[key]), statistics.median(times[key]), statistics.median(faults[key])) for key in steps}


# The flop counter has formulas for the CUDA attention kernels only: CPU's flash attention counted the same way
# (attention is recomputed by both sides, so leaving it out would hide part of the recomputation).
_CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        lambda query, key, value, *args, **kwargs: sdpa_flop_count(query, key, value),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda grad, query, key, value, *args, **kwargs: sdpa_backward_flop_count(grad, query, key, value),
}


def _flops(step) -> int:
    """FLOPs of one step as torch.utils.flop_counter counts them (matmuls, attention): no timing noise."""
    with FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION) as counter:
        step()
    return counter.get_total_flops()


def _batch(settings, args):
    return random_batch(torch.Generator().manual_seed(1), args.batch, settings["seq"], settings["vocab"])


def run_eager(settings, args, checkpointed) -> dict:
    """Eager PyTorch with the first ``checkpointed`` blocks under torch.utils.checkpoint."""
    torch.manual_seed(0)
    model = CheckpointedGPT(checkpointed, **settings)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, targets = _batch(settings, args)

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(tokens, targets).backward()
        optimizer.step()
    for _ in range(2):
        step()
    held = [*model.parameters(), tokens, targets,
            *[t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]]
    with LiveBytesTracker(held) as tracker:
        del held
        step()
    return {"measured": tracker.peak_bytes, "flops": _flops(step)}, step


def run_zerocc(settings, args, memory_budget=None) -> dict:
    torch.manual_seed(0)
    model = GPT(**settings)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=args.stage,
                          memory_budget=memory_budget)
    batch = _batch(settings, args)
    for _ in range(2):   # the first step's program and the steady state's
        step(*batch)
    flops = _flops(lambda: step(*batch))
    report = step.report()
    plan = step.remat_plan
    return {"live": report["live_peak_bytes"], "measured": report["measured_peak_bytes"], "flops": flops,
            "compile": report["compile_seconds"], "extra_flops": plan.extra_flops if plan is not None else 0,
            "recomputed": sum(1 for r in plan.recomputed if r.bytes) if plan is not None else 0}, \
        lambda: step(*batch)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)   # activations dominate; at 4 the optimizer phase peaks
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10, help="interleaved timing rounds")
    parser.add_argument("--out", default="benchmarks/checkpoint_budget")
    args = parser.parse_args()
    settings = {"vocab": 1024, "d_model": args.d_model, "layers": args.layers, "heads": 8, "seq": args.seq}

    steps = {}
    eager = []
    for blocks in range(args.layers + 1):
        result, steps[("eager", blocks)] = run_eager(settings, args, blocks)
        eager.append(result)
        print(f"eager, {blocks} blocks checkpointed: {result}", flush=True)
    base, steps[("zerocc", 0)] = run_zerocc(settings, args)
    zerocc_rows = [(None, base)]
    print(f"zerocc, no budget: {base}", flush=True)
    for blocks in range(1, args.layers + 1):
        budget = base["live"] - (eager[0]["measured"] - eager[blocks]["measured"])
        try:
            result, steps[("zerocc", blocks)] = run_zerocc(settings, args, budget)
        except MemoryBudgetError as error:
            print(f"memory_budget={budget:,}: {str(error).splitlines()[0]}", flush=True)
            result = None
        zerocc_rows.append((budget, result))
        print(f"zerocc, memory_budget={budget:,} (saving what {blocks} checkpointed blocks save): {result}", flush=True)
    for key, (fastest, median, faults) in _time_interleaved(steps, args.rounds).items():
        side, blocks = key
        row = eager[blocks] if side == "eager" else zerocc_rows[blocks][1]
        row.update(seconds=fastest, median_seconds=median, faults=faults)
        print(f"{side}, n = {blocks}: fastest {fastest:.3f} s, median {median:.3f} s, {faults:.0f} minor page "
              "faults per step", flush=True)
    write_table(eager, zerocc_rows, args, settings)
    plot(eager, zerocc_rows, args)


def write_table(eager, zerocc_rows, args, settings):
    lines = [f"GPT {settings}, batch {args.batch}, AdamW, one process; zerocc at stage {args.stage}. "
             f"Step time: fastest and median of {args.rounds} steady-state steps, timed in interleaved rounds (one "
             "step of every configuration per round); faults: median minor page faults per step; GFLOP: one step under "
             "torch.utils.flop_counter (matmuls and attention). Peaks in bytes (measured); 'saved' and 'extra' "
             "are against the same side's run without recomputation.", "",
             "| n | eager + checkpoint: peak | saved | extra GFLOP | step (s): fastest, median | extra (s): fastest, "
             "median | faults | zerocc budget | live peak (plan) | measured peak | saved | extra GFLOP | "
             "step (s): fastest, median | extra (s): fastest, median | faults | "
             "tensors recomputed | compile (s) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = zerocc_rows[0][1]
    for blocks, (mine, (budget, ours)) in enumerate(zip(eager, zerocc_rows)):
        left = (f"| {blocks} | {mine['measured']:,} | {eager[0]['measured'] - mine['measured']:,} | "
                f"{(mine['flops'] - eager[0]['flops']) / 1e9:.2f} | {_times(mine, eager[0])} | {mine['faults']:,.0f} |")
        if ours is None:
            lines.append(left + f" {budget:,} | cannot reach | | | | | | | | |")
            continue
        lines.append(left + f" {'none' if budget is None else f'{budget:,}'} | {ours['live']:,} | "
                     f"{ours['measured']:,} | {base['measured'] - ours['measured']:,} | "
                     f"{(ours['flops'] - base['flops']) / 1e9:.2f} | {_times(ours, base)} | "
                     f"{ours['faults']:,.0f} | {ours['recomputed']} | "
                     f"{ours['compile']:.1f} |")
    with open(args.out + ".md", "w") as file:
        file.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def _times(row, reference) -> str:
    """'fastest, median | extra fastest, extra median' against the same side's run without recomputation."""
    return (f"{row['seconds']:.3f}, {row['median_seconds']:.3f} | {row['seconds'] - reference['seconds']:+.3f}, "
            f"{row['median_seconds'] - reference['median_seconds']:+.3f}")


def plot(eager, zerocc_rows, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    base = zerocc_rows[0][1]
    sides = {
        "eager + torch.utils.checkpoint, first n blocks": (eager[0], list(enumerate(eager))),
        "zerocc memory_budget (same bytes saved)": (base, [(n, r) for n, (_, r) in enumerate(zerocc_rows) if r]),
    }
    curves = ((axes[0], "seconds", 1.0, "", "-"), (axes[0], "median_seconds", 1.0, ", median step", ":"),
              (axes[1], "flops", 1e9, "", "-"))
    for axis, key, scale, suffix, style in curves:
        for (label, (reference, rows)), marker, color in zip(sides.items(), ("o", "s"), ("C0", "C1")):
            points = [((reference["measured"] - r["measured"]) / 1e6, (r[key] - reference[key]) / scale, n)
                      for n, r in rows]
            axis.plot([p[0] for p in points], [p[1] for p in points], style, marker=marker, color=color,
                      label=label + suffix, alpha=1.0 if style == "-" else 0.5)
            for x, y, n in points if style == "-" else ():
                axis.annotate(str(n), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    for axis, title in zip(axes, ("extra step time (s): fastest (solid), median (dotted)",
                                  "extra GFLOP per step (flop counter)")):
        axis.axhline(0, color="black", lw=0.6)
        axis.set_xlabel("peak memory saved per rank (MB, measured)")
        axis.set_ylabel(title)
    axes[0].legend(fontsize=8)
    figure.suptitle("GPT: memory saved against recomputation (n: blocks checkpointed / matched)")
    figure.tight_layout()
    figure.savefig(args.out + ".png", dpi=110)


if __name__ == "__main__":
    main()
