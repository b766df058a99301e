"""Mixture-of-experts models from Hugging Face transformers train under zerocc as in eager PyTorch.

transformers 5 runs a model's experts one of three ways (the config's
``experts_implementation``): ``grouped_mm`` (the default: tokens sorted by
expert, one ``aten._grouped_mm`` per projection), ``batched_mm`` (each
token's expert weights gathered, one ``bmm``) and ``eager`` (a Python loop
over the experts that received tokens). ``aten._grouped_mm``'s meta kernel
accepts only bf16 while its CPU kernel multiplies float32; zerocc's fake
kernel (zerocc/fake_kernels.py) states what the CPU kernel does.

The routing differs from batch to batch, so each test trains several batches
and compares every step. The reference runs with
``torch.use_deterministic_algorithms(True)``: eager PyTorch's CPU
``index_put_(accumulate=True)`` (the backward of gathering expert weights or
tokens by index) otherwise sums duplicates in a run-dependent order, and no
two eager runs agree bit for bit.
"""
from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch

import zerocc
from tests import distributed
from tests.helpers import assert_rank_matches_reference, beside_eager
from tests.reference import eager, eager_accumulated_step

transformers = pytest.importorskip("transformers")
from tests.zoo import MIXTURES_OF_EXPERTS, MORE_MIXTURES_OF_EXPERTS, TOKENS, VOCAB  # noqa: E402  (needs transformers; the zoo trains every MoE model)
from tests.hf_more import mixed_accumulated_keyword_step  # noqa: E402  (needs transformers)


def build(name, **options):
    torch.manual_seed(0)
    return {**MIXTURES_OF_EXPERTS, **MORE_MIXTURES_OF_EXPERTS}[name](**options)


def token_batches(steps, rows=TOKENS[0], seed=1):
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (rows, TOKENS[1]), generator=generator)
        batches.append(dict(input_ids=ids, labels=ids))
    return batches


def train_and_compare(name, stage, steps=3, compile_options=None, **options):
    """Train eager and compiled side by side; every loss and, at the end, every parameter equal bit for bit."""
    step, _ = beside_eager(functools.partial(build, name, **options), token_batches(steps), lr=1e-2, stage=stage,
                           **(compile_options or {}))
    return step


def routed_counts(name, batches):
    """How many tokens each expert of the first MoE layer gets, per batch (eager, before training)."""
    model = build(name)
    gate = next(module for module_name, module in model.named_modules() if module_name.endswith("mlp.gate"))
    counts = []
    handle = gate.register_forward_hook(lambda module, args, output: counts.append(
        torch.bincount(output[-1].flatten(), minlength=4).tolist()))
    with torch.no_grad():
        for batch in batches:
            model(**batch)
    handle.remove()
    return counts


def test_routing_differs_between_the_batches_the_tests_train():
    counts = routed_counts("mixtral", token_batches(3))
    assert len({tuple(c) for c in counts}) == 3   # a program specialized on the first batch's routing would fail


@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), pytest.param(1, marks=pytest.mark.slow),
                                   pytest.param(2, marks=pytest.mark.slow), 3])
def test_mixtral_grouped_mm_equals_eager_at_every_stage(stage, deterministic):
    step = train_and_compare("mixtral", stage, experts_implementation="grouped_mm")
    graph = str(step.graph("capture"))
    assert graph.count("torch.ops.aten._grouped_mm.default(") == 6   # 2 forward, 4 backward (input and weight grads)
    assert len(step.cache.programs()) == 1   # one program for every routing, the first step's included


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MORE_MIXTURES_OF_EXPERTS))
def test_more_mixture_of_experts_architectures_equal_eager(name, deterministic):
    train_and_compare(name, stage=3)


@pytest.mark.slow
def test_grouped_mm_in_memory_pools_equals_eager(deterministic):
    """Pools place _grouped_mm's results in arena slices a previous value used: its rows must all be written."""
    train_and_compare("mixtral", stage=3, compile_options=dict(memory_pools=True))


