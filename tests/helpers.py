"""Helpers several test files share: programs compiled without peers, two-rank pass comparisons, checkpoints read whole.

A pass's tests read the program the pipeline makes for one rank (``compile_graph``:
the pipeline never runs a collective, so a world size and a group name are all it
needs) and check that disabling the pass changes nothing a user sees
(``assert_two_ranks_train_the_same``).
"""
from __future__ import annotations

import collections
import contextlib
import functools

import torch
import torch.optim.optimizer as torch_optimizer
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import zerocc
from tests import distributed
from tests.models import batches, build
from zerocc import graph as g
from zerocc.capture import capture
from zerocc.context import CompileContext
from zerocc.pipeline import build_pipeline, run_pipeline
from zerocc.runtime.comm_counter import CountCollectives
from zerocc.tracing import make_fake_mode
from torch.utils._python_dispatch import TorchDispatchMode

SMALL_BUCKETS = 16 * 1024     # the tiny test GPT gets several buckets


def compile_graph(stage, rank=0, *, world_size=2, prefetch_bytes=1 << 30, bucket_bytes=SMALL_BUCKETS, name="gpt",
                  disable=(), clip=None):
    """``name``'s program for ``rank`` of ``world_size``, without peers, with passes disabled or clipping on:
    (graph module, context, pass history)."""
    torch.manual_seed(0)
    model, _, loss_fn = build(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fake_mode = make_fake_mode()
    captured = capture(model, optimizer, batches(name, 1, 4)[0], loss_fn=loss_fn, num_targets=1 if loss_fn else 0,
                       fake_mode=fake_mode, check_update_elementwise=stage != 0)
    ctx = CompileContext(stage, world_size, rank, "unused", optimizer, captured, fake_mode, bucket_bytes)
    passes = build_pipeline(stage, disable, prefetch_bytes=prefetch_bytes, user_passes=(), clip=clip)
    gm, history = run_pipeline(captured.gm, ctx, passes)
    return gm, ctx, history


@functools.lru_cache(maxsize=None)
def compiled(stage, rank=0, *, world_size=2, prefetch_bytes=1 << 30, bucket_bytes=SMALL_BUCKETS, name="gpt"):
    """``compile_graph`` once per configuration for the whole run (for tests that only read it)."""
    return compile_graph(stage, rank, world_size=world_size, prefetch_bytes=prefetch_bytes,
                         bucket_bytes=bucket_bytes, name=name)


def collective_order(gm):
    return [(g.short_name(n.target), n.meta.get(g.BUCKET), g.nbytes(n)) for n in gm.graph.nodes if g.is_collective(n)]


def train_gpt(rank, world_size, stage, disable, options=None):
    """Rank ``rank``'s 3 steps of the tiny GPT (16 KiB buckets): losses, full state, the last step's collectives."""
    torch.manual_seed(0)
    model, _, loss_fn = build("gpt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # memory pools off unless asked: the passes these comparisons disable (the gloo rewrites,
    # gradients_into_buckets) are off under pools, and a comparison with a pass that does nothing cannot fail
    options = {"memory_pools": False, **(options or {})}
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=loss_fn, bucket_bytes=16 * 1024, disable=disable,
                          **options)
    losses = []
    for batch in batches("gpt", 3, 4 * world_size):
        with CountCollectives() as counted:
            losses.append(step(*(t[rank * 4:(rank + 1) * 4] for t in batch)))
    return torch.stack(losses), step.full_state_dict(), dict(counted.calls), dict(counted.bytes)


def assert_two_ranks_train_the_same(stage, without_pass, options=None):
    """2 ranks of ``train_gpt`` with every pass and with ``without_pass`` disabled: equal losses and state, the
    same collectives counted (calls and volume); returns the calls."""
    new = distributed.run(train_gpt, 2, stage, (), options)
    old = distributed.run(train_gpt, 2, stage, (without_pass,), options)
    for (losses, state, calls, volume), (old_losses, old_state, old_calls, old_volume) in zip(new, old):
        assert torch.equal(losses, old_losses)
        assert state.keys() == old_state.keys()
        for key, value in old_state.items():
            assert torch.equal(state[key], value), key
        assert calls == old_calls and volume == old_volume
    return calls


def read_whole(path) -> dict[str, torch.Tensor]:
    """Every entry of a checkpoint, whole, without a process group."""
    entries = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {key: torch.empty(entry.size, dtype=entry.properties.dtype) for key, entry in entries.items()
             if isinstance(entry, TensorStorageMetadata)}   # the optimizer's param_groups are Python values
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


def assert_rank_matches_reference(rank, losses, expected, state, expected_state, *, state_rtol, state_atol):
    """One rank's losses (within 1e-5) and state (within the given tolerances) against the reference's, by name."""
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"rank {rank} losses: {m}")
    for name, value in expected_state.items():
        torch.testing.assert_close(state[name], value, rtol=state_rtol, atol=state_atol,
                                   msg=lambda m: f"rank {rank} {name}: {m}")


