"""Checkpoints: exact resume, resharding across world sizes and stages, nothing lost, one-file export.

A checkpoint is compared by its contents: every entry read back whole
(``read_whole``), independent of the layout that wrote it.
"""
from __future__ import annotations

import ctypes
import gc
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import zerocc
from zerocc import state_dict
from tests import distributed
from tests.models import TinyGPT, batches, build, eager_step
from tests.reference import adamw
from tests.helpers import read_whole

K = 2   # steps before and after a save

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def compiled(name, stage, seed=0, **options):
    model, _, loss_fn = build(name, seed)
    return zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn, **options)


def local_batches(name, rank, world_size, steps, seed=1):
    """This rank's slice of the same global batches at any world size (4 samples per rank)."""
    return [tuple(t[rank * 4:(rank + 1) * 4] for t in batch) for batch in batches(name, steps, 4 * world_size, seed)]


def assert_same_checkpoint(path_a, path_b):
    a, b = read_whole(path_a), read_whole(path_b)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# -- exact resume ------------------------------------------------------------------
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_is_exact_world_size_1(tmp_path, stage):
    data = batches("mlp", 2 * K, 8)
    original = compiled("mlp", stage)
    for batch in data[:K]:
        original(*batch)
    zerocc.save_checkpoint(original, tmp_path / "ckpt")
    expected = [original(*batch) for batch in data[K:]]

    resumed = compiled("mlp", stage, seed=7)        # fresh model and optimizer, other weights
    zerocc.load_checkpoint(resumed, tmp_path / "ckpt")   # before its first step: nothing compiled yet
    assert resumed.steps == K
    got = [resumed(*batch) for batch in data[K:]]
    assert all(torch.equal(a, b) for a, b in zip(got, expected)), (got, expected)
    assert len(resumed.cache.programs()) == 1   # the steady-state program only
    full_a, full_b = original.full_state_dict(), resumed.full_state_dict()
    for key in full_a:
        assert torch.equal(full_a[key], full_b[key]), key


def test_a_plain_process_saves_loads_and_exports_without_dcp_warnings(tmp_path):
    """At world size 1 every save, load and export printed DCP's UserWarning "torch.distributed is disabled,
    unavailable or uninitialized, assuming the intent is to save in a single process", from inside torch."""
    import warnings
    step = compiled("mlp", 3)
    step(*batches("mlp", 1, 8)[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zerocc.save_checkpoint(step, tmp_path / "ckpt")
        zerocc.load_checkpoint(step, tmp_path / "ckpt")
        zerocc.export_full_state_dict(tmp_path / "ckpt", tmp_path / "model.safetensors")
    assert [str(w.message) for w in caught] == []


def test_load_into_a_step_that_already_ran(tmp_path):
    data = batches("mlp", 2 * K, 8)
    original = compiled("mlp", 3)
    for batch in data[:K]:
        original(*batch)
    zerocc.save_checkpoint(original, tmp_path / "ckpt")
    expected = [original(*batch) for batch in data[K:]]
    other = compiled("mlp", 3, seed=3)
    for batch in batches("mlp", 3, 8, seed=9):   # its own history, then the checkpoint replaces it
        other(*batch)
    zerocc.load_checkpoint(other, tmp_path / "ckpt")
    assert other.steps == K
    got = [other(*batch) for batch in data[K:]]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))



@pytest.mark.parametrize("stage", [0, 3])
def test_a_checkpoint_saved_before_the_first_call_loaded_into_a_step_that_ran_restarts_the_optimizer_as_eager(
        tmp_path, stage):
    """Saved before any step, a checkpoint's optimizer entries are the zeros a first update starts from, standing for
    no state; loaded into a step that had trained, they were copied into its state, where eager's
    ``optimizer.load_state_dict`` leaves none: SGD's dampened momentum then took (1 - dampening) of the gradient
    where eager's first update takes all of it. The next call is now a first update again."""
    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    data = batches("mlp", 2 * K, 8)
    reference, _, loss_fn = build("mlp", 0)
    reference_optimizer = sgd(reference)
    initial = ({k: v.clone() for k, v in reference.state_dict().items()}, reference_optimizer.state_dict())
    model, _, _ = build("mlp", 0)
    step = zerocc.compile(model, sgd(model), stage=stage, loss_fn=loss_fn)
    zerocc.save_checkpoint(step, tmp_path / "initial")
    for batch in data[:K]:
        eager_step(reference, reference_optimizer, loss_fn, batch)
        step(*batch)
    reference.load_state_dict(initial[0])
    reference_optimizer.load_state_dict(initial[1])
    zerocc.load_checkpoint(step, tmp_path / "initial")
    for batch in data[K:]:
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, loss_fn, batch))
    full = step.full_state_dict()
    assert [k for k, v in reference.state_dict().items() if not torch.equal(full[k], v)] == []

