"""Copies the program makes that eager does not (issue 19): the gradient bucket's ``cat`` and the updated bucket's
``cat`` into its slot. Under memory pools (the default) each updated parameter is written straight into its slice
of the old slot (``analysis/arena.py``'s ``_pieces_into_slots``): the same numbers as eager, bit for bit. (The gradient
bucket's ``cat`` stays under pools: written into the bucket, its gradients raised the planned peak at stage 2 on
2 ranks over stage 1's, tests/test_planning.py.)"""
from __future__ import annotations

import pytest
import torch

import zerocc
from tests.models import batches, build, eager_step
from tests.reference import adamw

aten = torch.ops.aten


def _update_cats(step):
    """The optimizer's 1-D cats in the final program (the only ones of these models are the buckets' updates)."""
    gm = step.graph("place_buffers").graph_module
    return [n for n in gm.graph.nodes if n.target in (aten.cat.default, aten.cat.out) and n.meta["val"].dim() == 1
            and n.meta.get(zerocc.graph.PHASE) == zerocc.graph.OPTIMIZER]


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05)


@pytest.mark.parametrize("make_optimizer", [adamw, _sgd], ids=["adamw", "sgd"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_world_size_1_writes_updates_into_their_slots_slices_bit_for_bit(stage, make_optimizer):
    """SGD's update (``add`` of the parameter's own slice) is the last reader of the slice it writes: allowed, as
    eager's ``add_``. AdamW reads the parameter in its weight decay ``mul`` first."""
    reference, _, loss_fn = build("mlp")
    reference_optimizer = make_optimizer(reference)
    model, _, _ = build("mlp")
    step = zerocc.compile(model, make_optimizer(model), stage=stage, loss_fn=loss_fn)
    for batch in batches("mlp", 3, 8):
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, loss_fn, batch))
    for key, value in reference.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key
    assert _update_cats(step) == []
    note = step.graph("place_buffers").note
    assert "0 updated pieces" not in note and "updated pieces written straight into their slot's slice" in note
    # every updated piece writes into a slice of the slot it replaces, and the slot is read as written afterwards
    gm = step.graph("place_buffers").graph_module
    written = [n for n in gm.graph.nodes if n.target is zerocc.ops.bucket_written and n.args[0].op == "placeholder"]
    assert written
    for node in written:
        for writer in node.args[1]:
            out = [writer.kwargs[a.name] for a in writer.target._schema.arguments if a.is_out]
            assert [o.target for o in out] == [aten.slice.Tensor] and out[0].args[0] is node.args[0]
