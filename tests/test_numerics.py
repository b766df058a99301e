"""The contract: the compiled step trains exactly like eager PyTorch.

World size 1: every stage equals eager bit for bit (torch.equal), losses and
parameters, for several steps, with plain allocation and with memory pools
(``compile(memory_pools=True)``: outputs written into arenas at planned
offsets). World size N: every stage matches DDP on the same global batch
within float tolerance (with pools too, for the GPT at 2 ranks), starting from
rank 0's weights whatever each rank built, with the first SGD update equal to
minus DDP's averaged gradient, and every rank holding the same parameters bit
for bit.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import zerocc
from tests import distributed
from tests.models import batches, build, eager_step
from tests.helpers import OpCalls, foreach_as_on_cuda
from tests.reference import adamw

STAGES = (0, 1, 2, 3)
STEPS = 3


@pytest.mark.parametrize("memory_pools", [False, True], ids=["plain", "pools"])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", ["mlp", "gpt", "cnn"])
def test_world_size_1_equals_eager_bit_for_bit(name, stage, memory_pools):
    reference, _, loss_fn = build(name)
    reference_optimizer = adamw(reference)
    model, _, _ = build(name)
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn, memory_pools=memory_pools)
    assert bool(step.passes[-1] == "place_buffers") is memory_pools
    for batch in batches(name, STEPS, 8):
        expected = eager_step(reference, reference_optimizer, loss_fn, batch)
        assert torch.equal(step(*batch), expected)
    full = step.full_state_dict()
    assert full.keys() == reference.state_dict().keys()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key


OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5, centered=True),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
    "rprop": lambda p: torch.optim.Rprop(p, lr=1e-2),   # x[mask] = scalar: elementwise (optimizer_step._is_masked_fill)
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_any_elementwise_optimizer_bit_for_bit(optimizer):
    reference, _, loss_fn = build("mlp")
    reference_optimizer = OPTIMIZERS[optimizer](reference.parameters())
    model, _, _ = build("mlp")
    step = zerocc.compile(model, OPTIMIZERS[optimizer](model.parameters()), stage=3, loss_fn=loss_fn)
    for batch in batches("mlp", STEPS, 8):
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, loss_fn, batch))
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key


@pytest.mark.parametrize("stage", [0, 3])
def test_the_update_runs_the_implementation_eager_picks(stage):
    """With ``foreach`` left to torch.optim, eager runs the multi-tensor update where the parameters' device has
    foreach kernels (CUDA) and the single-tensor one elsewhere; the kernels round differently on CUDA (seen on an
    H200), so the program traces the same one, and launches each foreach op once over the group, as eager does
    (not once per parameter: on a GPU every launch costs the host). Here the CPU is made a foreach device."""
    with foreach_as_on_cuda():
        reference, _, loss_fn = build("gpt")
        reference_optimizer = adamw(reference)
        model, _, _ = build("gpt")
        step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn)
        for number, batch in enumerate(batches("gpt", STEPS, 8)):
            with OpCalls() as eager_calls:
                expected = eager_step(reference, reference_optimizer, loss_fn, batch)
            with OpCalls() as program_calls:
                assert torch.equal(step(*batch), expected)
            if number > 0:   # the first call compiles
                assert eager_calls.foreach() > 0 and program_calls.foreach() == eager_calls.foreach()
        for key, value in reference.state_dict().items():
            assert torch.equal(step.full_state_dict()[key], value), key


def test_learning_rate_schedule_is_read_every_step():
    reference, _, loss_fn = build("mlp")
    reference_optimizer = adamw(reference)
    reference_schedule = torch.optim.lr_scheduler.StepLR(reference_optimizer, step_size=1, gamma=0.5)
    model, _, _ = build("mlp")
    optimizer = adamw(model)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    step = zerocc.compile(model, optimizer, stage=3, loss_fn=loss_fn)
    for batch in batches("mlp", 4, 8):
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, loss_fn, batch))
        reference_schedule.step()
        schedule.step()
    assert len(step.cache.programs()) == 1   # the first step's included (optimizer_init.py); no recompile per lr
    for key, value in reference.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key


def test_a_tensor_learning_rate_under_a_schedule():
    """A tensor lr: the scheduler records it as the group's initial_lr, a tensor setting in the program's key."""
    def make(model):
        optimizer = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-2))
        return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    reference, _, loss_fn = build("mlp")
    reference_optimizer, reference_schedule = make(reference)
    model, _, _ = build("mlp")
    optimizer, schedule = make(model)
    step = zerocc.compile(model, optimizer, stage=3, loss_fn=loss_fn)
    for batch in batches("mlp", 3, 8):
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, loss_fn, batch))
        reference_schedule.step()
        schedule.step()
    assert len(step.cache.programs()) == 1
    for key, value in reference.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key


@pytest.mark.parametrize("stage", [0, 3])
def test_a_schedule_that_cycles_betas_compiles_once(stage):
    """OneCycleLR cycles Adam's betas with the learning rate: both are read every step, one program trains."""
    reference, _, loss_fn = build("mlp")
    model, _, _ = build("mlp")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)]
    schedules = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=10) for o in optimizers]
    step = zerocc.compile(model, optimizers[1], stage=stage, loss_fn=loss_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no "compiles a new program" warning either
        for batch in batches("mlp", 4, 8):
            assert torch.equal(step(*batch), eager_step(reference, optimizers[0], loss_fn, batch))
            for schedule in schedules:
                schedule.step()
    assert optimizers[1].param_groups[0]["betas"][0] != 0.95   # the schedule did change them
    assert len(step.compile_stats) == 1
    for key, value in reference.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key


def test_a_schedule_that_changes_momentum_compiles_once():
    """OneCycleLR cycles SGD's momentum: read every step as the learning rate is, no program per step and no
    warning (it compiled one per step, with a warning, when only lr and betas were read every step)."""
    reference, _, loss_fn = build("mlp")
    model, _, _ = build("mlp")
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in (reference, model)]
    schedules = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=10) for o in optimizers]
    step = zerocc.compile(model, optimizers[1], stage=3, loss_fn=loss_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for batch in batches("mlp", 4, 8):
            assert torch.equal(step(*batch), eager_step(reference, optimizers[0], loss_fn, batch))
            for schedule in schedules:
                schedule.step()
    assert optimizers[1].param_groups[0]["momentum"] != 0.95   # the schedule did change it
    assert len(step.compile_stats) == 2   # the first step's (it copies the gradient into the momentum buffer), then one
    for key, value in reference.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key


def sgd(model):
    """Plain SGD, lr 1: the first update is minus the averaged gradient, so a gradient off by a factor shows
    (Adam's first update is the gradient's sign, blind to a rank summing instead of averaging)."""
    return torch.optim.SGD(model.parameters(), lr=1.0)


# the slots (persistent tensors) by the report's kinds of model state; gradients are not persistent
HELD_SLOTS = {"bucket": "params", "compute": "params", "param": "params", "frozen": "params", "state": "optimizer"}


def held_bytes(step) -> dict[str, int]:
    """The bytes the step's slot tensors really take, by kind: what ``model_state_bytes_per_rank`` must report."""
    held = {"params": 0, "optimizer": 0}
    for slot, tensor in step.state.slots.items():
        if slot.split(":")[0] in HELD_SLOTS:
            held[HELD_SLOTS[slot.split(":")[0]]] += tensor.numel() * tensor.element_size()
    return held


def _train_all_stages(rank, world_size, name, memory_pools=None):
    """Per rank: DDP's losses, final state and first-step gradients (mean over ranks); then each stage's
    losses, final state, first SGD update (at 2 ranks without pools, to keep the suite's time), and the
    bytes its slots hold beside the bytes its report says they hold.

    Each rank builds its zerocc model from its own seed, as jobs on several machines can: compile
    broadcasts rank 0's weights, so every rank trains as DDP does from rank 0's (seed 0) weights.
    """
    data = batches(name, STEPS, 4 * world_size)
    local = [tuple(t[rank * 4:(rank + 1) * 4] for t in batch) for batch in data]
    reference, _, loss_fn = build(name)
    ddp = DistributedDataParallel(reference)
    optimizer = adamw(reference)
    expected = [eager_step(ddp, optimizer, loss_fn, local[0])]
    gradients = {key: p.grad.clone() for key, p in reference.named_parameters()}
    expected += [eager_step(ddp, optimizer, loss_fn, batch) for batch in local[1:]]
    results = {"ddp": (expected, {k: v.clone() for k, v in reference.state_dict().items()}, gradients)}
    for stage in STAGES:
        model, _, _ = build(name, seed=rank)
        step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn, memory_pools=memory_pools)
        losses = [step(*batch) for batch in local]
        reported = step.report()["model_state_bytes_per_rank"]
        results[stage] = (losses, step.full_state_dict(), None, held_bytes(step),
                          {kind: reported[kind] for kind in ("params", "optimizer")})
        if world_size != 2 or memory_pools:   # the default allocation's runs carry the SGD check
            continue
        model, _, _ = build(name, seed=rank)
        sgd_step = zerocc.compile(model, sgd(model), stage=stage, loss_fn=loss_fn, memory_pools=memory_pools)
        before = sgd_step.full_state_dict()
        sgd_step(*local[0])
        results[stage] = (losses, results[stage][1],
                          {key: value - before[key] for key, value in sgd_step.full_state_dict().items()},
                          *results[stage][3:])
    return results


