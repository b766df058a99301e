"""The loop around the step: misuse between calls is an error naming the input or object and the fix (issue 20, 7-9)."""
from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.prune as prune

import zerocc
from tests.models import MLP, batches, build, eager_step
from tests.reference import adamw
from tests import distributed


def compiled_mlp(stage=3, **options):
    model, _, loss_fn = build("mlp")
    optimizer = adamw(model)
    return zerocc.compile(model, optimizer, stage=stage, loss_fn=loss_fn, **options), model, optimizer


# -- item 8: crashes and silent cases around compile ------------------------------------

@pytest.mark.parametrize("stage", [True, 3.0, "3"])
def test_a_stage_that_only_compares_equal_to_one_is_refused(stage):
    model = MLP()
    with pytest.raises(zerocc.ConfigError, match=rf"stage={stage!r} is not a ZeRO stage; .* as an int"):
        zerocc.compile(model, adamw(model), stage=stage, loss_fn=F.mse_loss)


def test_a_model_on_the_meta_device_points_to_plan():
    with torch.device("meta"):
        model = MLP()
    with pytest.raises(zerocc.ConfigError, match=r"on the meta device \(net.0.weight, .*zerocc.plan\(model, "
                                                 r"optimizer.*model.to_empty\(device='cpu'\)"):
        zerocc.compile(model, adamw(model), stage=3, loss_fn=F.mse_loss)


def test_a_batch_on_the_meta_device_points_to_plan():
    step, _, _ = compiled_mlp(stage=0)
    x, y = batches("mlp", 1, 4)[0]
    with pytest.raises(zerocc.ConfigError, match=r"  - argument 0 is on the meta device: .*zerocc.plan\(model"):
        step(x.to("meta"), y)


def test_add_param_group_after_the_first_step_is_refused_with_the_way_out():
    model, _, loss_fn = build("mlp")
    head = nn.Linear(5, 5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = zerocc.compile(model, optimizer, stage=0, loss_fn=loss_fn)
    data = batches("mlp", 2, 4)
    step(*data[0])
    optimizer.add_param_group({"params": head.parameters()})
    with pytest.raises(zerocc.ConfigError, match=r"the optimizer's parameters changed after the step's first call "
                                                 r"\(it had 1 param group\(s\) of \d+ tensors, it now has 2 .*"
                                                 r"Add every param group before the first step"):
        step(*data[1])


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("change", ["freeze", "unfreeze"])
def test_freezing_or_unfreezing_after_the_first_step_is_refused_naming_the_parameter(stage, change):
    """The step would go on training (or not training) it as compiled; eager would skip a frozen one."""
    model, _, loss_fn = build("mlp")
    first = next(model.parameters())
    first.requires_grad_(change == "freeze")   # as compiled
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn)
    data = batches("mlp", 3, 4)
    step(*data[0])
    before = step.full_state_dict()
    first.requires_grad_(change == "unfreeze")
    name = next(name for name, _ in model.named_parameters())
    then, now = ("trained", False) if change == "freeze" else ("frozen", True)
    with pytest.raises(zerocc.ConfigError, match=rf"requires_grad changed after the step's first call for 1 "
                                                 rf"parameter\(s\): '{name}' \({then} then, requires_grad={now} now\)"
                                                 r".*own param group from the start and set that group's lr to 0"):
        step(*data[1])
    after = step.full_state_dict()
    assert all(torch.equal(after[key], value) for key, value in before.items())   # the refused call changed nothing
    first.requires_grad_(change == "freeze")   # as compiled again: the step trains on
    step(*data[2])


