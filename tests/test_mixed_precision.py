"""Mixed precision, compiled: bf16 compute from fp32 masters, reductions in reduce_dtype, fp16 loss scaling.

The reference is hand-written eager PyTorch doing the same thing
(``mixed_eager_step``): cast the fp32 master parameters to the compute
dtype, run forward and backward there, cast each gradient to fp32, average
it over ranks (all_reduce, then divide by N, as DDP does), and step the fp32
optimizer on the masters; with loss scaling, ``torch.amp.GradScaler`` scales
the loss, unscales, skips and updates the scale. At world size 1 the compiled
step equals it bit for bit; at world size 2 too (see the test for why).
"""
from __future__ import annotations


import pytest
import torch

import zerocc
from tests import distributed
from tests.models import batches, build
from tests.reference import adamw, mixed_eager_step

STAGES = (0, 1, 2, 3)
STEPS = 3


def _compiled(name, stage, **precision):
    model, _, loss_fn = build(name)
    return zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn, **precision)


@pytest.mark.parametrize("name,stage", [("mlp", 0), ("mlp", 1), ("mlp", 2), ("mlp", 3), ("gpt", 3)])
def test_bf16_world_size_1_equals_the_hand_written_reference_bit_for_bit(name, stage):
    reference, _, loss_fn = build(name)
    reference_optimizer = adamw(reference)
    step = _compiled(name, stage, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for batch in batches(name, STEPS, 8):
        expected = mixed_eager_step(reference, reference_optimizer, loss_fn, batch, torch.bfloat16)
        loss = step(*batch)
        assert loss.dtype == torch.float32
        assert torch.equal(loss, expected)
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert full[key].dtype == torch.float32, key      # the masters stay fp32
        assert torch.equal(full[key], value), key


def _persistent(step):
    """The step's parameter buckets and optimizer state, copied."""
    return {k: v.clone() for k, v in step.state.slots.items() if k.startswith(("bucket:", "state:"))}


def _fp16_against_grad_scaler(name, stage, scaling, steps, data=None):
    """Per step: (compiled loss, reference loss, compiled scale, reference scale, state equal, skipped exactly).

    ``data``: the batches (default: ``steps`` batches of 8)."""
    reference, _, loss_fn = build(name)
    reference_optimizer = adamw(reference)
    scaler = torch.amp.GradScaler("cpu", init_scale=scaling.init_scale, growth_factor=scaling.growth_factor,
                                  backoff_factor=scaling.backoff_factor, growth_interval=scaling.growth_interval)
    step = _compiled(name, stage, param_dtype=torch.float16, reduce_dtype=torch.float32, loss_scale=scaling)
    rows = []
    for batch in data if data is not None else batches(name, steps, 8):
        before = _persistent(step) if step.state.slots is not None else None
        expected = mixed_eager_step(reference, reference_optimizer, loss_fn, batch, torch.float16, scaler=scaler)
        loss = step(*batch)
        skipped = bool(step.state.slots[zerocc.precision.FOUND_INF_SLOT] > 0)
        after = _persistent(step)
        unchanged = before is not None and before.keys() == after.keys() and all(
            torch.equal(before[k], after[k]) for k in before)
        full = step.full_state_dict()
        same = all(torch.equal(full[k], v) for k, v in reference.state_dict().items())
        rows.append((loss, expected, step.loss_scale, scaler.get_scale(), same, skipped, unchanged,
                     sorted(k for k in step.state.slots if k.startswith("state:"))))
    return rows


def test_fp16_dynamic_loss_scale_matches_grad_scaler_and_skips_overflow_exactly(stage=3):
    # growth every step from 2**13: the scale doubles until the gradients overflow in fp16, then halves
    scaling = zerocc.DynamicLossScale(init_scale=2.0 ** 13, growth_interval=1)
    rows = _fp16_against_grad_scaler("mlp", stage, scaling, 6)
    for loss, expected, scale, expected_scale, same, skipped, unchanged, _ in rows:
        assert torch.equal(loss, expected)
        assert scale == expected_scale
        assert same
        if skipped:
            assert unchanged                     # params, optimizer state and its step counter untouched
    scales = [row[2] for row in rows]
    skips = [i for i, row in enumerate(rows) if row[5]]
    assert skips and all(scales[i] == scales[i - 1] / 2 for i in skips), scales   # a skip halves the scale
    assert scales[0] == 2.0 ** 14                                                   # a good step doubles it


def test_fp16_overflow_on_the_first_step_creates_no_state():
    # fp16 overflows at 65504: a scale of 2**40 overflows, the backoff brings it to 2**12, which does not
    scaling = zerocc.DynamicLossScale(init_scale=2.0 ** 40, backoff_factor=2.0 ** -28, growth_interval=3)
    rows = _fp16_against_grad_scaler("gpt", 3, scaling, 3)
    for loss, expected, scale, expected_scale, same, *_ in rows:
        assert torch.equal(loss, expected) and scale == expected_scale and same
    assert rows[0][5] and rows[0][2] == 2.0 ** 12 and rows[0][7] == []   # skipped: no optimizer state yet
    assert not rows[1][5] and rows[1][7]                                   # the next step creates it


@pytest.mark.parametrize("stage", [0, 3])
def test_fp16_overflow_on_the_first_step_then_a_new_program_trains_like_grad_scaler(stage):
    # the first step overflows and leaves no optimizer state; the next batch has another shape, so its program is
    # compiled after the skip: it must be a first step too (it used to be traced over the state the skipped step
    # would have made, and failed with KeyError 'state:...'), and so must the first shape's program afterwards
    scaling = zerocc.DynamicLossScale(init_scale=2.0 ** 40, backoff_factor=2.0 ** -28, growth_interval=3)
    data = batches("mlp", 3, 8)
    data[1] = tuple(t[:4] for t in data[1])
    rows = _fp16_against_grad_scaler("mlp", stage, scaling, 3, data)
    for loss, expected, scale, expected_scale, same, *_ in rows:
        assert torch.equal(loss, expected) and scale == expected_scale and same
    assert rows[0][5] and rows[0][7] == []                  # skipped: no optimizer state yet
    assert not rows[1][5] and rows[1][7]                    # the new shape's first step creates it
    assert not rows[2][5] and rows[2][7] == rows[1][7]


def _train_world_size_n(rank, world_size, name, precision, scaling):
    """Per rank: the reference's losses and masters, then each stage's (and the loss scales)."""
    data = batches(name, STEPS, 4 * world_size)
    local = [tuple(t[rank * 4:(rank + 1) * 4] for t in batch) for batch in data]
    dtype = precision["param_dtype"]
    reference, _, loss_fn = build(name)
    optimizer = adamw(reference)
    scaler = None
    if scaling is not None:
        scaler = torch.amp.GradScaler("cpu", init_scale=scaling.init_scale, growth_interval=scaling.growth_interval)
    expected = [mixed_eager_step(reference, optimizer, loss_fn, batch, dtype, scaler=scaler, world_size=world_size)
                for batch in local]
    results = {"reference": (expected, {k: v.clone() for k, v in reference.state_dict().items()},
                             scaler.get_scale() if scaler else None)}
    for stage in STAGES:
        step = _compiled(name, stage, **precision, **({"loss_scale": scaling} if scaling else {}))
        losses, skipped = [], []
        for batch in local:
            losses.append(step(*batch))
            skipped.append(scaling is not None and bool(step.state.slots[zerocc.precision.FOUND_INF_SLOT] > 0))
        results[stage] = (losses, step.full_state_dict(), step.loss_scale, skipped)
    return results


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["bf16", "fp16_dynamic"])
def test_world_size_2_matches_the_hand_written_reference(case):
    """Every stage against the eager reference on 2 ranks.

    Tolerance: the compiled step runs the same aten ops on the same values
    as the reference (bf16 matmuls on the same local batch, gradients cast
    to fp32 and summed by gloo, divided by 2, the fp32 AdamW); a sum of two
    fp32 values is the same in any order, so we expect equality and allow
    what test_numerics allows against DDP (rtol 1e-5 on losses, 1e-4 on
    masters), far below one bf16 ulp (2**-8 = 4e-3 relative): a wrong cast
    (an fp32 gather, a bf16 master, an unaveraged gradient) misses it by far.
    """
    precision = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    scaling, name = None, "mlp"   # the GPT (tied weights, attention) is checked bit for bit at world size 1
    if case == "fp16_dynamic":   # the MLP's fp16 gradients overflow at 2**18 on steps 1 and 3 (at 2**17 step 2 passes)
        precision = {"param_dtype": torch.float16, "reduce_dtype": torch.float32}
        scaling, name = zerocc.DynamicLossScale(init_scale=2.0 ** 18, growth_interval=1), "mlp"
    per_rank = distributed.run(_train_world_size_n, 2, name, precision, scaling)
    for rank, results in enumerate(per_rank):
        expected_losses, expected_state, expected_scale = results["reference"]
        for stage in STAGES:
            losses, state, scale, skipped = results[stage]
            assert scale == expected_scale, (stage, rank)
            assert skipped == ([True, False, True] if scaling else [False] * STEPS), (stage, rank)
            torch.testing.assert_close(torch.stack(losses), torch.stack(expected_losses), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"stage {stage} rank {rank} losses: {m}")
            for key, value in expected_state.items():
                assert state[key].dtype == torch.float32
                torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"stage {stage} rank {rank} {key}: {m}")


