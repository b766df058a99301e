"""A step called under ``torch.autocast``, as automatic-mixed-precision code calls its model.

The eager reference is PyTorch's recommended pattern: forward and loss under
autocast, backward and the optimizer's step outside it. The compiled step
equals it bit for bit, and a call outside autocast (or under another dtype)
compiles its own program, as eager would compute otherwise (``zerocc/autocast.py``).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import zerocc
from tests import distributed
from tests.reference import adamw, assert_ranks_match_ddp


class Float32Router(nn.Module):
    """A matmul kept in fp32 under the caller's autocast, as MoE routers and rotary embeddings keep theirs."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 32) / 8)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            return x + torch.softmax(x.float() @ self.weight, dim=-1).to(x.dtype)


def build():
    """bf16 matmuls under autocast, an fp32 layer norm (CPU autocast's fp32 list) and an fp32 matmul between."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), Float32Router(), nn.Linear(32, 32),
                         nn.GELU(), nn.Linear(32, 4))


def batches(steps):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator))
            for _ in range(steps)]


def eager(model, optimizer, batch, dtype):
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        loss = F.cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    optimizer.step()
    return loss.detach()


@pytest.mark.filterwarnings("ignore:the step is called under torch.autocast.dtype=torch.float16. without loss scaling")
@pytest.mark.parametrize("stage,memory_pools", [(0, None), (1, None), (3, None), (3, False)],
                         ids=["stage0", "stage1", "stage3", "stage3-no-pools"])
def test_a_step_under_autocast_trains_like_eager_and_outside_it_compiles_its_own_program(stage, memory_pools):
    """Without pools the program calls functional aten ops, which autocast would cast again: it runs outside it."""
    reference, model = build(), build()
    reference_optimizer = adamw(reference)
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=F.cross_entropy, memory_pools=memory_pools)
    # bf16, bf16, fp32 (no autocast), fp16, bf16: each state its own program, each step as eager's
    for number, (batch, dtype) in enumerate(zip(batches(5), [torch.bfloat16, torch.bfloat16, None, torch.float16,
                                                             torch.bfloat16])):
        expected = eager(reference, reference_optimizer, batch, dtype)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            got = step(*batch)
        assert torch.equal(got, expected), (number, dtype)
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key
    assert len(step.cache.programs()) == 3


def test_eval_forward_under_autocast_casts_as_eager_and_has_its_own_program():
    reference, model = build(), build()
    step = zerocc.compile(model, adamw(model), stage=3, loss_fn=F.cross_entropy)
    step(*batches(1)[0])
    eager(reference, adamw(reference), batches(1)[0], None)
    x = batches(2)[1][0]
    reference.eval()
    with torch.no_grad():
        plain = reference(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cast = reference(x)
    assert cast.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(step.eval_forward(x), cast)
    assert torch.equal(step.eval_forward(x), plain)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(step.eval_forward(x), cast)
    assert len(step.eval_programs) == 2


@torch.library.custom_op("zerocc_tests::gelu_linear", mutates_args=())
def gelu_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A custom op whose own code is torch code (a reference implementation of a fused kernel): under the caller's
    autocast its matmul computes in bf16, as a custom op has no autocast rule; it returns its input's dtype."""
    return F.gelu(x @ weight).to(x.dtype)


@gelu_linear.register_fake
def _gelu_linear_fake(x, weight):
    return x.new_empty(x.shape[0], weight.shape[1])


def _gelu_linear_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    with torch.enable_grad():
        x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
        return torch.autograd.grad(F.gelu(x @ weight), (x, weight), grad)