@pytest.mark.multirank
@pytest.mark.parametrize("name, world_size, memory_pools", [
    *[(name, world_size, None) for world_size in (2, 4) for name in ("mlp", "gpt", "cnn")],   # None: the default
    ("gpt", 2, True)])
def test_world_size_n_matches_ddp(name, world_size, memory_pools):
    _assert_every_stage_matches_ddp(distributed.run(_train_all_stages, world_size, name, memory_pools))


def _train_all_stages_with_foreach(rank, world_size, name):
    with foreach_as_on_cuda():
        return _train_all_stages(rank, world_size, name)


@pytest.mark.multirank
def test_the_foreach_update_across_ranks_matches_ddp():
    """The update as on CUDA (foreach, launched per bucket so that a bucket's update can follow its reduction),
    for DDP's eager optimizer and zerocc's alike."""
    _assert_every_stage_matches_ddp(distributed.run(_train_all_stages_with_foreach, 2, "gpt"))


def _assert_every_stage_matches_ddp(per_rank):
    for rank, results in enumerate(per_rank):
        expected_losses, expected_state, expected_gradients = results["ddp"]
        for stage in STAGES:
            losses, state, update, held, reported = results[stage]
            assert held == reported, f"stage {stage} rank {rank}: the slots hold {held}, the report says {reported}"
            torch.testing.assert_close(torch.stack(losses), torch.stack(expected_losses), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"stage {stage} rank {rank} losses: {m}")
            if update is not None:   # SGD with lr 1: the first update is minus the averaged gradient
                for key, gradient in expected_gradients.items():
                    torch.testing.assert_close(-update[key], gradient, rtol=1e-4, atol=1e-6,
                                               msg=lambda m: f"stage {stage} rank {rank} first update of {key}: {m}")
            assert state.keys() == expected_state.keys()
            for key, value in expected_state.items():
                torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"stage {stage} rank {rank} {key}: {m}")
            for key in expected_gradients:   # the ranks hold one model: parameters equal bit for bit
                assert torch.equal(state[key], per_rank[0][stage][1][key]), f"stage {stage} rank {rank} {key}"


