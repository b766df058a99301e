"""Memory pools as arenas (passes/place_buffers.py, runtime/arenas.py): placed, exact, and measured as planned."""
from __future__ import annotations

import copy
import os
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerocc
from tests import distributed
from tests.models import BooleanMask, batches, build, eager_step
from zerocc import graph as g
from zerocc.memory_plan import ALIGNMENT_BYTES, overlapping_pairs
from zerocc.analysis.kernels import out_variant
from zerocc.runtime.arenas import arena_view
from tests.reference import adamw, mixed_eager_step

aten = torch.ops.aten


def check_measured_is_planned(report, plan):
    """The run holds what the plan says: arenas, plus what lives outside them at its peak.

    The plan rounds every buffer outside the arenas up to 64 bytes (Adam's step
    counters are 4-byte tensors, an MLP's biases 20 bytes); the run counts
    exact storage sizes. So measured may be below planned by at most 63 bytes
    per buffer outside the arenas, and never above.
    """
    assert report["memory_pools"]
    outside = len(plan.unplanned) + sum(len(p.buffers) for p in plan.pools if p.name not in plan.arenas)
    rounding = (ALIGNMENT_BYTES - 1) * outside
    assert report["planned_peak_bytes"] - rounding <= report["measured_peak_bytes"] <= report["planned_peak_bytes"]
    assert report["lower_bound_bytes"] <= report["planned_peak_bytes"]


def test_out_variants_are_found_by_schema():
    assert out_variant(aten.mm.default) == (aten.mm.out, ("out",))
    assert out_variant(aten.add.Tensor) == (aten.add.out, ("out",))
    assert out_variant(aten.native_layer_norm.default) == (aten.native_layer_norm.out, ("out0", "out1", "out2"))
    assert out_variant(aten.t.default) is None                                      # a view
    assert out_variant(aten._scaled_dot_product_flash_attention_for_cpu.default) is None   # none exists


def test_arena_view_is_the_bytes_at_the_offset():
    arena = torch.zeros(1024, dtype=torch.uint8)
    view = arena_view(arena, 128, (3, 4), (1, 3), torch.float32)
    view.copy_(torch.arange(12.0).view(3, 4))
    assert view.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
    assert torch.equal(arena[128: 128 + 48].view(torch.float32), torch.arange(12.0).view(3, 4).t().reshape(-1))
    assert arena[:128].eq(0).all() and arena[176:].eq(0).all()


@pytest.mark.parametrize("name, stage", [("gpt", 3), ("cnn", 2), ("mlp", 0)])
def test_pools_place_outputs_exactly_and_the_run_holds_what_was_planned(name, stage):
    reference, _, loss_fn = build(name)
    reference_optimizer = adamw(reference)
    model, _, _ = build(name)
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn, memory_pools=True)
    for batch in batches(name, 3, 8):
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, loss_fn, batch))
    for key, value in reference.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key

    plan = step.memory_plan
    assert plan.arenas == ("arena",) and {b.role for b in plan.pool("arena").buffers} >= {"activations"}
    assert overlapping_pairs(plan.buffers()) == []
    for pool in plan.pools:
        assert all(b.offset % ALIGNMENT_BYTES == 0 and b.offset + b.bytes <= pool.bytes for b in pool.buffers)
    # every buffer of an arena is written in place: one view of its arena per placed output
    final = step.graph("place_buffers").graph_module
    views = [n for n in final.graph.nodes if n.target is arena_view]
    placed = [b for p in plan.pools if p.name in plan.arenas for b in p.buffers]
    assert len(views) == len(placed) > 0
    arenas = g.placeholders(final, g.ROLE_ARENA)
    assert sorted(n.meta[g.SLOT] for n in arenas) == sorted(f"arena:{p}" for p in plan.arenas)
    for view in views:
        (user,) = view.users
        out_arguments = [a.name for a in user.target._schema.arguments if a.is_out]
        assert view in [user.kwargs[name] for name in out_arguments], user.format_node()
    # the optimizer's updates write into the slots they replace, and nothing reads an old value afterwards
    order = {n: i for i, n in enumerate(final.graph.nodes)}
    written = [(n, v) for n in final.graph.nodes if n.op == "call_function" for v in n.kwargs.values()
               if isinstance(v, torch.fx.Node) and v.op == "placeholder" and v.meta[g.ROLE] != g.ROLE_ARENA]
    assert written
    persistent = {b.name: b for b in plan.pool("persistent").buffers}
    by_name = {n.name: n for n in final.graph.nodes}
    for writer, slot in written:
        views = [by_name[name] for name in persistent[slot.name].aliases]
        for reader in [u for view in (slot, *views) for u in view.users if u is not writer]:
            until = max([order[w] for w in reader.users if g.is_wait(w)], default=order[reader])
            assert until < order[writer], (reader.name, writer.name)
    # what is not placed is listed, with its bytes and why
    assert all(u.reason and (u.bytes is None or u.bytes >= 0) for u in plan.unplanned)
    assert any(u.reason == "a value of the step's result: it outlives the step" for u in plan.unplanned)  # the loss
    assert "an arena" in plan.summary() and "unplanned: " in plan.summary()
    assert "unplanned: " in str(plan) and plan.to_dict()["arenas"] == list(plan.arenas)

    report = step.report()
    check_measured_is_planned(report, plan)
    assert report["arena_bytes"] == plan.arena_bytes   # both programs' arenas are the same size here


