"""Capture meets the user's own code and tools: tensor attributes, module hooks, dispatch modes, MemTracker."""
from __future__ import annotations

import contextlib
import dataclasses
import copy
import functools
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerocc
from zerocc.capture import capture, tensor_attributes
from zerocc.tracing import make_fake_mode
from tests.reference import eager


class CountingAttribute(nn.Module):
    """Counts its calls in a plain tensor attribute (not a buffer) and scales by a read-only one."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(12, 5)
        self.counter = torch.zeros(())
        self.scale = torch.tensor(2.0)

    def forward(self, x):
        self.counter += 1
        return self.linear(x).square().mean() * self.counter * self.scale


class CountingBuffer(nn.Module):
    """The fix the error names: the counter as a buffer, which the step carries."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(12, 5)
        self.register_buffer("counter", torch.zeros(()))
        self.scale = torch.tensor(2.0)

    def forward(self, x):
        self.counter += 1
        return self.linear(x).square().mean() * self.counter * self.scale


class Normalized(nn.Module):
    """Parameters, BatchNorm buffers and read-only tensor attributes of several sizes."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(12, 8)
        self.norm = nn.BatchNorm1d(8)
        self.shift = torch.linspace(-1, 1, 8)
        self.scale = torch.tensor(0.5)

    def forward(self, x):
        return (self.norm(self.linear(x)) * self.scale + self.shift).square().mean()


def every_tensor(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    tensors = {f"param {name}": t for name, t in model.named_parameters()}
    tensors |= {f"buffer {name}": t for name, t in model.named_buffers()}
    tensors |= {f"attribute {name}": t for name, t in tensor_attributes(model).values()}
    for index, state in enumerate(optimizer.state.values()):
        tensors |= {f"state {index} {key}": t for key, t in state.items() if isinstance(t, torch.Tensor)}
    return tensors


# -- tensor attributes that forward changes in place ----------------------------------

@pytest.mark.parametrize("stage", [0, 3])
def test_a_tensor_attribute_written_in_forward_is_refused_naming_it_and_left_as_it_was(stage):
    model = CountingAttribute()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=stage)
    with pytest.raises(zerocc.CaptureError, match=r"(?s)neither parameters nor buffers:\n  - 'counter' by add_ at "
                       r".*test_user_tooling.py:\d+: self.counter \+= 1\n.*"
                       r"fix: register it as a buffer .*self.register_buffer\('counter', torch.zeros\(\(\)\)\)"):
        step(torch.randn(4, 12))
    assert torch.equal(model.counter, torch.zeros(())) and torch.equal(model.scale, torch.tensor(2.0))


ROUTED = torch.zeros(5)   # a module-level tally, as some MoE code keeps its experts' loads


class CountingRoutes(nn.Module):
    """Counts how many rows pick each output (an MoE's tokens per expert) into a tensor that is not a buffer."""

    def __init__(self, into_global):
        super().__init__()
        self.linear = nn.Linear(12, 5)
        self.routed = torch.zeros(5)
        self.into_global = into_global

    def forward(self, x):
        y = self.linear(x)
        with torch.no_grad():
            counts = torch.bincount(y.argmax(-1), minlength=5).float()
            if self.into_global:
                ROUTED.add_(counts)
            else:
                self.routed += counts
        return y.square().mean()


def test_an_attribute_written_with_a_computed_value_is_refused_naming_it():
    """Written with a value the step computes, the attribute failed inside functionalization instead: "(no user
    frame found): RuntimeError: false INTERNAL ASSERT FAILED ... mutating a non-functional tensor"."""
    model = CountingRoutes(into_global=False)
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(zerocc.CaptureError, match=r"(?s)neither parameters nor buffers:\n  - 'routed' by add_ at "
                       r".*test_user_tooling.py:\d+: self.routed \+= counts\n.*self.register_buffer\('routed'"):
        step(torch.randn(8, 12))
    assert torch.equal(model.routed, torch.zeros(5))


def test_a_global_tensor_written_in_forward_is_refused_naming_the_line():
    """Not the model's: failed as the attribute did, or, written with a constant, was silently written only while
    tracing."""
    model = CountingRoutes(into_global=True)
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(zerocc.CaptureError, match=r"(?s)writes in place into tensors that are not the model's.*\n"
                       r"  - written by add_ at .*test_user_tooling.py:\d+: ROUTED.add_\(counts\)\n.*fix: keep it in a buffer"):
        step(torch.randn(8, 12))


@pytest.mark.parametrize("stage", [0, 3])
def test_the_counter_as_a_buffer_counts_like_eager(stage):
    torch.manual_seed(0)
    model = CountingBuffer()
    reference = copy.deepcopy(model)
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=stage)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 12, generator=generator)
        assert torch.equal(step(x), eager(reference, reference_optimizer, x))
    assert torch.equal(step.full_state_dict()["counter"], torch.tensor(3.0))
    assert torch.equal(model.scale, torch.tensor(2.0))


