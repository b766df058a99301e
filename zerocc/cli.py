"""``zerocc plan``: plan a job of any world size on this machine, print the per-rank memory table, plot it.

    zerocc plan --model examples.gpt:GPT --model-kwargs '{"layers": 36, "d_model": 4096, "heads": 32,
                "seq": 1024, "vocab": 51200}' --inputs long:1x1024 long:1x1024 \\
                --world-size 1,4,16,64,256,1024 --stage 1,2,3 --param-dtype bfloat16 --plot plan.png

``examples.gpt:GPT`` is the example GPT of zerocc's repository (run from its root); name your own the same
way: ``my_model:build`` imports my_model.py from the current folder, ``path/to/my_model.py:build`` loads a file.
The factory (``module:callable``) is called under ``torch.device("meta")``
(``--device`` changes that) and returns the model, or ``(model,
example_inputs)`` (a tuple, or a dict of keyword inputs). Inputs given with
``--inputs`` are ``dtype:shape`` (``long:8x1024``; ``bf16``, ``fp16``, ``fp32``
and torch's own names such as ``bfloat16``, ``half``, ``long`` are dtypes),
built on the model's device; ``name=dtype:shape`` passes one by keyword, as a
Hugging Face model takes its batch (``input_ids=long:1x1024
labels=long:1x1024``: the model returns its loss).

Mistakes in the arguments (a factory that does not import, bad JSON, a bad
shape, world size, dtype, device, bucket size or learning rate, a plot folder
that does not exist or a plot format matplotlib cannot write) are one line
on stderr and exit code 2, as argparse's own errors are; they are found
before planning starts.
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

# the table's unit: the largest whose value of the table's largest cell is at least 1 (decimal, as the ZeRO
# paper counts), so a small model's table does not read 0.000 everywhere
UNITS = (("TB", 10 ** 12), ("GB", 10 ** 9), ("MB", 10 ** 6), ("kB", 10 ** 3), ("B", 1))

# dtype names people write besides torch's own attribute names (torch.bfloat16, torch.half, torch.long, ...)
DTYPE_ALIASES = {"bf16": torch.bfloat16, "fp16": torch.float16, "f16": torch.float16, "fp32": torch.float32,
                 "f32": torch.float32, "fp64": torch.float64, "f64": torch.float64, "i32": torch.int32,
                 "i64": torch.int64}


class UsageError(Exception):
    """A bad command-line argument: printed as one line, exit code 2."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zerocc", description="ZeRO data parallelism as a compiler")
    commands = parser.add_subparsers(dest="command", required=True)
    planning = commands.add_parser("plan", help="plan a training step for a world size, without devices",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    planning.add_argument("--model", required=True, help="module:factory returning a model or (model, inputs)")
    planning.add_argument("--model-kwargs", default="{}", help="JSON keyword arguments for the factory")
    planning.add_argument("--inputs", nargs="*", default=[], help="example inputs as dtype:shape (long:1x1024), or name=dtype:shape by keyword")
    planning.add_argument("--world-size", default="1024", help="one or more, comma-separated")
    planning.add_argument("--stage", default="3", help="one or more of 0,1,2,3, comma-separated")
    planning.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS))
    planning.add_argument("--lr", type=float, default=1e-4)
    planning.add_argument("--param-dtype", default=None, help="bfloat16 or float16: mixed-precision accounting")
    planning.add_argument("--bucket-mb", type=float, default=4.0, help="bucket size in MiB")
    planning.add_argument("--device", default="meta", help="device the factory builds the model on")
    planning.add_argument("--plot", default="zerocc_plan.png", help="where to write the plot ('' for none)")
    planning.add_argument("--dump-dir", default=None, help="write the program after every pass here (with several "
                          "stages or world sizes, into stage<s>_world<n>/ per plan)")
    planning.add_argument("--explain", action="store_true", help="print what every pass decided, per plan")
    planning.add_argument("--json", default=None, help="write every plan's report here")
    args = parser.parse_args(argv)
    try:
        return plan_command(args)
    except UsageError as error:
        print(f"zerocc plan: error: {error}", file=sys.stderr)
        return 2


OPTIMIZERS = {
    "adamw": lambda p, lr: torch.optim.AdamW(p, lr=lr),
    "adam": lambda p, lr: torch.optim.Adam(p, lr=lr),
    "sgd": lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9),
}


def load_factory(spec: str):
    if ":" not in spec:
        raise UsageError(f"--model {spec!r}: expected module:factory, e.g. my_model:build (my_model.py in this folder) or path/to/my_model.py:build")
    module_name, attribute = spec.split(":", 1)
    if not module_name or not attribute:
        raise UsageError(f"--model {spec!r}: expected module:factory, e.g. my_model:build (my_model.py in this folder) or path/to/my_model.py:build")
    sys.path.insert(0, os.getcwd())
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            loaded = importlib.util.spec_from_file_location("zerocc_user_model", module_name)
            if loaded is None or not os.path.exists(module_name):
                raise UsageError(f"--model {spec!r}: no file {module_name!r}")
            module = importlib.util.module_from_spec(loaded)
            loaded.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as error:
        raise UsageError(f"--model {spec!r}: cannot import {module_name!r} ({error}); run from the folder that "
                         "holds it, or give a path: path/to/file.py:factory") from error
    if not hasattr(module, attribute):
        raise UsageError(f"--model {spec!r}: {module_name!r} has no attribute {attribute!r}")
    return getattr(module, attribute)