def test_state_dict_and_load_state_dict_with_dcp_directly(tmp_path):
    data = batches("mlp", 2, 8)
    original = compiled("mlp", 2)
    original(*data[0])
    dcp.save(original.state_dict(), checkpoint_id=tmp_path / "raw", no_dist=True)
    expected = original(*data[1])
    again = compiled("mlp", 2, seed=4)
    again(*batches("mlp", 1, 8, seed=5)[0])      # compiled, with optimizer state of its own
    state = again.state_dict()
    dcp.load(state, checkpoint_id=tmp_path / "raw", no_dist=True)
    again.load_state_dict(state)
    assert torch.equal(again(*data[1]), expected)


def _resume_ranks(rank, world_size, name, stage, folder):
    data = local_batches(name, rank, world_size, 2 * K)
    original = compiled(name, stage)
    for batch in data[:K]:
        original(*batch)
    zerocc.save_checkpoint(original, os.path.join(folder, "ckpt"))
    expected = [original(*batch) for batch in data[K:]]
    resumed = compiled(name, stage, seed=11)
    zerocc.load_checkpoint(resumed, os.path.join(folder, "ckpt"))
    loaded_steps = resumed.steps
    got = [resumed(*batch) for batch in data[K:]]
    return expected, got, loaded_steps


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,stage,name", [(2, 3, "mlp"), (4, 2, "mlp")])
def test_resume_is_exact_across_ranks(tmp_path, world_size, stage, name):
    for rank, (expected, got, steps) in enumerate(distributed.run(_resume_ranks, world_size, name, stage,
                                                                   str(tmp_path))):
        assert steps == K
        for a, b in zip(expected, got):
            assert torch.equal(a, b), f"rank {rank}: {a} != {b}"


# -- resharding: 2 ranks (stage 3) -> 4 ranks (stage 1) -> 1 rank (stage 2) ---------
def _train_and_save(rank, world_size, stage, path):
    step = compiled("gpt", stage)
    for batch in local_batches("gpt", rank, world_size, K):
        step(*batch)
    zerocc.save_checkpoint(step, path)
    return step.full_state_dict()


def _load_and_save(rank, world_size, stage, source, target):
    step = compiled("gpt", stage, seed=5)
    zerocc.load_checkpoint(step, source)
    zerocc.save_checkpoint(step, target)       # before any step: what it loaded, in its own layout
    step(*local_batches("gpt", rank, world_size, 1, seed=3)[0])   # compiles: the loaded state becomes slots
    zerocc.save_checkpoint(step, target + "-after")
    return step.full_state_dict()


def eager_from_checkpoint(path):
    """A plain model and AdamW holding exactly what the checkpoint holds."""
    whole = read_whole(path)
    model, _, loss_fn = build("gpt", 9)
    state = model.state_dict()
    model.load_state_dict({k: whole[f"model/{_first_name(model, k)}"].reshape(v.shape) for k, v in state.items()})
    optimizer = adamw(model)
    for names, param in state_dict.named_tensors(model, "param"):
        optimizer.state[param] = {key.rsplit("/", 1)[1]: value.reshape(param.shape) if value.dim() else value.clone()
                                  for key, value in whole.items() if key.startswith(f"optim/{names[0]}/")}
    return model, optimizer, loss_fn


def _first_name(model, key):
    for kind in ("param", "buffer"):
        for names, _ in state_dict.named_tensors(model, kind):
            if key in names:
                return names[0]
    raise KeyError(key)