class GatedRecurrence(nn.Module):
    """A GRU cell written out, unrolled: its gates are pieces of one matmul's output (unsafe_chunk, as in nn.GRU)."""

    def __init__(self, width=8):
        super().__init__()
        self.width = width
        self.input = nn.Linear(6, 3 * width)
        self.hidden = nn.Linear(width, 3 * width)
        self.head = nn.Linear(width, 3)

    def forward(self, x, y):
        h = x.new_zeros(x.shape[0], self.width)
        for t in range(x.shape[1]):
            input_reset, input_update, input_new = self.input(x[:, t]).unsafe_chunk(3, 1)
            hidden_reset, hidden_update, hidden_new = self.hidden(h).unsafe_chunk(3, 1)
            reset, update = torch.sigmoid(input_reset + hidden_reset), torch.sigmoid(input_update + hidden_update)
            h = (1 - update) * torch.tanh(input_new + reset * hidden_new) + update * h
        return F.cross_entropy(self.head(h), y)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_pools_never_reuse_the_bytes_of_a_piece_still_read(stage):
    # unsafe_chunk's pieces are views its schema does not declare: seen as fresh tensors, their matmul's
    # bytes were given to the next gate while its other pieces were still read (the LSTM+GRU model's loss
    # was off by 4e-4 with pools on)
    torch.manual_seed(0)
    reference, model = GatedRecurrence(), GatedRecurrence()
    model.load_state_dict(reference.state_dict())
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=stage, memory_pools=True)
    generator = torch.Generator().manual_seed(1)
    batch = (torch.randn(4, 2, 6, generator=generator), torch.randint(0, 3, (4,), generator=generator))
    assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, None, batch))
    for key, value in reference.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key
    assert step.memory_plan.arenas


def test_pools_off_is_plain_allocation_with_the_same_numbers(monkeypatch):
    monkeypatch.delenv("ZEROCC_MEMORY_POOLS", raising=False)
    losses = {}
    for pools in (True, False):
        model, _, loss_fn = build("gpt")
        step = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn, memory_pools=pools)
        losses[pools] = [step(*batch) for batch in batches("gpt", 2, 8)]
        report = step.report()
        assert report["memory_pools"] is pools
        assert ("place_buffers" in step.passes) is pools
    assert report["arena_bytes"] == 0 and not step.memory_plan.arenas and not step.memory_plan.unplanned
    assert report["planned_peak_bytes"] == step.memory_plan.planned_bytes
    assert all(torch.equal(a, b) for a, b in zip(losses[True], losses[False]))
    model, _, _ = build("gpt")   # the trained model belongs to its step: compiling it again is refused
    step = zerocc.compile(model, adamw(model))
    assert "place_buffers" in step.passes and step.memory_pools   # on unless turned off
    for dropped in ("plan_memory", "place_buffers"):   # disabling either turns the default off, not an error
        step = zerocc.compile(model, adamw(model), disable=[dropped])
        assert "place_buffers" not in step.passes and not step.memory_pools
    with pytest.raises(zerocc.ConfigError, match=r"memory_pools must be True or False, got 'yes'"):
        zerocc.compile(model, adamw(model), memory_pools="yes")
    with pytest.raises(zerocc.ConfigError, match=r"'place_buffers' cannot be disabled: compile\(memory_pools=True\)"):
        zerocc.compile(model, adamw(model), memory_pools=True, disable=["place_buffers"])