@pytest.mark.parametrize("name", ["mixtral", pytest.param("olmoe", marks=pytest.mark.slow),
                                  pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_router_load_balancing_loss_trains_as_eager(name, deterministic):
    """How MoE models are trained: the loss includes the router's auxiliary load-balancing term."""
    train_and_compare(name, stage=3, output_router_logits=True, router_aux_loss_coef=0.02)


@pytest.mark.slow
def test_batched_mm_experts_equal_eager(deterministic):
    step = train_and_compare("qwen2_moe", stage=3, experts_implementation="batched_mm")
    assert "torch.ops.aten._grouped_mm.default(" not in str(step.graph("capture"))


def test_eager_experts_loop_is_refused_naming_the_loop():
    """The loop runs once per expert that received tokens: a different computation for each routing."""
    model = build("mixtral", experts_implementation="eager")
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=3)
    with pytest.raises(zerocc.CaptureError, match=r"modeling_mixtral.py:\d+: for expert_idx in expert_hit:\n"
                                                  r"  why: it depends on the values in a tensor") as raised:
        step(**token_batches(1)[0])
    # it said to drop an `if tokens.numel() == 0` check, which the loop (in transformers' code) does not have
    assert "note: the loop runs once per element of a tensor whose length the data decides" in str(raised.value)
    assert 'trains with "grouped_mm" (its default) or "batched_mm"' in str(raised.value)
    assert "drop the check" not in str(raised.value)


def _against_single_process(rank, world_size, name):
    torch.use_deterministic_algorithms(True)
    batches = token_batches(3, rows=2 * world_size)
    model = build(name)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=3)
    losses = [step(**{key: value.chunk(world_size)[rank] if isinstance(value, torch.Tensor) else value
                      for key, value in batch.items()}) for batch in batches]
    return torch.stack(losses), step.full_state_dict()


@pytest.mark.slow
@pytest.mark.multirank
def test_two_ranks_match_one_process_on_the_global_batch(deterministic):
    reference = build("mixtral")
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    expected = []
    for batch in token_batches(3, rows=4):
        optimizer.zero_grad(set_to_none=True)
        loss = reference(**batch).loss
        loss.backward()
        optimizer.step()
        expected.append(loss.detach())
    results = distributed.run(_against_single_process, 2, "mixtral")
    # each rank's loss is the mean over its half of the tokens: their mean is the global batch's loss
    torch.testing.assert_close((results[0][0] + results[1][0]) / 2, torch.stack(expected), rtol=1e-5, atol=1e-6)
    for rank, (_, state) in enumerate(results):
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {rank} {key}: {m}")