def _train_with_rprop(rank, world_size):
    """Per rank: DDP's losses and final state with Rprop; then each sharding stage's."""
    data = batches("mlp", STEPS, 4 * world_size)
    local = [tuple(t[rank * 4:(rank + 1) * 4] for t in batch) for batch in data]
    reference, _, loss_fn = build("mlp")
    ddp = DistributedDataParallel(reference)
    optimizer = torch.optim.Rprop(reference.parameters(), lr=1e-2)
    results = {"ddp": ([eager_step(ddp, optimizer, loss_fn, batch) for batch in local], reference.state_dict())}
    for stage in (1, 2, 3):
        model, _, _ = build("mlp", seed=rank)
        step = zerocc.compile(model, torch.optim.Rprop(model.parameters(), lr=1e-2), stage=stage, loss_fn=loss_fn)
        results[stage] = ([step(*batch) for batch in local], step.full_state_dict())
    return results


@pytest.mark.multirank
def test_rprop_sharded_across_ranks_matches_ddp():
    """Rprop writes x[mask] = scalar: elementwise, so each rank updates its own slice (stages 1-3)."""
    for rank, results in enumerate(distributed.run(_train_with_rprop, 2)):
        expected_losses, expected_state = results["ddp"]
        for stage in (1, 2, 3):
            losses, state = results[stage]
            torch.testing.assert_close(torch.stack(losses), torch.stack(expected_losses), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"stage {stage} rank {rank} losses: {m}")
            for key, value in expected_state.items():
                torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"stage {stage} rank {rank} {key}: {m}")


