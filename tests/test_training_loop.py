"""Training-loop features: gradient accumulation, global-norm clipping, eval_forward, shapes.

World size 1: each equals eager PyTorch bit for bit (accumulation: ``(loss / K).backward()``
per micro-batch; clipping: ``torch.nn.utils.clip_grad_norm_``). World size 2: they match
DDP (``no_sync`` for accumulation, ``clip_grad_norm_`` on the averaged gradients).
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import gc
import linecache
import math
import warnings
import weakref

import pytest
import torch
import torch.fx.graph_module as fx_graph_module
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.parallel import DistributedDataParallel

import zerocc
from zerocc.data_guards import GuardedShapeEnv
from tests import distributed
from tests.models import batches, build, eager_step
from tests.reference import adamw, eager_accumulated_step


def sgd(model):
    # plain SGD moves by the gradient itself: a clipped and an unclipped gradient give different
    # parameters (Adam is nearly invariant to scaling the gradient, so it would hide a missing clip)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def assert_same_state(step, reference):
    full = step.full_state_dict()
    assert full.keys() == reference.state_dict().keys()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key


# -- gradient accumulation ----------------------------------------------------------

@pytest.mark.parametrize("name,stage", [("mlp", 0), ("mlp", 1), ("mlp", 2), ("mlp", 3), ("gpt", 3), ("cnn", 0)])
def test_grad_accumulation_world_size_1_bit_for_bit(name, stage):
    reference, _, loss_fn = build(name)
    reference_optimizer = adamw(reference)
    model, _, _ = build(name)
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn, grad_accumulation=4)
    for batch in batches(name, 3, 8):
        expected, _ = eager_accumulated_step(reference, reference_optimizer, loss_fn, batch, 4)
        assert torch.equal(step(*batch), expected)
    assert_same_state(step, reference)


def test_grad_accumulation_is_not_the_same_as_one_big_batch():
    """Guards the test above: with BatchNorm, K micro-batches and one batch really differ."""
    model, _, loss_fn = build("cnn")
    whole = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn)
    model, _, _ = build("cnn")
    split = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn, grad_accumulation=4)
    batch = batches("cnn", 1, 8)[0]
    assert not torch.equal(whole(*batch), split(*batch))


def activation_bytes(step):
    return step.memory_plan.pool("activations").bytes


def test_grad_accumulation_keeps_one_micro_batch_of_activations():
    """K micro-batches run forward and backward in turn: activations do not grow K-fold."""
    planned = {}
    for k, rows in [(1, 64), (4, 256), (1, 256)]:
        model, _, loss_fn = build("mlp")
        # pools off: the activations pool of the plan by role (with pools one arena holds every role)
        step = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn, grad_accumulation=k, memory_pools=False)
        step(*batches("mlp", 1, rows)[0])
        planned[(k, rows)] = activation_bytes(step)
        gradient_bytes = step.report()["param_bytes"]
    # 256 rows in 4 micro-batches hold what 64 rows hold plus at most two sets of gradients (the
    # running sum and the micro-batch's new gradients, added together), far less than 256 rows at once
    assert planned[(4, 256)] <= planned[(1, 64)] + 2 * gradient_bytes, (planned, gradient_bytes)
    assert planned[(4, 256)] < 0.5 * planned[(1, 256)], planned


# -- clipping ------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_clip_grad_norm_world_size_1_bit_for_bit(stage):
    reference, _, loss_fn = build("gpt")
    reference_optimizer = sgd(reference)
    model, _, _ = build("gpt")
    step = zerocc.compile(model, sgd(model), stage=stage, loss_fn=loss_fn, clip_grad_norm=1.0,
                          bucket_bytes=16384)   # several buckets
    for batch in batches("gpt", 3, 8):
        expected, norm = eager_accumulated_step(reference, reference_optimizer, loss_fn, batch, 1, clip=1.0)
        assert norm > 1.0   # the clip acts
        assert torch.equal(step(*batch), expected)
        assert torch.equal(step.last_grad_norm, norm)
    assert_same_state(step, reference)
    assert step.passes == ["capture", "shard", "clip_gradients", "place_remat", "insert_collectives", "schedule",
                           "overlap_updates", "scatter_by_all_to_all", "gather_by_send_recv",
                           "gradients_into_buckets", "release_slots", "plan_memory", "place_buffers"]


@pytest.mark.parametrize("norm_type", [1.0, math.inf])
def test_clip_grad_norm_other_norms_bit_for_bit(norm_type):
    reference, _, loss_fn = build("mlp")
    reference_optimizer = sgd(reference)
    model, _, _ = build("mlp")
    step = zerocc.compile(model, sgd(model), stage=3, loss_fn=loss_fn, clip_grad_norm=0.05, clip_norm_type=norm_type)
    for batch in batches("mlp", 3, 8):
        expected, norm = eager_accumulated_step(reference, reference_optimizer, loss_fn, batch, 1, clip=0.05,
                                                norm_type=norm_type)
        assert norm > 0.05
        assert torch.equal(step(*batch), expected)
        assert torch.equal(step.last_grad_norm, norm)
    assert_same_state(step, reference)


def test_clipping_and_accumulation_together_bit_for_bit():
    reference, _, loss_fn = build("cnn")
    reference_optimizer = sgd(reference)
    model, _, _ = build("cnn")
    step = zerocc.compile(model, sgd(model), stage=2, loss_fn=loss_fn, grad_accumulation=2, clip_grad_norm=0.5)
    for batch in batches("cnn", 3, 8):
        expected, norm = eager_accumulated_step(reference, reference_optimizer, loss_fn, batch, 2, clip=0.5)
        assert norm > 0.5
        assert torch.equal(step(*batch), expected)
        assert torch.equal(step.last_grad_norm, norm)
    assert_same_state(step, reference)


@pytest.mark.parametrize("stage", [0, 3])
def test_an_infinite_clip_reports_the_norm_and_trains_as_eager(stage):
    """clip_grad_norm=inf, as with clip_grad_norm_(..., inf): the gradient norm to log, the gradients unchanged."""
    reference, _, loss_fn = build("gpt")
    reference_optimizer = adamw(reference)
    model, _, _ = build("gpt")
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn, clip_grad_norm=math.inf)
    for batch in batches("gpt", 3, 8):
        expected, norm = eager_accumulated_step(reference, reference_optimizer, loss_fn, batch, 1, clip=math.inf)
        assert torch.equal(step(*batch), expected)
        assert torch.equal(step.last_grad_norm, norm) and 0 < norm < math.inf
    assert_same_state(step, reference)


def assert_trains_as_eager_with(loss_fn, targets, stage):
    """Three steps of a small MLP with ``loss_fn`` and no ``num_targets``, the batch ``(x, *targets)``: losses (in
    their shape) and state equal to the eager loop ``loss_fn(model(x), *targets)``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    reference = copy.deepcopy(model)
    reference_optimizer = sgd(reference)
    step = zerocc.compile(model, sgd(model), stage=stage, loss_fn=loss_fn)
    for _ in range(3):
        x = torch.randn(4, 8)
        expected = loss_fn(reference(x), *targets)
        reference_optimizer.zero_grad()
        expected.backward()
        reference_optimizer.step()
        got = step(x, *targets)
        assert got.shape == expected.shape and torch.equal(got, expected.detach())
    assert_same_state(step, reference)