def beside_eager(build, batches: list[dict], *, lr: float = 1e-3, stage: int = 3, **options):
    """``build()`` trained with AdamW on each keyword batch eagerly and as a compiled step (``options`` to compile),
    dropout seeded alike per step: every loss and, at the end, every entry of the eager model's state equal bit for
    bit. Returns the step and the eager model."""
    from tests.reference import train_eagerly
    reference = build()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=lr)
    model = build()
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=lr), stage=stage, **options)
    for number, batch in enumerate(batches):
        expected = train_eagerly(reference, reference_optimizer, batch, seed=100 + number)
        torch.manual_seed(100 + number)
        assert torch.equal(step(**batch), expected), number
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key
    return step, reference


def beside_ddp(build, global_batches: list[dict], rank: int, world_size: int, *, find_unused_parameters=False,
               **options) -> tuple:
    """``build()`` trained with AdamW on this rank's slice of each keyword batch, under DDP and as a zerocc stage-3
    step (``options`` to compile), dropout seeded alike per step: (DDP's losses, the step's losses, DDP's state, the
    step's full state), what ``reference.assert_ranks_match_ddp`` compares. ``find_unused_parameters`` for models
    whose batches leave parameters without a gradient (XLNet's segment embeddings)."""
    from torch.nn.parallel import DistributedDataParallel
    from tests.reference import train_eagerly
    data = [{key: value.chunk(world_size)[rank] if isinstance(value, torch.Tensor) else value
             for key, value in batch.items()} for batch in global_batches]
    reference = build()
    ddp = DistributedDataParallel(reference, find_unused_parameters=find_unused_parameters)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    expected = [train_eagerly(ddp, reference_optimizer, batch, seed=100 + number) for number, batch in enumerate(data)]
    model = build()
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=3, **options)
    got = []
    for number, batch in enumerate(data):
        torch.manual_seed(100 + number)
        got.append(step(**batch))
    return expected, got, dict(reference.state_dict()), step.full_state_dict()


@contextlib.contextmanager
def foreach_as_on_cuda():
    """torch.optim's choice of update on CUDA, made on the CPU: with ``foreach`` left unset, eager (and the program,
    which traces what eager picks) runs the multi-tensor update here too."""
    devices = torch_optimizer._get_foreach_kernels_supported_devices
    torch_optimizer._get_foreach_kernels_supported_devices = lambda: [*devices(), "cpu"]
    try:
        yield
    finally:
        torch_optimizer._get_foreach_kernels_supported_devices = devices


class OpCalls(TorchDispatchMode):
    """How many times each aten op (by name, in-place and functional apart) runs inside the ``with``."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def foreach(self) -> int:
        return sum(count for name, count in self.calls.items() if name.startswith("_foreach_"))