def test_the_environment_sets_the_default_and_an_argument_overrides_it(monkeypatch):
    model, _, loss_fn = build("mlp")
    monkeypatch.setenv("ZEROCC_MEMORY_POOLS", "1")
    assert "place_buffers" in zerocc.compile(model, adamw(model)).passes
    planned = zerocc.plan(model, adamw(model), example_inputs=batches("mlp", 1, 2)[0], loss_fn=loss_fn)
    assert "place_buffers" in planned.passes and planned.memory_plan.arenas
    assert "place_buffers" not in zerocc.compile(model, adamw(model), memory_pools=False).passes
    monkeypatch.setenv("ZEROCC_MEMORY_POOLS", "0")
    assert "place_buffers" not in zerocc.compile(model, adamw(model)).passes
    assert "place_buffers" in zerocc.compile(model, adamw(model), memory_pools=True).passes
    monkeypatch.delenv("ZEROCC_MEMORY_POOLS")
    assert "place_buffers" in zerocc.compile(model, adamw(model)).passes   # unset: on
    monkeypatch.setenv("ZEROCC_MEMORY_POOLS", "on")
    with pytest.raises(zerocc.ConfigError, match=r"\$ZEROCC_MEMORY_POOLS must be 1 \(memory pools on\) or 0 \(off\), got 'on'"):
        zerocc.compile(model, adamw(model))


@pytest.mark.parametrize("memory_pools", [True, False])
def test_data_dependent_sizes_are_listed_as_unplanned(memory_pools):
    torch.manual_seed(0)
    reference, model = BooleanMask(), BooleanMask()
    model.load_state_dict(reference.state_dict())
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3, memory_pools=memory_pools)
    for seed in range(3):
        x = torch.randn(8, 12, generator=torch.Generator().manual_seed(seed))
        reference_optimizer.zero_grad()
        expected = reference(x)
        expected.backward()
        reference_optimizer.step()
        assert torch.equal(step(x), expected.detach())
    plan = step.memory_plan
    sized_by_data = [u for u in plan.unplanned if u.reason.startswith("size depends on the data")]
    assert sized_by_data and all(u.bytes is None for u in sized_by_data)
    assert all(b.bytes > 0 or b.name not in {u.name for u in sized_by_data} for b in plan.buffers())
    assert "of a size known only at run time" in plan.summary()


def test_explain_says_in_words_why_a_data_dependent_size_is_unplanned():
    """The reason printed was "size depends on the data (u7x1 elements)": torch's symbol for the size read at run
    time, an internal name, and one reason per shape, which split the summary's count of such buffers."""
    torch.manual_seed(0)
    model = BooleanMask()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=0)
    step(torch.randn(8, 12, generator=torch.Generator().manual_seed(0)))
    sized_by_data = [u for u in step.memory_plan.unplanned if u.bytes is None]
    assert sized_by_data
    reason = "size depends on the data (a boolean mask, nonzero or .tolist() decides it as the step runs)"
    assert {u.reason for u in sized_by_data} == {reason}
    text = step.explain()
    assert f"{len(sized_by_data)} {reason}" in text
    assert re.search(r"\bu\d+", text + step.memory_plan.table()) is None, text


