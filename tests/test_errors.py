"""Bad input fails at compile time with a message that says what, where, why and how to fix it."""
from __future__ import annotations

import contextlib
import copy
import random
from random import random as random_by_name

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerocc
from tests import distributed
from tests.models import BooleanMask, MLP, batches, eager_step


def test_stage_out_of_range():
    model = MLP()
    with pytest.raises(zerocc.ConfigError, match=r"stage=5 is not a ZeRO stage; use 0 \(plain data parallel\), 1, 2 or 3"):
        zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=5)


def test_optimizer_holding_tensors_not_in_the_model():
    model, stranger = MLP(), nn.Linear(2, 2)
    optimizer = torch.optim.SGD([*model.parameters(), *stranger.parameters()], lr=0.1)
    step = zerocc.compile(model, optimizer, stage=3, loss_fn=F.mse_loss)
    with pytest.raises(zerocc.ConfigError, match=r"the optimizer holds 2 tensor\(s\) that are not parameters of the model"):
        step(*batches("mlp", 1, 4)[0])


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(12, 5)

    def forward(self, x):
        y = self.linear(x)
        if y.sum() > 0:   # data-dependent control flow
            y = y * 2
        return y


def test_data_dependent_control_flow_names_the_users_line():
    model = Branchy()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3, loss_fn=F.mse_loss)
    with pytest.raises(zerocc.CaptureError, match=r"test_errors.py:\d+: if y.sum\(\) > 0:   # data-dependent") as info:
        step(*batches("mlp", 1, 4)[0])
    assert "torch.where" in str(info.value)


class NormalizedSGD(torch.optim.Optimizer):
    """Scales each gradient by its norm: not elementwise, a slice cannot compute the norm."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (p.grad.norm() + 1e-6), alpha=-group["lr"])


class GlobalNormSGD(torch.optim.Optimizer):
    """Scales every gradient by the norm over all of them: the update of one parameter reads the others."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            norm = torch.stack([p.grad.norm() for p in params]).norm()
            for p in params:
                p.add_(p.grad / (norm + 1e-6), alpha=-group["lr"])


def test_optimizer_that_is_not_elementwise_names_the_op():
    model = MLP()
    step = zerocc.compile(model, NormalizedSGD(model.parameters()), stage=2, loss_fn=F.mse_loss)
    with pytest.raises(zerocc.UnsupportedOptimizerError, match=r"(?s)NormalizedSGD.step\(\) is not elementwise per parameter:\n"
                       r"  - aten.linalg_vector_norm, \d+ call\(s\), first at .*test_errors.py:\d+: p.add_\(p.grad / \(p.grad.norm\(\)"):
        step(*batches("mlp", 1, 4)[0])


@pytest.mark.parametrize("optimizer", [NormalizedSGD, GlobalNormSGD])
def test_a_non_elementwise_optimizer_still_runs_at_stage_0(optimizer):
    """Stage 0 traces the update per class of look-alike parameters only if that trace is elementwise."""
    reference, model = MLP(), MLP()
    model.load_state_dict(reference.state_dict())
    step = zerocc.compile(model, optimizer(model.parameters()), stage=0, loss_fn=F.mse_loss)
    reference_optimizer = optimizer(reference.parameters())
    for x, y in batches("mlp", 2, 4):
        reference_optimizer.zero_grad()
        expected = F.mse_loss(reference(x), y)
        expected.backward()
        reference_optimizer.step()
        assert torch.equal(step(x, y), expected.detach())
    for key, value in reference.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key


def test_model_without_a_loss_asks_for_loss_fn():
    model = MLP()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=1)
    with pytest.raises(zerocc.CaptureError, match=r"not a scalar loss.*pass loss_fn=\.\.\. to zerocc.compile"):
        step(batches("mlp", 1, 4)[0][0])


def test_a_model_returning_its_loss_in_a_tuple_is_told_which_item_and_how():
    """Hugging Face models with return_dict=False return (loss, logits, ...); the hint it gives trains."""
    class LossAndOutput(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 1)

        def forward(self, x, y):
            out = self.linear(x)
            return F.mse_loss(out, y), out

    model = LossAndOutput()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=0)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    with pytest.raises(zerocc.CaptureError, match=r"the model returned tuple.*its item 0 is a scalar.*"
                                                  r"loss_fn=lambda output: output\[0\], num_targets=0"):
        step(x, y)
    torch.manual_seed(0)
    hinted, reference = LossAndOutput(), LossAndOutput()
    reference.load_state_dict(hinted.state_dict())
    step = zerocc.compile(hinted, torch.optim.SGD(hinted.parameters(), lr=0.1), stage=0,
                          loss_fn=lambda output: output[0], num_targets=0)
    expected, _ = reference(x, y)
    expected.backward()
    assert torch.equal(step(x, y), expected.detach())


def test_nothing_to_train():
    model = MLP().requires_grad_(False)
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3, loss_fn=F.mse_loss)
    with pytest.raises(zerocc.ConfigError, match="no parameter that both requires grad and is in the optimizer"):
        step(*batches("mlp", 1, 4)[0])


