"""Resume from a fresh process the way users do: ``dcp.save(step.state_dict())``, then in a new process
``sd = step.state_dict(); dcp.load(sd, ...); step.load_state_dict(sd)`` before the first call.

Each phase is its own process-group run (``tests/distributed.py``): state passes only through files.
The resumed losses must equal the uninterrupted run's bit for bit (same world size and stage), or
within float tolerance when the checkpoint is resharded to another world size and stage.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import zerocc
from tests import distributed
from tests.models import batches, build, eager_step

K = 2   # steps before and after the save

OPTIONS = {
    "plain": {},
    "bf16": {"param_dtype": torch.bfloat16},
    "accumulate": {"grad_accumulation": 2},
    # the riskiest cell for the default suite: sharded bf16 compute copies and accumulated fp32 gradients
    "bf16+accumulate": {"param_dtype": torch.bfloat16, "grad_accumulation": 2},
}
MATRIX_OPTIONS = ["accumulate", "bf16", "plain"]

pytestmark = [pytest.mark.multirank, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]


def compiled(stage, seed, options):
    model, _, loss_fn = build("gpt", seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return zerocc.compile(model, optimizer, stage=stage, loss_fn=loss_fn, **OPTIONS[options])


def local_batches(rank, world_size, steps):
    """This rank's slice of the same global batches (8 samples) at any world size."""
    per_rank = 8 // world_size
    return [tuple(t[rank * per_rank:(rank + 1) * per_rank] for t in batch) for batch in batches("gpt", steps, 8)]


def _train_save_train(rank, world_size, stage, options, folder):
    step = compiled(stage, 0, options)
    data = local_batches(rank, world_size, 2 * K)
    for batch in data[:K]:
        step(*batch)
    dcp.save(step.state_dict(), checkpoint_id=folder)
    return [step(*batch) for batch in data[K:]]


def _fresh_resume(rank, world_size, stage, options, folder):
    step = compiled(stage, 7, options)          # other weights: everything must come from the files
    state = step.state_dict()
    dcp.load(state, checkpoint_id=folder)
    step.load_state_dict(state)
    return [step(*batch) for batch in local_batches(rank, world_size, 2 * K)[K:]]


def check_resume(folder, world_size, stage, options, load_world_size=None, load_stage=None):
    expected = distributed.run(_train_save_train, world_size, stage, options, folder)
    if load_world_size is None:   # same layout: every rank's losses bit for bit
        got = distributed.run(_fresh_resume, world_size, stage, options, folder)
        for rank, (a, b) in enumerate(zip(got, expected)):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (rank, a, b)
        return
    got = distributed.run(_fresh_resume, load_world_size, load_stage, options, folder)
    global_loss = [torch.stack(losses).mean() for losses in zip(*expected)]   # equal slices: mean of the means
    for x, y in zip(got[0], global_loss):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


# the default suite's cell: world 2, stage 3, bf16 and accumulation together (the matrix below has each alone)
@pytest.mark.parametrize("world_size,stage,options", [(2, 3, "bf16+accumulate")])
def test_fresh_process_resume_is_exact(tmp_path, world_size, stage, options):
    check_resume(str(tmp_path / "ckpt"), world_size, stage, options)


def test_fresh_process_resume_resharded_to_one_rank_at_stage_2(tmp_path):
    check_resume(str(tmp_path / "ckpt"), 2, 3, "plain", load_world_size=1, load_stage=2)


@pytest.mark.slow
@pytest.mark.parametrize("options", MATRIX_OPTIONS)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_fresh_process_resume_matrix(tmp_path, world_size, stage, options):
    check_resume(str(tmp_path / "ckpt"), world_size, stage, options)


# -- the optimizer's param_groups (an LR scheduler's learning rate) -------------------
def _with_scheduler(stage, seed):
    model, _, loss_fn = build("mlp", seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=loss_fn)
    return step, torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)


@pytest.mark.parametrize("stage", [0, 3])
def test_resume_with_an_lr_scheduler_is_exact(tmp_path, stage):
    data = batches("mlp", 2 * K + 1, 8)
    step, scheduler = _with_scheduler(stage, 0)
    for batch in data[:K]:
        step(*batch)
        scheduler.step()
    zerocc.save_checkpoint(step, tmp_path / "ckpt")
    saved_scheduler = scheduler.state_dict()   # the scheduler's own state, saved beside the step's (README)
    expected = []
    for batch in data[K:]:
        expected.append(step(*batch))
        scheduler.step()

    resumed, scheduler = _with_scheduler(stage, 5)
    zerocc.load_checkpoint(resumed, tmp_path / "ckpt")
    scheduler.load_state_dict(saved_scheduler)
    assert resumed.optimizer.param_groups[0]["lr"] == 1e-2 * 0.5 ** K
    for batch, loss in zip(data[K:], expected):
        assert torch.equal(resumed(*batch), loss)
        scheduler.step()