def test_a_collectives_inputs_live_until_its_wait():
    # a collective reads its input while the program runs on: the bytes may not be reused before the wait
    model, _, _ = build("gpt")
    planned = zerocc.plan(model, adamw(model), stage=2, world_size=4, example_inputs=batches("gpt", 1, 2)[0],
                          bucket_bytes=16 * 1024)
    plan = planned.memory_plan
    position = {name: i for i, name in enumerate(plan.positions)}
    lives = {b.name: b for b in [*plan.buffers(), *plan.unplanned]}
    # a bucket written in place (passes/gradients_into_buckets.py) reaches its collective as a view
    lives.update({alias: b for b in plan.buffers() for alias in b.aliases})
    gm = planned.graph("plan_memory").graph_module
    checked = 0
    for node in gm.graph.nodes:
        if g.is_reduce_scatter(node) and node.args[0].name in lives:
            wait = next(u for u in node.users if g.is_wait(u))
            assert lives[node.args[0].name].end >= position[wait.name] > position[node.name]
            checked += 1
    assert checked > 0


def _two_ranks(rank, world_size):
    results = {}
    for stage in (0, 3):
        losses = {}
        for pools in (False, True) if stage == 3 else (True,):   # stage 0 against plain allocation: test_numerics
            model, _, loss_fn = build("gpt")
            step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn, memory_pools=pools)
            losses[pools] = [step(*batch) for batch in batches("gpt", 2, 4, seed=1 + rank)]
        results[stage] = (losses, step.report(), step.memory_plan)
    return results


@pytest.mark.multirank
def test_world_size_2_places_gathered_parameters_and_gradients_exactly():
    for result in distributed.run(_two_ranks, 2):
        for stage, (losses, report, plan) in result.items():
            if False in losses:
                assert all(torch.equal(a, b) for a, b in zip(losses[True], losses[False])), stage
            check_measured_is_planned(report, plan)
        arena = {b.role for b in result[3][2].pool("arena").buffers}
        assert "gathered parameters" in arena     # all_gather_into_tensor_out writes into the arena
        assert "gradient buckets" in {b.role for b in result[0][2].pool("arena").buffers}
        # gloo's all-to-all (scatter_by_all_to_all) receives into the arena: zerocc::all_to_all_single_out
        assert any(b.name.startswith("all_to_all_single") for b in result[3][2].pool("arena").buffers)


def test_the_arena_keeps_the_all_gather_and_the_gradient_cat():
    """gather_by_send_recv and gradients_into_buckets are off under pools: place_buffers writes gloo's all-gather
    (all_gather_into_tensor_out) and the bucket's cat into the arena; their replacements have no out= form."""
    model, _, loss_fn = build("gpt")
    planned = zerocc.plan(model, adamw(model), stage=3, world_size=2, example_inputs=batches("gpt", 1, 2)[0],
                          loss_fn=loss_fn, memory_pools=True)
    assert planned.graph("gather_by_send_recv").note.startswith("off under memory_pools")
    assert planned.graph("gradients_into_buckets").note.startswith("off under memory_pools")
    program = str(planned.graph("place_buffers"))
    assert "all_gather_into_tensor_out" in program and "all_gather_by_send_recv" not in program
    assert "torch.ops.aten.cat.out(" in program
    # the one bucket_written left is the updated pieces' (written into their slot's slices), not a gradient bucket's
    written = [n for n in planned.graph("place_buffers").graph_module.graph.nodes
               if n.target is torch.ops.zerocc.bucket_written.default]
    assert all(n.args[0].op == "placeholder" and n.meta.get(g.PHASE) == g.OPTIMIZER for n in written), written