def test_grouped_mm_fake_kernel_matches_the_cpu_kernel_in_zerocc_fake_modes_only():
    """Every layout the CPU kernel takes in float32, with its result's shape and strides; other fake modes unchanged."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zerocc.tracing import make_fake_mode
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)   # one empty group
    cases = [(torch.randn(6, 4), torch.randn(3, 4, 8), offs),                   # tokens x per-expert matrices
             (torch.randn(6, 4), torch.randn(3, 8, 4).transpose(-2, -1), offs),  # transposed weights, as transformers
             (torch.randn(6, 4).t(), torch.randn(6, 8), offs),                  # the weights' gradient
             (torch.randn(3, 6, 4), torch.randn(3, 4, 8), None)]                # batched
    fake_mode = make_fake_mode()
    for a, b, groups in cases:
        real = torch._grouped_mm(a, b, offs=groups)
        with fake_mode:
            fake = torch._grouped_mm(*(fake_mode.from_tensor(t) if t is not None else None for t in (a, b)),
                                     offs=fake_mode.from_tensor(groups) if groups is not None else None)
        assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)
    with fake_mode, pytest.raises(RuntimeError, match="Expected mat_a to be Float32, BFloat16 or Float16 matrix"):
        torch._grouped_mm(fake_mode.from_tensor(torch.randn(6, 4, dtype=torch.float64)),
                          fake_mode.from_tensor(torch.randn(3, 4, 8, dtype=torch.float64)), offs=fake_mode.from_tensor(offs))
    plain = FakeTensorMode()
    with plain, pytest.raises(RuntimeError, match="Expected inputs of BF16 type"):
        torch._grouped_mm(plain.from_tensor(cases[0][0]), plain.from_tensor(cases[0][1]), offs=plain.from_tensor(offs))


# -- mixture-of-experts layers written by hand, as in the repos users copy them from ----------------------------

class HandWrittenMoE(torch.nn.Module):
    """A small LM whose feed-forward is a top-2 mixture of four experts, routed by ``route`` (a method name)."""

    def __init__(self, route, width=16, hidden=32, experts=4, vocab=64, aux_free=False):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, width)
        self.norm = torch.nn.LayerNorm(width)
        self.router = torch.nn.Linear(width, experts, bias=False)
        self.w1 = torch.nn.Parameter(torch.randn(experts, width, hidden) / width ** 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(experts, hidden, width) / hidden ** 0.5)
        self.head = torch.nn.Linear(width, vocab)
        self.route = getattr(self, route)
        self.experts = experts
        self.aux_free = aux_free
        if aux_free:   # DeepSeek-V3's auxiliary-loss-free balancing: a bias on the scores that choose the experts
            self.register_buffer("expert_bias", torch.zeros(experts))
            self.register_buffer("tokens_per_expert", torch.zeros(experts))

    def float32_router(self, x, gates, chosen):
        """Routers kept in float32 by converting the module every step (Switch Transformers' router does)."""
        self.router = self.router.to(torch.float32)
        self.router.to(x.device)
        return self.where_loop(x, gates, chosen)

    def expert(self, e, x):
        return torch.nn.functional.silu(x @ self.w1[e]) @ self.w2[e]

    def where_loop(self, x, gates, chosen):
        """The loop most first MoEs write: each expert's tokens found with torch.where (a data-dependent count)."""
        out = torch.zeros_like(x)
        for e in range(self.experts):
            token, slot = torch.where(chosen == e)
            out.index_add_(0, token, self.expert(e, x[token]) * gates[token, slot, None])
        return out

    def checkpointed_where_loop(self, x, gates, chosen):
        """The loop under activation checkpointing: backward recomputes it, each expert's tokens found again."""
        return torch.utils.checkpoint.checkpoint(self.where_loop, x, gates, chosen, use_reentrant=False)

    def skipping_empty_experts(self, x, gates, chosen):
        """The loop as older Mixtral code wrote it: an expert that received no tokens is skipped."""
        out = torch.zeros_like(x)
        for e in range(self.experts):
            token, slot = torch.where(chosen == e)
            if token.shape[0] == 0:
                continue
            out.index_add_(0, token, self.expert(e, x[token]) * gates[token, slot, None])
        return out

    def grouped_mm(self, x, gates, chosen):
        """torchtitan's dispatch: tokens sorted by expert, per-expert counts from torch.bincount, one _grouped_mm."""
        order = chosen.flatten().argsort(stable=True)
        token = order // chosen.shape[-1]
        offsets = torch.bincount(chosen.flatten(), minlength=self.experts).cumsum(0).to(torch.int32)
        hidden = torch.nn.functional.silu(torch._grouped_mm(x[token], self.w1, offs=offsets))
        out = torch._grouped_mm(hidden, self.w2, offs=offsets) * gates.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, token, out)

    def forward(self, ids, labels):
        h = self.embedding(ids)
        x = self.norm(h).flatten(0, 1)
        scores = self.router(x).softmax(-1)
        if self.aux_free:
            chosen = (scores + self.expert_bias).topk(2, dim=-1).indices
            gates = scores.gather(-1, chosen)
            with torch.no_grad():   # torchtitan counts in forward and balances in an optimizer pre-step hook
                self.tokens_per_expert += torch.histc(chosen.float(), bins=self.experts, min=0, max=self.experts - 1)
        else:
            gates, chosen = scores.topk(2, dim=-1)
        gates = gates / gates.sum(-1, keepdim=True)
        h = h + self.route(x, gates, chosen).view_as(h)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def token_pairs(steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(ids, ids.roll(1, 1)) for ids in (torch.randint(0, 64, (4, 8), generator=generator) for _ in range(steps))]


