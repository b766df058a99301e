"""User code that uses torch.distributed itself, beside the step: a model split across the ranks by hand, two
steps interleaved with the user's own collectives between them.

``docs/guide/your-model.md`` ("Collectives in the step") says what is supported.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

import zerocc
from tests import distributed

STEPS = 3


class RowParallelMLP(nn.Module):
    """Megatron-style tensor parallelism written by hand: each rank holds its slice of the hidden layer (rows of
    the first weight, columns of the second); forward all-reduces the partial products over all ranks."""

    def __init__(self, full1: nn.Linear, full2: nn.Linear, rank: int, world_size: int):
        super().__init__()
        self.w1 = nn.Parameter(full1.weight.detach().chunk(world_size, 0)[rank].clone())
        self.b1 = nn.Parameter(full1.bias.detach().chunk(world_size, 0)[rank].clone())
        self.w2 = nn.Parameter(full2.weight.detach().chunk(world_size, 1)[rank].clone())
        self.b2 = nn.Parameter(full2.bias.detach().clone())

    def forward(self, x, y):
        h = torch.relu(x @ self.w1.T + self.b1)
        out = funcol.all_reduce(h @ self.w2.T, "sum", dist.group.WORLD) + self.b2
        return nn.functional.mse_loss(out, y)


def _tensor_parallel(rank, world_size, own_groups):
    """The hand-split MLP compiled over one group per rank (each rank its own replica set) or over both ranks;
    the same module trained eagerly beside it."""
    torch.manual_seed(0)
    full1, full2 = nn.Linear(8, 16), nn.Linear(16, 8)
    model = RowParallelMLP(full1, full2, rank, world_size)
    eager = copy.deepcopy(model)
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    groups = [dist.new_group([r]) for r in range(world_size)] if own_groups else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3,
                              group=groups[rank] if own_groups else None)
        generator = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(STEPS):
            x, y = torch.randn(6, 8, generator=generator), torch.randn(6, 8, generator=generator)   # the same on every rank
            losses.append(step(x, y))
            eager_loss = eager(x, y)
            eager_optimizer.zero_grad()
            eager_loss.backward()
            eager_optimizer.step()
    replica = [str(w.message) for w in caught if issubclass(w.category, zerocc.ReplicaWarning)]
    return step.full_state_dict(), eager.state_dict(), replica


@pytest.mark.multirank
def test_hand_split_model_over_a_group_per_rank_trains_as_eager():
    """Each rank its own data-parallel group (``dist.new_group([rank])``): the step's forward all-reduces over both
    ranks, and every rank's shard trains bit for bit as the same code run eagerly on those ranks."""
    for full, eager, replica in distributed.run(_tensor_parallel, 2, True):
        assert replica == []
        for name, value in eager.items():
            assert torch.equal(full[name], value), name


@pytest.mark.multirank
def test_hand_split_model_over_the_same_ranks_warns():
    """Compiled over the ranks it is split across, compile replaced rank 1's shards by rank 0's (as DDP does):
    a model that is not the user's trained without a word until ReplicaWarning named the parameters, the
    collective's line and the fix."""
    (_, _, on_rank0), (full, eager, on_rank1) = distributed.run(_tensor_parallel, 2, False)
    assert on_rank0 == []   # its parameters were not replaced
    assert len(on_rank1) == 1, on_rank1
    message = on_rank1[0]
    assert "parameters w1, b1, w2 differed from rank 0's" in message
    assert "test_user_distributed.py:" in message and "funcol.all_reduce(h @ self.w2.T" in message
    assert "dist.new_group([rank])" in message
    assert not torch.equal(full["w1"], eager["w1"])   # what the warning is about


def _unseeded_replicas(rank, world_size):
    """Ranks built without a common seed whose forward gathers across them (CLIP's negatives): replicas that were
    only initialized differently, broadcast from rank 0 as DDP does; the warning is for that case too."""
    torch.manual_seed(100 + rank)
    model = nn.Linear(4, 4)

    def loss_fn(out, y):
        everyone = funcol.all_gather_single_autograd(out, 0, dist.group.WORLD)
        return (everyone.sum() - y.sum()) ** 2

    quiet = nn.Linear(4, 4)   # differing too, no collective of its own: no warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = zerocc.compile(quiet, torch.optim.SGD(quiet.parameters(), lr=0.1), stage=1,
                               loss_fn=lambda out, y: (out - y).pow(2).mean())
        plain(torch.ones(2, 4), torch.zeros(2, 4))
        quiet_warnings = [w for w in caught if issubclass(w.category, zerocc.ReplicaWarning)]
        step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=1, loss_fn=loss_fn)
        step(torch.ones(2, 4), torch.zeros(2, 4))
    return len(quiet_warnings), len([w for w in caught if issubclass(w.category, zerocc.ReplicaWarning)])