class TwoHalves(torch.nn.Module):
    """Two parameters that land in different ranks' shards of one bucket at world size 2."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.full((64,), 0.5))
        self.b = torch.nn.Parameter(torch.full((64,), 0.5))

    def forward(self, x):
        return (self.a * x[:, :64]).sum() + (self.b * x[:, 64:]).sum()


def _one_rank_overflows(rank, world_size, stage):
    """Rank 0's gradient of ``a`` overflows in fp16, nothing else does: every rank must skip."""
    scaling = zerocc.DynamicLossScale(init_scale=2.0 ** 10)
    model = TwoHalves()
    step = zerocc.compile(model, adamw(model), stage=stage, param_dtype=torch.float16,
                          reduce_dtype=torch.float32, loss_scale=scaling)
    normal = (torch.full((4, 128), 0.01),)
    huge = (torch.cat([torch.full((4, 64), 100.0), torch.full((4, 64), 0.01)], dim=1),)   # 4 * 100 * 2**10 > 65504
    step(*normal)
    before = step.full_state_dict()
    step(*(huge if rank == 0 else normal))
    owned = [piece.param for _, _, piece in step.shard_plan.owned_pieces()]
    return before, step.full_state_dict(), step.loss_scale, owned


@pytest.mark.multirank
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    """At stage 3 each rank checks only its shard: the found-inf flag is all-reduced."""
    for before, after, scale, owned in distributed.run(_one_rank_overflows, 2, 3):
        assert len(owned) == 1                       # a on rank 0, b on rank 1: only rank 0 sees the inf
        assert scale == 2.0 ** 9
        for key, value in before.items():
            assert torch.equal(after[key], value), key