def test_unknown_graph_name_lists_the_passes():
    model = MLP()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3, loss_fn=F.mse_loss)
    step(*batches("mlp", 1, 4)[0])
    with pytest.raises(zerocc.ConfigError, match="no pass named 'sharding'; the passes are: capture, shard, place_remat, insert_collectives"):
        step.graph("sharding")


def test_bad_arguments_to_compile():
    model = MLP()
    with pytest.raises(zerocc.ConfigError, match="optimizer must be a torch.optim.Optimizer, got list"):
        zerocc.compile(model, list(model.parameters()))
    with pytest.raises(zerocc.ConfigError, match="model must be a torch.nn.Module"):
        zerocc.compile(lambda x: x, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(zerocc.ConfigError, match="bucket_bytes must be a positive int"):
        zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), bucket_bytes=0)


def test_loss_fn_returning_a_tensor():
    model = MLP()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=lambda out, target: out - target)
    with pytest.raises(zerocc.CaptureError, match=r"loss_fn \(.*test_errors.py:\d+\) returned a tensor of shape "
                       r"\(4, 5\), not a scalar tensor; reduce it"):
        step(*batches("mlp", 1, 4)[0])


def test_loss_fn_returning_the_loss_and_metrics_is_refused_naming_it():
    def loss_and_metrics(out, target):
        loss = F.mse_loss(out, target)
        return loss, {"mae": (out - target).abs().mean()}
    model = MLP()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_and_metrics)
    line = loss_and_metrics.__code__.co_firstlineno
    with pytest.raises(zerocc.CaptureError, match=rf"loss_fn \(.*test_errors.py:{line}\) returned tuple, not a "
                       r"scalar tensor; the step returns the loss alone: return it alone"):
        step(*batches("mlp", 1, 4)[0])


def test_more_targets_than_arguments():
    model = MLP()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.mse_loss, num_targets=3)
    with pytest.raises(zerocc.ConfigError, match=r"the step got 2 positional argument\(s\) but 3 target\(s\) were declared"):
        step(*batches("mlp", 1, 4)[0])


def test_a_model_short_of_arguments_says_how_the_step_split_them():
    """A batch missing its target: the model gets none of the step's one argument, and the error says so."""
    model = MLP()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.mse_loss)
    with pytest.raises(zerocc.CaptureError, match=r"missing 1 required positional argument.*the step passed its first "
                                                  r"0 positional argument\(s\) to the model and the last 1 to loss_fn "
                                                  r"as targets: give compile num_targets="):
        step(batches("mlp", 1, 4)[0][0])


def test_a_keyword_the_model_does_not_take_names_its_forward_not_how_the_step_split_positional_arguments():
    """A data collator's extra column (special_tokens_mask) passed with step(**batch): the error said to give compile
    num_targets=, which has nothing to do with a keyword."""
    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(12, 5)

        def forward(self, x, labels):
            return F.mse_loss(self.linear(x), labels)

    model = Tagger()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = batches("mlp", 1, 4)[0]
    with pytest.raises(zerocc.CaptureError, match=r"unexpected keyword argument 'special_tokens_mask' \(the step "
                       r"passes every keyword of its call to the model, whose forward is at .*test_errors.py:\d+, as "
                       r"eager's model\(\*\*batch\) does: leave out of the call the keys it does not take") as error:
        step(x=x, labels=y, special_tokens_mask=y)
    assert "num_targets" not in str(error.value)
    step(x=x, labels=y)   # nothing changed: the batch without it trains


def test_optimizer_that_needs_a_closure():
    model = MLP()
    step = zerocc.compile(model, torch.optim.LBFGS(model.parameters()), loss_fn=F.mse_loss)
    with pytest.raises(zerocc.UnsupportedOptimizerError, match=r"LBFGS.step\(\) needs a closure"):
        step(*batches("mlp", 1, 4)[0])


@pytest.mark.parametrize("stage", [0, 3])
def test_optimizer_that_branches_on_tensor_values(stage):
    """Adafactor's class names the package as its module: the branch is still found in its own file, and named."""
    model = MLP()
    step = zerocc.compile(model, torch.optim.Adafactor(model.parameters()), stage=stage, loss_fn=F.mse_loss)
    with pytest.raises(zerocc.UnsupportedOptimizerError,
                       match=r"(?s)Adafactor.step\(\) branches in Python .* at .*_adafactor.py:\d+: rho_t = min.*fix: use"):
        step(*batches("mlp", 1, 4)[0])


class CountingSGD(torch.optim.Optimizer):
    """Keeps a Python int step count in each parameter's state and decays its step size by it."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["count"] = state.get("count", 0) + 1
                p.add_(p.grad, alpha=-group["lr"] / state["count"])


@pytest.mark.parametrize("stage", [0, 3])
def test_optimizer_with_python_number_state_that_changes_is_refused(stage):
    """A Python number in the state would be traced as its first step's value and never change: refused."""
    model = MLP()
    step = zerocc.compile(model, CountingSGD(model.parameters()), stage=stage, loss_fn=F.mse_loss)
    with pytest.raises(zerocc.UnsupportedOptimizerError,
                       match=r"(?s)CountingSGD.step\(\) keeps per-parameter state that is not a tensor: 'count' \(a Python "
                             r"int, 1 after the first step\); param group 0.*fix: keep it as a tensor"):
        step(*batches("mlp", 1, 4)[0])