def test_compile_after_eager_steps_continues_exactly():
    """The optimizer already has state (from eager steps): the compiled step picks it up."""
    reference, _, loss_fn = build("mlp")
    reference_optimizer = adamw(reference)
    model, _, _ = build("mlp")
    optimizer = adamw(model)
    data = batches("mlp", 4, 8)
    for batch in data[:2]:
        eager_step(reference, reference_optimizer, loss_fn, batch)
        eager_step(model, optimizer, loss_fn, batch)
    step = zerocc.compile(model, optimizer, stage=3, loss_fn=loss_fn)
    for batch in data[2:]:
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, loss_fn, batch))
    for key, value in reference.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key


class TransposedDropout(torch.nn.Module):
    """Dropout on a transposed tensor: eager draws its mask in place, in the tensor's memory order."""

    def __init__(self):
        super().__init__()
        self.linear, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x):   # x: (length, batch, 8) -> dropout on the (batch, length, 8) view
        return self.head(torch.nn.functional.dropout(self.linear(x).transpose(0, 1), 0.3)).mean(1)


class EncoderLayers(torch.nn.Module):
    """nn.TransformerEncoder with batch_first: its dropouts act on MultiheadAttention's transposed output."""

    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        padding = torch.zeros(x.shape[:2], dtype=torch.bool)
        padding[:, -2:] = True
        return self.head(self.encoder(x, src_key_padding_mask=padding).mean(1))


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("architecture", [TransposedDropout, EncoderLayers], ids=["transposed", "encoder"])
def test_dropout_on_a_transposed_tensor_draws_eagers_mask(architecture, stage):
    """Functionalized, eager's in-place draw became a contiguous one: the same numbers on other elements."""
    def built():
        torch.manual_seed(0)
        return architecture()
    reference, model = built(), built()
    reference_optimizer = adamw(reference)
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=torch.nn.functional.mse_loss)
    generator = torch.Generator().manual_seed(1)
    for number in range(3):
        batch = (torch.randn(6, 4, 8, generator=generator), torch.randn(6 if architecture is EncoderLayers else 4, 1,
                                                                        generator=generator))
        torch.manual_seed(100 + number)
        expected = eager_step(reference, reference_optimizer, torch.nn.functional.mse_loss, batch)
        torch.manual_seed(100 + number)
        assert torch.equal(step(*batch), expected), number
    for key, value in reference.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key


class FrozenEncoder(torch.nn.Module):
    """A frozen pretrained encoder in eval mode under a trained head: nothing through it requires grad, so eager
    runs PyTorch's fused inference kernels (``_transformer_encoder_layer_fwd``, ``_native_multi_head_attention``)."""

    def __init__(self, nested=False):
        super().__init__()
        self.embedding = torch.nn.Embedding(50, 16)
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested)
        self.attention = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = torch.nn.Linear(16, 3)
        for frozen in (self.embedding, self.encoder, self.attention):
            frozen.requires_grad_(False).eval()

    def forward(self, ids, padding):
        hidden = self.encoder(self.embedding(ids), src_key_padding_mask=padding)
        hidden = self.attention(hidden, hidden, hidden, key_padding_mask=padding)[0]
        return self.head(hidden.mean(1))


def _padded_batches(count):
    generator = torch.Generator().manual_seed(1)
    for _ in range(count):
        padding = torch.zeros(4, 7, dtype=torch.bool)
        padding[0, -2:] = True
        yield torch.randint(0, 50, (4, 7), generator=generator), padding, torch.randint(0, 3, (4,), generator=generator)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_frozen_eval_mode_encoder_runs_eagers_fused_kernels(stage):
    """The trace took the composite path (fake tensors answer has_torch_function, make_fx blocks attention's fast
    path), 1 ulp off eager's fused kernels from the second step on; eval_forward likewise."""
    def built():
        torch.manual_seed(0)
        return FrozenEncoder()
    reference, model = built(), built()
    reference_optimizer = torch.optim.AdamW(reference.head.parameters(), lr=1e-2)
    loss_fn = torch.nn.CrossEntropyLoss()
    step = zerocc.compile(model, torch.optim.AdamW(model.head.parameters(), lr=1e-2), stage=stage, loss_fn=loss_fn)
    for number, batch in enumerate(_padded_batches(3)):
        torch.manual_seed(100 + number)
        expected = eager_step(reference, reference_optimizer, loss_fn, batch)
        torch.manual_seed(100 + number)
        assert torch.equal(step(*batch), expected), number
    for key, value in reference.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key
    ids, padding, _ = next(_padded_batches(1))
    reference.eval()
    with torch.no_grad():
        assert torch.equal(step.eval_forward(ids, padding), reference(ids, padding))


