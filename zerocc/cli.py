"""``zerocc plan``: plan a job of any world size on this machine, print the per-rank memory table, plot it.

    zerocc plan --model examples.gpt:GPT --model-kwargs '{"layers": 36, "d_model": 4096, "heads": 32,
                "seq": 1024, "vocab": 51200}' --inputs long:1x1024 long:1x1024 \\
                --world-size 1,4,16,64,256,1024 --stage 1,2,3 --param-dtype bfloat16 --plot plan.png

The factory (``module:callable``) is called under ``torch.device("meta")``
(``--device`` changes that) and returns the model, or ``(model,
example_inputs)``. Inputs given with ``--inputs`` are ``dtype:shape``
(``long:8x1024``), built on the model's device.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time

import torch

GB = 1e9   # decimal gigabytes, as the ZeRO paper counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zerocc", description="ZeRO data parallelism as a compiler")
    commands = parser.add_subparsers(dest="command", required=True)
    planning = commands.add_parser("plan", help="plan a training step for a world size, without devices",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    planning.add_argument("--model", required=True, help="module:factory returning a model or (model, inputs)")
    planning.add_argument("--model-kwargs", default="{}", help="JSON keyword arguments for the factory")
    planning.add_argument("--inputs", nargs="*", default=[], help="example inputs as dtype:shape, e.g. long:1x1024")
    planning.add_argument("--world-size", default="1024", help="one or more, comma-separated")
    planning.add_argument("--stage", default="3", help="one or more of 0,1,2,3, comma-separated")
    planning.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS))
    planning.add_argument("--lr", type=float, default=1e-4)
    planning.add_argument("--param-dtype", default=None, help="bfloat16 or float16: mixed-precision accounting")
    planning.add_argument("--bucket-mb", type=float, default=4.0, help="bucket size in MiB")
    planning.add_argument("--device", default="meta", help="device the factory builds the model on")
    planning.add_argument("--plot", default="zerocc_plan.png", help="where to write the plot ('' for none)")
    planning.add_argument("--dump-dir", default=None, help="write the program after every pass here")
    planning.add_argument("--explain", action="store_true", help="print what every pass decided, per plan")
    planning.add_argument("--json", default=None, help="write every plan's report here")
    args = parser.parse_args(argv)
    return plan_command(args)


OPTIMIZERS = {
    "adamw": lambda p, lr: torch.optim.AdamW(p, lr=lr),
    "adam": lambda p, lr: torch.optim.Adam(p, lr=lr),
    "sgd": lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9),
}


def load_factory(spec: str):
    if ":" not in spec:
        raise SystemExit(f"--model {spec!r}: expected module:factory, e.g. examples.gpt:GPT")
    module_name, attribute = spec.split(":", 1)
    sys.path.insert(0, os.getcwd())
    if module_name.endswith(".py") or os.sep in module_name:
        loaded = importlib.util.spec_from_file_location("zerocc_user_model", module_name)
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    return getattr(module, attribute)


def parse_input(text: str, device) -> torch.Tensor:
    dtype_name, _, shape = text.partition(":")
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise SystemExit(f"--inputs {text!r}: unknown dtype {dtype_name!r} (long, float32, bfloat16, ...)")
    sizes = [int(s) for s in shape.split("x") if s]
    return torch.zeros(sizes, dtype=dtype, device=device)


def plan_command(args) -> int:
    from .planning import Planner
    started = time.perf_counter()

    def say(line: str) -> None:
        print(f"[zerocc plan {time.perf_counter() - started:6.1f} s] {line}", file=sys.stderr, flush=True)

    factory = load_factory(args.model)
    with torch.device(args.device):
        built = factory(**json.loads(args.model_kwargs))
    model, inputs = (built if isinstance(built, tuple) else (built, None))
    if inputs is None:
        if not args.inputs:
            raise SystemExit("give the example inputs with --inputs dtype:shape ... (or return them from the factory)")
        inputs = tuple(parse_input(text, args.device) for text in args.inputs)
    param_count = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    say(f"built {type(model).__name__} with {param_count:,} parameters on {args.device}")
    optimizer = OPTIMIZERS[args.optimizer](model.parameters(), args.lr)
    param_dtype = getattr(torch, args.param_dtype) if args.param_dtype else None
    planner = Planner(model, optimizer, example_inputs=inputs, accounting_dtype=param_dtype,
                      bucket_bytes=int(args.bucket_mb * 1024 * 1024), progress=say)
    stages = [int(s) for s in str(args.stage).split(",")]
    world_sizes = [int(w) for w in str(args.world_size).split(",")]
    rows, reports = [], []
    for stage in stages:
        for world_size in world_sizes:
            plan = planner.plan(stage, world_size, dump_dir=args.dump_dir)
            report = plan.report()
            reports.append(report)
            held = report["model_state_bytes_per_rank"]
            rows.append((stage, world_size, held["params"], held["grads"], held["optimizer"], sum(held.values()),
                         sum(report["comm_bytes_per_step"].values())))
            if args.explain:
                print(plan.explain() + "\n")
    print(table(rows, param_count, param_dtype or next(model.parameters()).dtype))
    print(f"\nplanned {len(rows)} configuration(s) in {time.perf_counter() - started:.1f} s "
          f"({'mixed-precision accounting: ' + str(param_dtype).replace('torch.', '') + ' params/grads, fp32 master + optimizer state' if param_dtype else 'as compiled'})")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(reports, file, indent=1, default=str)
    if args.plot:
        written = plot(rows, args.plot, f"{type(model).__name__}, {param_count / 1e9:.2f}B parameters")
        if written:
            print(f"plot: {written}")
    return 0


def table(rows, param_count: int, dtype) -> str:
    lines = [f"model states per rank (GB = 1e9 bytes), {param_count:,} parameters, "
             f"{str(dtype).replace('torch.', '')} compute:",
             f"{'stage':>5} {'ranks':>6} {'params':>10} {'grads':>10} {'optimizer':>10} {'total':>10} {'comm/step':>10}"]
    for stage, world_size, params, grads, optimizer, total, comm in rows:
        lines.append(f"{stage:>5} {world_size:>6} {params / GB:>10.3f} {grads / GB:>10.3f} {optimizer / GB:>10.3f} "
                     f"{total / GB:>10.3f} {comm / GB:>10.3f}")
    return "\n".join(lines)


def plot(rows, path: str, title: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return None
    figure, axis = plt.subplots(figsize=(6, 4))
    for stage in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == stage]
        axis.plot([r[1] for r in mine], [r[5] / GB for r in mine], marker="o", label=f"stage {stage}")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("ranks (data-parallel degree)")
    axis.set_ylabel("model states per rank (GB)")
    axis.set_title(title)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
