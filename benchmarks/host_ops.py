"""What the host does per step at world size 1: aten ops dispatched and time outside the program, eager beside zerocc.

    python benchmarks/host_ops.py [--layers 12] [--stage 0] [--foreach-as-on-cuda]

On a GPU every dispatched op and every Python line around the program is host time the step waits for
(``docs/performance.md``, "On a GPU"); this counts them on the CPU, where it can run anywhere. The example GPT
(``examples/gpt.py``) with a small width and ``--layers`` layers (the module tree and the parameter count of the
124M model at 12 layers, none of its compute), AdamW; after three warm-up steps one step of each is counted with a
``TorchDispatchMode`` (every aten op, views included), then 20 steps of zerocc are timed, splitting off the time
inside ``Program.run``. ``--foreach-as-on-cuda`` makes the CPU a foreach device for eager and zerocc alike, as
torch.optim picks on CUDA.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
import zerocc  # noqa: E402
from gpt import GPT  # noqa: E402
from tests.helpers import OpCalls, foreach_as_on_cuda  # noqa: E402
from zerocc.runtime import program as program_module  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--foreach-as-on-cuda", action="store_true")
    args = parser.parse_args()
    with foreach_as_on_cuda() if args.foreach_as_on_cuda else contextlib.nullcontext():
        config = dict(vocab=512, d_model=64, layers=args.layers, heads=4, seq=32)
        torch.manual_seed(0)
        model, reference = GPT(**config), GPT(**config)
        reference.load_state_dict(model.state_dict())
        step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=args.stage)
        optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)

        def eager(tokens, targets):
            optimizer.zero_grad(set_to_none=True)
            reference(tokens, targets).backward()
            optimizer.step()
        generator = torch.Generator().manual_seed(1)
        data = [(torch.randint(0, 512, (2, 32), generator=generator),) * 2 for _ in range(24)]
        for batch in data[:3]:
            step(*batch)
            eager(*batch)
        with OpCalls() as program_calls:
            step(*data[3])
        with OpCalls() as eager_calls:
            eager(*data[3])
        inside = [0.0]
        run = program_module.Program.run

        def timed(self, *arguments, **keywords):
            started = time.perf_counter()
            try:
                return run(self, *arguments, **keywords)
            finally:
                inside[0] += time.perf_counter() - started
        program_module.Program.run = timed
        started = time.perf_counter()
        for batch in data[4:]:
            step(*batch)
        total = (time.perf_counter() - started) / len(data[4:])
        program_module.Program.run = run
    parameters = sum(p.numel() for p in model.parameters()) if args.stage != 3 else "-"
    print(f"GPT of {args.layers} layers ({len(list(reference.parameters()))} parameter tensors, {parameters} elements), "
          f"stage {args.stage}, world size 1{', foreach as on CUDA' if args.foreach_as_on_cuda else ''}")
    print(f"aten ops dispatched per step: eager {sum(eager_calls.calls.values()):,} (foreach {eager_calls.foreach()}), "
          f"zerocc {sum(program_calls.calls.values()):,} (foreach {program_calls.foreach()})")
    print(f"zerocc per call: {total * 1e3:.2f} ms, of which outside the program {(total - inside[0] / len(data[4:])) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