def _volumes(rank, world_size):
    """Per configuration: the report and what one steady-state step really issues (tests/test_communication.py)."""
    from zerocc.runtime.comm_counter import CountCollectives
    configurations = [(0, {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}),
                      (1, {"param_dtype": torch.bfloat16}),                                 # reduced in bf16 too
                      (2, {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}),
                      (3, {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}),
                      (3, {"param_dtype": torch.float16, "loss_scale": "dynamic"})]        # reduced in fp16 too
    results = []
    for stage, precision in configurations:
        model, _, loss_fn = build("gpt")
        step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn, bucket_bytes=16 * 1024, **precision)
        data = batches("gpt", 3, 2, seed=rank)
        step(*data[0])
        step(*data[1])
        with CountCollectives() as counter:
            step(*data[2])
        results.append((stage, precision, step.report(), dict(counter.calls), dict(counter.bytes)))
    return results


@pytest.mark.multirank
def test_gathers_move_param_dtype_bytes_and_reductions_reduce_dtype_bytes():
    per_rank = distributed.run(_volumes, 2)
    for rank, results in enumerate(per_rank):
        for (stage, precision, report, calls, volume), first in zip(results, per_rank[0]):
            assert (calls, volume) == first[3:], (rank, stage, precision)   # every rank issues the same
            assert calls == report["collectives_per_step"]
            assert volume == {k: v for k, v in report["comm_bytes_per_step"].items() if v}
            padded = report["param_count"] + report["padding_elements"]        # elements, all trained here
            reduce_bytes = 4 if precision.get("reduce_dtype") is torch.float32 else 2
            comm = report["comm_bytes_per_step"]
            assert report["param_dtype"] == str(precision["param_dtype"]).replace("torch.", "")
            if stage == 0:
                assert comm["all_reduce"] == 2 * padded * reduce_bytes and comm["all_gather"] == 0
            elif stage in (1, 2):   # the updated fp32 master shards are gathered cast to bf16: once, 2 bytes each
                assert comm["reduce_scatter"] == padded * reduce_bytes and comm["all_gather"] == padded * 2
                assert comm["all_reduce"] == 0
                held = report["model_state_bytes_per_rank"]
                assert held["params"] == padded * 2 + padded // 2 * 4     # the bf16 bucket, the fp32 master shard
            else:              # bf16 gathers: half of test_communication's fp32 bytes
                assert comm["reduce_scatter"] == padded * reduce_bytes
                # each bucket gathered once for forward, again for backward unless the schedule
                # kept forward's copy (test_communication)
                assert padded * 2 <= comm["all_gather"] <= 2 * padded * 2
                # loss scaling all-reduces one fp32 found-inf flag (counted twice, as all_reduce is)
                assert comm["all_reduce"] == (8 if "loss_scale" in precision else 0)


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_stage_3_gathers_each_bucket_where_forward_first_reads_it(param_dtype):
    """Under param_dtype the step casts every parameter before forward's first op; the views of a gathered
    bucket were made there too, so the schedule waited every gather before the first op and the whole model
    sat gathered at the peak (a 2-layer 7B-width Llama at world size 64: 1.33 GB of its 1.48 GB live peak)."""
    model, _, loss_fn = build("gpt")
    plan = zerocc.plan(model, torch.optim.AdamW(model.parameters()), stage=3, world_size=8, loss_fn=loss_fn,
                       example_inputs=[t[:2] for t in batches("gpt", 1, 2)[0]], bucket_bytes=16 * 1024,
                       prefetch_bytes=16 * 1024, param_dtype=param_dtype)
    memory = plan.memory_plan
    gathered = memory.live_bytes_by_role().by_role["gathered parameters"]
    first_op = next(i for i, (name, phase) in enumerate(zip(memory.positions, memory.phases))
                    if phase == "forward" and not name.startswith(("_to_copy", "slice", "view")))
    buckets = [b.bytes for b in memory.buffers() if b.role == "gathered parameters"]
    assert len(buckets) > 6
    # at forward's first op: its own bucket and what prefetch_bytes lets be in flight, not every bucket
    assert gathered[first_op] <= 2 * max(buckets) + 16 * 1024 < sum(buckets) / 2


