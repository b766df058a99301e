"""One command for a lent GPU: zerocc against eager, torch.compile and FSDP2 at world size 1 (issue 19).

    python benchmarks/gpu.py [--model 124m|705m|tiny] [--precision fp32|bf16] [--rounds 5] [--steps 5]
                             [--systems eager,torch.compile,FSDP2,zerocc-0,zerocc-3] [--out FILE.md] [--profile TOP]

Every system trains the example GPT (``examples/gpt.py``) from the same
initial weights on the same batches, with AdamW (``foreach``, as PyTorch
picks on CUDA):

- ``eager``: plain PyTorch; ``torch.compile``: the model compiled (default
  mode), the optimizer eager; ``FSDP2``: ``fully_shard`` per block and at the
  root on a one-rank NCCL group; ``zerocc-0`` / ``zerocc-3``:
  ``zerocc.compile(stage=0|3)``, no other options (on CUDA the step is
  planned against the device's free memory, ``zerocc/device_budget.py``).
- ``--precision fp32`` (TF32 matmuls allowed for every system) or ``bf16``:
  eager and torch.compile under ``torch.autocast(bf16)``, FSDP2 with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, zerocc with
  ``param_dtype=bf16, reduce_dtype=fp32``: each system's own mixed precision.

Measured, with the same method for every system:

- **memory and the first step**: each system alone in a new process (the CUDA
  caching allocator keeps what it reserved, so systems sharing a process
  would share a high-water mark): seconds to build plus the first step
  (compiles included), then ``--steps`` steps; the peak the allocator
  reserved and the peak allocated over the whole run (CPU: peak RSS);
- **step time**: every system built in one process and timed in ``--rounds``
  rounds of ``--steps`` steps each, the order rotating every round; a step
  is timed between device synchronizations; the median over rounds;
- **MFU**: the model FLOPs of one step (``torch.utils.flop_counter`` over an
  eager forward and backward, the optimizer's elementwise work left out)
  over the step time and the device's dense peak for the precision (H100
  SXM: 989 TFLOP/s bf16, 495 TF32; unknown devices: no MFU).

``--device cpu`` runs the same on CPU with gloo (a smoke test of the
script; ``--model tiny``). Writes a markdown table (stdout, and ``--out``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import zerocc  # noqa: E402
from gpt import GPT  # noqa: E402

# the model and batch (sequences of the model's length) per name
MODELS = {
    "tiny": (dict(vocab=512, d_model=64, layers=2, heads=4, seq=32), 2),
    "124m": (dict(vocab=50304, d_model=768, layers=12, heads=12, seq=1024), 8),   # GPT-2 small's shape
    "705m": (dict(vocab=8192, d_model=1536, layers=24, heads=16, seq=1024), 8),   # issue 21's model, longer sequences
}
SYSTEMS = ("eager", "torch.compile", "FSDP2", "zerocc-0", "zerocc-3")

# dense peak FLOP/s by device name and precision (vendor datasheets)
PEAKS = {"H100 PCIe": {"bf16": 756e12, "fp32": 378e12}, "H100 NVL": {"bf16": 835e12, "fp32": 418e12},
         "H100": {"bf16": 989e12, "fp32": 495e12}, "H200": {"bf16": 989e12, "fp32": 495e12},
         "A100": {"bf16": 312e12, "fp32": 156e12}}


def peak_flops(device: torch.device, precision: str) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAKS.items():   # the more specific names first
        if key in name:
            return peaks[precision]
    return None


def make_model(args, device):
    torch.manual_seed(0)
    return GPT(**MODELS[args.model][0]).to(device)


def make_batches(args, device, count):
    config, sequences = MODELS[args.model]
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config["vocab"], (count, sequences, config["seq"] + 1), generator=generator)
    return [(t[:, :-1].to(device), t[:, 1:].to(device)) for t in tokens]


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)


def build(name: str, args, device):
    """A function ``step(tokens, targets) -> loss`` training ``name``'s system."""
    model = make_model(args, device)
    bf16 = args.precision == "bf16"
    if name.startswith("zerocc-"):
        precision = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else {}
        return zerocc.compile(model, make_optimizer(model.parameters()), stage=int(name[-1]), **precision)
    if name == "FSDP2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(device.type, (1,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        forward = model
    elif name == "torch.compile":
        forward = torch.compile(model)
    elif name == "eager":
        forward = model
    else:
        raise SystemExit(f"unknown system {name!r}; the systems are {', '.join(SYSTEMS)}")
    optimizer = make_optimizer(model.parameters())
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 and name != "FSDP2" \
        else contextlib.nullcontext

    def step(tokens, targets):
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = forward(tokens, targets)
        loss.backward()
        optimizer.step()
        return loss.detach()
    return step


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_flops(args, device) -> int:
    """FLOPs of one eager forward and backward of the model on one batch (fp32; the optimizer left out)."""
    from torch.utils.flop_counter import FlopCounterMode
    model = make_model(args, device)
    tokens, targets = make_batches(args, device, 1)[0]
    with FlopCounterMode(display=False) as counter:
        model(tokens, targets).backward()
    return counter.get_total_flops()