def test_capture_leaves_every_tensor_reachable_from_the_model_and_optimizer_untouched():
    torch.manual_seed(0)
    model = Normalized()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    eager(model, optimizer, torch.randn(4, 12))   # optimizer state exists, BatchNorm statistics moved
    before = {name: (t._version, t.detach().clone()) for name, t in every_tensor(model, optimizer).items()}
    capture(model, optimizer, [torch.randn(4, 12)], loss_fn=None, num_targets=0, fake_mode=make_fake_mode())
    after = every_tensor(model, optimizer)
    assert after.keys() == before.keys()
    changed = [name for name, (version, value) in before.items()
               if after[name]._version != version or not torch.equal(after[name], value)]
    assert not changed


class LazyCache(nn.Module):
    """Builds a tensor attribute on its first call (and again for a new batch size), as position caches do."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 1)
        self.cache = None

    def forward(self, x):
        if self.cache is None or self.cache.shape[0] != x.shape[0]:
            self.cache = torch.linspace(0, 1, x.shape[0]).unsqueeze(1)
        return self.linear(x) + self.cache


@pytest.mark.parametrize("stage", [0, 3])
def test_an_attribute_forward_sets_is_traced_and_not_left_fake_on_the_module(stage):
    torch.manual_seed(0)
    model, reference = LazyCache(), LazyCache()
    reference.load_state_dict(model.state_dict())
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=0.1), stage=stage, loss_fn=F.mse_loss)
    generator = torch.Generator().manual_seed(1)
    for rows in (4, 6, 4):
        x, y = torch.randn(rows, 8, generator=generator), torch.randn(rows, 1, generator=generator)
        reference_optimizer.zero_grad(set_to_none=True)
        expected = F.mse_loss(reference(x), y)
        expected.backward()
        reference_optimizer.step()
        assert torch.equal(step(x, y), expected.detach())
    assert model.cache is None   # as before compiling: the programs hold what the traces computed
    assert torch.equal(step.eval_forward(x), reference.eval()(x).detach())
    assert model.cache is None


LOGGED_BY_THE_LOSS = []


class Observed(nn.Module):
    """Keeps what it computes for a user to look at: a dict of statistics and the last hidden state."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)
        self.stats = {"calls": 0}

    def forward(self, x):
        hidden = self.a(x).relu()
        self.stats["mean"] = hidden.mean().detach()
        self.last_hidden = hidden.detach()
        return self.b(hidden)


def test_tensors_the_steps_python_keeps_for_the_user_are_taken_out_and_named():
    """A forward hook logging norms into a list, a loss function appending to a module-level list, a module's
    dict of statistics: the step runs that Python once, while tracing, so they kept placeholders (FakeTensors)
    that no later step updated, without a word. They are put back as they were, and a warning names each."""
    def loss_fn(output, target):
        loss = F.mse_loss(output, target)
        LOGGED_BY_THE_LOSS.append(loss.detach())
        return loss

    torch.manual_seed(0)
    model, reference = Observed(), Observed()
    reference.load_state_dict(model.state_dict())
    norms = []
    model.a.register_forward_hook(lambda module, inputs, output: norms.append(output.norm()))
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=0.1), stage=3, loss_fn=loss_fn)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1)
    LOGGED_BY_THE_LOSS.clear()
    with pytest.warns(zerocc.ObservedValueWarning) as caught:
        for _ in range(3):
            x, y = torch.randn(4, 8), torch.randn(4, 1)
            expected = F.mse_loss(reference(x), y)
            reference_optimizer.zero_grad()
            expected.backward()
            reference_optimizer.step()
            assert torch.equal(step(x, y), expected.detach())
    said = str(caught[0].message)
    assert all(name in said for name in ("norms (named by the hook", "LOGGED_BY_THE_LOSS", "Observed.stats"))
    assert "last_hidden" not in said   # an attribute set to a tensor is put back unnamed: most are caches
    assert caught[0].filename == __file__
    assert norms == [] and LOGGED_BY_THE_LOSS == [] and model.stats == {"calls": 0}
    assert not hasattr(model, "last_hidden")


# -- the user's tools and hooks ----------------------------------------------------------

def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 5))