def test_the_loss_scale_is_checkpointed(tmp_path):
    scaling = zerocc.DynamicLossScale(init_scale=2.0 ** 13, growth_interval=1)
    data = batches("mlp", 5, 8)
    original = _compiled("mlp", 3, param_dtype=torch.float16, loss_scale=scaling)
    for batch in data[:3]:
        original(*batch)
    assert original.loss_scale == 2.0 ** 16
    zerocc.save_checkpoint(original, tmp_path / "ckpt")
    saved = original.full_state_dict()
    resumed = _compiled("mlp", 3, param_dtype=torch.float16, loss_scale=scaling)
    zerocc.load_checkpoint(resumed, tmp_path / "ckpt")     # before its first step
    assert resumed.loss_scale == 2.0 ** 16
    for batch in data[3:]:
        assert torch.equal(resumed(*batch), original(*batch))
        assert resumed.loss_scale == original.loss_scale
    plain = _compiled("mlp", 3)                            # a step without loss scaling ignores the scale
    zerocc.load_checkpoint(plain, tmp_path / "ckpt")
    assert plain.loss_scale is None
    loaded = plain.full_state_dict()
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():                       # but takes the fp32 masters
        assert torch.equal(loaded[key], value), key



@pytest.mark.parametrize("started", [False, True], ids=["before-first-call", "after-a-call"])
def test_a_checkpoint_without_a_loss_scale_resumes_under_fp16_scaling_from_the_initial_scale(tmp_path, started):
    """A bf16 run resumed with param_dtype=float16 and loss_scale (hardware without bf16): the checkpoint has no
    scale, so the step's starts at init_scale as a new GradScaler would. It was refused as 'saved from a
    different model or optimizer'."""
    scaling = zerocc.DynamicLossScale(init_scale=2.0 ** 13, growth_interval=1)
    data = batches("mlp", 5, 8)
    reference, _, loss_fn = build("mlp")
    reference_optimizer = adamw(reference)
    bf16 = _compiled("mlp", 3, param_dtype=torch.bfloat16)
    for batch in data[:2]:
        mixed_eager_step(reference, reference_optimizer, loss_fn, batch, torch.bfloat16)
        bf16(*batch)
    zerocc.save_checkpoint(bf16, tmp_path / "ckpt")
    resumed = _compiled("mlp", 1, param_dtype=torch.float16, reduce_dtype=torch.float32, loss_scale=scaling)
    if started:   # its scale grew to 2**14: the load starts it afresh all the same
        resumed(*data[4])
    zerocc.load_checkpoint(resumed, tmp_path / "ckpt")
    assert resumed.loss_scale == 2.0 ** 13
    scaler = torch.amp.GradScaler("cpu", init_scale=scaling.init_scale, growth_interval=scaling.growth_interval)
    for batch in data[2:4]:
        expected = mixed_eager_step(reference, reference_optimizer, loss_fn, batch, torch.float16, scaler=scaler)
        assert torch.equal(resumed(*batch), expected)
        assert resumed.loss_scale == scaler.get_scale()
    full = resumed.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key


