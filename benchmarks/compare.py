"""zerocc stages 0-3 against DDP, FSDP2 and DeepSpeed ZeRO 1-3, side by side, on the same GPT and data.

    pip install torch==2.13.0 -e ".[bench]"
    torchrun --standalone --nproc_per_node 2 benchmarks/compare.py

Every system trains ``examples/gpt.py``'s ``GPT()`` (5.03M parameters, 6
layers, d_model 256, vocab 1024, seq 128; ``--model 98m``: 97.9M parameters,
12 layers, d_model 768, vocab 8192, 2 sequences per rank) with AdamW from the
same initialization on the same batches (4 sequences per rank), on gloo.
Besides the default systems, ``--systems`` takes the memory-saving
configurations a user of a peer would try: ``DDP+AC``, ``FSDP2+AC`` (per-block
activation checkpointing, non-reentrant, applied before sharding as
torchtitan does), ``FSDP2-noreshard`` and ``FSDP2-noreshard+AC``
(``reshard_after_forward=False``); ``benchmarks/frontier.py`` runs them all
beside a sweep of zerocc's ``memory_budget``.

Per system, in this order:
  - build it and take ``--warmup`` steps (zerocc compiles here);
  - one step under ``MemTracker`` (torch.distributed._tools.mem_tracker), which
    was also active while the system was built: every tensor the system
    allocates through the dispatcher, C++ buffers such as DDP's gradient
    buckets included, is counted from allocation to release; the peak of that
    step is the "peak live bytes". The same step counts the collectives issued
    and their volume as the ZeRO paper counts it (an all-gather or a
    reduce-scatter moves the full tensor's bytes, an all-reduce twice them);
  - then every system is timed, interleaved: ``--repeats`` rounds, each round
    running ``--steps`` steps of every system, the order rotating from round
    to round so that machine noise falls on every system alike. Besides the
    wall-clock step time, the process's CPU time per step is taken (every
    thread: compute and gloo's communication threads), which is steadier than
    wall-clock time on a machine shared with other jobs, and counts what
    communication costs on a CPU, where it competes with compute for cores.
Every system takes the same number of steps, so the final losses compare.

``--malloc tuned`` re-executes every rank, before anything is imported,
with glibc's allocator told to keep freed memory (``TUNED_MALLOC``: no
mmap for blocks under 32 MiB, no trimming below 4 GiB, 256 MiB of top
pad), so that large blocks freed in one step are reused in the next instead
of being returned to the OS and faulted back in. Every system shares the
process, so every system runs under the same allocator settings.

Writes benchmarks/results/compare[-tuned].{md,json,png} (rank 0) and prints the table;
with ``--malloc tuned`` the table also lists the rows of the last default run
(compare.json) beside the tuned ones, marked by their allocator.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
import time

# glibc reads these once, at start-up: --malloc tuned re-executes the process with them
TUNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "4294967296",
                "MALLOC_TOP_PAD_": "268435456"}


def _reexec_with_malloc_settings() -> None:
    """Under ``--malloc tuned``, replace this process by itself with TUNED_MALLOC in its environment."""
    tuned = "--malloc=tuned" in sys.argv or any(a == "--malloc" and b == "tuned" for a, b in zip(sys.argv, sys.argv[1:]))
    if tuned and any(os.environ.get(k) != v for k, v in TUNED_MALLOC.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **TUNED_MALLOC})


_reexec_with_malloc_settings()   # before torch is imported: the same pid, so torchrun keeps watching it

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("DS_BUILD_OPS", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed._tools.mem_tracker import MemTracker  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, ".."))
import zerocc  # noqa: E402
from zerocc.runtime.comm_counter import CountCollectives  # noqa: E402
from gpt import GPT, random_batch  # noqa: E402

LR = 1e-3
# --model: the GPT every system trains (examples/gpt.py's arguments) and sequences per rank
MODELS = {
    "5m": (dict(), 4),
    "98m": (dict(vocab=8192, d_model=768, layers=12, heads=12, seq=128), 2),
    "705m": (dict(vocab=8192, d_model=1536, layers=24, heads=16, seq=128), 1),   # issue 21's compile-time model
}
MODEL = dict(MODELS["5m"][0])   # set from --model before any system is built
BATCH = [MODELS["5m"][1]]        # sequences per rank, set from --model


def select_model(name):
    """Every system from now on trains the GPT of ``--model name`` with its sequences per rank."""
    MODEL.update(MODELS[name][0])
    BATCH[0] = MODELS[name][1]


def model_batch(generator):
    """(tokens, targets) of one rank's batch for the selected model."""
    return random_batch(generator, BATCH[0], MODEL.get("seq", 128), MODEL.get("vocab", 1024))