def train_both(model, steps=3, stage=3, around=None):
    """The compiled step (its calls inside ``around``) and eager on the same batches: the losses, compared."""
    reference = copy.deepcopy(model)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=0.1), stage=stage, loss_fn=F.mse_loss)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(4, 12, generator=generator), torch.randn(4, 5, generator=generator)
        with around() if around is not None else contextlib.nullcontext():
            loss = step(x, y)
        reference_optimizer.zero_grad(set_to_none=True)
        expected = F.mse_loss(reference(x), y)
        expected.backward()
        reference_optimizer.step()
        assert torch.equal(loss, expected.detach())
    return step


def test_compiling_and_training_under_memtracker():
    from torch.distributed._tools.mem_tracker import MemTracker
    model = mlp()
    tracker = MemTracker()
    tracker.track_external(model)
    train_both(model, around=lambda: tracker)   # compiled at the first call, inside the tracker
    assert tracker.get_tracker_snapshot("peak")   # it saw the compiled step's real tensors


class CountingMode(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_a_users_dispatch_mode_sits_out_the_trace_and_sees_the_steps_ops():
    mode = CountingMode()
    model = mlp()
    seen = []

    @contextlib.contextmanager
    def counting():
        before = mode.calls
        with mode:
            yield
        seen.append(mode.calls - before)
    train_both(model, steps=3, around=counting)
    assert all(count > 0 for count in seen)   # each step's ops, at run time
    assert seen[0] < 2 * seen[2]              # the first two calls compile: the mode saw no trace


def test_anomaly_detection_sits_out_the_trace_with_a_warning_and_stays_on():
    # a user hunting a NaN turns it on for the whole run; its check reads every backward output's values, which a
    # trace on fake tensors does not have: the compile failed as data-dependent control flow naming no user line
    from zerocc import user_tooling
    user_tooling._warn_anomaly_once.cache_clear()
    with torch.autograd.set_detect_anomaly(True):
        with pytest.warns(UserWarning, match="anomaly detection is on.*no NaN check runs inside a compiled step") as caught:
            train_both(mlp(), steps=2)
        assert torch.is_anomaly_enabled()
    # it names the user's call of the step (in train_both), not a line of zerocc's (it named api.py)
    assert [w.filename for w in caught if "anomaly detection is on" in str(w.message)] == [__file__]


def test_global_module_hooks_sit_out_the_trace_and_stay_registered():
    from torch.nn.modules.module import register_module_forward_hook
    calls = []
    handle = register_module_forward_hook(lambda module, inputs, output: calls.append(type(module).__name__))
    try:
        train_both(mlp(), steps=2)
        calls.clear()
        mlp()(torch.randn(2, 12))
        assert calls   # still registered after compiling
    finally:
        handle.remove()


def test_global_optimizer_hooks_sit_out_every_trace_of_the_optimizer():
    """The probe that finds which param-group settings the update reads every step (optimizer_step.live_modes)
    traces the optimizer's step() on a stand-in: a global optimizer hook was called with that stand-in, three times
    in the first call, and a counting dispatch mode saw the probe's ops."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    calls = []
    handle = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: calls.append(type(optimizer).__name__))
    try:
        train_both(mlp(), steps=2)
        assert calls == ["AdamW", "AdamW"]   # the eager reference's two steps, no more
    finally:
        handle.remove()


@pytest.mark.parametrize("kind", ["forward", "forward_pre"])
def test_a_module_hook_that_changes_the_output_is_traced(kind):
    model = mlp()
    if kind == "forward":
        model[1].register_forward_hook(lambda module, inputs, output: output * 0.5)
    else:
        model[2].register_forward_pre_hook(lambda module, inputs: (inputs[0] + 1.0,))
    train_both(model)   # the reference is a deep copy: it has the same hook


def test_a_module_hook_that_only_observes_leaves_the_step_as_eager():
    model = mlp()
    shapes = []
    model[0].register_forward_hook(lambda module, inputs, output: shapes.append(tuple(output.shape)))
    train_both(model, stage=0)
    assert (4, 16) in shapes


def _clipped_gradient(grad):
    return grad.clamp(-0.05, 0.05) * 3.0


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_gradient_hook_on_a_parameter_is_traced(stage, accumulation):
    """``param.register_hook(fn)`` changes the gradient eager's backward gives that parameter; the step was silently
    training without it (the hook sat on the user's parameter, not on the traced one)."""
    model, reference = mlp(), mlp()
    for net in (model, reference):
        net[0].weight.register_hook(_clipped_gradient)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=F.mse_loss, grad_accumulation=accumulation)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 12, generator=generator), torch.randn(4, 5, generator=generator)
        reference_optimizer.zero_grad(set_to_none=True)
        expected = 0
        for micro_x, micro_y in zip(x.chunk(accumulation), y.chunk(accumulation)):
            loss = F.mse_loss(reference(micro_x), micro_y) / accumulation
            loss.backward()
            expected = expected + loss.detach()
        reference_optimizer.step()
        assert torch.equal(step(x, y), expected)
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key


