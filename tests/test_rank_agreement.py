"""Every rank issues the same collectives in the same order: compiled here for each rank, no process group."""
from __future__ import annotations

import pytest
import torch

import zerocc

from tests.architectures import architecture_batches, build_architecture
from tests.models import batches, build
from tests.reference import two_groups
from zerocc import graph as g
from zerocc.capture import capture
from zerocc.context import CompileContext
from zerocc.pipeline import default_pipeline, run_pipeline
from zerocc.tracing import make_fake_mode


def collective_sequence(model_maker, optimizer_maker, batch, loss_fn, stage, world_size, rank):
    model = model_maker()
    optimizer = optimizer_maker(model)
    fake_mode = make_fake_mode()
    captured = capture(model, optimizer, batch, loss_fn=loss_fn, num_targets=1 if loss_fn else 0, fake_mode=fake_mode)
    ctx = CompileContext(stage, world_size, rank, "fake", optimizer, captured, fake_mode, 256)
    gm, _ = run_pipeline(captured.gm, ctx, default_pipeline(stage))
    return [(g.short_name(n.target), tuple(n.meta[g.VAL].shape)) for n in gm.graph.nodes
            if g.is_collective(n) or g.is_wait(n)]


@pytest.mark.parametrize("stage", [1, 3])
def test_ranks_that_own_no_piece_of_a_bucket_still_communicate(stage):
    # a graph network, two param groups and 256-byte buckets: some buckets are smaller than the
    # world size, so some ranks own only padding of them and have no use for their gradient shard
    sequences = [collective_sequence(lambda: build_architecture("gnn"), two_groups,
                                     architecture_batches("gnn", 1, 2)[0], None, stage, 4, rank) for rank in (0, 3)]
    assert sequences[0]
    assert all(sequence == sequences[0] for sequence in sequences)


def test_same_sequence_on_every_rank_for_the_zoo():
    for name in ("gpt", "cnn"):
        model, _, loss_fn = build(name)
        sequences = [collective_sequence(lambda: build(name)[0], lambda m: torch.optim.AdamW(m.parameters()),
                                         batches(name, 1, 2)[0], loss_fn, 3, 3, rank) for rank in (0, 2)]
        assert all(sequence == sequences[0] for sequence in sequences), name


def test_the_same_model_compiles_to_the_same_program():
    # ranks are separate processes, so nothing in a program may depend on object ids (a set's order):
    # two compiles in one process hold different objects and must still print the same program
    programs = []
    for seed in range(3):
        model, _, _ = build("gpt", seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        plan = zerocc.plan(model, optimizer, stage=3, world_size=2, example_inputs=batches("gpt", 1, 4)[0])
        programs.append([str(plan.graph(name)) for name in plan.passes])
    assert programs[1] == programs[0] and programs[2] == programs[0]