def make_model():
    torch.manual_seed(0)
    return GPT(**MODEL)
# DeepSpeed's defaults (5e8-element buckets) allocate a 1.9 GiB buffer; these are sized like
# zerocc's 4 MiB buckets (in elements: 1M fp32 elements = 4 MiB).
DS_BUCKET_ELEMENTS = 1 << 20


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=LR)


# -- the systems: each is (name, build() -> step(tokens, targets) -> loss) ------------------------------------

ZEROCC_OPTIONS = {}   # bucket_bytes / prefetch_bytes from the command line, else zerocc's defaults


def build_zerocc(stage, bucket_bytes=None, memory_pools=False, disable=(), prefetch_bytes=None, memory_budget=None):
    options = dict(ZEROCC_OPTIONS, **({} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}))
    if prefetch_bytes is not None:
        options["prefetch_bytes"] = prefetch_bytes
    if memory_budget is not None:
        options["memory_budget"] = memory_budget
    if memory_pools:
        options["memory_pools"] = True
    if disable:
        options["disable"] = list(disable)

    def build():
        model = make_model()
        return zerocc.compile(model, make_optimizer(model.parameters()), stage=stage, **options).__call__
    return build


def system(name):
    """The builder for ``name``: one of SYSTEMS, or a zerocc variant
    ``zerocc-<stage>[@<bucket MiB>][^<prefetch MiB>][~<memory budget MiB>][+pools][-<pass>...]``
    (``-<pass>``: compiled with that pass disabled, e.g. ``zerocc-3-overlap_updates``; ``^32``:
    ``prefetch_bytes`` of 32 MiB; ``~88.5``: ``memory_budget`` of 88.5 MiB)."""
    if name in SYSTEMS:
        return SYSTEMS[name]
    match = re.fullmatch(r"zerocc-([0-3])(?:@([0-9.]+))?(?:\^([0-9.]+))?(?:~([0-9.]+))?(\+pools)?((?:-[a-z_]+)*)", name)
    if match is None:
        raise SystemExit(f"unknown system {name!r}: one of {', '.join(SYSTEMS)} or "
                         f"zerocc-<stage>[@<bucket MiB>][^<prefetch MiB>][~<memory budget MiB>][+pools][-<pass>...]")
    bucket_bytes = None if match[2] is None else int(float(match[2]) * 2**20)
    prefetch_bytes, memory_budget = (None if m is None else int(float(m) * 2**20) for m in (match[3], match[4]))
    disable = tuple(match[6].split("-")[1:])
    return build_zerocc(int(match[1]), bucket_bytes, memory_pools=match[5] is not None, disable=disable,
                        prefetch_bytes=prefetch_bytes, memory_budget=memory_budget)


def eager_step(model, optimizer):
    """One plain PyTorch training step of ``model`` (DDP- or FSDP2-wrapped), as a callable."""
    def step(tokens, targets):
        optimizer.zero_grad(set_to_none=True)
        loss = model(tokens, targets)
        loss.backward()
        optimizer.step()
        return loss.detach()
    return step