class AuxiliaryHead(nn.Module):
    """An auxiliary classifier the loop switches on or off between steps (``model.use_aux``)."""
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(12, 16)
        self.head = nn.Linear(16, 5)
        self.aux = nn.Linear(16, 5)
        self.use_aux = True

    def forward(self, x):
        h = self.body(x)
        out = self.head(torch.relu(h))
        if self.use_aux:
            out = out + 0.3 * self.aux(h)
        return out


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("first", [True, False], ids=["switched_off", "switched_on"])
def test_a_part_of_the_model_switched_on_or_off_between_steps_is_refused_and_compiling_again_trains_as_eager(
        stage, first):
    """Switched on, the head's parameters had no bucket and were silently never trained; switched off, the compile
    failed inside the shard pass (KeyError). Each is refused, naming the parameters and the flag; compiling again
    after the switch takes the model over and trains on as eager (which skips a parameter without a gradient)."""
    torch.manual_seed(0)
    model = AuxiliaryHead()
    reference = AuxiliaryHead()
    reference.load_state_dict(model.state_dict())
    optimizer, reference_optimizer = adamw(model), adamw(reference)
    model.use_aux = reference.use_aux = first
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=F.cross_entropy)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 12, generator=generator), torch.randint(0, 5, (8,), generator=generator))
            for _ in range(4)]
    eager = functools.partial(eager_step, reference, reference_optimizer, F.cross_entropy)

    for batch in data[:2]:
        assert torch.equal(step(*batch), eager(batch))
    before = step.full_state_dict()
    model.use_aux = reference.use_aux = not first
    changed = "the loss no longer reaches 'aux.bias', 'aux.weight'" if first else \
        "it now reaches 'aux.bias', 'aux.weight', which it did not then"
    with pytest.raises(zerocc.CaptureError, match=rf"trains other parameters than the step's first program: {changed} "
                       rf"\(changed since then: model use_aux: {first} -> {not first}\).*Compile again after the switch"):
        step(*data[2])
    after = step.full_state_dict()
    assert all(torch.equal(after[key], value) for key, value in before.items())   # the refused call changed nothing
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=F.cross_entropy)
    for batch in data[2:]:
        assert torch.equal(step(*batch), eager(batch))
    step.close()
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_a_training_step_under_inference_mode_is_refused_and_eval_forward_runs_there():
    step, _, _ = compiled_mlp(stage=3)
    data = batches("mlp", 2, 4)
    with torch.inference_mode(), pytest.raises(zerocc.ConfigError, match=r"called under torch.inference_mode\(\).*"
                                                                         r"use step.eval_forward"):
        step(*data[0])
    step(*data[0])   # the refused first call left nothing half done
    with torch.inference_mode():
        assert step.eval_forward(data[1][0]).shape == data[1][1].shape


def test_a_training_step_under_no_grad_is_refused_without_training():
    """An evaluation loop under torch.no_grad() calling the training step by mistake would train on its batches;
    eager's loss.backward() fails there."""
    step, _, _ = compiled_mlp(stage=3)
    data = batches("mlp", 2, 4)
    step(*data[0])
    before = {key: value.clone() for key, value in step.full_state_dict().items()}
    with torch.no_grad(), pytest.raises(zerocc.ConfigError, match=r"called under torch.no_grad\(\).*"
                                                                  r"use step.eval_forward"):
        step(*data[1])
    after = step.full_state_dict()
    assert all(torch.equal(after[key], value) for key, value in before.items())   # nothing trained
    assert step.steps == 1
    with torch.no_grad():
        assert step.eval_forward(data[1][0]).shape == data[1][1].shape


@pytest.mark.parametrize("method", ["report", "explain"])
def test_report_and_explain_without_a_memory_plan(method):
    step, _, _ = compiled_mlp(stage=0, disable=["plan_memory"])
    step(*batches("mlp", 1, 4)[0])
    result = getattr(step, method)()
    if method == "report":
        assert result["planned_peak_bytes"] is None and result["memory_pools"] is False
    else:
        assert "passes:" in result