@pytest.mark.parametrize("optimizer_class, line", [(torch.optim.RAdam, r"radam.py:\d+: if rho_t > 5"),
                                                   (torch.optim.ASGD, r"asgd.py:\d+: .*mu.item\(\) != 1")])
def test_an_optimizer_that_branches_on_its_step_count_names_the_branch(optimizer_class, line):
    """RAdam and ASGD are elementwise, but branch in Python on values computed from their step count."""
    model = MLP()
    step = zerocc.compile(model, optimizer_class(model.parameters()), stage=0, loss_fn=F.mse_loss)
    with pytest.raises(zerocc.UnsupportedOptimizerError,
                       match=rf"(?s)\.step\(\) branches in Python on a value .* at .*{line}.*fix: use an optimizer"):
        step(*batches("mlp", 1, 4)[0])


def test_a_fused_optimizer_says_to_unfuse_it():
    model = MLP()
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=True), loss_fn=F.mse_loss)
    with pytest.raises(zerocc.UnsupportedOptimizerError,
                       match=r"(?s)AdamW\(fused=True\).step\(\) could not be traced.*fix: build the optimizer with fused=False"):
        step(*batches("mlp", 1, 4)[0])


@pytest.mark.parametrize("optimizer_class", [torch.optim.Adam, torch.optim.RMSprop])
def test_a_capturable_optimizer_on_the_cpu_says_eager_refuses_it_too(optimizer_class):
    """capturable=True on CPU parameters raises in torch.optim itself (eager too); the refusal blamed the update
    for branching on tensor values or keeping state not shaped like its parameter, and said to use an elementwise
    optimizer, which Adam is."""
    model = MLP()
    step = zerocc.compile(model, optimizer_class(model.parameters(), lr=0.1, capturable=True), loss_fn=F.mse_loss)
    with pytest.raises(zerocc.UnsupportedOptimizerError,
                       match=r"(?s)\(capturable=True\).step\(\) raised: AssertionError: If capturable=True.*"
                             r"eager's optimizer.step\(\) raises the same.*fix: build the optimizer with capturable=False"):
        step(*batches("mlp", 1, 4)[0])


def test_sparse_gradients():
    model = nn.Sequential(nn.Embedding(10, 5, sparse=True))
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=lambda out, target: out.sum())
    with pytest.raises(zerocc.ConfigError, match=r"parameter\(s\) 0.weight get sparse gradients"):
        step(torch.tensor([1, 2]), torch.zeros(1))


class SparseLookups(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, sparse=True, mode="sum")
        self.table = nn.Parameter(torch.randn(10, 4))

    def forward(self, ids):
        pooled = self.bag(ids)
        return (pooled + F.embedding(ids, self.table, sparse=True).sum(1)).sum()


@pytest.mark.parametrize("stage", [0, 3])
def test_sparse_gradients_name_each_lookup_built_with_sparse_true(stage):
    """The refusal said "nn.Embedding(sparse=True)?" and named no line: an EmbeddingBag or an F.embedding call
    with sparse=True (a SparseAdam recipe) left the user to find which lookup it meant."""
    model = SparseLookups()
    step = zerocc.compile(model, torch.optim.SparseAdam(list(model.parameters())), stage=stage)
    with pytest.raises(zerocc.ConfigError, match=r"(?s)table, bag.weight get sparse gradients.*"
                                                 r"test_errors.py:\d+: pooled = self.bag\(ids\).*"
                                                 r"test_errors.py:\d+: return \(pooled \+ F.embedding\(ids, self.table, "
                                                 r"sparse=True\).*fix: build them with sparse=False"):
        step(torch.tensor([[1, 2, 3], [4, 5, 1]]))


def test_data_dependent_shapes_trace_symbolically_not_baked_in():
    torch.manual_seed(0)
    reference, model = BooleanMask(), BooleanMask()
    model.load_state_dict(reference.state_dict())
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3)
    rows = set()
    for seed in range(4):
        x = torch.randn(8, 12, generator=torch.Generator().manual_seed(seed))
        rows.add(int((x.sum(1) > 0).sum()))
        reference_optimizer.zero_grad()
        expected = reference(x)
        expected.backward()
        reference_optimizer.step()
        assert torch.equal(step(x), expected.detach())
    assert len(rows) > 1   # the batches really routed differently
    assert len(step.cache.programs()) == 1   # one program for any row count, the first step's included


# -- training-loop features (tests/test_training_loop.py) ------------------------------