def checkpoint_blocks(model):
    """Per-block activation checkpointing, as torchtitan applies it before sharding (non-reentrant)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block)
    return model


def build_ddp(checkpointed=False):
    def build():
        from torch.nn.parallel import DistributedDataParallel
        model = make_model()
        model = DistributedDataParallel(checkpoint_blocks(model) if checkpointed else model)
        optimizer = make_optimizer(model.parameters())
        return eager_step(model, optimizer)
    return build


def build_fsdp2(reshard_after_forward=True, checkpointed=False):
    def build():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        model = make_model()
        if checkpointed:
            checkpoint_blocks(model)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
        optimizer = make_optimizer(model.parameters())
        return eager_step(model, optimizer)
    return build


def build_deepspeed(stage):
    def build():
        import deepspeed
        model = make_model()
        zero = {"stage": stage, "reduce_bucket_size": DS_BUCKET_ELEMENTS, "allgather_bucket_size": DS_BUCKET_ELEMENTS,
                "overlap_comm": True, "contiguous_gradients": True}
        if stage == 3:
            zero.update({"stage3_prefetch_bucket_size": DS_BUCKET_ELEMENTS, "stage3_max_live_parameters": 4 * DS_BUCKET_ELEMENTS,
                         "stage3_max_reuse_distance": 4 * DS_BUCKET_ELEMENTS, "stage3_param_persistence_threshold": 1 << 12})
        config = {"train_micro_batch_size_per_gpu": BATCH[0], "gradient_accumulation_steps": 1,
                  "zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30,
                  "wall_clock_breakdown": False}
        plain = torch.nn.functional.linear
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=make_optimizer,
                                          config=config, dist_init_required=False)
        # ZeRO-3 replaces torch.nn.functional.linear process-wide with its own autograd.Function ("this will persist
        # unless manually reset"): every system built or stepped after it would run, and zerocc would trace,
        # DeepSpeed's linear (issue 19: frontier's budgeted compiles, built after DeepSpeed-3, traced it and named a
        # floor of 56,536,576 bytes against zerocc.plan's 56,257,536). DeepSpeed keeps its linear for its own steps.
        own = torch.nn.functional.linear
        torch.nn.functional.linear = plain

        def step(tokens, targets):
            torch.nn.functional.linear = own
            try:
                loss = engine(tokens, targets)
                engine.backward(loss)
                engine.step()
            finally:
                torch.nn.functional.linear = plain
            return loss.detach()
        return step
    return build


SYSTEMS = {
    "zerocc-0": build_zerocc(0), "zerocc-1": build_zerocc(1), "zerocc-2": build_zerocc(2), "zerocc-3": build_zerocc(3),
    "DDP": build_ddp(), "FSDP2": build_fsdp2(),
    # the configurations a user would try for memory: FSDP2 keeping gathered blocks after forward
    # (reshard_after_forward=False), and per-block activation checkpointing (+AC)
    "DDP+AC": build_ddp(checkpointed=True), "FSDP2-noreshard": build_fsdp2(reshard_after_forward=False),
    "FSDP2+AC": build_fsdp2(checkpointed=True),
    "FSDP2-noreshard+AC": build_fsdp2(reshard_after_forward=False, checkpointed=True),
    "DeepSpeed-1": build_deepspeed(1), "DeepSpeed-2": build_deepspeed(2), "DeepSpeed-3": build_deepspeed(3),
}

DEFAULT_SYSTEMS = ("zerocc-0", "zerocc-1", "zerocc-2", "zerocc-3", "DDP", "FSDP2", "DeepSpeed-1", "DeepSpeed-2",
                   "DeepSpeed-3")


# -- measuring ------------------------------------------------------------------------------------------------

def barrier():
    dist.barrier()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), default="5m",
                        help="5m: examples/gpt.py's defaults, 4 sequences per rank; 98m: 12 layers of d_model 768, "
                             "vocabulary 8192, 2 sequences per rank")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                        help="comma-separated; zerocc-3@1 is stage 3 with 1 MiB buckets, zerocc-3+pools with memory_pools=True")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per system per round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--bucket-bytes", type=int, help="zerocc's bucket_bytes (default: zerocc's)")
    parser.add_argument("--prefetch-bytes", type=int, help="zerocc's prefetch_bytes (default: zerocc's)")
    parser.add_argument("--malloc", choices=("default", "tuned", "mallopt"), default="default",
                        help="tuned: re-execute with TUNED_MALLOC (glibc keeps freed memory); mallopt: the same "
                             "through zerocc.keep_freed_host_memory() at start; either for every system alike")
    args = parser.parse_args()
    if args.malloc == "mallopt":
        zerocc.keep_freed_host_memory()
    if args.bucket_bytes is not None:
        ZEROCC_OPTIONS["bucket_bytes"] = args.bucket_bytes
    if args.prefetch_bytes is not None:
        ZEROCC_OPTIONS["prefetch_bytes"] = args.prefetch_bytes
    torch.set_num_threads(args.threads)
    select_model(args.model)
    dist.init_process_group("gloo")
    names = [n for n in args.systems.split(",") if n]
    results, failed = measure(names, {n: system(n) for n in names}, args)
    if dist.get_rank() == 0:
        write(results, failed, args, dist.get_world_size())
    dist.destroy_process_group()


def measure(names, builders, args):
    """Build, measure the peak of one step, then time every system interleaved; returns (results, failed)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    total_steps = args.warmup + 1 + args.repeats * args.steps
    generator = torch.Generator().manual_seed(1000 + rank)
    data = [model_batch(generator) for _ in range(total_steps)]

    steps, losses, peak, comm, calls, build_seconds, failed = {}, {}, {}, {}, {}, {}, {}
    for name in names:
        barrier()
        started = time.perf_counter()
        try:
            tracker = MemTracker()
            if name.startswith("zerocc"):
                # compiling traces modules, which MemTracker's module hooks do not survive; the step's
                # persistent tensors are all in its slots, so they are handed to the tracker instead
                step = builders[name]()
                for i in range(args.warmup):
                    step(*data[i])
                tracker.track_external(*step.__self__.state.slots.values(), *step.__self__.arenas.tensors())
            else:
                with tracker:
                    step = builders[name]()
                    for i in range(args.warmup):
                        step(*data[i])
                        tracker.reset_mod_stats()   # MemTracker refuses a module called again otherwise
            build_seconds[name] = time.perf_counter() - started
            gc.collect()
            barrier()
            with tracker:
                tracker._peak_mem = {dev: snap["Total"] for dev, snap in tracker._curr_mem_snap.items()}
                with CountCollectives() as counter:
                    losses[name] = [step(*data[args.warmup])]
            peak[name] = max(tracker.get_tracker_snapshot("peak").get(torch.device("cpu"), {"Total": 0})["Total"],
                             0)
            comm[name], calls[name] = dict(counter.bytes), dict(counter.calls)
            steps[name] = step
        except Exception as error:   # say why, keep comparing the others
            failed[name] = f"{type(error).__name__}: {error}"
            if rank == 0:
                print(f"{name} failed: {failed[name]}", flush=True)
        if rank == 0:
            print(f"built {name} in {time.perf_counter() - started:.1f}s", flush=True)

    running = [n for n in names if n in steps]
    times = {n: [] for n in running}
    cpu_times = {n: [] for n in running}   # this process's CPU time, every thread (gloo's too)
    cursor = {n: args.warmup + 1 for n in running}
    for round_index in range(args.repeats):
        shift = round_index % len(running)
        for name in running[shift:] + running[:shift]:
            barrier()
            started, cpu_started = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                losses[name].append(steps[name](*data[cursor[name]]))
                cursor[name] += 1
            cpu_times[name].append((time.process_time() - cpu_started) / args.steps)
            barrier()
            times[name].append((time.perf_counter() - started) / args.steps)

    results = {}
    for name in running:
        final = torch.stack(losses[name][-1:]).mean()
        dist.all_reduce(final)   # mean over ranks: each rank's loss is its own batch's
        results[name] = {
            "step_seconds_median": statistics.median(times[name]),
            "step_seconds_all": times[name],
            "cpu_seconds_median": statistics.median(cpu_times[name]),
            "peak_live_bytes": peak[name],
            "comm_bytes_per_step": comm[name],
            "collectives_per_step": calls[name],
            "final_loss": final.item() / world,
            "build_and_warmup_seconds": build_seconds[name],
        }
    peaks = [torch.tensor([results[n]["peak_live_bytes"] for n in running], dtype=torch.float64)]
    gathered = [torch.zeros_like(peaks[0]) for _ in range(world)]
    dist.all_gather(gathered, peaks[0])
    for i, name in enumerate(running):
        results[name]["peak_live_bytes_per_rank"] = [int(t[i]) for t in gathered]
    cpu = torch.tensor([results[n]["cpu_seconds_median"] for n in running], dtype=torch.float64)
    dist.all_reduce(cpu)
    for i, name in enumerate(running):
        results[name]["cpu_seconds_per_rank_mean"] = cpu[i].item() / world
    return results, failed


