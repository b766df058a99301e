"""gather_by_send_recv: on CPU every all-gather runs as sends and receives into place, bit for bit the same result."""
from __future__ import annotations

import pytest
import torch

import zerocc
from tests import distributed
from tests.models import batches, build
from tests.helpers import assert_two_ranks_train_the_same, compile_graph
from zerocc import graph as g
from zerocc import ops
from zerocc.passes.gather_by_send_recv import TAG_BASE

c10d = torch.ops._c10d_functional


@pytest.mark.parametrize("stage, world_size", [(1, 2), (3, 2), (3, 4)])
def test_each_gather_is_replaced_in_place_with_a_tag_of_its_own(stage, world_size):
    gm, ctx, _ = compile_graph(stage, world_size=world_size)
    without, _, _ = compile_graph(stage, world_size=world_size, disable=("gather_by_send_recv",))
    old = [n for n in without.graph.nodes if n.op == "call_function" and n.target is c10d.all_gather_into_tensor.default]
    new = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is ops.all_gather_by_send_recv]
    assert old and len(new) == len(old)
    assert not any(n.target is c10d.all_gather_into_tensor.default for n in gm.graph.nodes)
    assert all(g.is_all_gather(n) for n in new)
    # the same shards, sizes and buckets, in the same places of the program; the tags differ from each other
    assert [(n.args[0].name, n.args[1], n.meta.get(g.BUCKET), n.meta[g.VAL].shape) for n in new] == \
        [(n.args[0].name, n.args[1], n.meta.get(g.BUCKET), n.meta[g.VAL].shape) for n in old]
    assert [n.args[3] for n in new] == [TAG_BASE + i for i in range(len(new))]
    assert [n.name for n in gm.graph.nodes] == [n.name for n in without.graph.nodes]
    assert all(g.is_wait(next(iter(n.users))) for n in new)
    assert ctx.notes["gather_by_send_recv"].startswith(f"{len(new)} all_gather_into_tensor -> all_gather_by_send_recv")


def _gather(rank, world_size, rows):
    group = torch.distributed.group.WORLD.group_name
    shard = torch.arange(rows, dtype=torch.float32) + 100 * rank
    full = c10d.wait_tensor(ops.all_gather_by_send_recv(shard, world_size, group, TAG_BASE))
    reference = c10d.wait_tensor(c10d.all_gather_into_tensor(shard, world_size, group))
    # two gathers in flight at once, with their own tags, do not take each other's messages
    first = ops.all_gather_by_send_recv(shard, world_size, group, TAG_BASE + 1)
    second = ops.all_gather_by_send_recv(shard * -1, world_size, group, TAG_BASE + 2)
    return full, reference, c10d.wait_tensor(second), c10d.wait_tensor(first)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_op_gathers_what_all_gather_gathers(world_size):
    for full, reference, second, first in distributed.run(_gather, world_size, 5):
        assert torch.equal(full, reference)
        assert torch.equal(first, reference) and torch.equal(second, -reference)


@pytest.mark.multirank
@pytest.mark.parametrize("stage, options", [(1, {}), (3, {"param_dtype": torch.bfloat16})])
def test_two_ranks_train_bit_for_bit_as_with_all_gather(stage, options):
    """Equal losses and state; the counter sees the sends and receives as the all-gather they stand for (same
    calls, same volume). fp32 stage 3 runs the pass in every 2-rank test against DDP."""
    assert assert_two_ranks_train_the_same(stage, "gather_by_send_recv", options)["all_gather"] > 0


def test_a_plan_for_many_ranks_runs_the_pass_on_fake_tensors():
    torch.manual_seed(0)
    model, _, loss_fn = build("gpt")
    plan = zerocc.plan(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=3, world_size=1024,
                       example_inputs=batches("gpt", 1, 2)[0], loss_fn=loss_fn,
                       memory_pools=False)   # under pools place_buffers gathers into its arena instead
    assert "zerocc.all_gather_by_send_recv" in str(plan.graph("gather_by_send_recv"))


def test_ranks_compare_the_gathers_before_running():
    """check_ranks_agree compares every rank's collectives: the sends and receives standing for a gather count."""
    from zerocc.runtime.failures import agreement_lines
    gm, _, _ = compile_graph(3)
    lines = [line for line in agreement_lines(gm, None) if line.startswith("collective")]
    gathers = [line for line in lines if "all_gather_by_send_recv" in line]
    assert gathers and len(gathers) == sum(n.target is ops.all_gather_by_send_recv for n in gm.graph.nodes)