def _output_alone(output):
    return output.square().mean()


def _weighted(output, y, weight):
    return ((output - y).square() * weight).mean()


class _OutputAlone(torch.nn.Module):
    def forward(self, output):
        return output.square().mean()


class _Weighted(torch.nn.Module):
    def forward(self, output, y, weight, reduction="mean"):
        return ((output - y).square() * weight).mean()


TWO_TARGETS = (torch.randn(4, 1), torch.rand(4, 1))


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("loss_fn, targets", [
    (_output_alone, ()), (_weighted, TWO_TARGETS),
    (_OutputAlone(), ()), (_Weighted(), TWO_TARGETS), (functools.partial(_Weighted(), reduction="sum"), TWO_TARGETS),
], ids=["output-alone", "two-targets", "module-output-alone", "module-two-targets", "partial-of-module"])
def test_the_loss_functions_signature_says_how_many_arguments_are_targets(loss_fn, targets, stage):
    """``loss_fn(output)`` takes no target and ``loss_fn(output, y, weight)`` two: the step splits its arguments
    so, as the eager loop ``loss_fn(model(x), ...)`` does, without ``num_targets``. An ``nn.Module`` loss is called
    through ``Module.__call__(*args, **kwargs)``, whose signature says nothing: its ``forward``'s does (the step
    took one target for any module, so a loss of the output alone got the model's input, and one of two targets
    left the model a target as its second input)."""
    assert_trains_as_eager_with(loss_fn, targets, stage)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_loss_of_one_element_shaped_1_trains_as_eager(stage):
    """``loss.view(1)`` (what some models return): eager's ``loss.backward()`` takes it, so does the step."""
    def loss_fn(output, y):
        return F.mse_loss(output, y).view(1)

    assert_trains_as_eager_with(loss_fn, (torch.randn(4, 1),), stage)


def test_without_clipping_there_is_no_norm_and_no_pass():
    model, _, loss_fn = build("mlp")
    step = zerocc.compile(model, adamw(model), loss_fn=loss_fn)
    step(*batches("mlp", 1, 8)[0])
    assert step.last_grad_norm is None
    assert "clip_gradients" not in step.passes


# -- world size 2 against DDP ----------------------------------------------------------

# (feature, model, optimizer, compile options, stages): GPT for accumulation (tied weights, several
# buckets), the MLP for clipping (small buckets: parameters split across buckets and ranks)
FEATURES = [("accumulate", "gpt", adamw, dict(grad_accumulation=2, bucket_bytes=16384), (0, 2, 3)),
            ("clip", "mlp", sgd, dict(clip_grad_norm=0.1, bucket_bytes=2048), (0, 1, 2, 3)),
            ("clip_inf", "mlp", sgd, dict(clip_grad_norm=0.01, clip_norm_type=math.inf, bucket_bytes=2048), (3,))]


def _against_ddp(rank, world_size):
    """Per rank: DDP's losses, norms and final state; then each stage's, for accumulation and for clipping."""
    results = {}
    for feature, name, make_optimizer, options, stages in FEATURES:
        data = batches(name, 3, 8 * world_size)
        local = [tuple(t[rank * 8:(rank + 1) * 8] for t in batch) for batch in data]
        k = options.get("grad_accumulation", 1)
        clip, norm_type = options.get("clip_grad_norm"), options.get("clip_norm_type", 2.0)
        reference, _, loss_fn = build(name)
        ddp = DistributedDataParallel(reference)
        optimizer = make_optimizer(reference)
        expected = [eager_accumulated_step(ddp, optimizer, loss_fn, batch, k, clip, norm_type) for batch in local]
        results[(feature, "ddp")] = ([e for e, _ in expected], [n for _, n in expected],
                                     {key: v.clone() for key, v in reference.state_dict().items()}, None)
        for stage in stages:
            model, _, _ = build(name)
            step = zerocc.compile(model, make_optimizer(model), stage=stage, loss_fn=loss_fn, **options)
            losses, norms = [], []
            for batch in local:
                losses.append(step(*batch))
                norms.append(step.last_grad_norm)
            collectives = step.report()["collectives_per_step"]
            results[(feature, stage)] = (losses, norms, step.full_state_dict(),
                                         (collectives, len(step.shard_plan.buckets)))
    # eval_forward at stage 3 gathers the shards: the same output on every rank, equal to the trained model's
    model, _, loss_fn = build("mlp")
    step = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn, bucket_bytes=2048)
    x, y = batches("mlp", 1, 16)[0]
    step(x[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8])
    reference, _, _ = build("mlp")
    reference.load_state_dict(step.full_state_dict())
    with torch.no_grad():
        results["eval"] = (step.eval_forward(x), reference.eval()(x))
    return results