@pytest.mark.parametrize("kind", ["forward", "forward_pre", "full_backward", "parameter"])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_hook_registered_or_removed_between_steps_trains_as_eager(stage, kind):
    """Hooks are traced into the program: one registered after the first step was silently left out (the
    program traced without it ran on), where eager runs it. It now gets its own program, as does its removal."""
    model = mlp()
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = (torch.optim.AdamW(m.parameters(), lr=0.1) for m in (model, reference))
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=F.mse_loss)

    def register(net):
        if kind == "forward":
            return net[0].register_forward_hook(lambda module, inputs, output: output * 0.5)
        if kind == "forward_pre":
            return net[2].register_forward_pre_hook(lambda module, inputs: (inputs[0] + 1.0,))
        if kind == "full_backward":
            return net[2].register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 0.25,))
        return net[0].weight.register_hook(_clipped_gradient)
    generator = torch.Generator().manual_seed(1)
    handles, programs = [], []
    for index in range(4):
        if index == 1:
            handles = [register(net) for net in (model, reference)]
        if index == 3:
            for handle in handles:
                handle.remove()
        x, y = torch.randn(4, 12, generator=generator), torch.randn(4, 5, generator=generator)
        reference_optimizer.zero_grad(set_to_none=True)
        expected = F.mse_loss(reference(x), y)
        expected.backward()
        reference_optimizer.step()
        assert torch.equal(step(x, y), expected.detach()), index
        programs.append(len(step.compile_stats))
    assert programs[1] == programs[0] + 1 and programs[2] == programs[1]   # the hook compiled once
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key


def _three_steps_beside_eager(step, reference, reference_optimizer):
    """Three MSE steps of ``step`` against ``reference`` trained eagerly on the same batches, bit for bit; the
    last batch's input."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 12, generator=generator), torch.randn(4, 5, generator=generator)
        reference_optimizer.zero_grad(set_to_none=True)
        expected = F.mse_loss(reference(x), y)
        expected.backward()
        reference_optimizer.step()
        assert torch.equal(step(x, y), expected.detach())
    return x


class _HooksOnFirstCall(nn.Module):
    """Registers a forward hook on a submodule in its first forward, as transformers' output capturing does
    (SegFormer compiled twice: the first program was keyed on the model without the hook)."""

    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        if not hasattr(self, "_installed"):
            self.net[0].register_forward_hook(lambda module, inputs, output: output * 0.5)
            self._installed = True
        return self.net(x)


@pytest.mark.parametrize("stage", [0, 3])
def test_hooks_a_first_forward_registers_compile_once(stage):
    torch.manual_seed(0)
    model = _HooksOnFirstCall()
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = (torch.optim.AdamW(m.parameters(), lr=0.1) for m in (model, reference))
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=F.mse_loss)
    _three_steps_beside_eager(step, reference, reference_optimizer)
    assert len(step.compile_stats) == 1
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key


@pytest.mark.parametrize("wrapped", ["model", "block"])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_model_or_block_wrapped_in_torch_compile_is_traced_through_its_own_code(stage, wrapped):
    """torch.compile(model), or per block as torchtitan does: dynamo inlines it in the trace, bit for bit with eager."""
    model, reference = mlp(), mlp()   # the reference runs eagerly: torch.compile's kernels round otherwise
    if wrapped == "model":
        model = torch.compile(model)
    else:
        model[0] = torch.compile(model[0])
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=0.1), stage=stage, loss_fn=F.mse_loss)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1)
    x = _three_steps_beside_eager(step, reference, reference_optimizer)
    full = {key.replace("_orig_mod.", ""): value for key, value in step.full_state_dict().items()}
    assert full.keys() == reference.state_dict().keys()
    assert all(torch.equal(full[key], value) for key, value in reference.state_dict().items())
    reference.eval()
    with torch.no_grad():
        assert torch.equal(step.eval_forward(x), reference(x))



# A loss weight an outer loop anneals, read by the loss function from its module's globals.
AUX_WEIGHT = 0.5


@dataclasses.dataclass
class Settings:   # a config object a module holds, as Hugging Face's self.config
    shift: float = 0.0


class Annealed(nn.Module):
    """Reads Python numbers a training loop changes between steps: dropout's p, a temperature, a config's
    field, a list's entry, a dict's entry and whether a set holds a value."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(12, 16)
        self.dropout = nn.Dropout(0.1)
        self.head = nn.Linear(16, 5)
        self.temperature = 1.0
        self.settings = Settings()
        self.widths = [1.0, 2.0]
        self.scales = {"hidden": 1.0}
        self.gelu_at = {0}
        self.calls = 0   # forward's own counter: the trace writes it, which is no reason to compile again

    def forward(self, x):
        self.calls += 1
        activation = F.gelu if 0 in self.gelu_at else F.silu
        hidden = self.dropout(activation(self.linear(x))) * self.widths[0] * self.scales["hidden"] + self.settings.shift
        return self.head(hidden) / self.temperature, hidden