@pytest.mark.multirank
def test_reshard_2_to_4_to_1_across_stages(tmp_path):
    first, second = str(tmp_path / "ws2_stage3"), str(tmp_path / "ws4_stage1")
    per_rank = distributed.run(_train_and_save, 2, 3, first)
    saved = per_rank[0]
    for rank, state in enumerate(per_rank):        # the ranks hold one model, bit for bit
        assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved), rank
    after_load = distributed.run(_load_and_save, 4, 1, first, second)
    assert_same_checkpoint(first, second)          # nothing changed on the way through 4 ranks at stage 1
    assert read_whole(first)["zerocc/steps"].item() == K
    written = read_whole(second + "-after")        # what each of the 4 ranks holds after its step is what it wrote
    for rank, state in enumerate(after_load):
        model, _, _ = build("gpt", 9)
        for key in model.state_dict():
            assert torch.equal(state[key].reshape(-1), written[f"model/{_first_name(model, key)}"]), (rank, key)

    # 4 ranks (stage 1, after a step) -> 1 rank at stage 2 trains exactly as eager PyTorch from the same state
    data = batches("gpt", K, 8, seed=4)
    step = compiled("gpt", 2, seed=6)
    zerocc.load_checkpoint(step, second + "-after")
    model, optimizer, loss_fn = eager_from_checkpoint(second + "-after")
    for batch in data:
        assert torch.equal(step(*batch), eager_step(model, optimizer, loss_fn, batch))
    for key, value in model.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key

    # the consolidated export equals what the 2-rank run held, and loads into a plain model
    info = zerocc.export_full_state_dict(first, str(tmp_path / "model.safetensors"))
    exported = state_dict.read_safetensors(str(tmp_path / "model.safetensors"))
    assert exported.keys() == saved.keys()
    for key in saved:
        assert torch.equal(exported[key], saved[key]), key
    plain, _, _ = build("gpt", 8)
    plain.load_state_dict(exported)
    assert torch.equal(plain.lm_head.weight, saved["wte.weight"])   # tied weights under both names
    assert info["largest_tensor_bytes"] == max(v.numel() * v.element_size() for v in saved.values())


class _WithTable(torch.nn.Module):
    """A table built from the configuration, registered persistent=False (as a RoPE model's inv_freq and cos/sin
    caches): not in model.state_dict(), so eager's load_state_dict leaves the new model's own table in place."""

    def __init__(self, scale, length):
        super().__init__()
        self.linear = torch.nn.Linear(12, 5)
        self.register_buffer("table", torch.arange(float(length)) * scale, persistent=False)

    def forward(self, x):
        return self.linear(x) * self.table[:5]


def _with_table(scale, length, seed):
    torch.manual_seed(seed)
    model = _WithTable(scale, length)
    return model, adamw(model)


def _train_with_table(rank, world_size, stage, path):
    model, optimizer = _with_table(1.0, 8, 0)
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=torch.nn.functional.mse_loss)
    for batch in batches("mlp", K, 8):
        step(*batch)
    zerocc.save_checkpoint(step, path)
    return step.full_state_dict(), optimizer.state_dict()


def _resume_with_another_table(rank, world_size, stage, path, first_call):
    model, optimizer = _with_table(2.0, 16, 7)   # a longer table of other values: the configuration changed
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=torch.nn.functional.mse_loss)
    if first_call == "after":
        step(*batches("mlp", 1, 8, seed=9)[0])
    zerocc.load_checkpoint(step, path)
    return [step(*batch) for batch in batches("mlp", 2 * K, 8)[K:]]


@pytest.mark.multirank
@pytest.mark.parametrize("stage,first_call", [(0, "before"), (3, "before"), (3, "after")])
def test_a_checkpoint_leaves_buffers_registered_persistent_false_to_the_model(tmp_path, stage, first_call):
    """They were saved and loaded: a model whose table had another length failed deep in DCP, and one of other
    values trained silently on the saved table. Resumed in a new process, the step trains as eager does after
    ``model.load_state_dict`` / ``optimizer.load_state_dict``: with the new model's table."""
    path = str(tmp_path / "ckpt")
    (model_state, optimizer_state), = distributed.run(_train_with_table, 1, stage, path)
    assert "model/table" not in dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    got, = distributed.run(_resume_with_another_table, 1, stage, path, first_call)
    reference, optimizer = _with_table(2.0, 16, 7)
    reference.load_state_dict(model_state)
    optimizer.load_state_dict(optimizer_state)
    loss_fn = torch.nn.functional.mse_loss
    expected = [eager_step(reference, optimizer, loss_fn, batch) for batch in batches("mlp", 2 * K, 8)[K:]]
    assert all(torch.equal(a, b) for a, b in zip(got, expected)), (got, expected)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    step = compiled("mlp", 3)
    step(*batches("mlp", 1, 8)[0])
    zerocc.save_checkpoint(step, tmp_path / "mlp")
    with pytest.raises(zerocc.ConfigError, match=r"lacks \d+ entries this step needs: model/"):
        zerocc.load_checkpoint(compiled("gpt", 3), tmp_path / "mlp")
    with pytest.raises(zerocc.ConfigError, match="not a complete zerocc checkpoint"):
        zerocc.load_checkpoint(step, tmp_path / "nowhere")