@pytest.mark.multirank
def test_world_size_2_matches_ddp():
    per_rank = distributed.run(_against_ddp, 2)
    for rank, results in enumerate(per_rank):
        for feature, _, _, options, stages in FEATURES:
            expected_losses, expected_norms, expected_state, _ = results[(feature, "ddp")]
            if feature != "accumulate":
                assert all(norm > options["clip_grad_norm"] for norm in expected_norms)   # the clip acts
            for stage in stages:
                losses, norms, state, (collectives, buckets) = results[(feature, stage)]
                where = f"{feature} stage {stage} rank {rank}"
                assert buckets > 1, where   # several reductions, and parameters split between buckets
                torch.testing.assert_close(torch.stack(losses), torch.stack(expected_losses), rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{where} losses: {m}")
                if feature != "accumulate":
                    # stage 0 clips the all-reduced gradients exactly as clip_grad_norm_ does; stages 1-3 add
                    # the shards' norms in another order: equal within float rounding
                    torch.testing.assert_close(torch.stack(norms), torch.stack(expected_norms), rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"{where} norms: {m}")
                    reductions = collectives.get("all_reduce", 0) - (buckets if stage == 0 else 0)
                    assert reductions == (0 if stage == 0 else 1), (where, collectives)
                else:   # one reduction per bucket per step, not one per micro-batch
                    assert collectives.get("reduce_scatter" if stage else "all_reduce") == buckets, (where, collectives)
                for key, value in expected_state.items():
                    torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5,
                                               msg=lambda m: f"{where} {key}: {m}")
        output, expected = results["eval"]
        torch.testing.assert_close(output, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(output, per_rank[0]["eval"][0], rtol=0, atol=0)


# -- loss normalized by a token count (transformers' num_items_in_batch) ------------------------------

class TokenCountLM(torch.nn.Module):
    """A language model whose loss is transformers' ``fixed_cross_entropy``: with ``num_items_in_batch`` the sum over
    the tokens not ignored (-100) divided by that count, which the loop computes per step."""
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(32, 16)
        self.head = torch.nn.Linear(16, 32)

    def forward(self, input_ids, labels, num_items_in_batch=None):
        logits = self.head(self.embedding(input_ids)).flatten(0, 1)
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = F.cross_entropy(logits, labels.flatten(), ignore_index=-100, reduction=reduction)
        return loss if num_items_in_batch is None else loss / num_items_in_batch


def token_batches(steps, rows, seed=1):
    """(input_ids, labels) with about a third of the labels ignored, a different count every step; the first rows of
    the second batch all ignored (a micro-batch of padding only)."""
    generator = torch.Generator().manual_seed(seed)
    data = []
    for index in range(steps):
        ids = torch.randint(0, 32, (rows, 6), generator=generator)
        labels = ids.masked_fill(torch.rand(rows, 6, generator=generator) < 0.35, -100)
        if index == 1:
            labels[:2] = -100
        data.append((ids, labels))
    return data


def test_a_token_count_that_changes_every_step_trains_as_eager_with_one_program_as_a_tensor():
    """A count passed as a 0-dim tensor is read by one program at every step, shared by the micro-batches, bit for
    bit with eager (a micro-batch of padding only adds nothing); passed as an int, each new count compiled a program
    of its own with no word until max_programs were exceeded: the first recompile now says so, naming it."""
    reference = TokenCountLM()
    reference_optimizer = sgd(reference)
    model = TokenCountLM()
    step = zerocc.compile(model, sgd(model), stage=3, grad_accumulation=2)
    data = token_batches(4, 4)
    counts = [int(labels.ne(-100).sum()) for _, labels in data]
    assert len(set(counts)) == 3 and counts[0] != counts[1]   # another count at the second step
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # nothing to say: one program
        for (ids, labels), count in zip(data, counts):
            reference_optimizer.zero_grad()
            expected = 0
            for micro_ids, micro_labels in zip(ids.chunk(2), labels.chunk(2)):
                loss = reference(micro_ids, micro_labels, num_items_in_batch=torch.tensor(count)) / 2
                loss.backward()
                expected = expected + loss.detach()
            reference_optimizer.step()
            assert torch.equal(step(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(count)), expected)
    assert len(step.cache.programs()) == 2   # SGD with momentum: its first step's and the steady state's, every count
    assert_same_state(step, reference)

    model = TokenCountLM()
    step = zerocc.compile(model, sgd(model), stage=3, grad_accumulation=2)
    step(input_ids=data[0][0], labels=data[0][1], num_items_in_batch=counts[0])
    with pytest.warns(zerocc.RecompileWarning, match=rf"a new program because Python values in the batch changed "
                      rf"\(num_items_in_batch=int {counts[0]} -> int {counts[1]}\).*Pass such a number as a tensor "
                      r"\(num_items_in_batch=torch.tensor\(n\)\)"):
        step(input_ids=data[1][0], labels=data[1][1], num_items_in_batch=counts[1])


def _token_counts_per_rank(rank, world_size):
    """Each rank's own count as an int (refused on every rank, naming the values), then the global count as a tensor
    divided by world size x accumulation: one process's training on the global batch, the loss over all its tokens."""
    data = token_batches(3, 4 * world_size)
    local = [(ids[rank * 4:(rank + 1) * 4], labels[rank * 4:(rank + 1) * 4]) for ids, labels in data]
    model = TokenCountLM()
    step = zerocc.compile(model, sgd(model), stage=3, grad_accumulation=2)
    ids, labels = local[0]
    try:
        step(input_ids=ids, labels=labels, num_items_in_batch=int(labels.ne(-100).sum()))
        refused = "no error"
    except zerocc.RankMismatchError as error:
        refused = str(error)
    for (ids, labels), (_, global_labels) in zip(local, data):
        step(input_ids=ids, labels=labels, num_items_in_batch=global_labels.ne(-100).sum() / (world_size * 2))
    reference = TokenCountLM()
    optimizer = sgd(reference)
    for ids, labels in data:
        optimizer.zero_grad()
        reference(ids, labels, num_items_in_batch=labels.ne(-100).sum()).backward()
        optimizer.step()
    return refused, step.full_state_dict(), reference.state_dict()


@pytest.mark.multirank
def test_token_counts_across_ranks():
    for rank, (refused, state, expected) in enumerate(distributed.run(_token_counts_per_rank, 2)):
        assert "ranks [1] were called with other Python values in the batch than rank 0's" in refused, refused
        assert "input 2 (num_items_in_batch=): Python int " in refused
        assert "fix: pass a number that differs between ranks as a tensor" in refused
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {key}: {m}")


# -- eval_forward ----------------------------------------------------------------------

@pytest.mark.parametrize("name,stage", [("mlp", 0), ("gpt", 3), ("cnn", 3)])
def test_eval_forward_equals_eager_eval_and_changes_nothing(name, stage):
    reference, _, loss_fn = build(name)
    reference_optimizer = adamw(reference)
    model, _, _ = build(name)
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn)
    data = batches(name, 4, 8)
    for batch in data[:2]:
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, loss_fn, batch))
    inputs = data[2] if loss_fn is None else data[2][:-1]
    reference.eval()
    with torch.no_grad():
        expected = reference(*inputs)
    reference.train()
    output = step.eval_forward(*inputs)
    assert torch.equal(output, expected)
    assert not output.requires_grad and model.training
    assert len(step.eval_programs) == 1 and len(step.cache.programs()) == 1   # cached apart from the training step
    # evaluation wrote nothing: BatchNorm statistics and the training step carry on exactly
    assert torch.equal(step(*data[3]), eager_step(reference, reference_optimizer, loss_fn, data[3]))
    assert_same_state(step, reference)


