"""release_slots: the old parameters and optimizer state die at their last use, and nothing is lost on failure."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import zerocc
from zerocc import graph as g
from tests.models import batches
from tests.reference import adamw


def _wide_mlp():
    """An MLP whose optimizer state outweighs its activations at batch 2: the optimizer phase is the peak."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                               torch.nn.GELU(), torch.nn.Linear(256, 5))


def _steady_state(stage, disable=()):
    model = _wide_mlp()
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=torch.nn.functional.mse_loss,
                          memory_pools=False, disable=disable)
    losses = [step(*batch) for batch in batches("mlp", 3, 2)]
    return step, losses


@pytest.mark.parametrize("stage", [0, 3])
def test_old_state_dies_at_its_last_use_as_planned_and_bits_do_not_change(stage):
    released, losses = _steady_state(stage)
    kept, kept_losses = _steady_state(stage, disable=("release_slots",))
    assert [l.item() for l in losses] == [l.item() for l in kept_losses]
    for name, value in released.full_state_dict().items():
        assert torch.equal(value, kept.full_state_dict()[name]), name
    state_bytes = sum(g.nbytes(n) for n in g.placeholders(released.cache.last.program.gm, g.ROLE_STATE))
    for step in (released, kept):
        report = step.report()
        # the plan's lifetimes are what a real step holds (the plan rounds buffers up to 64 bytes)
        assert 0.98 * report["live_peak_bytes"] <= report["measured_peak_bytes"] <= report["live_peak_bytes"]
    saved = kept.report()["measured_peak_bytes"] - released.report()["measured_peak_bytes"]
    # the old exp_avg and exp_avg_sq no longer sit beside the new ones (nor, at stage 3, the old parameters)
    assert saved >= 0.8 * state_bytes, (saved, state_bytes)
    assert "die at their last use" in released.explain()


def _token_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(16, 32), torch.nn.Flatten(), torch.nn.Linear(4 * 32, 5))


def _tokens(seed, high=16):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, (3, 4), generator=generator), torch.randn(3, 5, generator=generator)


def test_a_failure_before_the_release_point_leaves_every_slot_as_it_was():
    model = _token_model()
    step = zerocc.compile(model, adamw(model), stage=3, loss_fn=torch.nn.functional.mse_loss)
    for seed in (1, 2):
        step(*_tokens(seed))
    program = step.cache.last.program
    assert program.released_slots   # the steady state's program releases its state
    before = {slot: (value, value.clone()) for slot, value in step.state.slots.items()}
    bad_tokens, targets = _tokens(3)
    bad_tokens[0, 0] = 99   # out of the embedding's range: forward fails, before the release point
    with pytest.raises(IndexError):
        step(bad_tokens, targets)
    assert step.state.slots.keys() == before.keys()
    for slot, (value, copy) in before.items():
        assert torch.equal(step.state.slots[slot], copy), slot
    for slot in program.released_slots:   # (the learning rate's slot is set anew by every call)
        assert step.state.slots[slot] is before[slot][0], slot
    # and training goes on exactly as if the failed step had never been called
    reference = _token_model()
    reference_step = zerocc.compile(reference, adamw(reference), stage=3, loss_fn=torch.nn.functional.mse_loss)
    for seed in (1, 2):
        reference_step(*_tokens(seed))
    assert step(*_tokens(4)).item() == reference_step(*_tokens(4)).item()


class _Injected(RuntimeError):
    pass


def _fail(value):
    raise _Injected("injected into the optimizer's update")


def _fail_before_the_output(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    output = g.output_node(gm)
    with gm.graph.inserting_before(output):
        node = gm.graph.call_function(_fail, (output.args[0][1],))
    node.meta[g.PHASE] = g.OPTIMIZER
    gm.recompile()
    return gm


def test_a_failure_after_the_release_point_says_what_was_lost(monkeypatch):
    monkeypatch.setenv("ZEROCC_TRACE_FIRST_STEP", "1")   # a first step's program, then the steady state's
    model = _token_model()
    step = zerocc.compile(model, adamw(model), stage=3, loss_fn=torch.nn.functional.mse_loss)
    step(*_tokens(1))
    name = zerocc.register_pass(_fail_before_the_output, after="plan_memory")
    try:
        with pytest.raises(_Injected) as caught:
            step(*_tokens(2))   # the steady state's program: compiled now, with the failing node
    finally:
        zerocc.unregister_pass(name)
    note = "\n".join(getattr(caught.value, "__notes__", []))
    assert "failed after its release point" in note and "load a checkpoint" in note


def test_the_release_point_is_a_node_that_computes_not_the_losss_detach():
    """The loss the step returns is a ``detach`` of forward's, which the schedule puts at the end of the graph:
    counted as the last forward node, it put the release point (and the first update ``place_buffers`` may write
    into its slot) after every optimizer update, so the old and new state were held together to the end (the 5M
    benchmark GPT's stage-3 plan on 2 ranks: 106.7 MiB, 91.1 before 2026-11-25). The point is now the last node
    that computes on the data or waits, and the updates after it are written into the slots they replace."""
    from tests.models import GPT   # the benchmark GPT's defaults: its schedule ends with the loss's detach
    torch.manual_seed(0)
    model = GPT()
    tokens = torch.zeros(4, model.wpe.num_embeddings, dtype=torch.long)
    planned = zerocc.plan(model, adamw(model), stage=3, world_size=2, example_inputs=(tokens, tokens))
    nodes = list(planned.gm.graph.nodes)
    (point,) = [node for node in nodes if node.meta.get(g.RELEASE_POINT)]
    assert point.target is not torch.ops.aten.detach.default, point.format_node()
    updates = [i for i, node in enumerate(nodes) if node.meta.get(g.PHASE) == g.OPTIMIZER]
    assert nodes.index(point) < max(updates)   # updates run after it
    note = planned.ctx.notes["place_buffers"]
    written = int(note.split(" updates written into")[0].rsplit(" ", 1)[-1])
    assert written > len(list(model.parameters())), note   # the optimizer state's updates among them


@pytest.mark.parametrize("stage", [0, 3])
def test_the_release_point_comes_after_the_gradients_written_into_their_bucket(stage):
    """``gradients_into_buckets`` (without memory pools) makes each gradient's op write into its
    slice of the bucket (``mm.out``, ``copy_``): its result aliases the bucket, and counted as a view it was no node
    that computes, so the release point fell before the last gradients were computed and a failure there would find
    the old state already overwritten (one rank: no collective wait after them). An op that writes into an argument
    computes."""
    from zerocc.analysis.aliasing import writes_an_argument
    from tests.models import GPT
    torch.manual_seed(0)
    model = GPT()
    tokens = torch.zeros(4, model.wpe.num_embeddings, dtype=torch.long)
    planned = zerocc.plan(model, adamw(model), stage=stage, world_size=1, example_inputs=(tokens, tokens),
                          memory_pools=False)
    nodes = list(planned.gm.graph.nodes)
    (point,) = [node for node in nodes if node.meta.get(g.RELEASE_POINT)]
    pieces = {piece for node in nodes if node.target is torch.ops.zerocc.bucket_written.default
              for piece in node.args[1]}
    written = [i for i, node in enumerate(nodes) if node in pieces and node.meta.get(g.PHASE) == g.BACKWARD]
    assert written, "no gradient written into its bucket: the test no longer sees what it pins"
    assert all(writes_an_argument(nodes[i]) for i in written)
    assert nodes.index(point) >= max(written), (point.format_node(), nodes[max(written)].format_node())