def test_a_folder_dcp_save_wrote_is_refused_by_load_checkpoint_and_export_saying_how_to_load_it(tmp_path):
    """``dcp.save(step.state_dict(), checkpoint_id=path)`` then ``zerocc.load_checkpoint(step, path)`` (or an export)
    was refused as "not a complete zerocc checkpoint (no zerocc.json)", as a folder a killed save left, without
    saying that the folder is a whole checkpoint of another kind and how that one loads."""
    step = compiled("mlp", 3)
    step(*batches("mlp", 1, 8)[0])
    dcp.save(step.state_dict(), checkpoint_id=str(tmp_path / "dcp"))
    with pytest.raises(zerocc.ConfigError, match=r"not a complete zerocc checkpoint.*dcp.save wrote.*"
                                                 r"dcp.load\(sd, checkpoint_id=path\); step.load_state_dict\(sd\)"):
        zerocc.load_checkpoint(step, tmp_path / "dcp")
    with pytest.raises(zerocc.CheckpointError, match=r"dcp.save wrote.*save that with zerocc.save_checkpoint"):
        zerocc.export_full_state_dict(str(tmp_path / "dcp"), str(tmp_path / "model.safetensors"))
    with pytest.raises(zerocc.ConfigError, match="not a complete zerocc checkpoint: it does not exist"):
        zerocc.load_checkpoint(step, tmp_path / "nowhere")


def test_a_dcp_checkpoint_of_a_model_and_optimizer_is_refused_naming_the_recipe_that_resumes_it_exactly(tmp_path):
    """A checkpoint FSDP2 writes (``get_model_state_dict`` / ``get_optimizer_state_dict`` saved with ``dcp.save``) given
    to ``zerocc.load_checkpoint`` was said to be one "of step.state_dict()", to be loaded with
    ``dcp.load(step.state_dict(), ...)``: that failed inside DCP with a ``CheckpointException`` ("Missing key in
    checkpoint state_dict: model/..."). The refusal now names its keys and the load into the model and optimizer
    before compile, which continues as eager does."""
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    data = batches("mlp", 2 * K, 8)
    model, _, loss_fn = build("mlp", 0)
    optimizer = adamw(model)
    for batch in data[:K]:
        eager_step(model, optimizer, loss_fn, batch)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=str(tmp_path / "fsdp"))
    expected = [eager_step(model, optimizer, loss_fn, batch) for batch in data[K:]]

    step = compiled("mlp", 3, seed=5)
    with pytest.raises(zerocc.ConfigError, match=r"another state dict than a zerocc step's \(its keys: model.net.0.bias"
                                                 r".*set_optimizer_state_dict\(model, optimizer, sd\['optim'\]\)"):
        zerocc.load_checkpoint(step, tmp_path / "fsdp")
    with pytest.raises(zerocc.CheckpointError, match="another state dict than a zerocc step's"):
        zerocc.export_full_state_dict(str(tmp_path / "fsdp"), str(tmp_path / "model.safetensors"))
    resumed, _, _ = build("mlp", 5)
    resumed_optimizer = adamw(resumed)
    state = {"model": get_model_state_dict(resumed), "optim": get_optimizer_state_dict(resumed, resumed_optimizer)}
    dcp.load(state, checkpoint_id=str(tmp_path / "fsdp"))
    set_model_state_dict(resumed, state["model"])
    set_optimizer_state_dict(resumed, resumed_optimizer, state["optim"])
    step = zerocc.compile(resumed, resumed_optimizer, stage=3, loss_fn=loss_fn)
    assert all(torch.equal(step(*batch), loss) for batch, loss in zip(data[K:], expected))
    assert all(torch.equal(a, b) for a, b in zip(step.full_state_dict().values(), model.state_dict().values()))


def _load_missing_on_one_rank(rank, world_size, folder):
    data = local_batches("mlp", rank, world_size, 3)
    step = compiled("mlp", 3, timeout=60)
    step(*data[0])
    zerocc.save_checkpoint(step, os.path.join(folder, "ckpt"))
    # the folder is on rank 0's disk only (a node-local path)
    path = os.path.join(folder, "ckpt" if rank == 0 else "elsewhere")
    try:
        zerocc.load_checkpoint(step, path)
    except zerocc.ConfigError as error:
        refusal = str(error)
    losses = [step(*batch) for batch in data[1:]]   # nothing was loaded anywhere: the ranks train on together
    untouched = compiled("mlp", 3)
    expected = [untouched(*batch) for batch in data][1:]
    return refusal, [torch.equal(a, b) for a, b in zip(losses, expected)]