@pytest.mark.multirank
def test_differing_parameters_warn_only_with_a_collective_of_the_users():
    assert distributed.run(_unseeded_replicas, 2) == [(0, 0), (0, 1)]


class DiscriminatorLoss(nn.Module):
    def __init__(self, generator, discriminator):
        super().__init__()
        self.g, self.d = generator, discriminator

    def forward(self, noise, real):
        fake = self.g(noise).detach()
        return nn.functional.softplus(-self.d(real)).mean() + nn.functional.softplus(self.d(fake)).mean()


class GeneratorLoss(nn.Module):
    def __init__(self, generator, discriminator):
        super().__init__()
        self.g, self.d = generator, discriminator

    def forward(self, noise):
        return nn.functional.softplus(-self.d(self.g(noise))).mean()


def _gan(rank, world_size, timeout):
    """Two stage-3 steps over the default group, interleaved, with the user's broadcast of a seed, all-reduces of
    metrics and a barrier between them; eager trains the global batch beside them."""
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    eager_g, eager_d = copy.deepcopy(generator), copy.deepcopy(discriminator)
    g_copy, d_copy = copy.deepcopy(generator).requires_grad_(False), copy.deepcopy(discriminator).requires_grad_(False)

    def adam(m):
        return torch.optim.Adam(m.parameters(), lr=1e-2, betas=(0.5, 0.9))
    d_step = zerocc.compile(DiscriminatorLoss(g_copy, discriminator), adam(discriminator), stage=3, timeout=timeout)
    g_step = zerocc.compile(GeneratorLoss(generator, d_copy), adam(generator), stage=3, timeout=timeout)
    eager_d_optimizer, eager_g_optimizer = adam(eager_d), adam(eager_g)
    rows = 8 // world_size
    mine = slice(rank * rows, (rank + 1) * rows)
    metrics = []
    for it in range(STEPS):
        seed = torch.tensor([1000 + it * (rank + 1)])   # differs per rank until broadcast
        dist.broadcast(seed, 0)
        numbers = torch.Generator().manual_seed(int(seed))
        noise, real = torch.randn(8, 4, generator=numbers), torch.randn(8, 8, generator=numbers) + 2
        d_loss = d_step(noise[mine], real[mine]).detach().clone()
        dist.all_reduce(d_loss)
        with d_step.full_model(writeback=False):
            d_copy.load_state_dict(discriminator.state_dict())
        g_loss = g_step(noise[mine]).detach().clone()
        dist.all_reduce(g_loss, op=dist.ReduceOp.MAX)
        with g_step.full_model(writeback=False):
            g_copy.load_state_dict(generator.state_dict())
        dist.barrier()
        eager_d_loss = (nn.functional.softplus(-eager_d(real)).mean()
                        + nn.functional.softplus(eager_d(eager_g(noise).detach())).mean())
        eager_d_optimizer.zero_grad()
        eager_d_loss.backward()
        eager_d_optimizer.step()
        eager_g_loss = nn.functional.softplus(-eager_d(eager_g(noise))).mean()
        eager_g_optimizer.zero_grad()
        eager_g_loss.backward()
        eager_g_optimizer.step()
        metrics.append((float(d_loss) / world_size, float(eager_d_loss)))
    return metrics, d_step.full_state_dict(), g_step.full_state_dict(), eager_d.state_dict(), eager_g.state_dict()


@pytest.mark.multirank
@pytest.mark.parametrize("timeout", [None, 60])
def test_two_steps_interleaved_with_the_users_collectives(timeout):
    for metrics, d_full, g_full, eager_d, eager_g in distributed.run(_gan, 2, timeout):
        for mean, eager in metrics:
            assert mean == pytest.approx(eager, rel=1e-5)
        for name, value in eager_d.items():
            torch.testing.assert_close(d_full["d." + name], value, rtol=1e-5, atol=1e-6)
        for name, value in eager_g.items():
            torch.testing.assert_close(g_full["g." + name], value, rtol=1e-5, atol=1e-6)