def train_hand_written(route, steps=3, stage=3, **options):
    """Eager and compiled side by side from the same initial model: every loss, parameter and state equal."""
    torch.manual_seed(0)
    reference = HandWrittenMoE(route)
    model = copy.deepcopy(reference)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = zerocc.compile(model, optimizer, stage=stage, **options)
    for number, batch in enumerate(token_pairs(steps)):
        expected = eager(reference, reference_optimizer, *batch)
        assert torch.equal(step(*batch), expected), number
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    for key, value in reference_optimizer.state_dict()["state"].items():
        for name, tensor in value.items():
            assert torch.equal(optimizer.state_dict()["state"][key][name], tensor), (key, name)
    return step


def test_data_dependent_expert_sizes_under_a_memory_budget(deterministic):
    """Each expert's token count is an unbacked size: the remat planner and the cost model counted its elements
    (``int(u0 * 32)``) and failed with an obscure GuardOnDataDependentSymNode inside place_remat."""
    step = train_hand_written("where_loop", memory_budget=10**9)
    assert step.remat_plan is not None
    assert step.predicted_step_time("h100-sxm-bf16").seconds > 0


@pytest.mark.parametrize("memory_pools", [True, False])
def test_bincount_sized_expert_offsets_under_a_memory_budget(memory_pools, deterministic):
    """bincount's length is a SymInt that _grouped_mm's check makes the number of experts: the bytes the cost model
    counted stayed SymInts, and place_remat failed formatting its note ("unsupported format string passed to
    SymFloat.__format__")."""
    step = train_hand_written("grouped_mm", memory_budget=10**9, memory_pools=memory_pools)
    assert step.remat_plan is not None and isinstance(step.remat_plan.predicted_seconds, float)
    assert isinstance(step.predicted_step_time("h100-sxm-bf16").seconds, float)


def test_a_budget_the_tensors_sized_by_the_routing_exceed_is_warned_naming_their_lines(deterministic):
    """The plan a budget is met by leaves out each expert's tokens (unbacked sizes): a step planned at 4.5 MB held
    6.7 MB, its remat plan saying "fits", and nothing told the user that the budget did not hold."""
    torch.manual_seed(0)
    model = HandWrittenMoE("where_loop", width=64, hidden=256)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), memory_budget=5_000_000)
    ids = torch.randint(0, 64, (64, 8), generator=torch.Generator().manual_seed(1))
    with pytest.warns(zerocc.MemoryBudgetWarning, match=r"memory_budget=5,000,000 bytes was exceeded: the step's first "
                      r"run on this batch held [\d,]+ bytes at its peak \(the plan's: [\d,]+\): the plan leaves out the tensors whose "
                      r"size the data decides, .* made at .*test_moe.py:\d+: .*Lower memory_budget by the difference"):
        step(ids, ids.roll(1, 1))
    assert step.memory_plan.planned_peak_bytes <= 5_000_000 < step.report()["measured_peak_bytes"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", zerocc.MemoryBudgetWarning)
        step(ids.flip(0), ids)   # said once, at the program's first run


@pytest.mark.parametrize("stage, options", [(3, {}), (1, dict(memory_budget=10**9, memory_pools=True))])
def test_checkpointed_experts_whose_sizes_the_data_decides_train_as_eager(stage, options, deterministic):
    """The recomputation finds each expert's tokens again, a new unbacked size: torch.utils.checkpoint's check that
    the recomputed tensors have the saved shapes failed the trace ("Could not guard on data-dependent expression
    Eq(u5, u10)", at "(no user frame found)")."""
    step = train_hand_written("checkpointed_where_loop", stage=stage, **options)
    assert len(step.cache.programs()) == 1


def test_skipping_experts_without_tokens_is_refused_saying_to_drop_the_check():
    """The branch on an expert's token count is a branch on the routing; without it the loop trains (where_loop)."""
    torch.manual_seed(0)
    model = HandWrittenMoE("skipping_empty_experts")
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(zerocc.CaptureError, match=r"test_moe.py:\d+: if token.shape\[0\] == 0:\n.*\n  note: the branch "
                                                  r"asks whether a size the data decides is 0 .*: drop the check"):
        step(*token_pairs(1)[0])


def test_a_module_converted_to_its_own_dtype_in_forward_trains_as_eager(deterministic):
    """``module.to(dtype)`` in forward, a no-op in eager, failed while tracing: "_apply(): Couldn't swap Linear.weight"."""
    step = train_hand_written("float32_router")
    assert torch.isfinite(step.eval_forward(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)))