@pytest.mark.parametrize("stage", [0, 3])
def test_nadam_under_fp16_loss_scaling_trains_as_grad_scaler(stage):
    """Under loss scaling the first update is traced without optimizer state, and NAdam's makes its ``mu_product``
    as ``torch.tensor(1.0)``: torch's fake tensors fold ``mu_product *= mu`` on its value, with beta1 (read each
    step, a symbolic scalar without a value) as nan, and the program divided by ``1 - nan``: every parameter was
    nan after the first update (the loss after it too). Ops of constants and symbolic scalars are not folded."""
    scaling = zerocc.DynamicLossScale(init_scale=2.0 ** 20)   # two steps overflow, then the first update
    reference, _, loss_fn = build("mlp")
    optimizer = torch.optim.NAdam(reference.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=scaling.init_scale)
    model, _, _ = build("mlp")
    step = zerocc.compile(model, torch.optim.NAdam(model.parameters(), lr=1e-2), stage=stage, loss_fn=loss_fn,
                          param_dtype=torch.float16, reduce_dtype=torch.float32, loss_scale=scaling)
    for batch in batches("mlp", 5, 8):
        expected = mixed_eager_step(reference, optimizer, loss_fn, batch, torch.float16, scaler=scaler)
        assert torch.equal(step(*batch), expected)
    full = step.full_state_dict()
    assert [k for k, v in reference.state_dict().items() if not torch.equal(full[k], v)] == []

def test_unsupported_precision_settings_are_refused_clearly():
    model, _, loss_fn = build("mlp")
    optimizer = adamw(model)
    with pytest.raises(zerocc.ConfigError, match=r"param_dtype=torch.int8 is not supported: mixed precision computes"):
        zerocc.compile(model, optimizer, param_dtype=torch.int8)
    with pytest.raises(zerocc.ConfigError, match=r"reduce_dtype=torch.float8_e4m3fn is not supported"):
        zerocc.compile(model, optimizer, reduce_dtype=torch.float8_e4m3fn)
    with pytest.raises(zerocc.ConfigError, match=r"param_dtype must be a torch.dtype .* got 'bf16'"):
        zerocc.compile(model, optimizer, param_dtype="bf16")
    with pytest.raises(zerocc.ConfigError, match=r"loss_scale must be None, 'dynamic' or zerocc.DynamicLossScale"):
        zerocc.compile(model, optimizer, param_dtype=torch.float16, loss_scale=128.0)
    with pytest.raises(zerocc.ConfigError, match=r"backoff_factor must be in \(0, 1\), got 2.0; growth_interval must"):
        zerocc.compile(model, optimizer, loss_scale=zerocc.DynamicLossScale(backoff_factor=2.0, growth_interval=0))
    with pytest.warns(UserWarning, match=r"param_dtype=torch.float16 without loss scaling: small gradients underflow"):
        zerocc.compile(model, optimizer, param_dtype=torch.float16)
    low, _, _ = build("mlp")
    low.to(torch.bfloat16)
    with pytest.raises(zerocc.ConfigError, match=r"param_dtype=torch.float32 is wider than the model's parameters "
                                                  r"\(torch.bfloat16\): the parameters are the master copy"):
        zerocc.compile(low, adamw(low), param_dtype=torch.float32)