# -- BatchNorm statistics across ranks (docs/guide/checkpoints.md) -----------------------
def _cnn_step(stage, seed):
    model, _, loss_fn = build("cnn", seed)
    return zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=stage, loss_fn=loss_fn)


def _statistics(state):
    return {k: v for k, v in state.items() if "running" in k}


def _cnn_train_save_train(rank, world_size, stage, folder):
    from torch.nn.parallel import DistributedDataParallel
    data = [tuple(t.chunk(world_size)[rank] for t in batch) for batch in batches("cnn", 2 * K, 8)]
    reference, _, loss_fn = build("cnn")
    ddp, optimizer = DistributedDataParallel(reference), torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for batch in data[:K]:
        eager_step(ddp, optimizer, loss_fn, batch)
    step = _cnn_step(stage, 0)
    for batch in data[:K]:
        step(*batch)
    saved = _statistics(step.full_state_dict())
    zerocc.save_checkpoint(step, folder)
    return _statistics(reference.state_dict()), saved, [step(*batch) for batch in data[K:]]


def _cnn_resume(rank, world_size, stage, folder):
    step = _cnn_step(stage, 7)
    zerocc.load_checkpoint(step, folder)
    loaded = _statistics(step.full_state_dict())
    data = [tuple(t.chunk(world_size)[rank] for t in batch) for batch in batches("cnn", 2 * K, 8)]
    return loaded, [step(*batch) for batch in data[K:]]


@pytest.mark.parametrize("stage", [1, 3])
def test_a_checkpoint_across_ranks_holds_rank_0s_batchnorm_statistics(tmp_path, stage):
    """Each rank's BatchNorm statistics follow its own batch until the next step broadcasts rank 0's (as DDP's). The
    checkpoint holds rank 0's (what a DDP user saves from rank 0, and what every rank trains on next), not whichever
    rank DCP balanced the write to (rank 1, before); a new process loads them on every rank and trains on exactly."""
    folder = str(tmp_path / "ckpt")
    ranks = distributed.run(_cnn_train_save_train, 2, stage, folder)
    (ddp_rank_0, saved, _), (_, saved_by_rank_1, _) = ranks
    assert any(not torch.equal(saved[k], saved_by_rank_1[k]) for k in saved)   # the ranks' statistics differ
    for key, value in ddp_rank_0.items():
        torch.testing.assert_close(saved[key], value, rtol=1e-5, atol=1e-6)
    for (loaded, losses), (_, _, expected) in zip(distributed.run(_cnn_resume, 2, stage, folder), ranks):
        assert [k for k in saved if not torch.equal(loaded[k], saved[k])] == []
        assert all(torch.equal(a, b) for a, b in zip(losses, expected)), (losses, expected)


# -- optimizer state no rank holds yet ---------------------------------------------------
class _WithAnUnusedLayer(torch.nn.Module):
    """A trainable layer the loss never reaches (a pooler an LM loss ignores): eager's optimizer makes no state for it."""

    def __init__(self):
        super().__init__()
        self.a, self.unused, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _unused_layer_data():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=generator), torch.randn(8, 4, generator=generator)) for _ in range(2 * K)]


def _unused_layer_model(seed):
    torch.manual_seed(seed)
    model = _WithAnUnusedLayer()
    # dampening: a zero momentum buffer is not the same as none (the first update copies the gradient in)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)


def _unused_layer_eager(rank, world_size):
    model, optimizer = _unused_layer_model(0)
    losses = [eager_step(model, optimizer, torch.nn.functional.mse_loss, batch) for batch in _unused_layer_data()]
    return losses, model.state_dict()


def _unused_layer_train_save(rank, world_size, stage, folder):
    model, optimizer = _unused_layer_model(0)
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=torch.nn.functional.mse_loss)
    for batch in _unused_layer_data()[:K]:
        step(*batch)
    dcp.save(step.state_dict(), checkpoint_id=folder)


def _unused_layer_resume(rank, world_size, stage, folder):
    model, optimizer = _unused_layer_model(7)
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=torch.nn.functional.mse_loss)
    state = step.state_dict()   # names the state a first step would make for every trained parameter
    dcp.load(state, checkpoint_id=folder)
    step.load_state_dict(state)
    return [step(*batch) for batch in _unused_layer_data()[K:]], step.full_state_dict()