def _loss_with_auxiliary(output, target):
    logits, hidden = output
    return F.mse_loss(logits, target) + AUX_WEIGHT * hidden.square().mean()


def _weighted_loss():
    """A loss whose weight is a variable of its closure, and the loop's way to set it."""
    weight = 1.0

    def loss(output, target):
        return weight * F.mse_loss(output[0], target)

    def set_weight(value):
        nonlocal weight
        weight = value
    return loss, set_weight


class WeightedLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = 1.0

    def forward(self, output, target):
        return self.weight * F.mse_loss(output[0], target)


@pytest.mark.parametrize("changed", ["dropout p", "attribute", "config", "list", "dict", "set", "loss global",
                                     "loss closure", "loss module"])
@pytest.mark.parametrize("stage", [0, 3])
def test_python_numbers_forward_and_the_loss_read_changed_between_steps_train_as_eager(stage, changed, monkeypatch):
    """A trace bakes the Python numbers forward and the loss read into the program as constants: a loop that
    annealed dropout's p, a temperature or a loss weight between steps silently trained on with the first value.
    A changed value now compiles its own program, with a warning naming it. Dicts and sets of such values were
    not read at all (``model.scales["hidden"] = 2.0``, ``model.gelu_at.discard(0)`` trained on with the first
    program), changed in place or replaced."""
    model = Annealed()
    reference = copy.deepcopy(model)
    loss_fn = _loss_with_auxiliary
    if changed == "loss closure":
        loss_fn, set_weight = _weighted_loss()
    elif changed == "loss module":
        loss_fn = WeightedLoss()
        set_weight = functools.partial(setattr, loss_fn, "weight")
    optimizer, reference_optimizer = (torch.optim.AdamW(m.parameters(), lr=0.1) for m in (model, reference))
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=loss_fn)
    generator = torch.Generator().manual_seed(1)
    for index in range(4):
        if changed == "dropout p":
            model.dropout.p = reference.dropout.p = 0.1 * index
        elif changed == "attribute":
            model.temperature = reference.temperature = 1.0 + index
        elif changed == "config":   # Hugging Face: model.config.use_cache = False, config._attn_implementation
            model.settings.shift = reference.settings.shift = 0.1 * index
        elif changed == "list":
            model.widths[0] = reference.widths[0] = 1.0 + index
        elif changed == "dict":
            model.scales["hidden"] = reference.scales["hidden"] = 1.0 + index
        elif changed == "set":   # in place, then replaced; back to the first program's set at the last step
            for module in (model, reference):
                if index == 1:
                    module.gelu_at.discard(0)
                elif index > 1:
                    module.gelu_at = {1} if index == 2 else {0}
        elif changed == "loss global":
            monkeypatch.setattr(sys.modules[__name__], "AUX_WEIGHT", 0.5 * index)
        else:
            set_weight(1.0 + index)
        x, y = torch.randn(4, 12, generator=generator), torch.randn(4, 5, generator=generator)
        torch.manual_seed(index)
        with pytest.warns(zerocc.RecompileWarning, match="Python values") if index == 1 else contextlib.nullcontext():
            loss = step(x, y)
        torch.manual_seed(index)
        reference_optimizer.zero_grad(set_to_none=True)
        expected = loss_fn(reference(x), y)
        expected.backward()
        reference_optimizer.step()
        assert torch.equal(loss, expected.detach()), index
    assert len(step.compile_stats) == (3 if changed == "set" else 4)
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key


def test_the_recompile_warning_names_an_attribute_set_to_none_between_steps():
    """An attribute forward may read, set to None after the first call (``self.cache = None``), compiled a new
    program with a warning that named nothing ("Python values that forward or the loss read changed ()"): the
    value missing before and None now compared equal."""
    model = nn.Linear(12, 3)
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=0, loss_fn=F.mse_loss)
    x, y = torch.randn(4, 12), torch.randn(4, 3)
    step(x, y)
    model.cache = None
    with pytest.warns(zerocc.RecompileWarning, match=r"changed \(model cache: \(not set\) -> None\)"):
        step(x, y)