def test_grad_accumulation_that_does_not_divide_the_batch():
    model = MLP()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.mse_loss, grad_accumulation=3)
    with pytest.raises(zerocc.ConfigError, match=r"grad_accumulation=3 does not divide the batch along dim 0: "
                       r"argument 0 has 4 rows, argument 1 has 4 rows; use a batch whose size is a multiple of 3 "
                       r"\(every micro-batch is the same size; an epoch's short last batch: DataLoader\(\.\.\., "
                       r"drop_last=True\), or skip it in the loop\)"):
        step(*batches("mlp", 1, 4)[0])


def test_grad_accumulation_out_of_range():
    model = MLP()
    with pytest.raises(zerocc.ConfigError, match=r"grad_accumulation must be a positive int \(the number of "
                       r"micro-batches a batch is split into\), got 0"):
        zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), grad_accumulation=0)


def test_clip_grad_norm_not_positive():
    model = MLP()
    with pytest.raises(zerocc.ConfigError, match=r"clip_grad_norm must be a positive number \(the largest "
                       r"global gradient norm allowed; .*\), got -1.0; leave it None not to clip"):
        zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), clip_grad_norm=-1.0)


def test_no_targets_declared_for_a_loss_that_takes_one_names_the_models_call():
    """num_targets=0 passed the target to the model: the error said it failed at "(no user frame found)"."""
    model = torch.nn.Linear(4, 2)
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.mse_loss, num_targets=0)
    with pytest.raises(zerocc.CaptureError, match=r"failed at the step's call of the model \(Linear.forward at "
                                                  r".*linear.py:\d+\): TypeError: .*last 0 to loss_fn as targets"):
        step(torch.randn(3, 4), torch.randn(3, 2))


def test_clip_norm_type_without_clip_grad_norm_is_refused_rather_than_ignored():
    model = torch.nn.Linear(4, 2)
    with pytest.raises(zerocc.ConfigError, match=r"clip_norm_type=1 without clip_grad_norm clips nothing"):
        zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), clip_norm_type=1)


def test_clip_norm_type_not_positive():
    model = MLP()
    with pytest.raises(zerocc.ConfigError, match=r"clip_norm_type must be a positive number or float\('inf'\), got 0"):
        zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), clip_grad_norm=1.0, clip_norm_type=0)


def test_max_programs_not_positive():
    model = MLP()
    with pytest.raises(zerocc.ConfigError, match=r"max_programs must be a positive int \(compiled programs kept, "
                       r"by input shape\), got 0"):
        zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), max_programs=0)


class _Flagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(12, 5)

    def forward(self, x, double=False):
        return self.linear(x) * (2 if double else 1)


def test_static_shapes_with_a_python_value_changed_names_the_value_not_the_shape():
    """It said to pad or cut the batch to the compiled shape, where a keyword (use_cache=) had changed."""
    model = _Flagged()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=0, loss_fn=F.mse_loss,
                          static_shapes=True)
    x, y = torch.randn(4, 12), torch.randn(4, 5)
    step(y, x=x, double=False)
    with pytest.raises(zerocc.ConfigError, match=r"static_shapes=True, but .*a Python value of the batch changed.*"
                                                 r"pass the value the step was compiled with"):
        step(y, x=x, double=True)


def test_a_new_shape_under_static_shapes():
    model = MLP()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.mse_loss, static_shapes=True)
    step(*batches("mlp", 1, 4)[0])
    with pytest.raises(zerocc.ConfigError, match=r"static_shapes=True, but this batch is shapes \(3, 12\) float32, "
                       r"\(3, 5\) float32 and the step was compiled for shapes \(4, 12\) float32, \(4, 5\) float32; "
                       r"pad or cut the batch to the compiled shape"):
        step(*batches("mlp", 1, 3)[0])


class ScalesItsWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(12, 5)

    def forward(self, x):
        with torch.no_grad():
            self.linear.weight.mul_(0.5)   # in place, on a parameter
        return self.linear(x)


def test_in_place_write_to_a_parameter_in_forward():
    model = ScalesItsWeight()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=2, loss_fn=F.mse_loss)
    with pytest.raises(zerocc.CaptureError, match=r"(?s)the model writes into its parameters in place during the step:\n"
                       r"  - parameter 'linear.weight' by mul_ at .*test_errors.py:\d+: self.linear.weight.mul_\(0.5\).*"
                       r"fix: compute a new tensor instead"):
        step(*batches("mlp", 1, 4)[0])


def test_a_post_accumulate_grad_hook_is_refused_naming_the_parameter():
    model = MLP()
    name, param = next(iter(model.named_parameters()))
    param.register_post_accumulate_grad_hook(lambda p: None)
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3, loss_fn=F.mse_loss)
    with pytest.raises(zerocc.CaptureError, match=rf"parameter\(s\) '{name}' have a post-accumulate-grad hook "
                                                  r"\(register_post_accumulate_grad_hook\): the compiled step never"):
        step(*batches("mlp", 1, 4)[0])


class PackedLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 4, batch_first=True)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, (hidden, _) = self.lstm(packed)
        return hidden.square().mean()


@torch.library.custom_op("zerocc_tests::doubled_without_fake", mutates_args=())
def _doubled_without_fake(x: torch.Tensor) -> torch.Tensor:
    return x * 2