def test_memory_plan_plot_without_a_path_writes_a_default_file(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    step, _, _ = compiled_mlp(stage=0)
    step(*batches("mlp", 1, 4)[0])
    monkeypatch.chdir(tmp_path)
    assert step.memory_plan.plot() == "memory_plan.png"
    assert (tmp_path / "memory_plan.png").stat().st_size > 0


def test_memory_budget_error_is_exported():
    assert issubclass(zerocc.MemoryBudgetError, zerocc.ZeroccError)
    assert "MemoryBudgetError" in zerocc.__all__


def test_disabling_capture_says_why_it_stays():
    step, _, _ = compiled_mlp(stage=0)
    assert step.passes[0] == "capture"
    model = MLP()
    with pytest.raises(zerocc.ConfigError, match=r"cannot disable 'capture': it traces the step"):
        zerocc.compile(model, adamw(model), stage=0, loss_fn=F.mse_loss, disable=["capture"])


# -- item 7: run-time errors name the input and the user's line, not generated code ----------

def test_a_batch_of_another_dtype_names_the_input_and_the_first_batch():
    step, _, _ = compiled_mlp(stage=3)
    x, y = batches("mlp", 1, 4)[0]
    step(x, y)
    with pytest.raises(zerocc.ConfigError, match=r"this batch cannot run in the compiled step \(the first batch was "
                                                 r"argument 0: \(4, 12\) float32 on cpu, argument 1: \(4, 5\) float32 "
                                                 r"on cpu\).*\n  - argument 0 is float64, the first batch's was float32: "
                                                 r"cast it \(.to\(torch.float32\)\)"):
        step(x.double(), y)
    assert torch.isfinite(step(x, y))   # refused before running: the step goes on


def test_a_keyword_batch_of_another_dtype_names_the_keyword_as_it_is_passed():
    """It read 'the first batch was x=: (4, 12) float32 on cpu'."""
    model = MLP()
    step = zerocc.compile(model, adamw(model), stage=0, loss_fn=F.mse_loss)
    x, y = batches("mlp", 1, 4)[0]
    step(y, x=x)   # the target positional, the model's input by keyword
    with pytest.raises(zerocc.ConfigError, match=r"\(the first batch was argument 0: \(4, 5\) float32 on cpu, "
                                                 r"x=\(4, 12\) float32 on cpu\).*\n  - x= is float64"):
        step(y, x=x.double())


def test_a_batch_that_requires_grad_is_refused_with_the_fix():
    step, _, _ = compiled_mlp(stage=0)
    x, y = batches("mlp", 1, 4)[0]
    with pytest.raises(zerocc.ConfigError, match=r"  - argument 0 requires grad: .*pass it detached \(x.detach\(\)\)"):
        step(x.clone().requires_grad_(), y)
    step(x, y)
    with pytest.raises(zerocc.ConfigError, match=r"argument 1 requires grad"):
        step(x, y.clone().requires_grad_())


def test_an_out_of_range_token_id_names_the_users_line():
    model, _, _ = build("gpt")
    step = zerocc.compile(model, adamw(model), stage=3)
    ids, labels = batches("gpt", 1, 2)[0]
    step(ids, labels)
    bad = ids.clone()
    bad[0, 0] = 10_000
    with pytest.raises(IndexError, match=r"zerocc: IndexError raised by the compiled step at .*gpt.py:\d+: "
                                         r"x = self.wte\(tokens\).*a token id >= the embedding's num_embeddings"):
        step(bad, labels)
    assert torch.isfinite(step(ids, labels))   # the data error happened before any state changed


def test_eval_forward_checks_its_batch_and_names_the_users_line():
    model, _, _ = build("gpt")
    step = zerocc.compile(model, adamw(model), stage=0)
    ids, labels = batches("gpt", 1, 2)[0]
    step(ids, labels)
    with pytest.raises(zerocc.ConfigError, match=r"(?s)cannot run in the compiled eval_forward .*argument 0 is int32"):
        step.eval_forward(ids.int(), labels)
    bad = ids.clone()
    bad[0, 0] = 10_000
    with pytest.raises(IndexError, match=r"raised by the compiled eval_forward at .*gpt.py:\d+: x = self.wte"):
        step.eval_forward(bad, labels)


# -- items 7 and 9 across ranks: clear errors on every rank, never a hang ---------------------

def _shape_changes_on_one_rank_at_call_3(rank, world_size):
    import time
    step, _, _ = compiled_mlp(stage=3)   # no timeout=: the per-call check must not need one
    started = time.monotonic()
    try:
        for call in range(1, 5):
            step(*batches("mlp", 1, 6 if rank == 1 and call == 3 else 4)[0])
    except zerocc.RankMismatchError as error:
        return call, str(error), time.monotonic() - started
    return call, "no error", time.monotonic() - started


@pytest.mark.multirank
def test_a_batch_shape_that_changes_on_one_rank_after_the_first_call_fails_on_every_rank():
    results, exit_codes = distributed.run_tolerant(_shape_changes_on_one_rank_at_call_3, 2, limit=150)   # the deadline
    assert exit_codes == [0, 0], (exit_codes, results)   # nobody hung
    for call, message, _ in results:
        assert call == 3
        assert "ranks [1] were called with a batch of other shapes than rank 0's in this call" in message
        assert "rank 0: input 0: float32[4, 12]; input 1: float32[4, 5]" in message
        assert "rank 1: input 0: float32[6, 12]; input 1: float32[6, 5]" in message
        assert "fix: give every rank a batch of the same shapes at every call" in message


def _eval_forward_on_rank_0_only(rank, world_size):
    step, _, _ = compiled_mlp(stage=3, timeout=5)
    x, y = batches("mlp", 1, 4)[0]
    step(x, y)
    if rank == 1:
        return "skipped eval_forward"
    try:
        step.eval_forward(x)
    except zerocc.RankFailureError as error:
        return str(error)
    return "no error"


@pytest.mark.multirank
def test_eval_forward_on_one_rank_only_says_it_is_collective():
    results, exit_codes = distributed.run_tolerant(_eval_forward_on_rank_0_only, 2, limit=150)
    assert exit_codes == [0, 0], (exit_codes, results)
    assert results[1] == "skipped eval_forward"
    assert "rank 0 of 2: a collective of step.eval_forward after step 1 did not complete within 5 s" in results[0]
    assert "step.eval_forward is a collective (it gathers the sharded parameters): every rank must call it" in results[0]


def _a_loader_one_batch_shorter_on_rank_1(rank, world_size, folder, after):
    """Rank 1's loader has one batch fewer: it goes on to what follows the loop while rank 0 still trains."""
    step, _, _ = compiled_mlp(stage=3, timeout=5)
    try:
        for x, y in batches("mlp", 3 - rank, 4):
            step(x, y)
        if after == "zerocc.save_checkpoint":
            zerocc.save_checkpoint(step, os.path.join(folder, "ckpt"))
        else:
            step.full_state_dict()
    except (zerocc.RankFailureError, zerocc.RankMismatchError) as error:
        return str(error)
    return "no error"


@pytest.mark.multirank
@pytest.mark.parametrize("after", ["zerocc.save_checkpoint", "step.full_state_dict"])
def test_a_loader_that_ends_earlier_on_one_rank_fails_on_every_rank_naming_what_each_waited_in(tmp_path, after):
    """Rank 1 raised gloo's bare "Timed out waiting 5000ms for recv operation" RuntimeError from the call after its
    loop; rank 0 a RankFailureError from its step (DDP hangs here unless the loop runs under its join()). Both calls
    start with the same all-reduce (failures.check_calls_agree): the ranks meet there and both raise at once, naming
    what each called."""
    results, exit_codes = distributed.run_tolerant(_a_loader_one_batch_shorter_on_rank_1, 2, str(tmp_path), after,
                                                   limit=150)
    assert exit_codes == [0, 0], (exit_codes, results)
    for message in results:
        assert "the ranks met in different calls" in message
        assert f"  - rank 0: the training step\n  - rank 1: {after}\n" in message
        assert "if a rank's loader ran out of batches first, give every rank the same number of batches" in message


class MaskedOutput(nn.Module):
    """An MLP whose output is multiplied by a mask buffer the loop may replace (or, once present, shift by)."""
    def __init__(self):
        super().__init__()
        self.body = MLP()
        self.register_buffer("mask", torch.ones(5))

    def forward(self, x):
        out = self.body(x) * self.mask
        return out + self.shift if hasattr(self, "shift") else out


def _change_the_model(model, change):
    if change == "buffer replaced":
        model.mask = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    elif change == "buffer registered":
        model.register_buffer("shift", torch.full((5,), 0.5))
    else:   # prune: weight becomes weight_orig (the same Parameter), a mask buffer and a forward pre-hook
        prune.l1_unstructured(model.body.net[0], "weight", amount=0.3)


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("change, named", [("buffer replaced", "buffer 'mask' replaced by another tensor"),
                                           ("buffer registered", "buffer 'shift' added"),
                                           ("pruned", "parameter 'body.net.0.weight' now named "
                                                      "'body.net.0.weight_orig'; buffer 'body.net.0.weight_mask' added")])
def test_a_parameter_or_buffer_changed_between_steps_is_refused_and_compiling_again_trains_as_eager(stage, change,
                                                                                                  named):
    """A buffer replaced or registered between steps was never read: the program went on with its own copy of the
    first one, silently (a new mask, ``prune.l1_unstructured`` again on a pruned layer); pruning a layer (its
    parameter renamed) failed with a KeyError leaving ``step.full_model()``. The call after the change is refused
    naming it, and compiling again takes the model over with its trained tensors and trains on as eager."""
    torch.manual_seed(0)
    model = MaskedOutput()
    reference = MaskedOutput()
    reference.load_state_dict(model.state_dict())
    optimizer, reference_optimizer = adamw(model), adamw(reference)
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=F.mse_loss)
    data = batches("mlp", 5, 4)
    eager = functools.partial(eager_step, reference, reference_optimizer, F.mse_loss)

    for batch in data[:2]:
        assert torch.equal(step(*batch), eager(batch))
    with step.full_model():   # the whole parameters in place, as pruning by magnitude reads them
        _change_the_model(model, change)
    _change_the_model(reference, change)
    before = step.full_state_dict()
    with pytest.raises(zerocc.ConfigError, match=rf"the model's parameters or buffers changed after the step's first "
                                                 rf"call: {named}\. .*compile the model and optimizer again"):
        step(*data[2])
    assert all(torch.equal(step.full_state_dict()[key], value) for key, value in before.items())
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=F.mse_loss)
    for batch in data[2:]:
        assert torch.equal(step(*batch), eager(batch))
    full = step.full_state_dict()
    assert full.keys() == reference.state_dict().keys()
    assert all(torch.equal(full[key], value) for key, value in reference.state_dict().items())