@pytest.mark.parametrize("stage", [0, 3])
def test_resume_with_dcp_of_a_model_with_a_layer_the_loss_never_reaches_is_exact(tmp_path, stage):
    """The documented ``dcp.load(step.state_dict())`` resume failed in DCP with 'Missing key in checkpoint state_dict:
    optim/unused.bias/momentum_buffer': before the first call the state dict names the state a first step would make
    for every trained parameter, but a started step saved none for a parameter the loss never reached. It is now
    saved as the zeros a first step starts from, which the resumed step loads as no state (as eager has)."""
    folder = str(tmp_path / "ckpt")
    [(expected, expected_state)] = distributed.run(_unused_layer_eager, 1)
    distributed.run(_unused_layer_train_save, 1, stage, folder)
    [(losses, state)] = distributed.run(_unused_layer_resume, 1, stage, folder)
    assert all(torch.equal(a, b) for a, b in zip(losses, expected[K:])), (losses, expected[K:])
    assert [k for k, v in expected_state.items() if not torch.equal(state[k], v)] == []


_EVERY_STEP_OVERFLOWS = {"init_scale": 2.0 ** 20}   # 2**20 and 2**19 overflow fp16: the first K updates are skipped


def _fp16_eager(rank, world_size):
    from tests.reference import mixed_eager_step
    model, _, loss_fn = build("mlp", 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", **_EVERY_STEP_OVERFLOWS)
    losses = [mixed_eager_step(model, optimizer, loss_fn, batch, torch.float16, scaler=scaler)
              for batch in batches("mlp", 2 * K + 1, 8)]
    return losses, model.state_dict(), len(optimizer.state)


def _fp16_step(seed):
    model, _, loss_fn = build("mlp", seed)
    return zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=3, loss_fn=loss_fn,
                          param_dtype=torch.float16, reduce_dtype=torch.float32,
                          loss_scale=zerocc.DynamicLossScale(**_EVERY_STEP_OVERFLOWS))


def _fp16_train_save(rank, world_size, folder):
    step = _fp16_step(0)
    for batch in batches("mlp", K, 8):
        step(*batch)
    dcp.save(step.state_dict(), checkpoint_id=folder)


def _fp16_resume(rank, world_size, folder):
    step = _fp16_step(7)
    state = step.state_dict()
    dcp.load(state, checkpoint_id=folder)
    step.load_state_dict(state)
    return [step(*batch) for batch in batches("mlp", 2 * K + 1, 8)[K:]], step.full_state_dict()


def test_resume_with_dcp_after_every_update_so_far_was_skipped_by_the_fp16_loss_scale_is_exact(tmp_path):
    """Every update before the save overflowed: as under GradScaler the optimizer has no state, and the saved state
    dict had no optimizer entry, so ``dcp.load`` into a new process's ``step.state_dict()`` failed ('Missing key')."""
    folder = str(tmp_path / "ckpt")
    [(expected, expected_state, stateful)] = distributed.run(_fp16_eager, 1)
    assert stateful   # the updates after the save ran
    distributed.run(_fp16_train_save, 1, folder)
    [(losses, state)] = distributed.run(_fp16_resume, 1, folder)
    assert all(torch.equal(a, b) for a, b in zip(losses, expected[K:])), (losses, expected[K:])
    assert [k for k, v in expected_state.items() if not torch.equal(state[k], v)] == []


# -- a started step's state_dict() saved with torch.save on each rank ---------------------------
def local_mlp_batches(rank, world_size):
    return [tuple(t[rank * 4:(rank + 1) * 4] for t in batch) for batch in batches("mlp", K, 8)]


def _torch_save_on_each_rank(rank, world_size, folder):
    step, _ = _with_scheduler(3, 0)
    for batch in local_mlp_batches(rank, world_size):
        step(*batch)
    torch.save(step.state_dict(), f"{folder}/rank{rank}.pt")


def _torch_load_before_the_first_call(rank, world_size, folder):
    step, _ = _with_scheduler(3, 7)
    before = {k: v.clone() for k, v in step.model.state_dict().items()}
    with pytest.raises(zerocc.ConfigError, match=r"hold only this rank's pieces(.|\n)*zerocc.save_checkpoint"):
        step.load_state_dict(torch.load(f"{folder}/rank{rank}.pt", weights_only=False))
    # refused before anything changed: the step, the optimizer and the model are as they were
    assert step.steps == 0 and not step.optimizer.state and step.optimizer.param_groups[0]["lr"] == 1e-2
    assert all(torch.equal(v, before[k]) for k, v in step.model.state_dict().items())
    return True