def test_the_arena_keeps_gloos_all_to_all():
    """scatter_by_all_to_all's all-to-all receives into the arena (zerocc::all_to_all_single_out): functional, its
    full bucket was left to the allocator beside the arena, on top of the arena's peak (issue 19: the examples' 5M
    GPT on 2 CPU ranks planned 74.2 MB at stage 2, above stage 1's 72.0)."""
    model, _, loss_fn = build("gpt")
    planned = zerocc.plan(model, adamw(model), stage=3, world_size=2, example_inputs=batches("gpt", 1, 2)[0],
                          loss_fn=loss_fn, memory_pools=True)
    program = str(planned.graph("place_buffers"))
    assert "zerocc.all_to_all_single_out" in program and "_c10d_functional.all_to_all_single.default" not in program
    assert not any(u.name.startswith("all_to_all_single") for u in planned.memory_plan.unplanned)
    assert any(b.name.startswith("all_to_all_single") for b in planned.memory_plan.pool("arena").buffers)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_budget_equal_to_the_planned_peak_is_accepted_and_fits(stage):
    """The first step writes the optimizer state it creates into the tensor it created (place_buffers).

    Before, the first step held Adam's zeros and the new moments at once, so its plan peaked above the
    steady state's, and a budget equal to the steady state's own planned peak was refused.
    """
    model, _, loss_fn = build("mlp")
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn, memory_pools=True)
    first, second = batches("mlp", 2, 8)
    step(*first)
    first_peak = step.report()["planned_peak_bytes"]
    step(*second)
    budget = step.report()["planned_peak_bytes"]
    assert first_peak <= budget
    reference, _, _ = build("mlp")
    reference_optimizer = adamw(reference)
    model, _, loss_fn = build("mlp")
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn, memory_pools=True, memory_budget=budget)
    for batch in (first, second):
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, loss_fn, batch))
        report = step.report()
        assert report["planned_peak_bytes"] <= budget
        assert report["measured_peak_bytes"] <= report["planned_peak_bytes"]


def _planned_and_measured(name, stage, rank=0):
    """(planned, measured) peak bytes of the first step and of the steady state, with default options."""
    model, _, loss_fn = build(name)
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn)   # memory_pools not given: on
    peaks = []
    for batch in batches(name, 2, 8, seed=1 + rank):
        step(*batch)
        report = step.report()
        assert report["memory_pools"]
        peaks.append((report["planned_peak_bytes"], report["measured_peak_bytes"]))
    return peaks


@pytest.mark.parametrize("stage", [0, 3])
def test_dynamic_loss_scaling_holds_what_was_planned_and_trains_bit_for_bit(stage):
    """The overflow check of loss scaling was one aten.isfinite per bucket, whose composite kernel makes |x| and
    three masks of the bucket's size: unplanned, they put the measured peak 18% over the planned one (a budget of
    the plan's peak exceeded by them). The check is the kernel's ops as nodes now, planned and placed in the arena."""
    reference, _, loss_fn = build("mlp")
    reference_optimizer = adamw(reference)
    scaler = torch.amp.GradScaler("cpu")
    model, _, _ = build("mlp")
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn, loss_scale="dynamic", memory_pools=True)
    for batch in batches("mlp", 3, 8):
        expected = mixed_eager_step(reference, reference_optimizer, loss_fn, batch, torch.float32, scaler=scaler)
        assert torch.equal(step(*batch), expected)
    assert step.loss_scale == scaler.get_scale()
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key
    check_measured_is_planned(step.report(), step.memory_plan)


def _within_3_percent(peaks):
    for planned, measured in peaks:
        assert abs(planned - measured) <= 0.03 * measured, (planned, measured)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_by_default_the_planned_peak_is_the_measured_peak_within_3_percent(monkeypatch, name, stage):
    monkeypatch.delenv("ZEROCC_MEMORY_POOLS", raising=False)
    _within_3_percent(_planned_and_measured(name, stage))


def _two_ranks_default(rank, world_size):
    os.environ.pop("ZEROCC_MEMORY_POOLS", None)
    return _planned_and_measured("gpt", 3, rank)


@pytest.mark.multirank
def test_by_default_the_planned_peak_is_the_measured_peak_within_3_percent_at_world_size_2():
    for peaks in distributed.run(_two_ranks_default, 2):
        _within_3_percent(peaks)