def parse_dtype(name: str, option: str) -> torch.dtype:
    dtype = DTYPE_ALIASES.get(name.lower(), getattr(torch, name, None))
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"{option}: unknown dtype {name!r}; use a torch dtype name (float32, bfloat16, float16, "
                         "long, ...) or bf16, fp16, fp32")
    return dtype


def parse_input(text: str, device) -> torch.Tensor:
    dtype_name, _, shape = text.partition(":")
    dtype = parse_dtype(dtype_name, f"--inputs {text!r}")
    try:
        sizes = [int(s) for s in shape.split("x") if s]
    except ValueError:
        sizes = None
    if not sizes or any(size < 0 for size in sizes):
        raise UsageError(f"--inputs {text!r}: the shape must be sizes joined by x, e.g. long:8x1024")
    return torch.zeros(sizes, dtype=dtype, device=device)


def parse_inputs(texts: list[str], device) -> tuple[tuple, dict]:
    """``--inputs``: positional ``dtype:shape`` first, then keyword ``name=dtype:shape``, as in a call."""
    positional, keywords = [], {}
    for text in texts:
        name, equals, spec = text.rpartition("=")
        if not equals:
            if keywords:
                raise UsageError(f"--inputs {text!r}: a positional input after a keyword one; give the "
                                 "dtype:shape ones first")
            positional.append(parse_input(text, device))
        elif not name.isidentifier() or name in keywords:
            raise UsageError(f"--inputs {text!r}: expected name=dtype:shape with a new keyword name, e.g. "
                             "input_ids=long:1x1024")
        else:
            keywords[name] = parse_input(spec, device)
    return tuple(positional), keywords


def parse_ints(text: str, option: str, allowed=None) -> list[int]:
    """'1,8,64' -> [1, 8, 64]; anything else is a one-line usage error."""
    try:
        values = [int(part) for part in str(text).split(",")]
    except ValueError:
        values = None
    if not values or any(v < 1 if allowed is None else v not in allowed for v in values):
        wanted = "positive ints" if allowed is None else f"some of {', '.join(map(str, allowed))}"
        raise UsageError(f"{option} {text!r}: expected {wanted}, comma-separated (e.g. {option} "
                         f"{'1,8,64' if allowed is None else '2,3'})")
    return values


def check_writable(path: str | None, option: str) -> None:
    """Before planning (minutes at a large world size): the file's folder exists."""
    folder = os.path.dirname(os.path.abspath(path)) if path else None
    if folder and not os.path.isdir(folder):
        raise UsageError(f"{option} {path!r}: the folder {folder!r} does not exist; create it or write elsewhere")


def check_plot_format(path: str) -> None:
    """The plot is written last, after every plan (minutes at a large world size): matplotlib must know its format."""
    extension = os.path.splitext(path)[1][1:].lower()
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return   # plot() says it cannot plot
    formats = FigureCanvasBase.get_supported_filetypes()
    if extension and extension not in formats:
        raise UsageError(f"--plot {path!r}: matplotlib writes no {extension!r} files; end the name with one of "
                         f"{', '.join('.' + f for f in sorted(formats))} (or --plot '' for no plot)")


def parse_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise UsageError(f"--device {name!r}: not a torch device; e.g. meta (the default), cpu, cuda") from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name!r}: this machine has no CUDA device; plan on meta (the default): it "
                         "needs no device")
    return device


def check_options(args) -> None:
    """The numeric options, before the model is built and planned."""
    if not args.bucket_mb > 0:
        raise UsageError(f"--bucket-mb {args.bucket_mb:g}: expected a positive size in MiB (e.g. 4, 0.5)")
    if not args.lr >= 0:
        raise UsageError(f"--lr {args.lr:g}: expected a non-negative learning rate")
    if args.dump_dir and os.path.exists(args.dump_dir) and not os.path.isdir(args.dump_dir):
        raise UsageError(f"--dump-dir {args.dump_dir!r} is a file, not a folder; give a folder's path (it is "
                         "created if missing)")