def _bf16_stage_2_checkpoint(rank, world_size, folder):
    """Train 2 steps, save, train 2 more; resume into a step that already ran and into a fresh one."""
    precision = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    data = [tuple(t[rank * 4:(rank + 1) * 4] for t in batch) for batch in batches("mlp", 4, 4 * world_size)]

    def fresh(seed):
        model, _, loss_fn = build("mlp", seed)
        return zerocc.compile(model, adamw(model), stage=2, loss_fn=loss_fn, **precision)
    original = fresh(0)
    for batch in data[:2]:
        original(*batch)
    zerocc.save_checkpoint(original, f"{folder}/ckpt")
    saved = original.full_state_dict()
    slots = {k: (tuple(v.shape), v.dtype) for k, v in original.state.slots.items() if k.startswith(("bucket", "compute"))}
    expected = [original(*batch) for batch in data[2:]]
    ran = fresh(7)
    ran(*data[0])                                         # compiled, other weights: the load rebuilds compute:<i>
    zerocc.load_checkpoint(ran, f"{folder}/ckpt")
    after_running = [ran(*batch) for batch in data[2:]]
    before = fresh(7)
    zerocc.load_checkpoint(before, f"{folder}/ckpt")      # before the first step: whole, into the model
    before_running = [before(*batch) for batch in data[2:]]
    return saved, slots, expected, after_running, before_running, original.shard_plan.buckets[0].shard_numel


@pytest.mark.multirank
def test_stage_2_bf16_keeps_fp32_master_shards_checkpoints_them_and_resumes_exactly(tmp_path):
    from tests.helpers import read_whole
    per_rank = distributed.run(_bf16_stage_2_checkpoint, 2, str(tmp_path))
    on_disk = read_whole(str(tmp_path / "ckpt"))
    for saved, slots, expected, after_running, before_running, shard_numel in per_rank:
        assert slots["bucket:0"] == ((shard_numel,), torch.float32)          # this rank's shard of the masters
        assert slots["compute:0"] == ((2 * shard_numel,), torch.bfloat16)    # the whole bucket, in bf16
        for key, value in saved.items():
            assert value.dtype == torch.float32
            assert on_disk[f"model/{key}"].dtype == torch.float32
            assert torch.equal(on_disk[f"model/{key}"], value.reshape(-1)), key   # the fp32 masters, whole
        assert all(torch.equal(a, b) for a, b in zip(after_running, expected)), (after_running, expected)
        assert all(torch.equal(a, b) for a, b in zip(before_running, expected)), (before_running, expected)


class _CastsItsInput(torch.nn.Module):
    """The MLP, casting its input to its parameters' dtype itself (what cast_forward_inputs=False asks of a model)."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return self.mlp(x.to(self.mlp.net[0].weight.dtype))


def test_cast_forward_inputs_false_casts_nothing_and_an_uncast_input_is_named():
    """cast_forward_inputs=False leaves the batch as it is: a model that casts its input itself trains bit for bit
    as the reference (which casts the input); one that does not failed with PyTorch's 'mat1 and mat2 must have the
    same dtype' from generated code alone. The note now names the user's line and the option."""
    reference, _, loss_fn = build("mlp")
    reference_optimizer = adamw(reference)
    model, _, _ = build("mlp")
    model = _CastsItsInput(model)
    step = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn, param_dtype=torch.bfloat16,
                          reduce_dtype=torch.float32, cast_forward_inputs=False)
    for batch in batches("mlp", 2, 8):
        expected = mixed_eager_step(reference, reference_optimizer, loss_fn, batch, torch.bfloat16)
        assert torch.equal(step(*batch), expected)
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[f"mlp.{key}"], value), key

    plain, _, _ = build("mlp")
    step = zerocc.compile(plain, adamw(plain), stage=0, loss_fn=loss_fn, param_dtype=torch.bfloat16,
                          cast_forward_inputs=False)
    with pytest.raises(RuntimeError, match="same dtype") as raised:
        step(*batches("mlp", 1, 8)[0])
    (note,) = raised.value.__notes__
    assert "tests/models.py" in note and "bfloat16 and float32" in note and "cast_forward_inputs=False" in note