def test_a_state_dict_of_a_started_step_saved_with_torch_save_on_each_rank_is_refused_before_the_first_call(tmp_path):
    """At stage 3 on 2 ranks each rank's state_dict() holds ShardedTensors of its own pieces; loaded with torch.load
    into a new process's step before its first call (which needs whole tensors), the load failed inside PyTorch
    ("torch function 'any' ... not supported for ShardedTensor!") after setting the step count and learning rate."""
    distributed.run(_torch_save_on_each_rank, 2, str(tmp_path))
    assert distributed.run(_torch_load_before_the_first_call, 2, str(tmp_path)) == [True, True]


# -- dcp.async_save of step.state_dict() while training goes on (docs/guide/checkpoints.md) ---------
def _async_save_and_train_on(rank, world_size, folder):
    from torch.distributed.checkpoint.staging import BlockingAsyncStager
    step = compiled(3, 0, "plain")
    data = local_batches(rank, world_size, 2 * K)
    for batch in data[:K]:
        step(*batch)
    # the recipe the guide gives: a copy taken before async_save returns (DCP's default stager cannot copy a
    # ShardedTensor), and a group of its own (the background save's collectives beside the step's)
    saving = dcp.async_save(step.state_dict(), checkpoint_id=folder, async_stager=BlockingAsyncStager(),
                            process_group=torch.distributed.new_group(backend="gloo"))
    losses = [step(*batch) for batch in data[K:]]   # the buckets change under the background save
    saving.result()
    return losses


def test_dcp_async_save_with_the_guides_recipe_saves_the_state_of_its_call_while_training_goes_on(tmp_path):
    folder = str(tmp_path / "ckpt")
    expected = distributed.run(_async_save_and_train_on, 2, folder)
    got = distributed.run(_fresh_resume, 2, 3, "plain", folder)
    for rank, (a, b) in enumerate(zip(got, expected)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), (rank, a, b)


# -- a layer frozen on resume, unfrozen later: its optimizer state goes on, as eager's -----------------
def _mlp_step(stage, seed, frozen):
    model, _, loss_fn = build("mlp", seed)
    for parameter in model.net[0].parameters() if frozen else ():
        parameter.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)   # lists the frozen layer, as eager's would
    return zerocc.compile(model, optimizer, stage=stage, loss_fn=loss_fn)


def _train_frozen_then_unfrozen(rank, world_size, stage, phase, folder):
    data = [tuple(t.chunk(world_size)[rank] for t in batch) for batch in batches("mlp", 3 * K, 8)]
    step = _mlp_step(stage, phase, frozen=phase == 1)
    if phase == 1:
        zerocc.load_checkpoint(step, f"{folder}/{phase - 1}")
    elif phase == 2:   # the dcp path: the state dict named before the first call asks for the unfrozen layer's state
        state = step.state_dict()
        dcp.load(state, checkpoint_id=f"{folder}/{phase - 1}")
        step.load_state_dict(state)
    losses = [step(*batch) for batch in data[phase * K:(phase + 1) * K]]
    zerocc.save_checkpoint(step, f"{folder}/{phase}")
    step.close()
    return losses, step.model.state_dict(), step.optimizer.state_dict()


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_layer_frozen_on_resume_keeps_its_optimizer_state_for_when_it_is_unfrozen(tmp_path, world_size):
    """Train, resume with a layer frozen (its parameters still in the optimizer), resume again unfrozen, each in a
    new process: eager's optimizer keeps the frozen layer's Adam state and continues it once unfrozen. The step
    dropped it at its first call (it traced only what it trains), so the checkpoint it saved lacked it, close()
    handed back an optimizer without it, and the unfrozen run restarted the layer's moments and step count."""
    model, _, loss_fn = build("mlp", 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expected = []
    for phase, batch in enumerate(batches("mlp", 3 * K, 8)):
        for parameter in model.net[0].parameters():
            parameter.requires_grad_(not K <= phase < 2 * K)
        expected.append(eager_step(model, optimizer, loss_fn, batch))
    got = []
    for phase in range(3):
        ranks = distributed.run(_train_frozen_then_unfrozen, world_size, 3, phase, str(tmp_path))
        got += [torch.stack(per_rank).mean() for per_rank in zip(*[losses for losses, _, _ in ranks])]
        _, model_state, optimizer_state = ranks[0]
    if world_size == 1:
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), (got, expected)
        assert all(torch.equal(model_state[k], v) for k, v in model.state_dict().items())
        for index, entries in optimizer.state_dict()["state"].items():
            assert all(torch.equal(optimizer_state["state"][index][k], v) for k, v in entries.items()), index
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(model_state[k], v, rtol=1e-4, atol=1e-5)
        for index, entries in optimizer.state_dict()["state"].items():
            for k, v in entries.items():
                torch.testing.assert_close(optimizer_state["state"][index][k], v, rtol=1e-4, atol=1e-6)