def init_group(device):
    """A one-rank process group (FSDP2 needs one; zerocc runs in it as at world size 1)."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)   # torch 2.11 refuses a device without an index here


def alone(name: str, args, device) -> dict:
    """``name`` alone in this process: build + first step seconds, peak memory over ``--steps`` more, last loss."""
    init_group(device)
    data = make_batches(args, device, args.steps + 1)
    synchronize(device)
    started = time.perf_counter()
    step = build(name, args, device)
    loss = step(*data[0])
    synchronize(device)
    first = time.perf_counter() - started
    for batch in data[1:]:
        loss = step(*batch)
    synchronize(device)
    result = {"first_step_s": first, "loss": float(loss)}
    if device.type == "cuda":
        result.update(reserved_bytes=torch.cuda.max_memory_reserved(device),
                      allocated_bytes=torch.cuda.max_memory_allocated(device))
    else:
        result.update(peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if name.startswith("zerocc-"):
        result["zerocc_planned_peak_bytes"] = step.report()["planned_peak_bytes"]
    return result


def interleaved(names, args, device) -> tuple[dict[str, float], dict]:
    """Median seconds per step of each system, built together and timed in rotating rounds; and the steps."""
    init_group(device)
    steps = {name: build(name, args, device) for name in names}
    data = make_batches(args, device, args.steps)
    for step in steps.values():   # compiles and warm-up out of the timing
        for batch in data[:2]:
            step(*batch)
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in order:
            synchronize(device)
            started = time.perf_counter()
            for batch in data:
                steps[name](*batch)
            synchronize(device)
            times[name].append((time.perf_counter() - started) / len(data))
    return {name: statistics.median(values) for name, values in times.items()}, steps


def profiled(steps: dict, args, device) -> str:
    """One more step of each system under torch.profiler: its wall time, the device's busy time (the sum of its
    kernels), the number of kernels and of aten calls, and the top ops by self device time (CPU: self CPU time)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    batch = make_batches(args, device, 1)[0]
    summary = ["| system | profiled step ms | device busy ms | kernels | aten calls |", "|---|---:|---:|---:|---:|"]
    tables = []
    for name, step in steps.items():
        synchronize(device)
        with profile(activities=activities) as prof:
            started = time.perf_counter()
            step(*batch)
            synchronize(device)
            wall = time.perf_counter() - started
        events = prof.events()
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e3 if cuda else float("nan")
        aten = sum(1 for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::"))
        summary.append(f"| {name} | {wall * 1e3:.1f} | {busy:.1f} | {len(kernels)} | {aten} |")
        tables.append(f"### {name}\n\n```\n{prof.key_averages().table(sort_by=sort, row_limit=args.profile)}\n```")
    return "\n".join(["## One profiled step per system", "", *summary, "", *tables]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="124m")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="then profile one step of each system and list its TOP ops")
    parser.add_argument("--alone", help=argparse.SUPPRESS)   # the child process measuring one system
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if args.alone:
        print(json.dumps(alone(args.alone, args, device)))
        return
    names = args.systems.split(",")
    config, sequences = MODELS[args.model]
    params = sum(p.numel() for p in make_model(args, torch.device("cpu")).parameters())
    runs = {}
    for name in names:   # each alone in a new process: memory and the first step
        command = [sys.executable, os.path.abspath(__file__), "--alone", name, *sys.argv[1:]]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{name} failed alone:\n{done.stderr[-3000:]}", file=sys.stderr)
            runs[name] = None
            continue
        runs[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{name} alone: {runs[name]}", file=sys.stderr, flush=True)
    working = [name for name in names if runs[name] is not None]
    seconds, steps = interleaved(working, args, device)
    flops, peak = model_flops(args, device), peak_flops(device, args.precision)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    memory = "reserved GB | allocated GB" if device.type == "cuda" else "peak RSS GB | -"
    lines = [f"# zerocc against eager, torch.compile and FSDP2 on one {device_name}", "",
             f"`python benchmarks/gpu.py {' '.join(sys.argv[1:])}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"torch {torch.__version__}. GPT `{args.model}` ({params / 1e6:.1f}M parameters, {config}), "
             f"{sequences} x {config['seq']} tokens per step, AdamW, {args.precision}; {flops / 1e12:.2f} TFLOP per "
             f"step (forward + backward); median of {args.rounds} rotating rounds of {args.steps} steps.", "",
             f"| system | step ms | vs eager | MFU | build + first step s | {memory} | loss after {args.steps + 1} steps |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in names:
        run = runs[name]
        if run is None:
            lines.append(f"| {name} | failed (stderr above) | | | | | | |")
            continue
        step = seconds[name]
        ratio = f"{step / seconds['eager']:.2f}" if "eager" in seconds else "-"
        mfu = f"{flops / step / peak:.1%}" if peak else "-"
        held = (run.get("reserved_bytes", run.get("peak_rss_bytes", 0)) / 1e9, run.get("allocated_bytes", 0) / 1e9)
        lines.append(f"| {name} | {step * 1e3:.1f} | {ratio} | {mfu} | {run['first_step_s']:.1f} | {held[0]:.2f} | "
                     f"{held[1]:.2f} | {run['loss']:.4f} |")
    text = "\n".join(lines) + "\n"
    if args.profile:
        text += "\n" + profiled(steps, args, device)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