def test_a_module_conversion_that_changes_a_parameter_is_refused_naming_the_line():
    """With bf16 compute the router's float32 conversion would replace the parameter the program holds."""
    torch.manual_seed(0)
    model = HandWrittenMoE("float32_router")
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters()), param_dtype=torch.bfloat16)
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(zerocc.CaptureError, match=r"(?s)converts a module's parameters or buffers at .*test_moe.py:\d+: "
                       r"self.router = self.router.to\(torch.float32\).*fix: convert the model once before"):
        step(ids, ids)


def balance_experts(model):
    """torchtitan's expert-bias update: experts that got fewer tokens than the mean are favoured next step."""
    with torch.no_grad():
        model.expert_bias += 1e-2 * torch.sign(model.tokens_per_expert.mean() - model.tokens_per_expert)
        model.tokens_per_expert.zero_()


def test_an_optimizer_step_hook_is_refused_and_the_update_between_steps_trains_as_eager(deterministic):
    """The compiled step traces the optimizer's update on a copy, which copy.copy leaves without the optimizer's
    hooks: torchtitan's load balancing in a pre-step hook silently never ran (losses drifted from eager)."""
    torch.manual_seed(0)
    reference = HandWrittenMoE("where_loop", aux_free=True)
    model = copy.deepcopy(reference)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    reference_optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: balance_experts(reference))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hook = optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: balance_experts(model))
    step = zerocc.compile(model, optimizer)
    batches = token_pairs(4)
    with pytest.raises(zerocc.ConfigError, match=r"(?s)the optimizer has 1 step hook\(s\).*<lambda> \(.*test_moe.py:\d+\)"
                                                 r".*fix: remove the hook and do its work between steps"):
        step(*batches[0])
    hook.remove()
    for number, batch in enumerate(batches):
        expected = eager(reference, reference_optimizer, *batch)
        assert torch.equal(step(*batch), expected), number
        balance_experts(model)   # the model's buffers are the step's: the next step routes with this bias
    assert torch.equal(model.expert_bias, reference.expert_bias) and model.expert_bias.abs().sum() > 0
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


@pytest.mark.parametrize("stage", [0, 3])
def test_counts_forward_writes_in_eval_mode_are_written_by_eval_forward_as_eager(stage, deterministic):
    """torchtitan's MoE counts the tokens per expert in every forward, evaluation included, and balances the next
    step with them: eval_forward wrote no buffer, the counts missed the evaluation's tokens, and the expert bias
    and the training after it silently differed from eager."""
    torch.manual_seed(0)
    reference = HandWrittenMoE("where_loop", aux_free=True)
    model = copy.deepcopy(reference)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=stage)
    first, evaluated, last = token_pairs(3)
    assert torch.equal(step(*first), eager(reference, reference_optimizer, *first))
    reference.eval()
    with torch.no_grad():
        expected = reference(*evaluated)
    reference.train()
    assert torch.equal(step.eval_forward(*evaluated), expected)
    assert torch.equal(model.tokens_per_expert, reference.tokens_per_expert)
    balance_experts(reference)
    balance_experts(model)
    assert torch.equal(step(*last), eager(reference, reference_optimizer, *last))
    assert torch.equal(model.expert_bias, reference.expert_bias)


def _hand_written_on_ranks(rank, world_size, batches):
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = HandWrittenMoE("where_loop")
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=3, grad_accumulation=2,
                          clip_grad_norm=0.5)
    losses = [step(*(t.chunk(world_size)[rank] for t in batch)) for batch in batches]
    return losses, step.full_state_dict()


@pytest.mark.slow
@pytest.mark.multirank
def test_two_ranks_whose_experts_get_different_token_counts_match_one_process(deterministic):
    """Each rank's tensors sized by its routing differ in size from the other's and from step to step."""
    batches = token_pairs(3)
    torch.manual_seed(0)
    reference = HandWrittenMoE("where_loop")
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    expected = []
    for batch in batches:
        loss, _ = eager_accumulated_step(reference, optimizer, None, batch, 4, clip=0.5)   # 2 ranks x 2 micro-batches
        expected.append(loss)
    results = distributed.run(_hand_written_on_ranks, 2, batches)
    for rank, (losses, state) in enumerate(results):
        assert_rank_matches_reference(rank, [(a + b) / 2 for a, b in zip(results[0][0], results[1][0])], expected,
                                      state, reference.state_dict(), state_rtol=1e-4, state_atol=1e-5)