_doubled_without_fake.register_autograd(lambda ctx, grad: grad * 2)


class _KernelWithoutFake(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(12, 5)

    def forward(self, x):
        return _doubled_without_fake(self.linear(x))   # the op's line


def test_a_custom_op_without_a_fake_implementation_names_the_op_and_the_line():
    """zerocc traces on fake tensors: a torch.library.custom_op needs register_fake, as under torch.compile."""
    model = _KernelWithoutFake()
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters()), stage=3, loss_fn=F.mse_loss)
    with pytest.raises(zerocc.CaptureError, match=r"tracing the training step failed at .*test_errors\.py:\d+: "
                                                  r"return _doubled_without_fake\(.*no fake impl registered for "
                                                  r".*zerocc_tests::doubled_without_fake.*register_fake"):
        step(*batches("mlp", 1, 4)[0])


def test_a_packed_sequence_says_why_it_cannot_be_traced_and_to_pad_instead():
    model = PackedLSTM()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3)
    with pytest.raises(zerocc.CaptureError, match=r"(?s)tracing the training step failed at .*test_errors.py.*self.lstm\(packed\)"
                                                  r".*why: a tensor's value was used where PyTorch needs a Python number.*"
                                                  r"PackedSequence's batch_sizes.*fix: run the RNN on the padded batch"):
        step(torch.randn(3, 5, 4), torch.tensor([5, 2, 4]))


class _NormalizesItsInputInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(12, 5)

    def forward(self, x, labels):
        x.mul_(0.5)
        labels[labels < 0] = 0
        return F.mse_loss(self.linear(x), labels)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_model_writing_into_its_batch_in_place_is_refused(stage):
    """Eager changes the caller's batch tensor (a batch reused for several steps is halved each time); the program
    never writes the batch, so it trained differently from the second step on: refused, naming each write."""
    model = _NormalizesItsInputInPlace()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=stage)
    x, labels = torch.randn(4, 12), torch.randn(4, 5)
    with pytest.raises(zerocc.CaptureError, match=r"(?s)writes into its batch in place.*argument 0 by mul_ at "
                                                  r".*test_errors.py:\d+: x.mul_\(0.5\).*argument 1 by index_put_ "
                                                  r".*labels\[labels < 0\] = 0.*fix: compute a new tensor"):
        step(x, labels)


def test_a_model_wrapped_for_data_parallelism_is_refused_with_the_module_to_pass():
    model = nn.DataParallel(MLP())
    with pytest.raises(zerocc.ConfigError, match=r"the model is wrapped in DataParallel: zerocc does the data "
                                                 r"parallelism itself .* Pass the module inside \(model.module\)"):
        zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.mse_loss)


def _wrapped_by_ddp_or_fully_shard(rank, world_size):
    from torch.distributed.fsdp import fully_shard
    messages = []
    for wrap in (torch.nn.parallel.DistributedDataParallel, fully_shard):
        model = wrap(MLP())
        try:
            zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.mse_loss)
        except zerocc.ConfigError as error:
            messages.append(str(error))
    return messages


@pytest.mark.multirank
def test_a_model_under_ddp_or_fully_shard_is_refused_before_tracing_its_collectives():
    """DDP's forward would be traced with its buffer broadcasts; FSDP2's DTensors fail deep inside tracing."""
    ddp, fsdp = distributed.run(_wrapped_by_ddp_or_fully_shard, 1)[0]
    assert "the model is wrapped in DistributedDataParallel" in ddp and "(model.module)" in ddp
    assert fsdp.startswith("the model's parameters are DTensors (") and "before fully_shard" in fsdp


def _under_replicate_or_with_a_dtensor_buffer(rank, world_size):
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    messages = []
    replicated = replicate(MLP())
    with_buffer = MLP()
    with_buffer.register_buffer("scale", distribute_tensor(torch.ones(4), init_device_mesh("cpu", (1,)), [Replicate()]))
    for model in (replicated, with_buffer):
        try:
            zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.mse_loss)
        except zerocc.ConfigError as error:
            messages.append(str(error))
    return messages


@pytest.mark.multirank
def test_a_model_under_replicate_or_with_dtensor_buffers_is_refused():
    """replicate() (DDP as hooks) kept the model's class and plain parameters: tracing failed inside torch with
    "data is not allocated yet" at no user frame. A DTensor buffer failed in compile's broadcast from rank 0 with
    torch's "no sharding strategy registered"."""
    replicated, with_buffer = distributed.run(_under_replicate_or_with_a_dtensor_buffer, 1)[0]
    assert replicated.startswith("the model is under torch.distributed's replicate()") and "before replicate()" in replicated
    assert with_buffer.startswith("the model's buffers are DTensors (scale)") and "full_tensor()" in with_buffer


class CumulativeNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8, momentum=None)

    def forward(self, x):
        return self.bn(self.fc(x))   # the line the error names