def _two_ranks_accumulating_in_bf16(rank, world_size):
    model, _, loss_fn = build("gpt")
    step = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn, param_dtype=torch.bfloat16,
                          grad_accumulation=2, clip_grad_norm=1.0)
    for batch in batches("gpt", 2, 8, seed=1 + rank):
        step(*batch)
    report = step.report()
    return report["planned_peak_bytes"], report["measured_peak_bytes"]


@pytest.mark.multirank
def test_a_gather_input_is_measured_until_its_wait_as_planned_at_world_size_2():
    """Stage 3 with grad_accumulation issues a bucket's gathers for every micro-batch from one shard cast to bf16:
    the plan holds the cast until the last gather's wait, but gloo dropped it once the gathers were done and the
    run stopped counting it, 1.9% under the plan (3.7% on a LoRA model). The tracker holds a collective's input
    until its wait, the program's order of releases."""
    for planned, measured in distributed.run(_two_ranks_accumulating_in_bf16, 2):
        assert measured <= planned <= 1.005 * measured, (planned, measured)


# -- out= kernels that use their output as scratch (analysis/kernels.py's SCRATCH_OUT) ----------------------

def _resizes_its_output(packet, args, capfd) -> bool:
    """Whether ``packet.out`` given an output of the right shape resizes it (PyTorch warns on stderr)."""
    results = packet.default(*args)
    results = results if isinstance(results, tuple) else (results,)
    out = packet.out if "out" in packet.overloads() else getattr(packet, packet.overloads()[-1])
    names = [argument.name for argument in out._schema.arguments if argument.is_out]
    capfd.readouterr()
    out(*args, **{name: torch.empty_like(result) for name, result in zip(names, results)})
    return "was resized" in capfd.readouterr().err


def _kernels_tried():
    aten = torch.ops.aten
    a, b, labels = torch.rand(64, 3), torch.rand(64, 3), torch.zeros(64, dtype=torch.long)
    scratch = {aten.mse_loss: (a, b), aten.smooth_l1_loss: (a, b), aten.huber_loss: (a, b),
               aten.soft_margin_loss: (a, b), aten.binary_cross_entropy: (a.clamp(0.01, 0.99), b)}
    clean = {aten.multi_margin_loss: (a, labels), aten.multilabel_margin_loss: (a, torch.zeros(64, 3, dtype=torch.long)),
             aten.sum: (a,), aten.logsumexp: (a, [1]), aten.linalg_vector_norm: (a,), aten.dist: (a, b),
             aten.prod: (a,), aten.amax: (a, [1]), aten.nll_loss_forward: (a.log_softmax(1), labels, None, 1, -100),
             aten.mm: (a, b.t())}
    return scratch, clean


def test_the_kernels_that_resize_their_output_get_no_out_variant_and_the_others_keep_theirs(capfd):
    from zerocc.analysis.kernels import SCRATCH_OUT
    scratch, clean = _kernels_tried()
    assert {packet.default for packet in scratch} == SCRATCH_OUT
    for packet, args in scratch.items():
        assert _resizes_its_output(packet, args, capfd), packet   # still true of this PyTorch: else drop it
        assert out_variant(packet.default) is None
    for packet, args in clean.items():
        assert not _resizes_its_output(packet, args, capfd), packet
    assert out_variant(torch.ops.aten.nll_loss_forward.default) is not None


def test_an_op_that_moves_an_arena_is_caught_after_the_run():
    """The resize of a view at an arena's end reallocates the whole arena: the step raises instead of going on."""
    from zerocc.runtime.arenas import Arenas
    arenas = Arenas()
    arenas.fit("arena:activations", 256, torch.device("cpu"))
    before = arenas.addresses()
    last = arena_view(arenas["arena:activations"], 192, (), (), torch.float32)
    torch.ops.aten.mse_loss.out(torch.rand(64, 3), torch.rand(64, 3), out=last)
    with pytest.raises(RuntimeError, match=r"reallocated the memory arena\(s\) arena:activations.*SCRATCH_OUT"):
        arenas.check_unmoved(before)