def write(results, failed, args, world):
    os.makedirs(args.out, exist_ok=True)
    suffix = "" if args.malloc == "default" else f"-{args.malloc}"
    runs = [(args.malloc, results, failed)]
    earlier = os.path.join(args.out, "compare.json")
    if args.malloc != "default" and os.path.exists(earlier):   # the default run's rows beside these
        with open(earlier) as f:
            previous = json.load(f)
        runs.insert(0, (previous["args"].get("malloc", "default"), previous["results"], previous["failed"]))
    params = sum(p.numel() for p in GPT(**MODEL).parameters())
    lines = [f"GPT {params / 1e6:.2f}M parameters (examples/gpt.py, {MODEL or 'defaults'}), batch {BATCH[0]} x "
             f"{MODEL.get('seq', 128)} tokens per rank, AdamW, "
             f"{world} gloo ranks, {args.threads} thread(s) per rank; median of {args.repeats} interleaved rounds of "
             f"{args.steps} steps after {args.warmup} warm-up steps. malloc: glibc's defaults, or tuned "
             f"({' '.join(f'{k}={v}' for k, v in TUNED_MALLOC.items())}); ratios are to DDP in the same run.", "",
             "| system | malloc | step time (ms) | vs DDP | CPU ms / step / rank | vs DDP | peak live MiB / rank | "
             "comm MiB / step | collectives / step | final loss |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for malloc, run, run_failed in runs:
        ddp = run.get("DDP", {})
        for name, r in run.items():
            ms = r["step_seconds_median"] * 1e3
            ratio = f"{r['step_seconds_median'] / ddp['step_seconds_median']:.2f}" if ddp else "-"
            cpu = r.get("cpu_seconds_per_rank_mean")
            cpu_ms = "-" if cpu is None else f"{cpu * 1e3:.1f}"
            cpu_ratio = f"{cpu / ddp['cpu_seconds_per_rank_mean']:.2f}" if cpu and "cpu_seconds_per_rank_mean" in ddp else "-"
            lines.append(f"| {name} | {malloc} | {ms:.1f} | {ratio} | {cpu_ms} | {cpu_ratio} | "
                         f"{max(r['peak_live_bytes_per_rank']) / 2**20:.1f} | "
                         f"{sum(r['comm_bytes_per_step'].values()) / 2**20:.1f} | "
                         f"{sum(r['collectives_per_step'].values())} | {r['final_loss']:.6f} |")
        for name, why in run_failed.items():
            lines.append(f"| {name} | {malloc} | failed: {why[:200]} | | | | | | | |")
    lines.append("")
    for malloc, run, _ in runs:
        z = run.get("zerocc-3")
        for peer in ("DDP", "FSDP2", "DeepSpeed-3"):
            if z is not None and peer in run:
                p = run[peer]
                cpu = (f"CPU time {z['cpu_seconds_per_rank_mean'] / p['cpu_seconds_per_rank_mean']:.2f}, "
                       if "cpu_seconds_per_rank_mean" in z and "cpu_seconds_per_rank_mean" in p else "")
                lines.append(f"- malloc {malloc}: zerocc-3 / {peer}: step time "
                             f"{z['step_seconds_median'] / p['step_seconds_median']:.2f}, {cpu}peak live bytes "
                             f"{max(z['peak_live_bytes_per_rank']) / max(p['peak_live_bytes_per_rank']):.2f}, "
                             f"final loss difference {abs(z['final_loss'] - p['final_loss']):.2e}")
    table = "\n".join(lines) + "\n"
    print(table)
    with open(os.path.join(args.out, f"compare{suffix}.md"), "w") as f:
        f.write(table)
    with open(os.path.join(args.out, f"compare{suffix}.json"), "w") as f:
        json.dump({"results": results, "failed": failed, "args": vars(args)}, f, indent=1)
    try:
        plot(results, os.path.join(args.out, f"compare{suffix}.png"))
    except ImportError as error:
        print(f"no plot ({error}); pip install -e '.[bench]'")


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(results)
    colors = ["tab:green" if n.startswith("zerocc") else "tab:blue" if n in ("DDP", "FSDP2") else "tab:orange"
              for n in names]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.bar(names, [results[n]["step_seconds_median"] * 1e3 for n in names], color=colors)
    left.set_ylabel("median step time (ms)")
    right.bar(names, [max(results[n]["peak_live_bytes_per_rank"]) / 2**20 for n in names], color=colors)
    right.set_ylabel("peak live tensor MiB per rank")
    for axis in (left, right):
        axis.tick_params(axis="x", rotation=45)
    params = sum(p.numel() for p in GPT(**MODEL).parameters())
    figure.suptitle(f"GPT {params / 1e6:.0f}M, AdamW, {dist.get_world_size()} gloo ranks (CPU)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