def test_batch_norm_with_momentum_none_is_refused_naming_the_fix():
    """momentum=None divides by num_batches_tracked read as a Python float: the generic 'compute it with tensor
    ops' advice named a line the user cannot change that way."""
    model = CumulativeNorm()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.mse_loss)
    with pytest.raises(zerocc.CaptureError, match=r"(?s)test_errors.py:\d+: return self.bn\(self.fc\(x\)\).*"
                                                  r"BatchNorm with momentum=None.*give the BatchNorm a momentum"):
        step(torch.randn(4, 4), torch.randn(4, 8))


def test_batch_norm_with_momentum_none_in_a_sequential_is_named_by_its_place_in_the_model():
    # no line of the user's runs it (nn.Sequential's forward calls it): the error said "(no user frame found)"
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, momentum=None))
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.mse_loss)
    with pytest.raises(zerocc.CaptureError, match=r"(?s)cannot be traced at model\.1 \(BatchNorm1d\(8, .*momentum=None"
                                                  r".*give the BatchNorm a momentum"):
        step(torch.randn(4, 4), torch.randn(4, 8))


class HostRandomDepth(nn.Module):
    """Stochastic depth and mixup as some recipes write them: Python's and NumPy's global generators in the step."""

    def __init__(self, draw):
        super().__init__()
        self.draw = draw
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 3)
        self.rng = np.random.default_rng(0)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.draw == "random":
            if random.random() < 0.5:   # LayerDrop with Python's random
                h = h * 0
        elif self.draw == "numpy":
            lam = np.random.beta(0.4, 0.4)   # mixup's lambda from NumPy
            h = lam * h + (1 - lam) * h.flip(0)
        elif self.draw == "held":
            h = h * self.rng.uniform(0.5, 1.5)
        elif self.draw == "compared with 0":   # transformers' wav2vec2 adapter with layerdrop=0: always kept
            if np.random.random() > 0.0:
                h = h * 2
        elif self.draw == "reseeded":   # BigBird seeds NumPy before its random attention: the same every step
            np.random.seed(3)
            h = h[:, torch.as_tensor(np.random.permutation(8))]
        elif self.draw == "by name":
            h = h * random_by_name()
        else:   # torch's generator: drawn by the program at every step
            lam = torch.distributions.Beta(0.4, 0.4).sample()
            h = lam * h + (1 - lam) * h.flip(0)
        return self.fc2(h)


@pytest.mark.parametrize("draw, named", [("random", r"random.random\(\) at \S*test_errors.py:\d+: if random.random"),
                                         ("numpy", r"np.random.beta\(\) at \S*test_errors.py:\d+: lam = np.random"),
                                         ("by name", r"random's global generator \(a function imported by name"),
                                         ("held", r"the random generator model.rng\. ")],
                         ids=["random", "numpy", "by-name", "held"])
def test_python_or_numpy_random_in_the_step_is_refused_naming_it(draw, named):
    """The trace ran the draw once: the compiled step trained with the first step's number at every step (the
    losses left eager's from the second step on), silently; transformers' wav2vec2 with mask_time_prob > 0 so."""
    torch.manual_seed(0)
    model = HostRandomDepth(draw)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3, loss_fn=F.cross_entropy)
    with pytest.raises(zerocc.CaptureError, match=rf"(?s)depends on them: {named}.*constants of the compiled program.*torch.rand"):
        step(torch.randn(4, 4), torch.tensor([0, 1, 2, 0]))
    assert getattr(random.random, "__self__", None) is random._inst   # the generators are put back
    assert getattr(np.random.beta, "__self__", None) is np.random.mtrand._rand
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("draw", ["torch", "compared with 0", "reseeded"])
def test_random_numbers_the_program_does_not_depend_on_train_like_eager(draw):
    """torch's generator (the way out the refusal names), drawn by the program at every step; Python's or NumPy's
    where traces from other draws give the same program."""
    torch.manual_seed(0)
    model = HostRandomDepth(draw)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3, loss_fn=F.cross_entropy)
    generator = torch.Generator().manual_seed(1)
    for seed in range(3):
        x, y = torch.randn(4, 4, generator=generator), torch.randint(0, 3, (4,), generator=generator)
        torch.manual_seed(seed)
        optimizer.zero_grad()
        expected = F.cross_entropy(reference(x), y)
        expected.backward()
        optimizer.step()
        torch.manual_seed(seed)
        assert torch.equal(step(x, y), expected.detach())
    full = step.full_state_dict()
    assert all(torch.equal(full[k], v) for k, v in reference.state_dict().items())