def test_a_number_forward_writes_itself_compiles_once_and_eval_forward_reads_a_changed_one():
    model = Annealed()
    reference = copy.deepcopy(model).eval()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3, loss_fn=_loss_with_auxiliary)
    x, y = torch.randn(4, 12), torch.randn(4, 5)
    for _ in range(3):
        step(x, y)
    assert len(step.compile_stats) == 1   # forward's counter changed while tracing: not part of the key
    with step.full_model(writeback=False):
        reference.load_state_dict(model.state_dict())
    for temperature in (1.0, 3.0):
        model.temperature = reference.temperature = temperature
        with torch.no_grad():
            assert torch.equal(step.eval_forward(x)[0], reference(x)[0])


def _to_bf16(tensor):
    return tensor.to(torch.bfloat16) if tensor.dtype == torch.float32 else tensor


def _to_fp32(tensor):
    return tensor.float() if tensor.dtype == torch.bfloat16 else tensor


@pytest.mark.parametrize("stage", [0, 3])
def test_saved_tensor_hooks_around_some_steps_train_as_eager(stage):
    """Saved-tensor hooks around the step (here lossy: activations kept in bf16, which changes eager's gradients)
    are traced into the program; a step called without them after one called with them (or the reverse) ran the
    first call's program, silently. Each state now gets its own program; ``save_on_cpu`` entered anew around every
    step reuses one."""
    model = mlp()
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference))
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=F.mse_loss)
    generator = torch.Generator().manual_seed(1)
    for index, around in enumerate(["none", "bf16", "bf16", "none", "save_on_cpu", "save_on_cpu"]):
        def hooks():
            if around == "bf16":
                return torch.autograd.graph.saved_tensors_hooks(_to_bf16, _to_fp32)
            return torch.autograd.graph.save_on_cpu() if around == "save_on_cpu" else contextlib.nullcontext()
        x, y = torch.randn(4, 12, generator=generator), torch.randn(4, 5, generator=generator)
        with hooks():
            loss = step(x, y)
        reference_optimizer.zero_grad(set_to_none=True)
        with hooks():
            expected = F.mse_loss(reference(x), y)
            expected.backward()
        reference_optimizer.step()
        assert torch.equal(loss, expected.detach()), index
    assert len(step.compile_stats) == 3
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key


SHIFT = torch.tensor(0.5)   # a global tensor forward reads: the loop below replaces it


class Shifted(nn.Module):
    """Forward reads a plain tensor attribute and a global tensor; a loss module holds class weights."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(12, 3)
        self.scale = torch.tensor(2.0)   # a plain attribute, not a buffer

    def forward(self, x):
        return self.linear(x) * self.scale + SHIFT


@pytest.mark.parametrize("replaced", ["loss module's weight", "attribute", "global"])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_tensor_replaced_between_steps_trains_as_eager(stage, replaced, monkeypatch):
    """A trace reads the tensor objects it finds (a loss module's class weights, a plain tensor attribute, a global)
    as constants: `loss_fn.weight = new` between steps trained on with the old tensor. The objects' identities are
    part of the program's key; writing into the same tensor needs no new program."""
    torch.manual_seed(0)
    model = Shifted()
    reference = copy.deepcopy(model)
    loss_fn = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0]))
    optimizer, reference_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=loss_fn)
    generator = torch.Generator().manual_seed(1)
    for index in range(4):
        if index == 1:   # replaced by another object
            if replaced == "loss module's weight":
                loss_fn.weight = torch.tensor([5.0, 1.0, 1.0])
            elif replaced == "attribute":
                model.scale = reference.scale = torch.tensor(-1.0)
            else:
                monkeypatch.setattr(sys.modules[__name__], "SHIFT", torch.tensor(3.0))
        if index == 2:   # written in place: the program reads it as it is
            loss_fn.weight.mul_(2)
            model.scale.mul_(2)
            reference.scale.mul_(2)
        x, y = torch.randn(4, 12, generator=generator), torch.randint(0, 3, (4,), generator=generator)
        reference_optimizer.zero_grad(set_to_none=True)
        expected = loss_fn(reference(x), y)
        expected.backward()
        reference_optimizer.step()
        assert torch.equal(step(x, y), expected.detach()), index
    assert len(step.compile_stats) == 2   # the first program, and the replaced tensor's


REFERENCE = nn.Linear(12, 3).requires_grad_(False)   # a frozen reference model in a global: the loop below replaces it