def test_eval_forward_in_eval_mode_differs_from_training_mode():
    """Guards the test above: BatchNorm in eval mode uses running statistics, not the batch's."""
    model, _, loss_fn = build("cnn")
    step = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn)
    x, y = batches("cnn", 1, 8)[0]
    step(x, y)
    reference, _, _ = build("cnn")
    reference.load_state_dict(step.full_state_dict())
    with torch.no_grad():
        assert not torch.equal(step.eval_forward(x), reference(x))   # reference is in training mode


# -- changing input shapes ---------------------------------------------------------------

def test_new_shapes_compile_new_programs_up_to_max_programs():
    model, _, loss_fn = build("mlp")
    step = zerocc.compile(model, adamw(model), loss_fn=loss_fn, max_programs=2)
    step(*batches("mlp", 1, 8)[0])
    step(*batches("mlp", 1, 8)[0])   # the first step ran the steady state's program (zerocc/optimizer_init.py)
    step(*batches("mlp", 1, 6)[0])   # 8 rows, 6 rows: two programs
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(*batches("mlp", 1, 6)[0])   # cached: no warning
    with pytest.warns(zerocc.RecompileWarning, match=r"more than max_programs=2 compiled programs \(a new batch of "
                      r"shapes \(4, 12\) float32, \(4, 5\) float32\); dropped the least recently used, compiled for "
                      r"shapes \(8, 12\) float32"):
        step(*batches("mlp", 1, 4)[0])
    assert len(step.cache.programs()) == 2


def test_programs_dropped_beyond_max_programs_let_their_traces_go():
    """Dynamic padding (a new length every few steps) over a long run: max_programs kept 2 programs, but every
    compile's ShapeEnv (its guards, sympy expressions, tracebacks) stayed alive in the caches torch keeps on
    ShapeEnv's class, keyed on the env, and torch's fake tensor cache kept each trace's results by shape, so the
    process grew with every compile. Now at most the last trace's are kept beside the programs' own."""
    model, _, loss_fn = build("mlp")
    step = zerocc.compile(model, adamw(model), loss_fn=loss_fn, max_programs=2)
    gc.collect()   # envs alive before (other tests' steps in this worker process) are not this test's to count
    seen, made, cached = {id(o) for o in gc.get_objects() if type(o) is GuardedShapeEnv}, [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zerocc.RecompileWarning)
        for rows in (3, 4, 5, 6, 7):
            step(*batches("mlp", 1, rows)[0])
            cached.append(len(FakeTensorMode.cache))
            gc.collect()
            for env in (o for o in gc.get_objects() if type(o) is GuardedShapeEnv and id(o) not in seen):
                seen.add(id(env))
                made.append(weakref.ref(env))
    gc.collect()
    assert len(made) >= 5 and len(step.cache.programs()) == 2
    assert sum(env() is not None for env in made) <= 3
    assert cached[-1] <= 1.2 * cached[1], cached


def test_compile_records_are_bounded_and_still_count_and_time_every_compile(monkeypatch):
    """``step.compile_stats`` kept a record (about 1 kB) per compile for the step's life: a long run compiling a
    program per new length grew by it every compile. The last ``KEPT_RECORDS`` are kept whole; ``len`` still counts
    every compile and ``report()["compile_seconds_by_phase"]`` sums every compile's seconds."""
    monkeypatch.setattr(zerocc.compile_stats, "KEPT_RECORDS", 2)
    model, _, loss_fn = build("mlp")
    step = zerocc.compile(model, adamw(model), loss_fn=loss_fn, max_programs=2)
    records = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zerocc.RecompileWarning)
        for rows in (3, 4, 5, 6):
            step(*batches("mlp", 1, rows)[0])
            records.append(step.compile_stats[-1])
    assert len(step.compile_stats) == 4 and list(step.compile_stats) == records[2:]
    summed = {}
    for record in records:
        for phase, seconds in record.seconds.items():
            summed[phase] = summed.get(phase, 0.0) + seconds
    by_phase = step.report()["compile_seconds_by_phase"]
    assert by_phase.keys() == summed.keys()
    assert all(abs(by_phase[phase] - seconds) < 1e-3 for phase, seconds in summed.items()), (by_phase, summed)


def test_programs_dropped_beyond_max_programs_let_their_generated_python_go():
    """torch.fx keeps the Python it generates for a module (``_loader.eval_cache`` and ``linecache``) forever: every
    program a step compiled left its source behind (330 kB for a 6-layer toy GPT) though max_programs dropped the
    program, and a run over batches of ever new lengths (dynamic padding, random lengths) grew without bound. Now
    a dropped program's source goes with it; training is eager's all along."""
    reference, _, loss_fn = build("mlp")
    reference_optimizer = adamw(reference)
    model, _, _ = build("mlp")
    step = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn, max_programs=2)
    gc.collect()
    before = set(fx_graph_module._loader.eval_cache)   # other tests' modules in this worker are not this test's

    def sources() -> set:
        gc.collect()
        return set(fx_graph_module._loader.eval_cache) - before

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zerocc.RecompileWarning)
        for rows in (3, 4, 5, 6, 7, 8):
            batch = batches("mlp", 1, rows, seed=rows)[0]
            assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, loss_fn, batch))
            with torch.no_grad():
                assert torch.equal(step.eval_forward(batch[0]), reference(batch[0]))
    assert_same_state(step, reference)
    # two programs and two eval_forward programs kept, and the first program's graph (the step's captured model)
    assert len(step.cache.programs()) == 2 and len(sources()) <= 5, sorted(sources())
    assert sources() <= set(linecache.cache)
    step.close()
    del step
    assert not sources() & set(linecache.cache)