def _checkpointed_and_balanced(rank, world_size, stage, batches, folder, resume):
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = HandWrittenMoE("checkpointed_where_loop", aux_free=True)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=stage, memory_pools=True,
                          clip_grad_norm=0.5)
    if resume:
        zerocc.load_checkpoint(step, folder)
    losses = []
    for batch in batches:
        losses.append(step(*(t.chunk(world_size)[rank] for t in batch)))
        torch.distributed.all_reduce(model.tokens_per_expert)   # torchtitan's pre-step hook, between steps
        balance_experts(model)
    if not resume:
        zerocc.save_checkpoint(step, folder)
    return losses, step.full_state_dict()


@pytest.mark.slow
@pytest.mark.multirank
def test_checkpointed_experts_balanced_between_steps_resume_at_another_world_size_and_stage(tmp_path, deterministic):
    """Activation checkpointing over experts whose sizes the data decides, an expert bias moved between steps from
    the counts all-reduced over the ranks: 2 ranks at stage 3, resumed in new processes on 3 ranks at stage 1."""
    generator = torch.Generator().manual_seed(1)
    batches = [(ids, ids.roll(1, 1)) for ids in (torch.randint(0, 64, (6, 8), generator=generator) for _ in range(4))]
    torch.manual_seed(0)
    reference = HandWrittenMoE("checkpointed_where_loop", aux_free=True)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    expected = []
    for number, batch in enumerate(batches):
        expected.append(eager_accumulated_step(reference, optimizer, None, batch, 2 if number < 2 else 3, clip=0.5)[0])
        balance_experts(reference)
    first = distributed.run(_checkpointed_and_balanced, 2, 3, batches[:2], str(tmp_path / "checkpoint"), False)
    resumed = distributed.run(_checkpointed_and_balanced, 3, 1, batches[2:], str(tmp_path / "checkpoint"), True)
    losses = [torch.stack(per_rank).mean() for ranks in (first, resumed) for per_rank in zip(*(r[0] for r in ranks))]
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-5, atol=1e-6)
    assert reference.expert_bias.abs().sum() > 0
    for _, state in resumed:
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")


def _as_users_train(name):
    """A MoE model as users train one: the router's load-balancing loss in the loss, activation checkpointing."""
    model = build(name, output_router_logits=True, router_aux_loss_coef=0.02)
    model.gradient_checkpointing_enable()
    return model


COMBINED = dict(grad_accumulation=2, clip_grad_norm=0.25)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_next", "kimi_linear"])
def test_router_loss_checkpointing_bf16_accumulation_and_clipping_combined_bit_for_bit(name, deterministic):
    reference = _as_users_train(name)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    model = _as_users_train(name)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=3, param_dtype=torch.bfloat16,
                          reduce_dtype=torch.float32, **COMBINED)
    for number, batch in enumerate(token_batches(2)):
        expected, norm = mixed_accumulated_keyword_step(reference, reference_optimizer, batch, 100 + number,
                                                        dtype=torch.bfloat16, k=2, clip=0.25)
        torch.manual_seed(100 + number)
        assert torch.equal(step(**batch), expected), number
        assert torch.equal(step.last_grad_norm, norm), number
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key


def _combined_on_ranks(rank, world_size, name, batches):
    torch.use_deterministic_algorithms(True)
    model = _as_users_train(name)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=3, **COMBINED)
    losses = []
    for number, batch in enumerate(batches):
        torch.manual_seed(100 + number)
        losses.append(step(**{key: value.chunk(world_size)[rank] for key, value in batch.items()}))
    return losses, step.full_state_dict()