@pytest.mark.multirank
def test_a_checkpoint_one_rank_cannot_read_is_refused_on_every_rank(tmp_path):
    """A checkpoint folder missing on one rank (a node-local disk) was refused on that rank alone; the others waited
    in the load's collectives until its process ended, or failed with a mismatch of calls where the script caught
    the error and trained on. Every rank now refuses, naming the rank and why, and training goes on together."""
    (refusal_0, same_0), (refusal_1, same_1) = distributed.run(_load_missing_on_one_rank, 2, str(tmp_path))
    assert "not a complete zerocc checkpoint" in refusal_1 and "elsewhere" in refusal_1
    assert "rank 1: ConfigError" in refusal_0 and "elsewhere" in refusal_0
    assert same_0 == same_1 == [True, True]   # as a run that never tried to load


def test_checkpoint_of_another_optimizer_type_is_refused_before_the_first_call(tmp_path):
    """Before the first call the checkpoint's optimizer state goes in as saved: an AdamW checkpoint loaded into an
    SGD step put AdamW's state and settings (its weight decay among them) into the SGD, which then trained."""
    step = compiled("mlp", 3)
    step(*batches("mlp", 1, 8)[0])
    zerocc.save_checkpoint(step, tmp_path / "ckpt")
    model, _, loss_fn = build("mlp", 0)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    with pytest.raises(zerocc.ConfigError, match="settings SGD does not have: amsgrad, betas"):
        zerocc.load_checkpoint(zerocc.compile(model, sgd, stage=3, loss_fn=loss_fn), tmp_path / "ckpt")
    assert not sgd.state and set(sgd.param_groups[0]) == set(torch.optim.SGD(model.parameters()).param_groups[0])


def test_a_checkpoint_saved_under_a_scheduler_loads_before_the_scheduler_is_made(tmp_path):
    """The usual resume: load, then make the scheduler with last_epoch, which reads the groups' initial_lr the
    checkpoint brings (a setting no optimizer has: an LR scheduler's, not another optimizer type's)."""
    def run(steps, load=None, save=None):
        model, _, loss_fn = build("mlp", 0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = zerocc.compile(model, optimizer, stage=3, loss_fn=loss_fn)
        if load:
            zerocc.load_checkpoint(step, load)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.5 ** epoch,
                                                     last_epoch=step.steps - 1 if load else -1)
        for batch in batches("mlp", 4, 8)[step.steps:step.steps + steps]:
            step(*batch)
            schedule.step()
        if save:
            zerocc.save_checkpoint(step, save)
        return step.full_state_dict(), optimizer.param_groups[0]["lr"]
    whole, lr = run(4)
    run(2, save=tmp_path / "ckpt")
    resumed, resumed_lr = run(2, load=tmp_path / "ckpt")
    assert resumed_lr == lr == 1e-2 * 0.5 ** 4
    for key, value in whole.items():
        assert torch.equal(resumed[key], value), key


def test_checkpoint_with_a_tensor_of_another_shape_is_refused(tmp_path):
    """Entries are saved flat: a weight stored transposed (as many elements) loaded scrambled without a word, and
    a wider model failed inside DCP with "CheckpointException ranks:dict_keys([0])"."""
    step = compiled("gpt", 3)
    step(*batches("gpt", 1, 8)[0])
    zerocc.save_checkpoint(step, tmp_path / "ckpt")
    transposed, _, _ = build("gpt", 0)
    transposed.blocks[0].fc.weight = torch.nn.Parameter(transposed.blocks[0].fc.weight.detach().t().clone())
    with pytest.raises(zerocc.ConfigError, match=r"blocks.0.fc.weight: \(128, 32\) in the checkpoint, \(32, 128\) here"):
        zerocc.load_checkpoint(zerocc.compile(transposed, adamw(transposed), stage=3), tmp_path / "ckpt")
    wider = TinyGPT(d=48)
    with pytest.raises(zerocc.ConfigError, match=r"wte.weight: \(64, 32\) in the checkpoint, \(64, 48\) here"):
        zerocc.load_checkpoint(zerocc.compile(wider, adamw(wider), stage=3), tmp_path / "ckpt")


@pytest.mark.parametrize("stage", [1, 3])
def test_a_refused_checkpoint_leaves_the_trained_step_as_it_was(tmp_path, stage):
    """A checkpoint of a model with more layers names every parameter this one has: its param groups were checked
    only after DCP had loaded the parameters into the step's buckets (views of them), so the refused load
    overwrote the trained parameters. The step now refuses first and trains on as eager."""
    data = batches("gpt", 3, 8)
    torch.manual_seed(4)
    deeper = TinyGPT(layers=3)
    deeper_step = zerocc.compile(deeper, adamw(deeper), stage=stage)
    deeper_step(*data[0])
    zerocc.save_checkpoint(deeper_step, tmp_path / "deeper")
    reference, _, _ = build("gpt", 0)
    reference_optimizer = adamw(reference)
    step = compiled("gpt", stage)
    for batch in data[:2]:
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, None, batch))
    with pytest.raises(zerocc.ConfigError, match="param group"):
        zerocc.load_checkpoint(step, tmp_path / "deeper")
    assert torch.equal(step(*data[2]), eager_step(reference, reference_optimizer, None, data[2]))
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key