class KeptClose(nn.Module):
    """A policy kept close to a frozen reference model it does not register (RL's KL penalty, distillation): held in a
    global, in a plain attribute (``object.__setattr__``, to keep it out of ``parameters()`` and ``state_dict()``), or
    in a list."""

    def __init__(self, held_in, reference):
        super().__init__()
        self.linear = nn.Linear(12, 3)
        self.held_in = held_in
        if held_in == "attribute":
            object.__setattr__(self, "reference", reference)
        elif held_in == "list":
            self.references = [reference]

    def forward(self, x):
        reference = {"global": lambda: REFERENCE, "attribute": lambda: self.reference,
                     "list": lambda: self.references[0]}[self.held_in]()
        with torch.no_grad():
            target = reference(x)
        return F.mse_loss(self.linear(x), target)


@pytest.mark.parametrize("held_in", ["global", "attribute", "list", "its parameter"])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_reference_model_replaced_between_steps_trains_as_eager(stage, held_in, monkeypatch):
    """A module forward reads outside the model (a frozen reference model in a global, an unregistered attribute
    or a list) has its parameters read by the trace as constants: replacing it by another module
    (``REF = copy.deepcopy(policy)``), or one of its parameters by another, trained on silently against the old
    weights. The identities of the tensors such a module holds are part of the program's key; copying into it in
    place (``load_state_dict``) needs no new program."""
    torch.manual_seed(0)
    monkeypatch.setattr(sys.modules[__name__], "REFERENCE", nn.Linear(12, 3).requires_grad_(False))
    model = KeptClose("global" if held_in == "its parameter" else held_in, REFERENCE)
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    step = zerocc.compile(model, optimizer, stage=stage)
    generator = torch.Generator().manual_seed(1)
    for index in range(4):
        if index == 1:   # replaced by another object, the same for the step's model and eager's copy
            new = nn.Linear(12, 3).requires_grad_(False)
            if held_in == "its parameter":
                REFERENCE.weight = nn.Parameter(torch.randn(3, 12), requires_grad=False)
            elif held_in == "global":
                monkeypatch.setattr(sys.modules[__name__], "REFERENCE", new)
            elif held_in == "attribute":
                object.__setattr__(model, "reference", new)
                object.__setattr__(reference, "reference", new)
            else:
                model.references[0] = reference.references[0] = new
        if index == 2:   # written in place: the program reads it as it is
            with torch.no_grad():
                for module in {id(m): m for m in (REFERENCE, getattr(model, "reference", None),
                                                  *getattr(model, "references", ())) if m is not None}.values():
                    module.weight.mul_(2)
        x = torch.randn(4, 12, generator=generator)
        reference_optimizer.zero_grad(set_to_none=True)
        expected = reference(x)
        expected.backward()
        reference_optimizer.step()
        assert torch.equal(step(x), expected.detach()), index
    assert len(step.compile_stats) == 2   # the first program, and the replaced reference's


NOISE = torch.Generator().manual_seed(7)   # a global generator forward draws from: the loop below replaces it


class Noisy(nn.Module):
    """Forward draws noise from a generator it holds and from a global one (``torch.randn(..., generator=...)``)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(12, 3)
        self.generator = torch.Generator().manual_seed(3)

    def forward(self, x):
        x = x + torch.randn(x.shape, generator=self.generator)
        return self.linear(x) + torch.randn(3, generator=NOISE)


@pytest.mark.parametrize("replaced", ["attribute", "global"])
def test_a_generator_replaced_between_steps_trains_as_eager(replaced, monkeypatch):
    """A trace reads the torch.Generator forward draws from as a constant: `self.generator = torch.Generator()
    .manual_seed(s)` between steps went on drawing from the old generator, silently. The generators' identities are
    part of the program's key; reseeding the same generator needs no new program."""
    torch.manual_seed(0)
    model = Noisy()
    reference = copy.deepcopy(model)   # a generator of its own, in the same state
    optimizer, reference_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    step = zerocc.compile(model, optimizer, stage=3, loss_fn=F.cross_entropy)
    generator = torch.Generator().manual_seed(1)
    for index in range(4):
        if index == 1 and replaced == "attribute":
            model.generator, reference.generator = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        if index == 1 and replaced == "global":
            monkeypatch.setattr(sys.modules[__name__], "NOISE", torch.Generator().manual_seed(5))
        if index == 2:   # reseeded in place: the program draws from it as it is
            model.generator.manual_seed(9)
            reference.generator.manual_seed(9)
        x, y = torch.randn(4, 12, generator=generator), torch.randint(0, 3, (4,), generator=generator)
        state = NOISE.get_state()
        reference_optimizer.zero_grad(set_to_none=True)
        expected = F.cross_entropy(reference(x), y)
        expected.backward()
        reference_optimizer.step()
        NOISE.set_state(state)   # the step draws what eager drew
        assert torch.equal(step(x, y), expected.detach()), index
        assert torch.equal(model.generator.get_state(), reference.generator.get_state()), index
    assert len(step.compile_stats) == 2   # the first program, and the replaced generator's