def plan_command(args) -> int:
    from .planning import Planner
    started = time.perf_counter()

    def say(line: str) -> None:
        print(f"[zerocc plan {time.perf_counter() - started:6.1f} s] {line}", file=sys.stderr, flush=True)

    stages = parse_ints(args.stage, "--stage", allowed=(0, 1, 2, 3))
    world_sizes = parse_ints(args.world_size, "--world-size")
    param_dtype = parse_dtype(args.param_dtype, "--param-dtype") if args.param_dtype else None
    if param_dtype is not None and not param_dtype.is_floating_point:
        raise UsageError(f"--param-dtype {args.param_dtype!r}: expected a floating dtype (bfloat16 or float16, the "
                         "bytes the ZeRO paper counts per parameter)")
    check_options(args)
    parse_device(args.device)
    check_writable(args.plot, "--plot")
    if args.plot:
        check_plot_format(args.plot)
    check_writable(args.json, "--json")
    try:
        model_kwargs = json.loads(args.model_kwargs)
    except json.JSONDecodeError as error:
        raise UsageError(f"--model-kwargs {args.model_kwargs!r}: not JSON ({error}); e.g. '{{\"layers\": 2}}'") \
            from error
    if not isinstance(model_kwargs, dict):
        raise UsageError(f"--model-kwargs {args.model_kwargs!r}: expected a JSON object of keyword arguments")
    factory = load_factory(args.model)
    with torch.device(args.device):
        try:
            built = factory(**model_kwargs)
        except TypeError as error:   # most often keyword arguments the factory does not take
            raise UsageError(f"--model {args.model!r} with --model-kwargs {args.model_kwargs!r}: {error}") from error
    model, inputs = (built if isinstance(built, tuple) else (built, None))
    keyword_inputs = {}
    if isinstance(inputs, dict):
        inputs, keyword_inputs = (), inputs
    elif inputs is None:
        if not args.inputs:
            raise UsageError("give the example inputs with --inputs dtype:shape ... (or return them from the factory)")
        inputs, keyword_inputs = parse_inputs(args.inputs, args.device)
    param_count = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    say(f"built {type(model).__name__} with {param_count:,} parameters on {args.device}")
    optimizer = OPTIMIZERS[args.optimizer](model.parameters(), args.lr)
    planner = Planner(model, optimizer, example_inputs=inputs, example_keyword_inputs=keyword_inputs,
                      accounting_dtype=param_dtype,
                      bucket_bytes=int(args.bucket_mb * 1024 * 1024), progress=say)
    rows, reports = [], []
    for stage in stages:
        for world_size in world_sizes:
            # several configurations: a folder each, or each plan's files would overwrite the one before
            dump_dir = args.dump_dir and (os.path.join(args.dump_dir, f"stage{stage}_world{world_size}")
                                          if len(stages) * len(world_sizes) > 1 else args.dump_dir)
            plan = planner.plan(stage, world_size, dump_dir=dump_dir)
            report = plan.report()
            reports.append(report)
            held = report["model_state_bytes_per_rank"]
            rows.append((stage, world_size, held["params"], held["grads"], held["optimizer"], sum(held.values()),
                         sum(report["comm_bytes_per_step"].values()), report["planned_peak_bytes"]))
            if args.explain:
                print(plan.explain() + "\n")
    print(table(rows, param_count, param_dtype or next(model.parameters()).dtype, accounting=param_dtype is not None))
    print("step peak: the most bytes the planned step holds at once on a rank (model states, gathered buckets, "
          "activations), as compiled" + (f" (in {str(next(model.parameters()).dtype).replace('torch.', '')}, not "
                                         "the accounting dtype)" if param_dtype is not None else ""))
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


def unit_for(largest: float) -> tuple[str, float]:
    """The largest decimal unit in which ``largest`` bytes read at least 1."""
    return next(((name, size) for name, size in UNITS if largest >= size), UNITS[-1])


def table(rows, param_count: int, dtype, accounting: bool = False) -> str:
    """The per-rank table; ``accounting``: ``--param-dtype`` counts bytes in ``dtype``, the plans compute as built."""
    unit, size = unit_for(max((max(row[2:]) for row in rows), default=0))
    lines = [f"model states per rank ({unit}{f' = 1e{len(str(size)) - 1} bytes' if size > 1 else ''}), {param_count:,} "
             f"parameters, {str(dtype).replace('torch.', '')} {'accounting' if accounting else 'compute'}:",
             f"{'stage':>5} {'ranks':>6} {'params':>10} {'grads':>10} {'optimizer':>10} {'total':>10} {'comm/step':>10}"
             f" {'step peak':>10}"]
    for stage, world_size, params, grads, optimizer, total, comm, peak in rows:
        lines.append(f"{stage:>5} {world_size:>6} {params / size:>10.3f} {grads / size:>10.3f} "
                     f"{optimizer / size:>10.3f} {total / size:>10.3f} {comm / size:>10.3f} {peak / size:>10.3f}")
    return "\n".join(lines)


def plot(rows, path: str, title: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return None
    unit, size = unit_for(max((r[5] for r in rows), default=0))
    figure, axis = plt.subplots(figsize=(6, 4))
    for stage in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == stage]
        axis.plot([r[1] for r in mine], [r[5] / size for r in mine], marker="o", label=f"stage {stage}")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("ranks (data-parallel degree)")
    axis.set_ylabel(f"model states per rank ({unit})")
    axis.set_title(title)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    # a name without an extension is written as .png (savefig's default format): say which file it wrote
    return path if os.path.splitext(path)[1] else f"{path}.{matplotlib.rcParams['savefig.format']}"