def test_max_programs_1_with_a_first_step_program_trains_one_shape_without_a_warning():
    """SGD with momentum makes its first step's own program (the buffer is the first gradient): with max_programs=1
    the steady state's program, at the second call, dropped it with a RecompileWarning saying "a new batch of shapes
    (4, 12)" had come, the very shape of the first. A first step's program is dropped silently now (the step holds
    state: it would not run it again), and the step trains as eager."""
    reference, _, loss_fn = build("mlp")
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    model, _, _ = build("mlp")
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), loss_fn=loss_fn,
                          max_programs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", zerocc.RecompileWarning)
        for batch in batches("mlp", 3, 4):
            assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, loss_fn, batch))
    assert len(step.cache.programs()) == 1
    assert_same_state(step, reference)


def test_python_values_in_the_batch_that_change_every_batch_are_named_in_the_recompile_warning():
    """Per-sample file names passed along in the batch (forward ignores them) compile a program per batch: the
    warning said to pad batches to a few shapes, which all the batches already had."""
    class Named(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(12, 5)

        def forward(self, x, names):
            return self.linear(x)

    model = Named()
    step = zerocc.compile(model, adamw(model), loss_fn=F.mse_loss, max_programs=1)
    x, y = batches("mlp", 1, 4)[0]
    step(x, ["a.png", "b.png", "c.png", "d.png"], y)
    with pytest.warns(zerocc.RecompileWarning, match=r"argument 1\[0\]: str 'e.png'.*Each Python value in the batch "
                      r"\(a string, a number\) is compiled into the program: pass one that changes every batch \(file "
                      r"names, sample ids\) outside the step, or as a tensor"):
        step(x, ["e.png", "f.png", "g.png", "h.png"], y)


def test_new_shapes_train_exactly():
    reference, _, loss_fn = build("mlp")
    reference_optimizer = adamw(reference)
    model, _, _ = build("mlp")
    step = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn, max_programs=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zerocc.RecompileWarning)
        for rows in (8, 6, 8, 4, 6):
            batch = batches("mlp", 1, rows, seed=rows)[0]
            assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, loss_fn, batch))
    assert_same_state(step, reference)


class ConvAndPixels(torch.nn.Module):
    """A convolution (whose kernels round otherwise on a channels-last input) beside a linear layer on the pixels
    (``reshape`` of a contiguous batch is a view, of a permuted one a copy)."""
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.pixels = torch.nn.Linear(3 * 8 * 8, 4)

    def forward(self, x):
        return self.conv(x).mean((2, 3)) + self.pixels(x.reshape(len(x), -1))


@pytest.mark.parametrize("stage", [0, 3])
def test_batches_laid_out_otherwise_in_memory_train_exactly(stage):
    """A loader whose batches are sometimes channels-last or transposed (an augmentation): the program traced on the
    first batch's strides ran on the others, a channels-last convolution rounded otherwise than eager's and a
    permuted batch failed ('view size is not compatible'). Each layout gets a program, as a shape does."""
    generator = torch.Generator().manual_seed(1)
    laid_out = [lambda x: x, lambda x: x.contiguous(memory_format=torch.channels_last),
                lambda x: x.transpose(2, 3).contiguous().transpose(2, 3), lambda x: x]
    data = [(lay(torch.randn(6, 3, 8, 8, generator=generator)), torch.randint(0, 4, (6,), generator=generator))
            for lay in laid_out]
    torch.manual_seed(0)
    model = ConvAndPixels()
    reference = copy.deepcopy(model)
    reference_optimizer = adamw(reference)
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=F.cross_entropy)
    for batch in data:
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, F.cross_entropy, batch))
    assert_same_state(step, reference)
    assert len(step.cache.programs()) == 3   # one per layout
    for x, _ in data[1:3]:
        assert torch.equal(step.eval_forward(x), reference(x))


class Generator(torch.nn.Module):
    """A GAN generator's first layers: a linear layer's output viewed as a (contiguous) feature map, convolved."""
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 8 * 4 * 4)
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.out = torch.nn.Linear(8, 5)

    def forward(self, z):
        return self.out(torch.relu(self.conv(self.linear(z).view(len(z), 8, 4, 4))).mean((2, 3)))


@pytest.mark.parametrize("stage", [0, 3])
def test_a_channels_last_model_trains_exactly_on_contiguous_inputs(stage):
    """``model.to(memory_format=torch.channels_last)``: eager's convolutions compute in channels-last because the
    weights are, whatever their input's layout; the step read its parameters as contiguous views of its buckets and
    rounded otherwise from the first step on. They are read in their own strides, by every program (a second batch
    size, compiled after stage 3 released the parameters) and by eval_forward."""
    torch.manual_seed(0)
    model = Generator().to(memory_format=torch.channels_last)
    reference = copy.deepcopy(model)
    reference_optimizer = adamw(reference)
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=F.cross_entropy)
    generator = torch.Generator().manual_seed(1)
    for rows in (4, 6, 4):
        batch = torch.randn(rows, 16, generator=generator), torch.randint(0, 5, (rows,), generator=generator)
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, F.cross_entropy, batch))
    assert_same_state(step, reference)
    z = torch.randn(6, 16, generator=generator)
    with torch.no_grad():
        assert torch.equal(step.eval_forward(z), reference(z))


class UnpoolAndShuffle(torch.nn.Module):
    """Vision layers whose CPU kernels keep a channels-last input's layout: MaxUnpool2d (a SegNet decoder),
    channel_shuffle (ShuffleNet) and replication/reflection padding (3-D forward, 2-D and 3-D backward)."""
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")
        self.pool = torch.nn.MaxPool2d(2, return_indices=True)
        self.unpool = torch.nn.MaxUnpool2d(2)
        self.conv3d = torch.nn.Conv3d(1, 2, 3, padding=1, padding_mode="replicate")
        self.out = torch.nn.Linear(4 * 8 * 8 + 2 * 4 * 8 * 8, 5)

    def forward(self, x):
        h = F.pad(self.conv(x), (1, 1, 1, 1), mode="replicate")[..., 1:-1, 1:-1]
        h = F.channel_shuffle(self.unpool(*self.pool(h)), 2)
        volume = self.conv3d(h.unsqueeze(1).contiguous(memory_format=torch.channels_last_3d))
        return self.out(torch.cat([h.flatten(1), volume.flatten(1)], 1))