gelu_linear.register_autograd(_gelu_linear_backward,
                              setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


class FusedKernels(nn.Module):
    """The custom op under the caller's autocast, and once more inside a region that turns autocast off."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.first, self.second = nn.Parameter(torch.randn(32, 32) / 6), nn.Parameter(torch.randn(32, 32) / 6)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h = gelu_linear(self.embed(x).float(), self.first)
        with torch.autocast("cpu", enabled=False):
            h = gelu_linear(h, self.second)
        return self.head(h)


# the program runs outside autocast, so the op's own matmul computed in fp32 where eager's computed in bf16
@pytest.mark.parametrize("stage,memory_pools", [(0, None), (3, None), (3, False)])
def test_a_custom_op_under_autocast_computes_under_it_as_in_eager(stage, memory_pools):
    torch.manual_seed(0)
    reference = FusedKernels()
    model = copy.deepcopy(reference)
    reference_optimizer = adamw(reference)
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=F.cross_entropy, memory_pools=memory_pools)
    for batch in batches(3):
        expected = eager(reference, reference_optimizer, batch, torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(step(*batch), expected)
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key
    x = batches(4)[3][0]
    reference.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(step.eval_forward(x), reference(x))


def _under_autocast_per_rank(rank, world_size):
    """Per rank: DDP's and the step's losses and final states, both stepping under bf16 autocast."""
    local = [(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]) for x, y in
             [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
              for g in [torch.Generator().manual_seed(seed) for seed in range(3)]]]
    reference, model = build(), build()
    ddp, reference_optimizer = DistributedDataParallel(reference), adamw(reference)
    step = zerocc.compile(model, adamw(model), stage=3, loss_fn=F.cross_entropy)
    expected, got = [], []
    for batch in local:
        expected.append(eager(ddp, reference_optimizer, batch, torch.bfloat16))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got.append(step(*batch))
    return {"stage 3 under autocast": (expected, got, reference.state_dict(), step.full_state_dict())}


@pytest.mark.multirank
def test_a_step_under_autocast_sharded_across_ranks_matches_ddp():
    assert_ranks_match_ddp(distributed.run(_under_autocast_per_rank, 2))


class TiedLM(nn.Module):
    """Embedding, LayerNorm, a head tied to the embedding, logits upcast with ``.float()`` before the loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(40, 16)
        self.norm = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, ids):
        return self.head(self.norm(F.gelu(self.fc(self.embedding(ids))))).float().flatten(0, 1)


def token_loss(logits, targets):
    return F.cross_entropy(logits, targets.flatten())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16-loss-scale"])
@pytest.mark.parametrize("stage", [0, 3])
def test_param_dtype_under_the_callers_autocast_trains_as_eager_does_both(stage, dtype):
    """The guide says the two combine: eager with parameters cast to param_dtype, forward and loss under autocast,
    fp32 gradients to the masters (GradScaler for fp16, whose first step overflows here and is skipped)."""
    reference, model = TiedLM(), TiedLM()
    reference_optimizer = adamw(reference)
    scaling = zerocc.DynamicLossScale(init_scale=2.0 ** 15, growth_interval=1) if dtype is torch.float16 else None
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 15, growth_interval=1, enabled=scaling is not None)
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=token_loss, param_dtype=dtype, loss_scale=scaling)
    generator = torch.Generator().manual_seed(1)
    scales = []
    for _ in range(4):
        ids, targets = torch.randint(0, 40, (4, 8), generator=generator), torch.randint(0, 40, (4, 8), generator=generator)
        low = copy.deepcopy(reference)     # keeps the head tied
        for param in low.parameters():
            param.data = param.data.to(dtype)
        with torch.autocast("cpu", dtype=dtype):
            expected = token_loss(low(ids), targets)
        scaler.scale(expected).backward()
        for param, computed in zip(reference.parameters(), low.parameters()):
            param.grad = computed.grad.to(param.dtype)
        scaler.step(reference_optimizer)
        scaler.update()
        reference_optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            assert torch.equal(step(ids, targets), expected.detach())
        assert step.loss_scale == (scaler.get_scale() if scaling else None)
        scales.append(step.loss_scale)
    if scaling is not None:   # an overflow was skipped (the scale halved), and a good step grew it
        assert 2.0 ** 14 in scales and max(scales) > 2.0 ** 15, scales
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert full[key].dtype == torch.float32 and torch.equal(full[key], value), key


@pytest.mark.parametrize("stage", [0, 3])
def test_a_grad_scaler_loop_translated_to_loss_scale_trains_like_eager_autocast_and_grad_scaler(stage):
    """The documented translation of an AMP loop: the caller's autocast(float16) around the step, ``loss_scale``
    instead of a GradScaler of one's own, no ``param_dtype``. The autocast's casts of the linears' weights were taken
    for param_dtype's casts: at stage 3 the pass gathered each bucket cast to float16, so the LayerNorm and the router
    (kept in float32 by autocast) trained on float16-rounded weights and every parameter drifted by ulps."""
    reference, model = build(), build()
    reference_optimizer = adamw(reference)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=F.cross_entropy,
                          loss_scale=zerocc.DynamicLossScale(init_scale=2.0 ** 10, growth_interval=1))
    for x, y in batches(3):
        reference_optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            expected = F.cross_entropy(reference(x), y)
        scaler.scale(expected).backward()
        scaler.step(reference_optimizer)
        scaler.update()
        with torch.autocast("cpu", dtype=torch.float16):
            assert torch.equal(step(x, y), expected.detach())
        assert step.loss_scale == scaler.get_scale()
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key