def test_stack_traces_while_tracing_are_torchs_without_its_costs(monkeypatch):
    """make_fx leaves torch's own frames out of a node's stack trace with ``uninteresting_files()``, whose first call
    imports torch.export and AOTAutograd (a third of a second of a first step); while zerocc traces, the files of
    those modules already loaded stand for the set, and the stack is read from the live frames, not symbolized
    frame by frame for every node. The traces (the user lines errors and printed graphs name) and the recorded
    source files must be what torch's own path gives."""
    from torch.fx.experimental import symbolic_shapes

    from zerocc import tracing

    model = MLP()

    def step(x):
        return F.gelu(model(x)).sum()

    def trace():
        fake_mode = tracing.make_fake_mode()
        gm, _ = tracing.trace_functional(step, (torch.randn(4, 12),), fake_mode)
        return [n.stack_trace for n in gm.graph.nodes], gm.meta["zerocc_source_files"]

    tracing._REAL_UNINTERESTING_FILES.cache_clear()
    loaded = trace()
    assert tracing._REAL_UNINTERESTING_FILES.cache_info().currsize == 0   # torch's set was not computed
    assert symbolic_shapes.uninteresting_files is tracing._REAL_UNINTERESTING_FILES   # and is torch's again
    tracing._REAL_UNINTERESTING_FILES()
    assert trace() == loaded
    monkeypatch.setattr(tracing, "LIVE_STACKS", False)   # torch's CapturedTraceback, a FrameSummary per frame
    assert trace() == loaded
    traces = [trace for trace in loaded[0] if trace]
    assert any("tests/models.py" in trace for trace in traces)   # MLP.forward's lines
    assert not any("_symbolic_trace.py" in trace for trace in traces)   # torch's module-call wrapper, left out


def test_a_whole_compile_leaves_torchs_uninteresting_files_uncomputed():
    """The ShapeEnv also calls ``uninteresting_files()``, for the source location of each ``.item()`` read
    (Adam's step count, in the optimizer's trace and its functionalizing replay): there too the loaded modules
    stand for the set, so a first step does not import torch.export, AOTAutograd and networkx. Training is
    eager's, bit for bit."""
    from zerocc import tracing

    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    tracing._REAL_UNINTERESTING_FILES.cache_clear()
    step = zerocc.compile(model, optimizer, stage=3, loss_fn=F.mse_loss)
    for batch in batches("mlp", 2, 4):
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, F.mse_loss, batch))
    assert tracing._REAL_UNINTERESTING_FILES.cache_info().currsize == 0
    full = step.full_state_dict()
    assert all(torch.equal(full[k], v) for k, v in reference.state_dict().items())


@pytest.mark.parametrize("keyword, value, message", [
    ("bucket_bytes", True, r"bucket_bytes must be a positive int, got True"),
    ("prefetch_bytes", True, r"prefetch_bytes must be a non-negative int, got True"),
    ("timeout", True, r"timeout must be a positive number of seconds, got True"),
    ("static_shapes", "no", r"static_shapes must be True or False, got 'no'"),
    ("verify", "yes", r"verify must be True or False, got 'yes'"),
    ("num_targets", -1, r"num_targets must be a non-negative int .* got -1"),
    ("num_targets", "1", r"num_targets must be a non-negative int .* got '1'"),
    ("loss_fn", "mse", r"loss_fn must be callable .* got 'mse'"),
    ("group", "gloo", r"group must be a torch.distributed.ProcessGroup .* got 'gloo'"),
    ("disable", None, r"disable must be a list of pass names \(step.passes lists them\), got None"),
    ("disable", "shard", r"disable must be a list of pass names .* got 'shard'; write disable=\['shard'\]"),
    ("timeout", float("inf"), r"timeout=inf is beyond what a process group can wait; leave it None"),
])
def test_a_keyword_of_the_wrong_type_is_refused_at_compile_and_changes_nothing(keyword, value, message):
    """These were taken as given: static_shapes="no" read as True, bucket_bytes=True as 1-byte buckets, a
    loss_fn that is no function or a group that is a backend's name failed at the first call with Python's own
    TypeError or AttributeError, disable=None with a TypeError, timeout=inf with an OverflowError across ranks.
    A correct compile afterwards trains as eager does."""
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    options = {"loss_fn": F.mse_loss, keyword: value}
    with pytest.raises(zerocc.ConfigError, match=message):
        zerocc.compile(model, optimizer, stage=3, **options)
    eager_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1)
    step = zerocc.compile(model, optimizer, stage=3, loss_fn=F.mse_loss)
    for batch in batches("mlp", 2, 4):
        assert torch.equal(step(*batch), eager_step(reference, eager_optimizer, F.mse_loss, batch))
    step.close()
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


@pytest.mark.parametrize("keyword", ["dump_dir", "cache_dir"])
def test_a_folder_keyword_naming_a_file_is_refused_at_compile(keyword, tmp_path):
    """dump_dir=<a file> raised FileExistsError at the first call; cache_dir=<a file> only warned at each store."""
    file = tmp_path / "not-a-folder"
    file.write_text("")
    model = MLP()
    with pytest.raises(zerocc.ConfigError, match=rf"{keyword}=.*not-a-folder' is a file, not a folder"):
        zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.mse_loss, **{keyword: file})


def test_a_model_without_parameters_is_refused_at_compile():
    """It raised a bare StopIteration from zerocc.compile."""
    with pytest.raises(zerocc.ConfigError, match=r"the model \(ReLU\) has no parameters"):
        zerocc.compile(nn.ReLU(), torch.optim.SGD(MLP().parameters(), lr=0.1))