@pytest.mark.parametrize("memory_pools", [False, True])
def test_vision_layers_that_keep_a_channels_last_layout_train_exactly(memory_pools):
    """MaxUnpool2d after a channels-last convolution failed at the first call with "view size is not compatible
    with input tensor's size and stride" (graph node view, no line of the user's): the trace took the unpooled
    result for contiguous (its meta kernel's layout) and flattened it with a view, where the CPU kernel returns it
    channels-last and eager's flatten copies. channel_shuffle and the padding ops so too (the padding's gradients)."""
    torch.manual_seed(0)
    model = UnpoolAndShuffle()
    model.conv.to(memory_format=torch.channels_last)
    model.conv3d.to(memory_format=torch.channels_last_3d)
    reference = copy.deepcopy(model)
    reference_optimizer = adamw(reference)
    step = zerocc.compile(model, adamw(model), stage=3, loss_fn=F.cross_entropy, memory_pools=memory_pools)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        batch = (torch.randn(4, 3, 8, 8, generator=generator).contiguous(memory_format=torch.channels_last),
                 torch.randint(0, 5, (4,), generator=generator))
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, F.cross_entropy, batch))
    assert_same_state(step, reference)
    with torch.no_grad():   # the one-channel volume: its padding keeps channels-last strides, as the CPU kernel
        assert torch.equal(step.eval_forward(batch[0]), reference.eval()(batch[0]))