def test_a_recomputed_mse_loss_under_a_budget_is_not_placed_in_an_arena(capfd):
    """Remat copies the loss into backward (dropout masks cannot be recomputed, the loss can), where pools place
    it: it used to go through mse_loss.out."""
    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1),
                                                      nn.Linear(256, 64)) for _ in range(4))
            self.head = nn.Linear(64, 1)

        def forward(self, x, y):
            for block in self.blocks:
                x = x + block(x)
            return F.mse_loss(self.head(x), y)

    def built():
        torch.manual_seed(0)
        return Blocks()
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(2048, 64, generator=generator), torch.randn(2048, 1, generator=generator)) for _ in range(2)]
    model = built()
    unbudgeted = zerocc.compile(model, adamw(model), stage=3)
    unbudgeted(*data[0])
    planned = unbudgeted.report()["planned_peak_bytes"]
    reference, model = built(), built()
    reference_optimizer = adamw(reference)
    step = zerocc.compile(model, adamw(model), stage=3, memory_budget=int(planned * 0.95))
    capfd.readouterr()
    for number, batch in enumerate(data):
        torch.manual_seed(100 + number)
        expected = eager_step(reference, reference_optimizer, None, batch)
        torch.manual_seed(100 + number)
        assert torch.equal(step(*batch), expected)
    assert "was resized" not in capfd.readouterr().err
    assert step.remat_plan.recomputed
    targets = {node.target for node in step.graph("place_buffers").graph_module.graph.nodes}
    assert torch.ops.aten.mse_loss.default in targets and torch.ops.aten.mse_loss.out not in targets


# -- out= kernels that tell their outputs apart by storage (analysis/kernels.py's STORAGE_COMPARING_OUT) ---------

def _writes_every_output_in_one_storage(op, out, args) -> bool:
    """Whether ``out``, ``op``'s out= overload, given its outputs as views of one buffer (an arena), computes what
    ``op`` does."""
    expected = op(*args)
    arena = torch.full((1 << 14,), float("nan"))
    outs, offset = [], 0
    for result in expected:
        outs.append(arena[offset:].view(result.dtype).as_strided(result.shape, result.stride()))
        offset += result.numel() + 16
    out(*args, **{argument.name: view for argument, view in zip(
        [argument for argument in out._schema.arguments if argument.is_out], outs)})
    return all(torch.equal(got, want) for got, want in zip(outs, expected))


def test_the_kernels_that_compare_their_outputs_storage_get_no_out_variant_and_the_others_keep_theirs():
    from zerocc.analysis.kernels import STORAGE_COMPARING_OUT
    a = torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(0))
    spd = a @ a.mT + torch.eye(4)
    assert STORAGE_COMPARING_OUT == {aten.linalg_qr.default}
    assert not _writes_every_output_in_one_storage(aten.linalg_qr.default, aten.linalg_qr.out, (a,))   # still
    assert out_variant(aten.linalg_qr.default) is None   # true of this PyTorch: else drop it
    for op, args in {aten._linalg_eigh.default: (spd,), aten._linalg_svd.default: (a,),
                     aten.linalg_lu.default: (a,), aten.linalg_cholesky_ex.default: (spd,),
                     aten._linalg_slogdet.default: (a,), aten.geqrf.default: (a,)}.items():
        assert out_variant(op) is not None, op
        assert _writes_every_output_in_one_storage(op, out_variant(op)[0], args), op


class _QRHead(nn.Module):
    """torch.linalg.qr in forward (an orthogonalizing layer): Q and R both feed the loss."""

    def __init__(self):
        super().__init__()
        self.project, self.head = nn.Linear(6, 16), nn.Linear(4, 1)

    def forward(self, x, y):
        q, r = torch.linalg.qr(self.project(x).view(-1, 4, 4))
        return F.mse_loss(self.head((q @ r.tril()).sum(-1)).squeeze(-1), y)