class _OptionalLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.extra, self.use_extra = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), True

    def forward(self, x):
        return self.extra(self.a(x)) if self.use_extra else self.a(x)


@pytest.mark.parametrize("stage", [0, 3])
def test_optimizer_state_a_started_step_has_no_place_for_is_refused_before_anything_is_loaded(tmp_path, stage):
    """A step whose loss never reached ``extra`` has no optimizer state for it, nor a place in its program: a checkpoint
    holding some (a run that trained ``extra``) loaded into it after its first call dropped that state silently. It
    is refused, naming the entries, with the step as it was; before the first call it loads."""
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    torch.manual_seed(0)
    trained = _OptionalLayer()
    trained_step = zerocc.compile(trained, adamw(trained), stage=stage, loss_fn=torch.nn.functional.mse_loss)
    trained_step(x, y)
    zerocc.save_checkpoint(trained_step, tmp_path / "ckpt")
    model = _OptionalLayer()
    model.use_extra = False
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=torch.nn.functional.mse_loss)
    step(x, y)
    before = step.full_state_dict()
    with pytest.raises(zerocc.ConfigError, match=r"optimizer state for optim/extra\.bias/exp_avg.*before the step's "
                                                 r"first call"):
        zerocc.load_checkpoint(step, tmp_path / "ckpt")
    after = step.full_state_dict()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    fresh = _OptionalLayer()
    fresh.use_extra = False
    fresh_step = zerocc.compile(fresh, adamw(fresh), stage=stage, loss_fn=torch.nn.functional.mse_loss)
    zerocc.load_checkpoint(fresh_step, tmp_path / "ckpt")
    fresh_step(x, y)


# -- nothing lost ------------------------------------------------------------------
def _killed_save(path, where):
    """Train one more step and die at ``where`` in the middle of saving over ``path``."""
    torch.set_num_threads(1)
    step = compiled("mlp", 3)
    for batch in batches("mlp", K + 1, 8):
        step(*batch)

    def die(*args, **kwargs):
        os._exit(17)
    if where == "writing data":
        original = dcp.FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            original(self, plan, planner).wait()
            die()
        dcp.FileSystemWriter.write_data = write_then_die
    else:   # all data written and fsynced; dies before the rename that publishes it
        state_dict._publish = die
    zerocc.save_checkpoint(step, path)


@pytest.mark.parametrize("where", ["writing data", "publishing"])
def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, where):
    path = str(tmp_path / "ckpt")
    step = compiled("mlp", 3)
    for batch in batches("mlp", K, 8):
        step(*batch)
    zerocc.save_checkpoint(step, path)
    before = read_whole(path)

    process = distributed.process(_killed_save, path, where)
    process.start()
    process.join(120)
    assert process.exitcode == 17
    assert len(os.listdir(tmp_path)) == 3          # ckpt, its version, the abandoned new version
    after = read_whole(path)                         # the previous checkpoint, whole and loadable
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    resumed = compiled("mlp", 3, seed=2)
    zerocc.load_checkpoint(resumed, path)
    assert resumed.steps == K

    zerocc.save_checkpoint(resumed, path)            # the next save cleans the abandoned version up
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt.v2"]


def _saves_that_fail(rank, world_size, folder):
    """Three saves that fail, each on one rank: a plain directory where the checkpoint goes (rank 0 looks), rank 1's
    disk full while writing, rank 0's symlink refused while publishing; then training and saving go on."""
    step = compiled("mlp", 3)
    data = local_batches("mlp", rank, world_size, 3)
    step(*data[0])
    path = os.path.join(folder, "ckpt")
    zerocc.save_checkpoint(step, path)
    step(*data[1])
    os.makedirs(os.path.join(folder, "taken"), exist_ok=True)
    write_data, publish = dcp.FileSystemWriter.write_data, state_dict._publish

    def disk_full(self, plan, planner):
        if rank == 1:
            raise OSError(28, "No space left on device")
        return write_data(self, plan, planner)

    def link_refused(path, version):
        raise PermissionError(13, "Permission denied", path)
    failures = []
    for where, patch in [("taken", None), ("ckpt", ("write_data", disk_full)), ("ckpt", ("publish", link_refused))]:
        if patch == ("write_data", disk_full):
            dcp.FileSystemWriter.write_data = disk_full
        elif patch is not None and rank == 0:
            state_dict._publish = link_refused
        try:
            zerocc.save_checkpoint(step, os.path.join(folder, where))
            failures.append(None)
        except Exception as error:   # a training loop that logs a failed save and goes on
            failures.append((type(error).__name__, str(error)))
        dcp.FileSystemWriter.write_data, state_dict._publish = write_data, publish
    linked = os.readlink(path)
    step(*data[2])
    zerocc.save_checkpoint(step, path)
    return failures, linked, sorted(os.listdir(folder))