def _batch_norm_network(synchronized: bool):
    """Convolutions and a linear layer, each followed by a batch norm (without biases of their own, which a batch
    norm cancels: their gradients are rounding, which Adam would scale up to whole steps)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 4, 3, bias=False), torch.nn.BatchNorm2d(4, affine=False, momentum=0.3), torch.nn.Flatten(),
        torch.nn.Linear(4 * 36, 6, bias=False), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 5))
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) if synchronized else model


def _synchronized_batch_norm(rank, world_size, stage, options):
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(4 * world_size, 3, 8, 8, generator=generator) * 3 + 5,
             torch.randint(0, 5, (4 * world_size,), generator=generator)) for _ in range(3)]
    model = _batch_norm_network(synchronized=True)
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=F.cross_entropy, **options)
    reference = _batch_norm_network(synchronized=False)   # one process, the global batch
    reference_optimizer = adamw(reference)
    for batch in data:
        step(*(t.chunk(world_size)[rank] for t in batch))
        eager_step(reference, reference_optimizer, F.cross_entropy, batch)
    trained = step.full_state_dict(), {key: value.clone() for key, value in reference.state_dict().items()}
    # fine-tuning with the batch norms frozen (eval mode): they synchronize nothing
    model.apply(lambda m: m.eval() if isinstance(m, torch.nn.SyncBatchNorm) else None)
    reference.apply(lambda m: m.eval() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) else None)
    for batch in data:
        step(*(t.chunk(world_size)[rank] for t in batch))
        eager_step(reference, reference_optimizer, F.cross_entropy, batch)
    return trained, (step.full_state_dict(), reference.state_dict())


@pytest.mark.multirank
@pytest.mark.parametrize("stage, options", [(0, {}), (3, {"memory_budget": 2_000_000})])
def test_sync_batch_norm_on_two_ranks_trains_as_one_process_on_the_global_batch(stage, options):
    """nn.SyncBatchNorm.convert_sync_batchnorm(model), as DDP users do, on 2 gloo ranks: the first call failed at
    "(no user frame found): ValueError: SyncBatchNorm expected input tensor to be on GPU", naming neither the layer
    nor a way out (on a GPU, the eager collectives inside it were refused with advice for the user's own). Its
    statistics over the global batch are traced with functional collectives (zerocc/sync_batch_norm.py): the
    step trains as one process's BatchNorm on the global batch, as DDP with SyncBatchNorm does; frozen too."""
    for rank, results in enumerate(distributed.run(_synchronized_batch_norm, 2, stage, options)):
        for state, expected in results:
            for key, value in expected.items():
                torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{rank} {key}: {m}")


def test_sync_batch_norm_in_one_process_trains_as_batch_norm():
    """Without a process group SyncBatchNorm is a BatchNorm, in eager and in the step: bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.Linear(4 * 36, 5)))
    reference = copy.deepcopy(model)
    reference_optimizer = adamw(reference)
    step = zerocc.compile(model, adamw(model), stage=3, loss_fn=F.cross_entropy)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        batch = torch.randn(4, 3, 8, 8, generator=generator), torch.randint(0, 5, (4,), generator=generator)
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, F.cross_entropy, batch))
    assert_same_state(step, reference)


def test_a_default_dtype_set_between_steps_gets_its_own_program():
    """A factory in forward (``torch.ones``) makes the default dtype: float64 after ``torch.set_default_dtype``,
    which promotes the loss; the step traced under float32 must not keep running that program."""
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 1)

        def forward(self, x):
            return (self.linear(x) * torch.ones(x.shape[0], 1)).square().mean()

    torch.manual_seed(0)
    model, reference = Scaled(), Scaled()
    reference.load_state_dict(model.state_dict())
    reference_optimizer = sgd(reference)
    step = zerocc.compile(model, sgd(model), stage=0)
    try:
        for dtype in (torch.float32, torch.float64, torch.float32):
            torch.set_default_dtype(dtype)
            x = torch.randn(4, 8, dtype=torch.float32)
            expected = reference(x)
            reference_optimizer.zero_grad()
            expected.backward()
            reference_optimizer.step()
            got = step(x)
            assert got.dtype == expected.dtype == dtype and torch.equal(got, expected.detach())
    finally:
        torch.set_default_dtype(torch.float32)
    assert_same_state(step, reference)


def test_static_shapes_refuses_a_new_shape():
    model, _, loss_fn = build("mlp")
    step = zerocc.compile(model, adamw(model), loss_fn=loss_fn, static_shapes=True)
    step(*batches("mlp", 1, 8)[0])
    step(*batches("mlp", 1, 8)[0])   # the steady-state program is not a new shape
    with pytest.raises(zerocc.ConfigError, match=r"static_shapes=True, but this batch is shapes \(7, 12\) float32, "
                       r"\(7, 5\) float32 and the step was compiled for shapes \(8, 12\) float32, \(8, 5\) float32; "
                       r"pad or cut the batch"):
        step(*batches("mlp", 1, 7)[0])


def test_stage_3_accumulation_gathers_per_micro_batch_unless_told_not_to():
    """Planned at 8 ranks (fake tensors): per micro-batch, the gathered peak stays that of one batch.

    Without the schedule pass, which may let backward read forward's gather of a bucket and so changes
    the count by configuration: what is counted here is insert_collectives' gathers per micro-batch.
    """
    model, _, loss_fn = build("gpt")
    optimizer = adamw(model)
    results = {}
    for k, per_micro_batch in ((1, True), (2, True), (2, False)):
        plan = zerocc.plan(model, optimizer, stage=3, world_size=8, loss_fn=loss_fn, bucket_bytes=16 * 1024,
                           prefetch_bytes=32 * 1024,   # below the model: every gather cannot be issued at once
                           example_inputs=batches("gpt", 1, 4 * k)[0], grad_accumulation=k,
                           gather_per_micro_batch=per_micro_batch, disable=["schedule"],
                           memory_pools=False)   # the gathered parameters' own pool: pools off
        gathered = next(p.lower_bound_bytes for p in plan.memory_plan.pools if p.name == "gathered parameters")
        results[k, per_micro_batch] = (plan.report(), gathered)
    (one, one_peak), (each, each_peak), (kept, kept_peak) = results[1, True], results[2, True], results[2, False]
    assert each["collectives_per_step"]["all_gather"] == 2 * one["collectives_per_step"]["all_gather"]
    assert each["comm_bytes_per_step"]["all_gather"] == 2 * one["comm_bytes_per_step"]["all_gather"]
    assert kept["comm_bytes_per_step"]["all_gather"] == one["comm_bytes_per_step"]["all_gather"]
    assert each_peak <= 1.05 * one_peak          # no gathered copy outlives its micro-batch
    padded = (one["param_count"] + one["padding_elements"]) * 4
    assert kept_peak >= 1.9 * padded > 3 * one_peak   # kept: a forward and a backward copy of (nearly) every bucket


def _clipped_with_a_bucket_one_rank_owns(rank, world_size):
    """Stage 1 with clipping; the last bucket holds a 1-element bias alone, so rank 1 owns only its padding."""
    def build_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(12, 7), torch.nn.GELU(), torch.nn.Linear(7, 1))
    x, y = torch.randn(16, 12, generator=torch.Generator().manual_seed(1)), torch.randn(16, 1)
    local = [(x[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8])] * 2
    reference = build_model()
    ddp = DistributedDataParallel(reference)
    optimizer = sgd(reference)
    expected = [eager_accumulated_step(ddp, optimizer, F.mse_loss, batch, 1, clip=0.05) for batch in local]
    model = build_model()
    step = zerocc.compile(model, sgd(model), stage=1, loss_fn=F.mse_loss, clip_grad_norm=0.05, bucket_bytes=32,
                          memory_pools=False)
    got = []
    for batch in local:
        got.append((step(*batch), step.last_grad_norm))
    return expected, got, dict(reference.state_dict()), step.full_state_dict(), step.shard_plan


@pytest.mark.multirank
def test_clipping_at_stage_1_where_a_rank_owns_no_piece_of_the_last_bucket():
    # the norm's all_reduce went after the last piece this rank clips: on rank 1, before the last bucket's
    # reduce-scatter, on rank 0 after it (RankMismatchError: the ranks compiled different steps)
    for expected, got, expected_state, state, plan in distributed.run(_clipped_with_a_bucket_one_rank_owns, 2):
        last = plan.buckets[-1]
        assert [segment.numel for segment in last.segments] == [1] and not list(last.pieces(1))
        _assert_clipped_as_ddp(got, expected, state, expected_state, acting_norm=0.05)


def _assert_clipped_as_ddp(got, expected, state, expected_state, acting_norm):
    """Losses and gradient norms per step, then the trained state, within float rounding of DDP + clip_grad_norm_;
    every expected norm above ``acting_norm`` (the clip acts)."""
    for (loss, norm), (expected_loss, expected_norm) in zip(got, expected):
        assert expected_norm > acting_norm
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(norm, expected_norm, rtol=1e-5, atol=1e-6)
    for key, value in expected_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5)


class _FrozenWithATemperature(torch.nn.Module):
    """A frozen layer and one trained 0-dim temperature: fewer trained elements than ranks."""

    def __init__(self):
        super().__init__()
        self.frozen = torch.nn.Linear(12, 5).requires_grad_(False)
        self.temperature = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.frozen(x) / self.temperature


def _clipped_where_ranks_own_nothing(rank, world_size):
    def build_model():
        torch.manual_seed(0)
        return _FrozenWithATemperature()
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(4 * world_size, 12, generator=generator), torch.randn(4 * world_size, 5, generator=generator)
    local = [(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])] * 2
    reference = build_model()
    optimizer = sgd(reference)
    ddp = DistributedDataParallel(reference)
    expected = [eager_accumulated_step(ddp, optimizer, F.mse_loss, batch, 1, clip=0.01) for batch in local]
    results = {}
    for stage in (1, 2, 3):
        model = build_model()
        step = zerocc.compile(model, sgd(model), stage=stage, loss_fn=F.mse_loss, clip_grad_norm=0.01)
        got = [(step(*batch), step.last_grad_norm) for batch in local]
        results[stage] = (got, step.full_state_dict(), list(step.shard_plan.owned_pieces()))
    return expected, dict(reference.state_dict()), results


@pytest.mark.multirank
def test_clipping_at_world_size_3_where_two_ranks_own_no_piece_of_any_parameter():
    """Only a 0-dim temperature trains, so at stages 1-3 ranks 1 and 2 own nothing but padding. Their gradient norm
    was get_total_norm's torch.tensor(0.0) of no gradients, a constant the trace folds by running each op on it:
    those ranks ran the norm's all_reduce for real while compiling, and every rank hung."""
    for rank, (expected, expected_state, results) in enumerate(distributed.run(_clipped_where_ranks_own_nothing, 3)):
        for stage, (got, state, owned) in results.items():
            assert bool(owned) is (rank == 0), (stage, rank)
            _assert_clipped_as_ddp(got, expected, state, expected_state, acting_norm=0.01)


def _both_gather_modes(rank, world_size):
    data = [tuple(t[rank * 8:(rank + 1) * 8] for t in batch) for batch in batches("gpt", 2, 8 * world_size)]
    results = []
    for per_micro_batch in (True, False):
        model, _, loss_fn = build("gpt")
        step = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn, grad_accumulation=2,
                              bucket_bytes=16 * 1024, gather_per_micro_batch=per_micro_batch,
                              disable=["schedule"])   # every gather counted (the schedule may keep some)
        losses = [step(*batch) for batch in data]
        results.append((losses, step.full_state_dict(), step.report()["collectives_per_step"]["all_gather"]))
    return results