def test_an_encoders_nested_tensor_fast_path_is_refused_and_trains_with_it_off():
    """Eager ran the frozen encoder on a nested tensor (zeros at the padded positions); the step computed them and
    trained on another loss, silently. Refused naming the line; with the fast path off both compute alike."""
    def built():
        torch.manual_seed(0)
        return FrozenEncoder(nested=True)
    loss_fn = torch.nn.CrossEntropyLoss()
    model = built()
    step = zerocc.compile(model, torch.optim.AdamW(model.head.parameters(), lr=1e-2), loss_fn=loss_fn)
    batch = next(_padded_batches(1))
    with pytest.raises(zerocc.CaptureError, match=r"(?s)test_numerics.py:\d+: hidden = self.encoder.*"
                                                  r"nested-tensor fast path.*set_fastpath_enabled\(False\)"):
        step(*batch)
    reference = built()
    reference_optimizer = torch.optim.AdamW(reference.head.parameters(), lr=1e-2)
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        for number, batch in enumerate(_padded_batches(2)):
            torch.manual_seed(100 + number)
            expected = eager_step(reference, reference_optimizer, loss_fn, batch)
            torch.manual_seed(100 + number)
            assert torch.equal(step(*batch), expected), number
    finally:
        torch.backends.mha.set_fastpath_enabled(True)


class SequenceBatchNorm(torch.nn.Module):
    """BatchNorm1d over a sequence's features (conformer, wav2vec2-style): normalized transposed, then a linear layer."""

    def __init__(self):
        super().__init__()
        self.linear, self.norm, self.head = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1)

    def forward(self, x):   # x: (batch, length, 8)
        return self.head(self.norm(self.linear(x).transpose(1, 2)).transpose(1, 2)).mean(1)


@pytest.mark.parametrize("memory_pools", [False, True], ids=["plain", "pools"])
@pytest.mark.parametrize("stage", [0, 3])
def test_batch_norm_over_a_transposed_sequence_trains_bit_for_bit(stage, memory_pools):
    """The CPU batch norm kernel's output is contiguous where its meta kernel kept the transposed input's strides:
    the trace recorded F.linear's view of a contiguous tensor, and every call failed with "view size is not
    compatible with input tensor's size and stride" (eager copies the strided tensor and multiplies)."""
    torch.manual_seed(0)
    reference = SequenceBatchNorm()
    torch.manual_seed(0)
    model = SequenceBatchNorm()
    reference_optimizer = adamw(reference)
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=torch.nn.functional.mse_loss,
                          memory_pools=memory_pools)
    generator = torch.Generator().manual_seed(1)
    for number in range(3):
        batch = (torch.randn(4, 6, 8, generator=generator), torch.randn(4, 1, generator=generator))
        expected = eager_step(reference, reference_optimizer, torch.nn.functional.mse_loss, batch)
        assert torch.equal(step(*batch), expected), number
    for key, value in reference.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key


class GatedDecay(torch.nn.Module):
    """Qwen3-Next's gated delta rule, reduced: a softplus gate per head whose gradient arrives transposed."""

    def __init__(self):
        super().__init__()
        self.proj, self.dt_bias = torch.nn.Linear(8, 8), torch.nn.Parameter(torch.ones(4))
        self.activation = torch.nn.Hardswish()

    def forward(self, x):   # x: (batch, length, 8)
        batch, length, _ = x.shape
        b, a = self.proj(x).view(batch, length, 2, 4).split(2, dim=3)
        decay = torch.nn.functional.softplus(a.reshape(batch, length, 4) + self.dt_bias)
        gate = self.activation(b.reshape(batch, length, 4))
        return (decay * gate).transpose(1, 2).contiguous().cumsum(-1).mean((1, 2))   # heads first, as the kernel