@pytest.mark.parametrize("listing", ["twice in a group", "in two groups"])
def test_an_optimizer_listing_a_parameter_twice_is_refused(listing):
    """Eager SGD updates a parameter listed twice twice (torch only warns); the step's buckets hold it once, so it
    trained otherwise than eager without a word."""
    model = MLP()
    params = list(model.parameters())
    with pytest.warns(UserWarning) if listing == "twice in a group" else contextlib.nullcontext():
        optimizer = torch.optim.SGD(params + [params[0]] if listing == "twice in a group" else params, lr=0.1)
    if listing == "in two groups":   # add_param_group refuses this; a hand-built group does not
        optimizer.param_groups.append({**optimizer.param_groups[0], "params": [params[0]]})
    step = zerocc.compile(model, optimizer, stage=3, loss_fn=F.mse_loss)
    groups = "0, 0" if listing == "twice in a group" else "0, 1"
    with pytest.raises(zerocc.ConfigError, match=rf"the optimizer lists a tensor more than once \({model_name(model, params[0])} "
                                                 rf"in param group\(s\) \[{groups}\]\)"):
        step(*batches("mlp", 1, 4)[0])


def model_name(model, tensor):
    return next(name for name, param in model.named_parameters() if param is tensor).replace(".", r"\.")


def test_an_empty_batch_says_so():
    """A batch of 0 rows failed with 'ZeroDivisionError: float division by zero' and no hint of why."""
    model = MLP()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.mse_loss)
    x, y = batches("mlp", 1, 4)[0]
    with pytest.raises(zerocc.CaptureError, match=r"this batch has empty tensors \(argument 0 \(0, \d+\), argument 1 "
                                                  r"\(0, \d+\)\).*skip empty batches"):
        step(x[:0], y[:0])


@pytest.mark.parametrize("embedding", [nn.Embedding(10, 4, max_norm=1.0), nn.EmbeddingBag(10, 4, max_norm=1.0)],
                         ids=["Embedding", "EmbeddingBag"])
def test_an_embedding_with_max_norm_is_refused_naming_it_and_the_line(embedding):
    """max_norm rescales the weight's looked-up rows in place in forward (embedding_renorm_), which the program,
    over sharded parameters that only the optimizer updates, would lose."""
    class Lookup(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding, self.head = embedding, nn.Linear(4, 1)

        def forward(self, tokens, target):
            return F.mse_loss(self.head(self.embedding(tokens)).squeeze(-1), target)

    model = Lookup()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3)
    with pytest.raises(zerocc.CaptureError, match=r"(?s)parameter 'embedding.weight' by embedding_renorm_ at "
                                                  r".*test_errors.py:\d+: return F.mse_loss\(self.head\(self.embedding"
                                                  r".*max_norm=.*fix: build the embedding with max_norm=None"):
        step(torch.tensor([[1, 2], [3, 4]]), torch.zeros(2) if isinstance(embedding, nn.EmbeddingBag)
             else torch.zeros(2, 2))


class _CurvaturePenalty(nn.Module):
    """A penalty on each sample's Hessian of the output in its input: ``vmap(hessian(f))``."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x, y):
        curvature = torch.func.vmap(torch.func.hessian(lambda row: self.net(row).sum()))(x)   # the line
        return F.mse_loss(self.net(x), y) + 0.01 * curvature.square().mean()


def test_a_backward_formula_failing_while_tracing_names_the_forward_line_it_differentiates():
    """torch 2.13's fake tensors put one tensor of ``vmap(jacfwd(jacrev(f)))`` (``hessian``) on the meta device, and
    the step's backward fails on it inside autograd's engine, where no frame of the user's is on the stack: the
    error named no line ("(no user frame found)"). The step is traced again under anomaly detection, which
    reports the forward line of the node whose backward failed."""
    model = _CurvaturePenalty()
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters()), stage=3)
    with pytest.raises(zerocc.CaptureError, match=r"tracing the training step failed at .*test_errors\.py:\d+: "
                                                  r"curvature = torch\.func\.vmap\(torch\.func\.hessian.*"
                                                  r"\(the backward of its \w+Backward\d\)"):
        step(torch.randn(8, 3), torch.randn(8, 1))


class _MatchedOnTheHost(nn.Module):
    """A Hungarian-style matcher as DETR's loss runs it: the cost matrix's values to NumPy, an assignment there."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, target):
        cost = torch.cdist(self.linear(x), target)
        order = torch.as_tensor(cost.detach().numpy().argmin(1))   # scipy's linear_sum_assignment does this
        return F.mse_loss(self.linear(x), target[order])


def test_values_taken_to_numpy_in_the_step_say_why_and_to_match_outside_the_step():
    """It failed with torch's bare 'RuntimeError: .numpy() is not supported for tensor subclasses.'"""
    model = _MatchedOnTheHost()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3)
    with pytest.raises(zerocc.CaptureError, match=r"(?s)tracing the training step failed at .*test_errors.py:\d+: "
                                                  r"order = torch.as_tensor.*why: a tensor's values were taken to the "
                                                  r"host as a NumPy array.*fix: .*pass the matched indices"):
        step(torch.randn(5, 4), torch.randn(5, 4))