@pytest.mark.multirank
def test_stage_3_gather_modes_train_the_same_at_world_size_2():
    """Only when parameters are gathered differs: the losses and parameters are the same bit for bit."""
    for (losses, state, gathers), (kept_losses, kept_state, kept_gathers) in distributed.run(_both_gather_modes, 2):
        assert all(torch.equal(a, b) for a, b in zip(losses, kept_losses))
        assert all(torch.equal(state[k], kept_state[k]) for k in state)
        assert gathers == 2 * kept_gathers


@pytest.mark.parametrize("stage", [0, 3])
def test_switching_train_and_eval_between_steps_trains_as_eager_in_each_mode(stage):
    """Dropout and batch norm's statistics are traced per mode: model.eval() between steps gets its own program."""
    import torch.nn as nn
    import torch.nn.functional as F

    def model_with_modes():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 1))

    reference, model = model_with_modes(), model_with_modes()
    reference_optimizer = adamw(reference)
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=F.mse_loss)
    generator = torch.Generator().manual_seed(1)
    for number, mode in enumerate(["train", "eval", "eval", "train"]):
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator)
        getattr(model, mode)()
        getattr(reference, mode)()
        torch.manual_seed(number)
        expected = eager_step(reference, reference_optimizer, F.mse_loss, (x, y))
        torch.manual_seed(number)
        assert torch.equal(step(x, y), expected), (number, mode)
    assert_same_state(step, reference)
    assert len(step.cache.programs()) == 2


class _ContainerBatchModel(torch.nn.Module):
    """Reads its batch from a dict and a nested keyword argument holding None, a bool and a string."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(20, 8), torch.nn.Linear(8, 3)

    def forward(self, batch, extra=None):
        hidden = torch.where(batch["mask"][..., None], self.embed(batch["ids"]), 0.0)
        scale, (nothing, shift, how) = extra
        hidden = hidden.sum(1) if how == "sum" else hidden.mean(1)
        if nothing is None and scale:
            hidden = hidden * 2 + shift
        return torch.nn.functional.cross_entropy(self.head(hidden), batch["labels"])


def _container_batches(count):
    generator = torch.Generator().manual_seed(0)
    return [((dict(ids=torch.randint(0, 20, (4, 6), generator=generator, dtype=torch.int32),
                   mask=torch.rand(4, 6, generator=generator) > 0.3,
                   labels=torch.randint(0, 3, (4,), generator=generator)),),
             dict(extra=(i % 2 == 0, [None, torch.randn(8, generator=generator), ("sum", "mean")[i % 2]])))
            for i in range(count)]


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_batches_of_dicts_and_nested_containers_train_bit_for_bit(stage):
    """Containers in a batch are flattened into their leaves, as the trace flattens them: the program reads the
    leaves, a program is compiled per container structure and Python value, and each leaf is checked by name."""
    torch.manual_seed(0)
    model = _ContainerBatchModel()
    reference = _ContainerBatchModel()
    reference.load_state_dict(model.state_dict())
    eager_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=0.01), stage=stage)
    for args, kwargs in _container_batches(4):
        eager_optimizer.zero_grad()
        expected = reference(*args, **kwargs)
        expected.backward()
        eager_optimizer.step()
        assert torch.equal(step(*args, **kwargs), expected)
    assert len(step.compile_stats) == 2   # one program per Python flag and string, not one per batch
    assert_same_state(step, reference)
    (batch,), kwargs = _container_batches(1)[0]
    batch["labels"] = batch["labels"].float().requires_grad_()
    with pytest.raises(zerocc.ConfigError, match=r"(?s)argument 0\['labels'\] requires grad.*argument 0\['labels'\] "
                                                 r"is float32, the first batch's was int64"):
        step(batch, **kwargs)


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class _RegisteredBatch:
    x: torch.Tensor
    y: torch.Tensor


torch.utils._pytree.register_dataclass(_RegisteredBatch)


class _ReadsFields(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.Linear(16, 5))

    def forward(self, batch):
        x, y = (batch["x"], batch["y"]) if isinstance(batch, collections.UserDict) else (batch.x, batch.y)
        return F.mse_loss(self.net(x), y)


def _batches_differing_in_one_value(count):
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(200, 12, generator=generator), torch.randn(200, 5, generator=generator)
    for index in range(count):
        changed = x.clone()
        changed[100, 5] += index   # a value the tensor's repr leaves out ("...")
        yield changed, y


@pytest.mark.parametrize("kind", [_Batch, collections.UserDict])
def test_a_batch_object_pytree_cannot_flatten_is_refused_naming_it(kind):
    """A dataclass (or a ``UserDict``: transformers' ``BatchEncoding``) was one Python value to the program, keyed by
    its repr: the step kept training on the first batch's tensors (a repr elides most values), with no error."""
    model = _ReadsFields()
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=0.01), stage=3)
    x, y = next(_batches_differing_in_one_value(1))
    batch = _Batch(x, y) if kind is _Batch else collections.UserDict(x=x, y=y)
    with pytest.raises(zerocc.ConfigError, match=rf"argument 0 is a {kind.__name__} holding tensors \(x, y\).*"
                                                 r"keeping this batch's values for every later batch. "
                                                 r"Register the class once \(torch.utils._pytree.register_"):
        step(batch)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_dataclass_batch_registered_with_pytree_trains_bit_for_bit(stage):
    torch.manual_seed(0)
    model = _ReadsFields()
    reference = copy.deepcopy(model)
    eager_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=0.01), stage=stage)
    for x, y in _batches_differing_in_one_value(3):
        batch = _RegisteredBatch(x, y)
        eager_optimizer.zero_grad()
        expected = reference(batch)
        expected.backward()
        eager_optimizer.step()
        assert torch.equal(step(batch), expected)
    assert len(step.compile_stats) == 1
    assert_same_state(step, reference)