def test_float16_autocast_without_loss_scale_warns_naming_loss_scale_not_a_grad_scaler():
    """An AMP loop's GradScaler cannot scale a step that returns its loss after backward and the update (its
    ``scaler.scale(loss).backward()`` fails in torch: "element 0 of tensors does not require grad"): the first call
    under float16 autocast says to pass loss_scale, naming the caller's line; with loss_scale it says nothing."""
    model = build()
    step = zerocc.compile(model, adamw(model), stage=0, loss_fn=F.cross_entropy)
    x, y = batches(1)[0]
    with pytest.warns(UserWarning, match=r"torch.autocast\(dtype=torch.float16\) without loss scaling.*"
                                         r"loss_scale='dynamic'.*GradScaler of your own cannot") as caught:
        with torch.autocast("cpu", dtype=torch.float16):
            step(x, y)
    assert any(w.filename == __file__ for w in caught if "loss scaling" in str(w.message))
    scaled = build()
    step = zerocc.compile(scaled, adamw(scaled), stage=0, loss_fn=F.cross_entropy, loss_scale="dynamic")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cpu", dtype=torch.float16):
            step(x, y)
    assert not [w for w in caught if "loss scaling" in str(w.message)]


def _eager_amp_step(model, optimizer, scaler, x, y):
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_grad_scalers_state_moves_into_a_step_and_back_bit_for_bit(stage):
    """An eager AMP loop moves to the step and back: ``step.scaler_state()`` is ``GradScaler.state_dict()``'s format
    (it was zerocc's slots, ``{"loss_scale:scale": tensor, ...}``, which ``GradScaler.load_state_dict`` cannot read)
    and ``step.load_scaler_state`` takes a GradScaler's. Against one eager loop with one scaler all along: the
    losses, scales and parameters are equal bit for bit, a growth tracker left at 1 mid-interval included."""
    settings = dict(init_scale=2.0 ** 16, growth_factor=4.0, backoff_factor=0.25, growth_interval=2)
    data = batches(9)
    reference, model = build(), build()
    reference_optimizer, optimizer = adamw(reference), adamw(model)
    reference_scaler, scaler = torch.amp.GradScaler("cpu", **settings), torch.amp.GradScaler("cpu", **settings)
    expected = [_eager_amp_step(reference, reference_optimizer, reference_scaler, *batch) for batch in data]
    scales = []
    for batch in data[:3]:   # eager first
        _eager_amp_step(model, optimizer, scaler, *batch)
        scales.append(scaler.get_scale())
    assert scaler.state_dict()["_growth_tracker"] == 1 and 2.0 ** 16 not in scales[1:], scales   # mid-interval
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=F.cross_entropy,
                          loss_scale=zerocc.DynamicLossScale(**settings))
    step.load_scaler_state(scaler.state_dict())
    for number, batch in enumerate(data[3:6], 3):
        with torch.autocast("cpu", dtype=torch.float16):
            assert torch.equal(step(*batch), expected[number]), number
    state = step.scaler_state()
    assert set(state) == set(reference_scaler.state_dict())
    step.close()   # the model and optimizer back whole: the eager loop goes on with a new GradScaler
    scaler = torch.amp.GradScaler("cpu", **settings)
    scaler.load_state_dict(state)
    for number, batch in enumerate(data[6:], 6):
        assert torch.equal(_eager_amp_step(model, optimizer, scaler, *batch), expected[number]), number
    assert scaler.state_dict() == reference_scaler.state_dict()
    for (key, value), expected_value in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(value, expected_value), key


def test_load_scaler_state_refuses_settings_the_program_does_not_have_and_takes_the_old_slots():
    model = build()
    step = zerocc.compile(model, adamw(model), loss_fn=F.cross_entropy, loss_scale="dynamic")
    scaler = torch.amp.GradScaler("cpu", growth_interval=100)
    with pytest.raises(zerocc.ConfigError, match=r"growth_interval 100 \(the step's 2000\) differ.*compile with "
                                                 r"loss_scale=zerocc.DynamicLossScale\(growth_factor=2.0, "
                                                 r"backoff_factor=0.5, growth_interval=100\)"):
        step.load_scaler_state(scaler.state_dict())
    with pytest.raises(zerocc.ConfigError, match="the state is empty"):
        step.load_scaler_state(torch.amp.GradScaler("cpu", enabled=False).state_dict())
    step.load_scaler_state({"loss_scale:scale": torch.tensor(8.0), "loss_scale:growth_tracker": torch.tensor(3)})
    assert step.scaler_state()["scale"] == 8.0 and step.scaler_state()["_growth_tracker"] == 3
    assert step.loss_scale == 8.0
    plain = build()
    with pytest.raises(zerocc.ConfigError, match="no dynamic loss scale to load into"):
        zerocc.compile(plain, adamw(plain), loss_fn=F.cross_entropy).load_scaler_state(scaler.state_dict())