class NoisyFrom(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(12, 3)

    def forward(self, x, generator):
        return self.linear(x + torch.randn(x.shape, generator=generator))


def test_a_generator_passed_to_the_step_trains_as_eager_and_a_new_one_per_call_is_named_in_the_warning():
    """The step draws from the generator passed to it, as eager: the same one at every call needs one program. A
    new one is another program (the trace holds the generator), and the warning said to pass numbers as tensors;
    it says to pass the same generator."""
    torch.manual_seed(0)
    model = NoisyFrom()
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    step = zerocc.compile(model, optimizer, stage=3, loss_fn=F.cross_entropy)
    data = torch.Generator().manual_seed(1)
    passed, mine = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)

    def train(passed, mine):
        x, y = torch.randn(4, 12, generator=data), torch.randint(0, 3, (4,), generator=data)
        reference_optimizer.zero_grad(set_to_none=True)
        expected = F.cross_entropy(reference(x, mine), y)
        expected.backward()
        reference_optimizer.step()
        assert torch.equal(step(x, y, generator=passed), expected.detach())
        assert torch.equal(passed.get_state(), mine.get_state())

    for _ in range(2):
        train(passed, mine)
    assert len(step.compile_stats) == 1
    with pytest.warns(zerocc.RecompileWarning, match="pass the same one at every call"):
        train(torch.Generator().manual_seed(8), torch.Generator().manual_seed(8))
    assert len(step.compile_stats) == 2


@pytest.mark.parametrize("stage", [0, 3])
def test_eval_forward_reads_a_replaced_tensor_and_hooks_added_between_calls(stage):
    """eval_forward kept one program per batch shape and Python values: a tensor attribute replaced between calls
    and a forward hook added or removed evaluated with what the first call traced. Its key now holds the
    tensors' identities and the hooks, as the training step's does."""
    torch.manual_seed(0)
    model = Shifted()
    reference = copy.deepcopy(model)
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=stage, loss_fn=lambda out: out.sum())
    x = torch.randn(4, 12)
    step(x)
    with step.full_model(writeback=False):
        reference.load_state_dict(model.state_dict())
    reference.eval()
    with torch.no_grad():
        assert torch.equal(step.eval_forward(x), reference(x))
        model.scale = reference.scale = torch.tensor(-1.0)
        assert torch.equal(step.eval_forward(x), reference(x))
        handles = [m.linear.register_forward_hook(lambda module, inputs, out: out * 3) for m in (model, reference)]
        assert torch.equal(step.eval_forward(x), reference(x))
        for handle in handles:
            handle.remove()
        assert torch.equal(step.eval_forward(x), reference(x))


logits = torch.zeros(())   # a script's global named like an attribute forward reads (outputs.logits)


class ReadsAnAttributeNamedLikeAGlobal(nn.Module):
    def __init__(self):
        super().__init__()
        self.logits = nn.Linear(12, 3)

    def forward(self, x):
        return self.logits(x).square().mean()


def test_a_scripts_global_named_like_an_attribute_forward_reads_compiles_nothing_new():
    """Only the globals forward loads count: a loop's `logits = ...` each step is not forward's `self.logits`."""
    global logits
    model = ReadsAnAttributeNamedLikeAGlobal()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=0)
    for _ in range(3):
        logits = torch.randn(4, 3)
        step(torch.randn(4, 12))
    assert len(step.compile_stats) == 1


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(x.shape)).square().mean()


@pytest.mark.parametrize("stage", [0, 3])
def test_attention_kernels_chosen_around_some_steps_train_and_evaluate_as_eager(stage):
    """``with sdpa_kernel(SDPBackend.MATH):`` around every other step (or ``torch.backends.cuda.enable_flash_sdp``
    flipped in the loop): SDPA picks its kernel where it is traced, so the program kept the CPU flash kernel of
    its first trace while eager computed the math path, and gradients and eval_forward differed by rounding."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(0)
    model = _Attention()
    reference = copy.deepcopy(model)
    eager_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=stage)
    generator = torch.Generator().manual_seed(1)
    for number in range(4):
        x = torch.randn(4, 32, 16, generator=generator)
        with sdpa_kernel(SDPBackend.MATH) if number % 2 else contextlib.nullcontext():
            assert torch.equal(step(x), eager(reference, eager_optimizer, x))
            reference.eval()
            with torch.no_grad():
                assert torch.equal(step.eval_forward(x), reference(x))
            reference.train()
    assert len(step.compile_stats) == 2   # one program per setting, each reused
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key