@pytest.mark.slow
@pytest.mark.multirank
def test_gpt_oss_combined_options_on_two_ranks_match_one_process(deterministic):
    batches = token_batches(2, rows=8)
    reference = _as_users_train("gpt_oss")
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    expected = [mixed_accumulated_keyword_step(reference, optimizer, batch, 100 + number, dtype=torch.float32, k=4,
                                               clip=0.25)[0]   # 2 ranks x 2 micro-batches
                for number, batch in enumerate(batches)]
    results = distributed.run(_combined_on_ranks, 2, "gpt_oss", batches, timeout=900)
    for rank, (losses, state) in enumerate(results):
        assert_rank_matches_reference(rank, [(a + b) / 2 for a, b in zip(results[0][0], results[1][0])], expected,
                                      state, reference.state_dict(), state_rtol=1e-4, state_atol=1e-5)


# -- DeepSeek-V3's auxiliary-loss-free balancing on transformers' model, as its users add it ----------------------

def _count_routed_tokens(gate, args, output):
    with torch.no_grad():   # tokens per expert, counted into a buffer (a forward hook on each router)
        gate.tokens_per_expert.index_add_(0, output[2].flatten(), torch.ones(output[2].numel()))


def counting_deepseek_v3():
    model = build("deepseek_v3")
    for name, gate in model.named_modules():
        if name.endswith("mlp.gate"):
            gate.register_buffer("tokens_per_expert", torch.zeros(4))
            gate.register_forward_hook(_count_routed_tokens)
    return model


def move_expert_biases(model, world_size=1):
    """Between steps: the biases of under-loaded experts up, of over-loaded ones down, from the global counts."""
    counts = []
    with torch.no_grad():
        for name, gate in model.named_modules():
            if name.endswith("mlp.gate"):
                count = gate.tokens_per_expert.clone()
                if world_size > 1:
                    torch.distributed.all_reduce(count)   # each rank counted its own tokens, as under DDP
                gate.e_score_correction_bias += 0.1 * torch.sign(count.mean() - count)
                gate.tokens_per_expert.zero_()
                counts.append(count)
    return counts


def _balanced_steps(rank, world_size, stage, batches, folder, resume):
    torch.use_deterministic_algorithms(True)
    model = counting_deepseek_v3()
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=stage, clip_grad_norm=0.5)
    if resume:
        zerocc.load_checkpoint(step, folder)
    trained = [(step(**{key: value.chunk(world_size)[rank] for key, value in batch.items()}),
                move_expert_biases(model, world_size)) for batch in batches]
    if not resume:
        zerocc.save_checkpoint(step, folder)
    return trained, step.full_state_dict()


@pytest.mark.slow
@pytest.mark.multirank
def test_deepseek_v3_expert_bias_balancing_across_ranks_resumed_at_another_world_size_and_stage(tmp_path, deterministic):
    """Counts written by a hook in forward, all-reduced and turned into the router's bias between steps; saved on 2
    ranks at stage 3, resumed in new processes on 1 rank at stage 1: losses, counts and biases as one process's."""
    batches = token_batches(4, rows=4)
    reference = counting_deepseek_v3()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    expected = []
    for number, batch in enumerate(batches):
        k = 2 if number < 2 else 1   # 2 ranks' halves, then the whole batch on one rank
        optimizer.zero_grad(set_to_none=True)
        losses = [reference(**{key: value.chunk(k)[i] for key, value in batch.items()}).loss for i in range(k)]
        torch.stack(losses).mean().backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        optimizer.step()
        expected.append((torch.stack(losses).detach(), move_expert_biases(reference)))
    first = distributed.run(_balanced_steps, 2, 3, batches[:2], str(tmp_path / "checkpoint"), False)
    resumed = distributed.run(_balanced_steps, 1, 1, batches[2:], str(tmp_path / "checkpoint"), True)
    assert any(count.min() < count.max() for _, counts in expected for count in counts)   # the biases moved
    for number, (losses, counts) in enumerate(expected):
        ranks = first if number < 2 else resumed
        torch.testing.assert_close(torch.stack([trained[number % 2][0] for trained, _ in ranks]), losses,
                                   rtol=1e-5, atol=1e-6)
        for trained, _ in ranks:
            got = trained[number % 2][1]
            assert all(torch.equal(a, b) for a, b in zip(got, counts)), (number, got, counts)
    for _, state in [*first, *resumed][2:]:
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")


# -- hash routing (expert = token id % experts): counts per expert computed from the batch alone ------------------

