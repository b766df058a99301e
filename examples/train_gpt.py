"""The main job: ZeRO-3 training of a small GPT on CPU processes, printing what the compiler did.

    torchrun --standalone --nproc_per_node 2 examples/train_gpt.py [--stage 3] [--steps 5]

Each rank trains on its slice of the global batch. Rank 0 prints the pass
pipeline, the graph after insert_collectives, the bucket plan, the memory
plan (one line per pool, and a picture of memory over the step in
memory_plan.png when matplotlib is installed) and the report; at the end
every rank checks that training matched one process on the global batch.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zerocc  # noqa: E402
from gpt import GPT, random_batch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="compute dtype (mixed precision: fp32 masters, gradients reduced in fp32; "
                             "float16 adds dynamic loss scaling)")
    parser.add_argument("--show-graph", action="store_true", help="print the whole final graph, not only its head")
    parser.add_argument("--plot", default="memory_plan.png", help="where to draw the memory plan (needs matplotlib)")
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    say = print if rank == 0 else (lambda *a, **k: None)

    torch.manual_seed(0)
    model = GPT(layers=args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    precision = {}
    if args.param_dtype != "float32":
        precision = {"param_dtype": getattr(torch, args.param_dtype), "reduce_dtype": torch.float32,
                     "loss_scale": "dynamic" if args.param_dtype == "float16" else None}
    step = zerocc.compile(model, optimizer, stage=args.stage, **precision)

    generator = torch.Generator().manual_seed(1)
    batches = [random_batch(generator, args.batch * world) for _ in range(args.steps)]
    say(f"zerocc: ZeRO-{args.stage}, {world} rank(s), GPT with "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    losses = []
    for number, (tokens, targets) in enumerate(batches):
        mine = slice(rank * args.batch, (rank + 1) * args.batch)
        started = time.perf_counter()
        loss = step(tokens[mine], targets[mine])
        losses.append(loss)
        say(f"step {number}: loss {loss.item():.4f}  ({time.perf_counter() - started:.2f} s)")

    say("\npasses:", " -> ".join(step.passes))
    for name in step.passes:
        say(str(step.graph(name)).splitlines()[0])
    final = str(step.graph("insert_collectives"))
    say("\n" + (final if args.show_graph else "\n".join(final.splitlines()[2:40]) + "\n    ... (--show-graph for all)"))
    say("\nbuckets (this rank owns 1/%d of each):" % (world if args.stage else 1))
    for bucket in step.shard_plan.buckets:
        names = [step.state.captured.params[i].name for i in bucket.params]
        say(f"  bucket {bucket.index}: {bucket.numel:>9,} elements, {len(names):2} params: {', '.join(names[:4])}"
            + (" ..." if len(names) > 4 else ""))
    say("\nmemory plan (bytes per rank; print(step.memory_plan) for every buffer):")
    say("  " + step.memory_plan.summary().replace("\n", "\n  "))
    if rank == 0 and args.plot:
        try:
            say(f"  drawn in {step.memory_plan.plot(args.plot)}")
        except ImportError as error:
            say(f"  (no picture: {error})")
    report = step.report()
    say("\nreport:")
    for key, value in report.items():
        say(f"  {key}: {value}")

    # the contract: the same as one process training on the global batch
    full = step.full_state_dict()
    torch.manual_seed(0)
    reference = GPT(layers=args.layers)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.1)
    for tokens, targets in batches:
        reference_optimizer.zero_grad()
        reference(tokens, targets).backward()
        reference_optimizer.step()
    error = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    say(f"\nlargest parameter difference against one process on the global batch (fp32): {error:.2e}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
