"""Long runs of examples/gpt.py on gloo ranks: what grows over hundreds of steps.

    python benchmarks/long_run_memory.py --name s3_pools --stage 3 --options '{"memory_pools": true}'
    python benchmarks/long_run_memory.py --name shapes --stage 3 --seqs 128,96,64 --eval-every 25 --ckpt-every 50
    python benchmarks/long_run_memory.py --name m98 --model 98m --stage 3 --steps 60
    python benchmarks/long_run_memory.py --name eager --eager eager_128.json   # single-process reference losses

Each rank samples, every ``--every`` steps: its resident set (/proc/self/statm), the bytes glibc's malloc
has handed out and not got back (``mallinfo2``: in use, and free but kept), the mean step time since the
last sample, Python objects (``gc.get_objects``) and tensors among them, open file descriptors, OS threads,
and the step's programs and eval programs. ``--options`` is JSON for ``zerocc.compile`` (``param_dtype`` by
name). Writes ``<out>/<name>/rank<r>.json`` (samples, every loss, eval losses, ``step.report()``'s numbers).
Batches are the global batch (``--batch`` per rank x world size) drawn once; ``--eager`` trains the same
batches in one process, the reference the ranks' mean loss is compared with.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import socket
import sys
import threading
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)

PAGE = os.sysconf("SC_PAGE_SIZE")
MODELS = {"5m": dict(), "98m": dict(vocab=8192, d_model=768, layers=12, heads=12, seq=128)}


class _MallInfo(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo


def malloc_bytes() -> tuple[int, int]:
    """glibc's malloc: bytes handed out (in use, mmapped included) and bytes freed but kept."""
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd, info.fordblks


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def batches(args, world):
    from gpt import random_batch
    generator = torch.Generator().manual_seed(1)
    vocab = MODELS[args.model].get("vocab", 1024)
    seqs = [int(s) for s in args.seqs.split(",")]
    return [random_batch(generator, args.batch * world, seq=seqs[i % len(seqs)], vocab=vocab)
            for i in range(args.steps)]


def make(args):
    from gpt import GPT
    torch.manual_seed(0)
    model = GPT(**MODELS[args.model])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def sample(step, i, seconds):
    gc.collect()
    in_use, kept = malloc_bytes()
    objects = gc.get_objects()
    tensors = sum(1 for o in objects if isinstance(o, torch.Tensor))
    count = len(objects)
    del objects   # a kept list of every object would keep every later garbage alive
    return dict(step=i + 1, rss=rss(), malloc=in_use, mfree=kept, tensors=tensors, step_s=seconds, gc=count,
                fds=len(os.listdir("/proc/self/fd")), threads=len(os.listdir("/proc/self/task")),
                pythreads=threading.active_count(), programs=len(step.cache.programs()),
                eval_programs=len(step.eval_programs))


def rank_main(rank, world, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import zerocc
    model, optimizer = make(args)
    options = json.loads(args.options)
    if "param_dtype" in options:
        options["param_dtype"] = getattr(torch, options["param_dtype"])
    step = zerocc.compile(model, optimizer, stage=args.stage, **options)
    data = batches(args, world)
    samples, losses, evals = [], [], []
    seconds, steps = 0.0, 0
    warnings.simplefilter("ignore")
    for i in range(args.steps):
        tokens, targets = data[i]
        mine = slice(rank * args.batch, (rank + 1) * args.batch)
        started = time.perf_counter()
        losses.append(step(tokens[mine], targets[mine]).item())
        seconds += time.perf_counter() - started
        steps += 1
        if args.eval_every and (i + 1) % args.eval_every == 0:
            evals.append((i, step.eval_forward(tokens[mine], targets[mine]).item()))
        if args.ckpt_every and (i + 1) % args.ckpt_every == 0:
            zerocc.save_checkpoint(step, os.path.join(out, "ckpt"))
        if (i + 1) % args.every == 0 or i == 0:
            samples.append(sample(step, i, seconds / steps))
            seconds, steps = 0.0, 0
            if rank == 0:
                print(json.dumps(samples[-1]), flush=True)
    report = {k: v for k, v in step.report().items() if isinstance(v, (int, float, str, bool))}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(dict(samples=samples, losses=losses, evals=evals, report=report), f)
    dist.barrier()
    dist.destroy_process_group()


def eager(args, path):
    torch.set_num_threads(1)
    model, optimizer = make(args)
    losses = []
    for tokens, targets in batches(args, args.world):
        optimizer.zero_grad()
        loss = model(tokens, targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with open(path, "w") as f:
        json.dump(losses, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", required=True)
    parser.add_argument("--out", default="long_run_results")
    parser.add_argument("--model", choices=sorted(MODELS), default="5m")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seqs", default="128", help="sequence lengths, cycled step by step")
    parser.add_argument("--options", default="{}", help="zerocc.compile keywords, as JSON")
    parser.add_argument("--eval-every", type=int, default=0)
    parser.add_argument("--ckpt-every", type=int, default=0)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--eager", default=None, help="train eagerly in one process, losses to this JSON file")
    args = parser.parse_args()
    if args.eager:
        eager(args, args.eager)
        return
    out = os.path.join(args.out, args.name)
    os.makedirs(out, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.time()
    mp.spawn(rank_main, args=(args.world, port, args, out), nprocs=args.world)
    print(f"wall {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