@pytest.mark.multirank
def test_a_save_that_fails_on_one_rank_raises_on_every_rank_and_keeps_the_previous_checkpoint(tmp_path):
    """A save that failed on one rank left the others waiting for it (a path rank 0 refused, or rank 0 failing to
    publish: until gloo's timeout), or raised DCP's CheckpointException, a BaseException that a training loop's
    ``except Exception`` does not catch, reading "CheckpointException ranks:dict_keys([1])"."""
    for failures, linked, listing in distributed.run(_saves_that_fail, 2, str(tmp_path), timeout=180):
        assert [f and f[0] for f in failures] == ["ConfigError", "CheckpointError", "CheckpointError"], failures
        assert "taken exists and is not a zerocc checkpoint" in failures[0][1]
        assert "rank 1: OSError: [Errno 28] No space left on device" in failures[1][1]
        assert "on rank 0: PermissionError: [Errno 13] Permission denied" in failures[2][1]
        assert linked == "ckpt.v1"                             # the previous checkpoint, through every failure
        assert listing == ["ckpt", "ckpt.v2", "taken"]          # the next save removed what the failed ones left
    resumed = compiled("mlp", 3)
    zerocc.load_checkpoint(resumed, tmp_path / "ckpt")
    assert resumed.steps == 3


def test_a_save_over_a_symlink_of_the_users_own_refuses_and_deletes_nothing(tmp_path):
    """``latest -> run_final`` (a user's own symlink at the path given): the save repointed it at its version and
    deleted the folder it pointed to, as if it were the previous checkpoint's version."""
    own = tmp_path / "run_final"
    own.mkdir()
    (own / "model.pt").write_text("another run's weights")
    os.symlink(own, tmp_path / "latest")
    step = compiled("mlp", 0)
    step(*batches("mlp", 1, 8)[0])
    with pytest.raises(zerocc.ConfigError, match=r"latest exists and is not a zerocc checkpoint .* but a symlink to "):
        zerocc.save_checkpoint(step, tmp_path / "latest")
    assert (own / "model.pt").read_text() == "another run's weights"
    assert sorted(os.listdir(tmp_path)) == ["latest", "run_final"] and os.readlink(tmp_path / "latest") == str(own)
    zerocc.save_checkpoint(step, tmp_path / "ckpt")   # the checkpoint's own symlink, saved over twice
    zerocc.save_checkpoint(step, tmp_path / "ckpt")
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt.v2", "latest", "run_final"]


def test_export_holds_one_tensor_at_a_time(tmp_path):
    """By construction: the export reads one entry, writes it, drops it; its largest is one parameter."""
    step = compiled("gpt", 3)
    step(*batches("gpt", 1, 8)[0])
    zerocc.save_checkpoint(step, tmp_path / "ckpt")
    info = zerocc.export_full_state_dict(str(tmp_path / "ckpt"), str(tmp_path / "out.safetensors"))
    full = step.full_state_dict()
    assert info["tensors"] == len(full)
    assert info["bytes"] == sum(v.numel() * v.element_size() for v in full.values())
    assert info["largest_tensor_bytes"] == max(v.numel() * v.element_size() for v in full.values())
    assert not os.path.exists(tmp_path / "out.safetensors.partial")


