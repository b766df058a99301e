"""Under mixed precision, gradient buckets live in ``reduce_dtype``: the ZeRO paper's bytes, held for real.

The ``mixed_precision`` pass builds each bucket's flat gradient in
``reduce_dtype`` from the gradients backward computes in ``param_dtype``
(it used to build it in fp32 and cast it at the reduction, so stage 1 held
every full gradient at 4 bytes). Checked three ways: the plan against the
paper's formulas at N = 64 (stage 1: 2P + 2P + 12P/N, stage 2: 2P + 14P/N,
plus Adam's 4-byte step counts), the tensors a running step creates on 2
ranks, and the numerics: bit for bit against the hand-written bf16
reference of ``test_mixed_precision`` at world size 1 (a bf16 gradient cast
to fp32 and back is the same bf16 value).
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import zerocc
from zerocc.planning import Planner
from tests import distributed
from tests.models import batches, build
from tests.reference import adamw, mixed_eager_step

N = 64


def _step_counts(plan) -> int:
    """Bytes of the 0-dim ``step`` state Adam keeps per piece a rank owns (the paper does not count them)."""
    return 4 * sum(1 for _ in plan.shard_plan.owned_pieces())


@pytest.mark.parametrize("reduce_dtype, grad_bytes", [(None, 2), (torch.bfloat16, 2), (torch.float32, 4)],
                         ids=["reduce-default", "reduce-bf16", "reduce-fp32"])
def test_stage_1_and_2_hold_what_the_zero_paper_counts(reduce_dtype, grad_bytes):
    model, _, loss_fn = build("mlp")
    planner = Planner(model, adamw(model), example_inputs=batches("mlp", 1, 8)[0], loss_fn=loss_fn,
                      param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype, bucket_bytes=4096)
    for stage in (1, 2):
        plan = planner.plan(stage, N)
        report = plan.report()
        padded = report["param_count"] + report["padding_elements"]   # P, padded to whole shards
        held = report["model_state_bytes_per_rank"]
        assert held["params"] == 2 * padded + 4 * padded // N          # the bf16 bucket, the fp32 master shard
        assert held["grads"] == grad_bytes * (padded if stage == 1 else padded // N), stage
        assert held["optimizer"] == 8 * padded // N + _step_counts(plan)
        if grad_bytes == 2:   # the paper: 4P + 12P/N at stage 1, 2P + 14P/N at stage 2
            expected = 4 * padded + 12 * padded // N if stage == 1 else 2 * padded + 14 * padded // N
            assert sum(held.values()) - _step_counts(plan) == expected, stage


class Created(TorchDispatchMode):
    """Every tensor the ops under it return: (op, dtype, numel)."""

    def __init__(self):
        super().__init__()
        self.tensors = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(value, torch.Tensor):
                self.tensors.append((str(func), value.dtype, value.numel()))
        return out


def _created_in_a_steady_step(rank, world_size):
    """Per stage 1 and 2, with and without memory pools (buckets made by a cat into the arena, or gradients
    computed into their bucket): what a steady step creates, the buckets' sizes, the reported gradient bytes."""
    results = {}
    for stage, memory_pools in itertools.product((1, 2), (True, False)):
        model, _, loss_fn = build("mlp")
        step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn, bucket_bytes=4096,
                              param_dtype=torch.bfloat16, memory_pools=memory_pools)   # reduced in bf16 too
        data = batches("mlp", 3, 4, seed=rank)
        step(*data[0])
        step(*data[1])
        with Created() as created:
            step(*data[2])
        buckets = {bucket.numel for bucket in step.shard_plan.buckets}
        assert len(buckets) > 1
        results[stage, memory_pools] = (created.tensors, buckets, step.report()["model_state_bytes_per_rank"]["grads"])
    return results


# the ops that make a whole gradient bucket (``bucket_written``: gradients computed into it), cast it or reduce it
BUCKET_MAKERS = ("aten.cat.default", "aten.cat.out", "zerocc.bucket_written.default")
BUCKET_READERS = ("aten._to_copy.default", "_c10d_functional.all_to_all_single.default",
                  "_c10d_functional.reduce_scatter_tensor.default")


@pytest.mark.multirank
def test_a_running_step_holds_no_fp32_bucket_of_gradients():
    """At stages 1-2 on 2 ranks every whole gradient bucket is made, cast and reduced in bf16, none in fp32."""
    for per_stage in distributed.run(_created_in_a_steady_step, 2):
        for (stage, memory_pools), (tensors, buckets, grad_bytes) in per_stage.items():
            whole = [(op, dtype, numel) for op, dtype, numel in tensors
                     if numel in buckets and op in BUCKET_MAKERS + BUCKET_READERS]
            assert whole and all(dtype == torch.bfloat16 for _, dtype, _ in whole), (stage, memory_pools, whole)
            if stage == 1:   # the report counts every whole bucket made, 2 bytes an element
                assert sum(numel * 2 for op, _, numel in whole if op in BUCKET_MAKERS) == grad_bytes


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_reductions_world_size_1_bit_for_bit(stage):
    reference, _, loss_fn = build("mlp")
    reference_optimizer = adamw(reference)
    model, _, _ = build("mlp")
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn, param_dtype=torch.bfloat16,
                          reduce_dtype=torch.bfloat16)
    for batch in batches("mlp", 3, 8):
        expected = mixed_eager_step(reference, reference_optimizer, loss_fn, batch, torch.bfloat16)
        assert torch.equal(step(*batch), expected)
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert full[key].dtype == value.dtype and torch.equal(full[key], value), key


@pytest.mark.parametrize("settings", [dict(param_dtype=torch.bfloat16), dict(grad_accumulation=2)])
def test_each_bucket_is_reduced_where_its_gradients_are_computed(settings):
    """With param_dtype (capture casts each gradient to the master dtype after backward returns) or grad_accumulation
    (micro-batch sums after each backward) every bucket's cat and reduction waited for the end of backward: the whole
    model's gradients alive at once (a 7B bf16 Llama at stage 3: 13.5 GB) and no reduction beside backward."""
    from zerocc import graph as g
    model, _, loss_fn = build("gpt")
    plan = zerocc.plan(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=3, world_size=4,
                       loss_fn=loss_fn, example_inputs=batches("gpt", 1, 4)[0], bucket_bytes=16 * 1024, **settings)
    nodes = list(plan.graph("insert_collectives").graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    reductions = [position[n] for n in nodes if g.is_reduce_scatter(n)]
    last_backward_op = max(position[n] for n in nodes if n.meta.get(g.PHASE) == g.BACKWARD
                           and n.op == "call_function" and n.target is torch.ops.aten.mm.default)
    assert len(reductions) == plan.report()["buckets"] > 2
    # 10 of 12 (the embedding's, read first and last, are final at the end); none before
    assert sum(r < last_backward_op for r in reductions) >= len(reductions) // 2