class Normalized(nn.Module):
    """A loss normalized by the global token count, as many LLM trainers write it, with the user's ``how``."""

    def __init__(self, how):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.how = how

    def forward(self, x, mask):
        total = (self.fc(x).pow(2).sum(-1) * mask).sum()
        count = mask.sum()
        if self.how == "barrier":
            dist.barrier()
        elif self.how == "all_reduce":
            dist.all_reduce(count)
        elif self.how == "functional":
            count = funcol.all_reduce(count, "sum", dist.group.WORLD)
        return total / count * dist.get_world_size()


def _normalized(rank, world_size, how):
    torch.manual_seed(0)
    model = Normalized(how)
    eager = copy.deepcopy(model)
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3)
    x, mask = torch.randn(2 * world_size, 3, 4, generator=torch.Generator().manual_seed(1)), torch.ones(2 * world_size, 3)
    mask[1:, 2:] = 0
    rows = slice(2 * rank, 2 * rank + 2)
    try:
        step(x[rows], mask[rows])
    except zerocc.CaptureError as error:
        return str(error)
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    ((eager.fc(x).pow(2).sum(-1) * mask).sum() / mask.sum()).backward()   # one process, the global batch
    eager_optimizer.step()
    full = step.full_state_dict()
    return max((full[k] - v).abs().max().item() for k, v in eager.state_dict().items())


@pytest.mark.multirank
def test_collectives_in_forward_are_refused_with_the_fix_for_each():
    """A barrier in forward was refused with advice to use functional gathers, which have no barrier among them;
    dist.all_reduce's advice now names its functional counterpart, which trains like one process on the global
    batch."""
    barrier = distributed.run(_normalized, 1, "barrier")[0]
    assert "(c10d.barrier.default) at" in barrier and "test_user_distributed.py:" in barrier
    assert "fix: remove it from the step" in barrier and "between calls to the step" in barrier
    all_reduce = distributed.run(_normalized, 1, "all_reduce")[0]
    assert "dist.all_reduce(count)" in all_reduce and "_functional_collectives.all_reduce(x, 'sum', group)" in all_reduce
    for difference in distributed.run(_normalized, 2, "functional"):
        assert difference < 1e-6


def test_parameter_fingerprint_sees_a_change_in_any_chunk_of_a_large_parameter():
    """The replicas check's per-parameter float64 sum is taken a chunk at a time (``api._float64_sum``): a
    parameter larger than a chunk still sums to its float64 sum's value, and a change in its last chunk shows."""
    from zerocc.api import _SUM_CHUNK, _float64_sum
    generator = torch.Generator().manual_seed(0)
    large = torch.randn(3 * _SUM_CHUNK + 5, generator=generator)
    assert torch.allclose(_float64_sum(large), large.sum(dtype=torch.float64), rtol=1e-12, atol=1e-9)
    assert torch.equal(_float64_sum(large), _float64_sum(large.clone()))
    changed = large.clone()
    changed[-1] += 1.0
    assert not torch.equal(_float64_sum(changed), _float64_sum(large))
    as_complex = torch.randn(_SUM_CHUNK + 3, dtype=torch.complex64, generator=generator)
    assert torch.allclose(_float64_sum(as_complex), torch.view_as_real(as_complex).sum(dtype=torch.float64),
                          rtol=1e-12, atol=1e-9)


@pytest.mark.skipif(not hasattr(__import__("resource"), "getrusage") or not __import__("sys").platform.startswith("linux"),
                    reason="page faults counted through getrusage on Linux")
def test_parameter_fingerprint_makes_no_float64_copy_of_the_parameter():
    """``sum(dtype=torch.float64)`` on the CPU copies its whole input to float64 first: fingerprinting the
    parameters at compile wrote a float64 copy of each (twice the model's size). A chunk at a time, the copy is
    a chunk's, reused."""
    import resource

    from zerocc.api import _float64_sum
    large = torch.randn(16 * 2**20)   # 64 MiB: a float64 copy is 32k new 4 KiB pages
    _float64_sum(torch.randn(2 * 2**20))   # the allocator's first chunks, outside the count
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    _float64_sum(large)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < large.numel() * 8 // 4096 // 4, f"{faults} page faults: a float64 copy of the whole parameter"