def _process_bytes(field):
    """A field of /proc/self/status (VmRSS: resident now, VmHWM: the peak since the last reset), in bytes."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))


def test_export_peak_memory_is_a_tensor_not_the_model(tmp_path):
    """Measured, not taken from the export's own account: the process's peak resident memory while it runs.

    128 tensors of 1 MiB: holding the model would add 128 MiB; reading one entry at a time adds a few
    copies of one tensor (dcp reads the bytes, unpickles them, copies them into place: 5-9 MiB in a fresh
    process). The model is large beside what a test worker's own allocator state adds: with 48 tensors a CI
    worker measured 17.0 MiB against a bound of 16.
    """
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(128)])
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3,
                          loss_fn=torch.nn.functional.mse_loss)
    zerocc.save_checkpoint(step, tmp_path / "ckpt")   # before a first step: the model as it is, nothing compiled
    model_bytes = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    del step, model
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)   # freed memory back to the system: the export cannot reuse it unseen
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")                      # VmHWM := VmRSS (Linux): the peak from here on
    before = _process_bytes("VmRSS")
    zerocc.export_full_state_dict(str(tmp_path / "ckpt"), str(tmp_path / "out.safetensors"))
    added = _process_bytes("VmHWM") - before
    assert added < model_bytes / 3, f"the export added {added / 2**20:.1f} MiB for a {model_bytes / 2**20:.0f} MiB model"


def test_a_checkpoint_call_given_something_else_than_an_open_step_and_a_path_says_so(tmp_path):
    """save_checkpoint(model, path) raised AttributeError: 'Sequential' object has no attribute 'ranks', and a closed
    step saved and loaded without a word (a load into it changed nothing the user would train on)."""
    model, batch_maker, loss_fn = build("mlp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = zerocc.compile(model, optimizer, stage=3, loss_fn=loss_fn)
    step(*batches("mlp", 1, 4)[0])
    path = str(tmp_path / "ckpt")
    with pytest.raises(zerocc.ConfigError, match=r"zerocc.save_checkpoint\(step, path\) takes the step zerocc.compile "
                                                 r"returned first, got MLP"):
        zerocc.save_checkpoint(model, path)
    with pytest.raises(zerocc.ConfigError, match=r"got str \(the path first\?\)"):
        zerocc.load_checkpoint(path, step)
    with pytest.raises(zerocc.ConfigError, match=r"path must be a checkpoint's path \(str or os.PathLike\), got None"):
        zerocc.save_checkpoint(step, None)
    zerocc.save_checkpoint(step, path)
    step.close()
    for call in (zerocc.save_checkpoint, zerocc.load_checkpoint):
        with pytest.raises(zerocc.ConfigError, match="this compiled step was closed"):
            call(step, path)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(12, 24), torch.nn.Linear(24, 12)
        self.norm = torch.nn.BatchNorm1d(12)

    def forward(self, x):
        return self.norm(x + self.b(torch.nn.functional.gelu(self.a(x))))


def _wrapped_blocks():
    """Two blocks wrapped by ``apply_activation_checkpointing`` (whose state-dict hooks take the wrapper's name out
    of the keys) and a head."""
    import functools
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                               apply_activation_checkpointing,
                                                                               checkpoint_wrapper)
    model = torch.nn.Sequential(_Block(), _Block(), torch.nn.Linear(12, 5))
    apply_activation_checkpointing(
        model, check_fn=lambda module: isinstance(module, _Block),
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    return model


@pytest.mark.parametrize("stage", [0, 3])
def test_blocks_wrapped_by_checkpoint_wrapper_are_in_every_state_dict_and_export(tmp_path, stage):
    """``step.full_state_dict()`` of a model whose blocks ``apply_activation_checkpointing`` wrapped held the head
    alone: it looked ``model.state_dict()``'s keys (``0.a.weight``) up as module names
    (``0._checkpoint_wrapped_module.a.weight``). ``model.state_dict()`` at stage 3 gave the blocks' empty
    placeholders, and ``export_full_state_dict`` left them out of the file. Keys are matched to tensors by identity."""
    from safetensors.torch import load_file
    torch.manual_seed(0)
    model, reference = _wrapped_blocks(), _wrapped_blocks()
    reference.load_state_dict(model.state_dict())
    optimizer, reference_optimizer = adamw(model), adamw(reference)
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=torch.nn.functional.mse_loss)
    for batch in batches("mlp", 3, 8):
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, torch.nn.functional.mse_loss,
                                                    batch))
    expected = reference.state_dict()
    assert "0.a.weight" in expected
    zerocc.save_checkpoint(step, tmp_path / "ckpt")
    zerocc.export_full_state_dict(tmp_path / "ckpt", tmp_path / "model.safetensors")
    exported = load_file(tmp_path / "model.safetensors")
    for got in (step.full_state_dict(), model.state_dict(), exported):
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[key], value) for key, value in expected.items())
    fresh = _wrapped_blocks()
    resumed = zerocc.compile(fresh, adamw(fresh), stage=stage, loss_fn=torch.nn.functional.mse_loss)
    zerocc.load_checkpoint(resumed, tmp_path / "ckpt")
    batch = batches("mlp", 4, 8)[3]
    assert torch.equal(resumed(*batch), step(*batch))