@pytest.mark.parametrize("memory_pools", [False, True], ids=["plain", "pools"])
@pytest.mark.parametrize("stage", [0, 3])
def test_activation_gradients_arriving_transposed_train_bit_for_bit(stage, memory_pools):
    """softplus_backward's (and hardswish_backward's, ...) fake kernel laid its result out like its second input, the
    CPU kernel like its first (the transposed gradient): without memory pools every call failed with "view size is
    not compatible with input tensor's size and stride"; with them, placed in the traced layout, the gradient of
    dt_bias was summed in another order than eager's (Qwen3-Next's, off by an ulp)."""
    torch.manual_seed(0)
    reference = GatedDecay()
    model = copy.deepcopy(reference)
    reference_optimizer = adamw(reference)
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=torch.nn.functional.mse_loss,
                          memory_pools=memory_pools)
    generator = torch.Generator().manual_seed(1)
    for number in range(3):
        batch = (torch.randn(4, 6, 8, generator=generator), torch.randn(4, generator=generator))
        expected = eager_step(reference, reference_optimizer, torch.nn.functional.mse_loss, batch)
        assert torch.equal(step(*batch), expected), number
    for key, value in reference.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key


@pytest.mark.parametrize("stage", [0, 3])
def test_eval_forward_of_a_linear_layer_over_a_transposed_tensor_equals_eager(stage):
    """``matmul`` folds a strided 3-d input into one ``mm`` when the weight requires grad, and runs ``bmm``
    otherwise: eval_forward traced over the step's buckets, which do not, and differed from eager by rounding."""
    torch.manual_seed(0)
    reference = SequenceBatchNorm()
    torch.manual_seed(0)
    model = SequenceBatchNorm()
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=torch.nn.functional.mse_loss)
    step(torch.randn(4, 6, 8), torch.randn(4, 1))
    reference.load_state_dict(step.full_state_dict())
    reference.eval()
    x = torch.randn(4, 6, 8)
    assert torch.equal(step.eval_forward(x), reference(x))
    with torch.no_grad():
        assert torch.equal(step.eval_forward(x), reference(x))


class _SpectralFilter(torch.nn.Module):
    """A complex parameter: a learned filter applied in the frequency domain (torch.fft)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.filter = torch.nn.Parameter(torch.randn(5, dtype=torch.complex64))

    def forward(self, x, target):
        spectrum = torch.fft.rfft(self.linear(x), dim=-1) * self.filter
        return torch.nn.functional.mse_loss(torch.fft.irfft(spectrum, n=8, dim=-1), target)


@pytest.mark.parametrize("stage", STAGES)
def test_complex_parameters_with_adamw_weight_decay_bit_for_bit(stage):
    """AdamW decays a complex parameter by 1 - lr * weight_decay, a traced Python float times a complex tensor,
    which the functional op's fake kernel could not convert: the step now traces it and trains as eager does,
    under a schedule too."""
    torch.manual_seed(0)
    model, reference = _SpectralFilter(), _SpectralFilter()
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    eager_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.1)
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (optimizer, eager_optimizer)]
    step = zerocc.compile(model, optimizer, stage=stage)
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        batch = (torch.randn(4, 6, 8, generator=generator), torch.randn(4, 6, 8, generator=generator))
        eager_optimizer.zero_grad()
        expected = reference(*batch)
        expected.backward()
        eager_optimizer.step()
        assert torch.equal(step(*batch), expected)
        for schedule in schedules:
            schedule.step()
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key


class _FocalLoss(torch.nn.Module):
    """A multi-label head trained with the sigmoid focal loss (as torchvision.ops.sigmoid_focal_loss writes it): the
    elementwise binary cross-entropy, weighted by how wrong each logit is; an in-place ReLU, as torchvision writes them."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(inplace=True), torch.nn.Linear(16, 5))

    def forward(self, x, labels):
        logits = self.body(x)
        cross_entropy = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="none")
        probability = torch.sigmoid(logits)
        p_t = probability * labels + (1 - probability) * (1 - labels)
        return (cross_entropy * (1 - p_t) ** 2).mean()


@pytest.mark.parametrize("memory_pools", [False, True], ids=["plain", "pools"])
@pytest.mark.parametrize("stage", [0, 3])
def test_binary_cross_entropy_with_logits_is_eagers_kernel(stage, memory_pools):
    """torch.func.functionalize swapped the op for functorch's formula (log of a sum of exps, where eager's kernel
    takes log_sigmoid): every element a few ulps off, which the focal loss's gradient reads."""
    torch.manual_seed(0)
    reference, model = _FocalLoss(), _FocalLoss()
    model.load_state_dict(reference.state_dict())
    reference_optimizer = adamw(reference)
    step = zerocc.compile(model, adamw(model), stage=stage, memory_pools=memory_pools)
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        batch = (torch.randn(32, 8, generator=generator) * 3, (torch.rand(32, 5, generator=generator) > 0.5).float())
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, None, batch))
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key