class HashRoutedMoE(HandWrittenMoE):
    """Hash layers: each token's expert is its id modulo the number of experts, tokens split by the counts."""

    def forward(self, ids, labels):
        h = self.embedding(ids)
        x = self.norm(h).flatten(0, 1)
        expert = ids.flatten() % self.experts
        order = expert.argsort(stable=True)
        counts = torch.nn.functional.one_hot(expert, self.experts).sum(0).tolist()
        if self.route == "as_numbers":
            counts = [int(count) for count in counts]
        pieces = x[order].split(counts)
        out = torch.cat([self.expert(e, piece) for e, piece in enumerate(pieces)])
        h = h + torch.zeros_like(x).index_add_(0, order, out).view_as(h)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def train_hash_routed(route, steps):
    torch.manual_seed(0)
    reference = HashRoutedMoE("where_loop")
    reference.route = route
    model = copy.deepcopy(reference)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), stage=3)
    for number, batch in enumerate(token_pairs(steps)):
        assert torch.equal(step(*batch), eager(reference, reference_optimizer, *batch)), number
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key
    return step


def test_split_sizes_counted_from_the_batch_serve_every_batch_with_one_program(deterministic):
    step = train_hash_routed("as_symbols", 3)
    assert len(step.cache.programs()) == 1


def test_counts_read_as_python_numbers_compile_every_batch_and_say_so_naming_the_line(deterministic):
    """``int(count)`` of a count read from the batch makes it a number the program is traced with: another set of
    counts every batch compiled a program every step, without a word until ``max_programs`` were exceeded (and
    then a warning that told the user to pad batches whose shapes never changed)."""
    with pytest.warns(zerocc.RecompileWarning, match=r"compiles a new program for the same shapes because values "
                      r"read from the batch differ \(.*test_moe.py:\d+: counts = \[int\(count\) for count in counts\]"
                      r"\).*without int\(\)"):
        step = train_hash_routed("as_numbers", 3)
    assert len(step.cache.programs()) == 3


class SplitByRoutedCounts(HandWrittenMoE):
    """Top-1 routing, tokens sorted by expert and split by the counts read with ``.tolist()``, written three ways."""

    def forward(self, ids, labels):
        h = self.embedding(ids)
        x = self.norm(h).flatten(0, 1)
        chosen = self.router(x).argmax(-1)
        order = chosen.argsort(stable=True)
        if self.route == "one_hot":
            counts = torch.nn.functional.one_hot(chosen, self.experts).sum(0).tolist()
        elif self.route == "int":
            counts = [int(count) for count in torch.nn.functional.one_hot(chosen, self.experts).sum(0).tolist()]
        else:
            counts = torch.bincount(chosen, minlength=self.experts).tolist()
        out = torch.cat([self.expert(e, piece) for e, piece in enumerate(x[order].split(counts))])
        h = h + torch.zeros_like(x).index_add_(0, order, out).view_as(h)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("route, note", [
    ("int", r"note: int\(\) or float\(\) makes a number the data decides .*: drop it and pass the value to the op "
            r"itself \(`x.split\(counts.tolist\(\)\)`"),
    ("bincount", r"note: torch.bincount's length is the largest value plus one .*: count with F.one_hot\(x, n\).sum\(0\) "
                 r"or torch.histc")])
def test_routing_counts_made_python_numbers_are_refused_saying_what_keeps_them_symbols(route, note):
    """The error said to replace Python control flow with tensor ops, on a line that has none: ``int(count)`` of a
    routed count, or the split by ``bincount(...).tolist()`` (whose length the data decides)."""
    torch.manual_seed(0)
    model = SplitByRoutedCounts("where_loop")
    model.route = route
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(zerocc.CaptureError, match=r"(?s)test_moe.py:\d+: counts = .*\n  why: .*\n  " + note):
        step(*token_pairs(1)[0])


def test_split_by_routed_counts_read_with_tolist_trains_as_eager_with_one_program(deterministic):
    torch.manual_seed(0)
    reference = SplitByRoutedCounts("where_loop")
    reference.route = "one_hot"
    model = copy.deepcopy(reference)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=3)
    for number, batch in enumerate(token_pairs(3)):
        assert torch.equal(step(*batch), eager(reference, reference_optimizer, *batch)), number
    assert len(step.cache.programs()) == 1