@pytest.mark.parametrize("stage", [0, 3])
def test_linalg_qr_in_forward_trains_bit_for_bit_with_memory_pools(stage):
    """Q and R placed in one arena: linalg_qr.out took R for the tensor it had factored in (the same storage as
    Q) and never wrote it; the loss was inf from the first step."""
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 6, generator=generator), torch.randn(4, generator=generator)) for _ in range(3)]
    torch.manual_seed(0)
    reference = _QRHead()
    torch.manual_seed(0)
    model = _QRHead()
    reference_optimizer = adamw(reference)
    step = zerocc.compile(model, adamw(model), stage=stage, memory_pools=True)
    for batch in data:
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, None, batch))
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key



class _TableAndLinear(nn.Module):
    """A linear layer over its input plus rows of a table the module holds as a plain tensor (no buffer)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 64)
        self.table = torch.randn(4096, 64)   # 1 MB

    def forward(self, x):
        return self.linear(x + self.table[:len(x)])


@pytest.mark.parametrize("loss_fn", [F.mse_loss, F.smooth_l1_loss, F.l1_loss])
@pytest.mark.parametrize("table", [False, True])
def test_what_the_plan_does_not_see_by_shape_is_planned_as_it_runs(monkeypatch, loss_fn, table):
    """Two real tensors the plan missed, planned peak below measured: CPU's mse_loss (smooth_l1, soft_margin,
    binary_cross_entropy) returns its 0-dim loss in the elementwise scratch it reduced, a storage the batch's
    size that lives as long as the loss, planned as 64 bytes (5-9% under on a small model); a tensor the module
    holds, read in forward, was planned alive to its last use, though the module holds it all along. Both are
    planned now, the measured peak within 1% of the plan, and training is eager's bit for bit."""
    monkeypatch.delenv("ZEROCC_MEMORY_POOLS", raising=False)
    torch.manual_seed(0)
    reference = _TableAndLinear() if table else nn.Linear(64, 64)
    model = copy.deepcopy(reference)
    step = zerocc.compile(model, adamw(model), loss_fn=loss_fn)
    reference_optimizer = adamw(reference)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        batch = torch.randn(256, 64, generator=generator), torch.randn(256, 64, generator=generator)
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, loss_fn, batch))
    report = step.report()
    assert abs(report["planned_peak_bytes"] - report["measured_peak_bytes"]) <= 0.01 * report["measured_peak_bytes"]


def test_a_table_the_model_holds_is_planned_once_under_accumulation(monkeypatch):
    """Each micro-batch of grad_accumulation reads the model's table through a constant of its own: planned alive
    all along, each was counted as a storage of its own, the planned peak a table over the measured one."""
    monkeypatch.delenv("ZEROCC_MEMORY_POOLS", raising=False)
    torch.manual_seed(0)
    model = _TableAndLinear()
    step = zerocc.compile(model, adamw(model), loss_fn=F.l1_loss, grad_accumulation=2)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        step(torch.randn(256, 64, generator=generator), torch.randn(256, 64, generator=generator))
    report = step.report()
    assert abs(report["planned_peak_bytes"] - report["measured_peak_bytes"]) <= 0.01 * report["measured_peak_bytes"]


def test_first_run_measures_without_making_arena_views_under_the_tracker(monkeypatch):
    """The first run is measured under ``LiveBytesTracker``, a Python dispatch mode: the arenas' views are made
    before it (``Program.make_arena_views``), not one by one inside it (two ops each through the mode: most of
    a 12-layer GPT's first step running ~0.5 s longer than the next). The measurement and numerics stay as planned."""
    from zerocc.runtime.memory import LiveBytesTracker
    seen = []
    dispatch = LiveBytesTracker.__torch_dispatch__

    def counting(self, func, types, args=(), kwargs=None):
        seen.append(func)
        return dispatch(self, func, types, args, kwargs)
    monkeypatch.setattr(LiveBytesTracker, "__torch_dispatch__", counting)
    reference, _, loss_fn = build("gpt")
    reference_optimizer = adamw(reference)
    model, _, _ = build("gpt")
    step = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn, memory_pools=True)
    for batch in batches("gpt", 2, 8):
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, loss_fn, batch))
    assert seen, "the first run was measured"
    assert aten.as_strided.default not in seen and aten.view.dtype not in seen
    check_measured_is_planned(step.report(), step.memory_plan)
