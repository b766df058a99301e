"""Capture: one whole training step -> one functional aten FX graph.

First stage of the pipeline (see ``zerocc/pipeline.py``). The graph computes

    loss, new params, new buffers, new optimizer state
        = step(params, frozen params, buffers, optimizer state, learning rates, inputs)

and every placeholder is tagged with its role (``graph.ROLE``), every node
with its phase (``graph.PHASE``): forward, backward or optimizer. Gradient
nodes carry ``graph.GRAD_OF`` (the indices of their parameters). Python control flow
is specialized on the example batch; what cannot be traced fails here with
the user's source line. Branches on batch values are decided on the real
batch and kept as guards (``zerocc/data_guards.py``); the user's dispatch
modes and global hooks sit out the trace (``zerocc/user_tooling.py``); and
tracing leaves every real tensor of the model as it found it (a tensor
attribute that forward writes in place is refused: it must be a buffer).
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import inspect
import re
import time
import traceback
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.nn.utils.stateless import _reparametrize_module
import torch.nn as nn
from torch._subclasses.fake_tensor import DynamicOutputShapeException, DataDependentOutputException
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from . import compile_stats
from . import graph as g
from . import decisions
from . import optimizer_init
from . import stamping
from .compile_stats import CompileStats
from .autocast import autocast_as, autocast_state, outside_autocast
from .batch import BatchLayout
from .data_guards import DataGuard, GuardRecorder, recording
from .errors import (CaptureError, ConfigError, ZeroccError, defined_at, innermost_frame, is_users,
                     raised_by_user_code, user_frame, user_line_of_node)
from .optimizer_step import REPLICATE_IF_ELEMENTWISE, check_elementwise, check_state_shapes, splice_update
from . import precision as mixed
from .host_random import EXTREMES, HostDraws, same_program
from .model_recomputation import generators_reached, traced_recomputation
from .tracing import (fakeify, module_conversions_as_eager, no_traced_values_left, reassigned_state_read,
                      record_source_lines_of, trace_functional)
from .sync_batch_norm import synchronized_batch_norm_traceable
from .user_tooling import suspended_user_tooling



@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One parameter or buffer of the model, by every name it has (tied weights have several)."""
    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    group: int = -1          # optimizer param group, -1 if not trained

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclasses.dataclass
class Captured:
    """The captured graph and what its placeholders and outputs mean."""
    gm: fx.GraphModule
    params: list[TensorInfo]            # trained parameters (ROLE_PARAM placeholders, in order)
    frozen: list[TensorInfo]            # parameters not trained in this step
    buffers: list[TensorInfo]
    state_keys: list[tuple[str, ...]]   # per trained param: its optimizer-state tensors, in placeholder order
    num_groups: int
    num_inputs: int
    # output layout: [loss, *new params, *new buffers, *new states (flattened in state_keys order)]
    new_state_keys: list[tuple[str, ...]] = dataclasses.field(default_factory=list)
    guards: tuple[DataGuard, ...] = ()  # branches decided on the batch's values, re-checked before every step
    stats: CompileStats = dataclasses.field(default_factory=lambda: CompileStats("capture"))   # seconds per part
    written_buffers: tuple[str, ...] = ()   # buffers the step writes (BatchNorm's running statistics), by name


def named_tensors(model: nn.Module, kind: str) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    """(names, tensor) for each distinct parameter or buffer; tied tensors keep all their names."""
    getter = model.named_parameters if kind == "param" else model.named_buffers
    by_id: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in getter(remove_duplicate=False):
        by_id.setdefault(id(tensor), ([], tensor))[0].append(name)
    return [(tuple(names), tensor) for names, tensor in by_id.values()]


def state_dict_names(model: nn.Module, named=None) -> dict[str, str]:
    """Each key of ``model.state_dict()`` that holds a parameter or buffer, with that tensor's first name in the module
    (``named``: ``named_tensors``' pairs, by default of both kinds now).

    The two differ where a state-dict hook renames keys: ``checkpoint_wrapper`` (``apply_activation_checkpointing``)
    takes ``_checkpoint_wrapped_module.`` out of its blocks' keys, and ``step.full_state_dict()``, which looked the
    keys up as names, left those blocks out (``model.state_dict()`` at stage 3 gave their empty placeholders). Matched
    by identity (``keep_vars=True``): callers inside the step read it with ``StepState.reading_keys_only``."""
    if named is None:
        named = [*named_tensors(model, "param"), *named_tensors(model, "buffer")]
    first = {id(tensor): names[0] for names, tensor in named}
    return {key: first[id(value)] for key, value in model.state_dict(keep_vars=True).items() if id(value) in first}


def parameter_layouts(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The strides of the parameters laid out otherwise than contiguously (``model.to(memory_format=
    torch.channels_last)``), by name: what ``capture(parameter_layouts=...)`` reads them in."""
    return {name: tuple(param.stride()) for name, param in model.named_parameters()
            if not param.is_contiguous() and is_non_overlapping_and_dense_or_false(param)}


def laid_out(value: torch.Tensor, stride: tuple[int, ...] | None) -> torch.Tensor:
    """``value`` with ``stride`` (a copy, differentiable), or ``value`` itself where ``stride`` is None.

    The step keeps a parameter in a flat bucket and reads it as a contiguous view; eager's kernels read the
    parameter's own strides: a convolution whose weight is channels-last computes in channels-last (and rounds
    otherwise) even on a contiguous input. The copy gives the program's ops the strides eager's see.
    """
    if stride is None:
        return value
    return torch.empty_strided(value.shape, stride, dtype=value.dtype, device=value.device).copy_(value)


def extract_loss(output: Any, targets: Sequence[Any], loss_fn: Callable | None) -> torch.Tensor:
    """The scalar loss: ``loss_fn(output, *targets)``, the output itself, or its ``loss`` entry."""
    if loss_fn is not None:
        loss = loss_fn(output, *targets)
        if _one_number(loss):
            return loss
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        items = loss.values() if isinstance(loss, dict) else loss if isinstance(loss, (tuple, list)) else ()
        hint = ("; the step returns the loss alone: return it alone, and compute metrics with metrics_fn= (given "
                "to zerocc.compile, called as metrics_fn(output, *arguments): they are then in step.last_metrics)"
                if any(isinstance(i, torch.Tensor) and i.dim() == 0 for i in items) else "; reduce it (e.g. with .mean())")
        raise CaptureError(f"loss_fn ({_defined_at(loss_fn)}) returned {got}, not a scalar tensor{hint}")
    if isinstance(output, dict) and "loss" in output:
        output = output["loss"]
    elif not isinstance(output, torch.Tensor) and isinstance(getattr(output, "loss", None), torch.Tensor):
        output = output.loss
    if _one_number(output):
        return output
    got = f"a tensor of shape {tuple(output.shape)}" if isinstance(output, torch.Tensor) else type(output).__name__
    scalars = [i for i, item in enumerate(output) if isinstance(item, torch.Tensor) and item.dim() == 0] \
        if isinstance(output, (tuple, list)) else []
    hint = (f" (its item {scalars[0]} is a scalar: if that is the loss, as in a Hugging Face model's "
            f"return_dict=False output, pass loss_fn=lambda output: output[{scalars[0]}], num_targets=0, and metrics_fn= to "
            "read its other items, such as the logits, in step.last_metrics)") if scalars else ""
    raise CaptureError(
        f"the model returned {got}, not a scalar loss or an object with a scalar 'loss' entry{hint}; "
        "pass loss_fn=... to zerocc.compile (it is called as loss_fn(output, *targets), the targets being the "
        "last num_targets arguments of the step)"
    )


METRIC_PREFIX = "metric:output:"   # the runtime slot of each value ``metrics_fn`` returned, by its name (step.last_metrics)


def metrics_of(metrics_fn: Callable, output: Any, arguments: tuple[list, dict]) -> dict[str, torch.Tensor]:
    """What ``metrics_fn(output, *positional, **keywords)`` returns on one micro-batch: a dict of tensors by name.

    Not copied (logits can be the size of the step's peak): a program output is alive to the end of its step in
    the lifetimes (``analysis/lifetimes.py``: "updated state", the persistent pool, never an arena), so no op of
    this step writes into it in place and no later step reuses its memory; a kept list of accuracies or logits
    stays as it was read. A value that is not a tensor would be the traced batch's, frozen into the program:
    refused, naming ``metrics_fn``.
    """
    from .options import called_function   # options imports the passes, which import this module
    positional, keywords = arguments
    try:   # a call that does not bind is the metrics function's signature, not the model's: say so
        inspect.signature(called_function(metrics_fn)).bind(output, *positional, **keywords)
    except TypeError as error:
        shown = ", ".join(["output", *(f"arg{i}" for i in range(len(positional))), *keywords])
        raise CaptureError(f"metrics_fn ({_defined_at(metrics_fn)}) cannot be called as metrics_fn({shown}), with the "
                           f"model's output and the step's arguments: {error}\n  fix: take them all (e.g. "
                           "def metrics_fn(output, *args, **kwargs))") from None
    except ValueError:   # a builtin without a signature: called as it is
        pass
    metrics = metrics_fn(output, *positional, **keywords)
    if not isinstance(metrics, dict) or not all(isinstance(k, str) for k in metrics):
        raise CaptureError(f"metrics_fn ({_defined_at(metrics_fn)}) returned {type(metrics).__name__}, not a dict of "
                           "tensors by name (e.g. {'accuracy': (output.argmax(-1) == y).float().mean()})")
    wrong = [name for name, value in metrics.items() if not isinstance(value, torch.Tensor)]
    if wrong:
        raise CaptureError(
            f"metrics_fn ({_defined_at(metrics_fn)}) returned {', '.join(f'{n!r} ({type(metrics[n]).__name__})' for n in wrong)}"
            ", not a tensor: a Python number computed while tracing would be the first batch's value in every step; "
            "return the tensor (the step's values are read with step.last_metrics[name].item())")
    return {name: value.detach() for name, value in metrics.items()}


def stacked_metrics(per_micro_batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One tensor per name: the micro-batch's value, or with grad_accumulation K the K values stacked along a new
    first dimension, in order (what an eager loop over the micro-batches would collect; ``.mean(0)`` of a mean
    over equal micro-batches is the batch's mean, ``.flatten(0, 1)`` of per-sample values the batch's)."""
    if len(per_micro_batch) <= 1:
        return per_micro_batch[0] if per_micro_batch else {}
    return {name: torch.stack([metrics[name] for metrics in per_micro_batch]) for name in per_micro_batch[0]}


def _split_hint(error: Exception, num_model_inputs: int, num_targets: int, model: nn.Module) -> str:
    """For a call given the wrong arguments: how the step split its positional arguments, or, for a keyword the
    model's forward does not take, that every keyword goes to the model."""
    if not (isinstance(error, TypeError) and "argument" in str(error)):
        return ""
    if "unexpected keyword argument" in str(error):
        return (f" (the step passes every keyword of its call to the model, whose forward is at "
                f"{_defined_at(type(model).forward)}, as eager's model(**batch) does: leave out of the call the keys "
                "it does not take, such as a data collator's extra columns)")
    return (f" (the step passed its first {num_model_inputs} positional argument(s) to the model and the last "
            f"{num_targets} to loss_fn as targets: give compile num_targets= to split them otherwise)")


def _empty_hint(inputs: Sequence[Any]) -> str:
    """For a batch with an empty tensor (0 rows): a mean over it divides by zero while tracing, as eager's gives NaN."""
    empty = [f"argument {i} {tuple(leaf.shape)}" for i, argument in enumerate(inputs)
             for leaf in pytree.tree_leaves(argument) if isinstance(leaf, torch.Tensor) and leaf.numel() == 0]
    if not empty:
        return ""
    return (f"\n  note: this batch has empty tensors ({', '.join(empty)}): a loss averaged over no elements is not a "
            "number (eager's is NaN); skip empty batches in the loop")


def _one_number(loss: Any) -> bool:
    """A loss eager's ``loss.backward()`` takes: a tensor of one element (0-dim, or shaped ``(1,)`` as some
    models return it); the step returns it in its own shape."""
    return isinstance(loss, torch.Tensor) and loss.numel() == 1


def _defined_at(function: Callable) -> str:
    """Where ``function`` is defined, as file:line (its name when Python does not say)."""
    return defined_at(function) or getattr(function, "__qualname__", type(function).__name__)


def check_micro_batches(inputs: Sequence[Any], count: int, layout: BatchLayout) -> None:
    """Every batch tensor (one dimension or more) must split into ``count`` equal micro-batches along dim 0."""
    if count == 1:
        return
    bad = [f"{layout.name_of(i)} has {t.shape[0]} rows" for i, t in enumerate(inputs)
           if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] % count]
    if bad:
        raise ConfigError(f"grad_accumulation={count} does not divide the batch along dim 0: {', '.join(bad)}; "
                          f"use a batch whose size is a multiple of {count} (every micro-batch is the same size; an epoch's "
                          "short last batch: DataLoader(..., drop_last=True), or skip it in the loop)")


def micro_batches(batch: Sequence[Any], count: int) -> list[list[Any]]:
    """``count`` micro-batches: each tensor with a dim 0 split in equal consecutive parts, the rest shared."""
    if count == 1:
        return [list(batch)]
    parts = [t.chunk(count) if isinstance(t, torch.Tensor) and t.dim() > 0 else [t] * count for t in batch]
    return [list(micro) for micro in zip(*parts)]


def capture(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: Sequence[Any], **options) -> Captured:
    """``trace_step`` without the user's dispatch modes and global hooks (``zerocc/user_tooling.py``).

    ``autocast`` is the caller's ``torch.autocast`` state (``zerocc/autocast.py``; the current one when not
    given): the model and the loss are traced under it, everything else outside it.
    """
    autocast = options.pop("autocast", None)
    autocast = autocast_state() if autocast is None else autocast
    with suspended_user_tooling(), outside_autocast():
        optimizer_init.refuse_python_state(optimizer, trained_parameters(model, optimizer))
        try:
            return trace_step(model, optimizer, inputs, autocast=autocast, stamp=stamping.enabled(), **options)
        except stamping.NotStampable as why:   # the trace's guards, draws and symbols start again from nothing
            stamping.LAST[0].refused = str(why)
            return trace_step(model, optimizer, inputs, autocast=autocast, stamp=False, **options)


def _group_of_id(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """Each optimized tensor's param group, by ``id``; refuses tensors that are not the model's parameters."""
    group_of_id, twice = {}, {}
    for index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) in group_of_id:
                twice.setdefault(id(p), [group_of_id[id(p)]]).append(index)
            group_of_id[id(p)] = index
    name_of_id = {id(t): names[0] for names, t in named_tensors(model, "param")}
    if twice:   # eager updates such a tensor once per listing; the step's buckets hold each parameter once
        listed = "; ".join(f"{name_of_id.get(i, 'a tensor not in the model')} in param group(s) {groups}"
                           for i, groups in twice.items())
        raise ConfigError(
            f"the optimizer lists a tensor more than once ({listed}): eager PyTorch then applies its update once per "
            "listing (and warns that this will become an error); give every parameter to the optimizer once, "
            "e.g. torch.optim.AdamW(model.parameters())")
    model_ids = set(name_of_id)
    strays = [i for i, group in enumerate(optimizer.param_groups) for p in group["params"] if id(p) not in model_ids]
    if strays:
        raise ConfigError(
            f"the optimizer holds {len(strays)} tensor(s) that are not parameters of the model "
            f"(in param group(s) {sorted(set(strays))}); build the optimizer from model.parameters()"
        )
    return group_of_id


def trained_parameters(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor, int]]:
    """(name, tensor, param group) of every parameter the step trains, in the order capture labels them."""
    group_of_id = _group_of_id(model, optimizer)
    return [(names[0], t, group_of_id[id(t)]) for names, t in named_tensors(model, "param")
            if t.requires_grad and id(t) in group_of_id]


def _memory_span(tensor: torch.Tensor) -> tuple[int, int, int] | None:
    """(storage address, first byte, end byte) of the memory ``tensor`` reads; None for no memory (empty, meta, fake,
    a stage-3 parameter the step released)."""
    if tensor.numel() == 0 or tensor.device.type == "meta" or isinstance(tensor, torch._subclasses.FakeTensor):
        return None
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return None
    reach = sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))
    first = tensor.storage_offset() - sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride())
                                          if stride < 0)
    return storage.data_ptr(), first * tensor.element_size(), (first + reach + 1) * tensor.element_size()


def reassigned_buffers(buffer_infos, buffers, tensors: dict) -> list:
    """The buffers after one micro-batch's forward, a buffer forward reassigned (``self.center = self.center * m +
    c * (1 - m)``, DINO's loss; eager's ``Module.__setattr__`` puts the new tensor in ``_buffers``) as its new value.

    ``_reparametrize_module`` writes what the module holds on leaving it back into ``tensors``: without reading it
    there, the step returned the buffer it was given and the new value was silently dropped at every step. The
    program's buffer slot keeps its shape and dtype, so a new value of another is refused.
    """
    new = list(buffers)
    for position, info in enumerate(buffer_infos):
        value = tensors.get(info.name, new[position])
        if value is new[position]:
            continue
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(info.shape) or value.dtype != info.dtype:
            found = (f"a {type(value).__name__}" if not isinstance(value, torch.Tensor)
                     else f"shape {tuple(value.shape)}, {value.dtype}")
            raise ConfigError(
                f"forward assigns buffer {info.name!r} a new value of {found}; it was registered with shape "
                f"{tuple(info.shape)}, {info.dtype}\n"
                "  why: the compiled step carries each buffer from one step to the next in a slot of its registered shape "
                "and dtype\n"
                "  fix: assign a tensor of the buffer's shape and dtype (e.g. .to(self.buffer.dtype)), or write into it in "
                "place (self.buffer.copy_(new))")
        new[position] = value.detach()
    return new


def refuse_shared_memory(params: Sequence, buffers: Sequence, trained_ids: set[int]) -> None:
    """Refuse a trained parameter whose memory another parameter or buffer of the model also reads.

    ``nn.Parameter(tensor)`` keeps ``tensor``'s memory: ``self.head.weight = nn.Parameter(self.embed.weight)`` (or its
    ``.t()``) makes two parameters over one memory, and a buffer registered as ``weight.data`` is a third name for it.
    Eager's optimizer updates that memory through each of them in turn, and every other one sees the update; the step
    keeps each trained parameter in its own slot, so it would train them apart. Tied weights (one Parameter object
    under two names) and parameters that are disjoint views of one flat tensor are fine."""
    spans = []
    for kind, named in (("parameter", params), ("buffer", buffers)):
        for names, tensor in named:
            span = _memory_span(tensor)
            if span is not None:
                spans.append((span, kind, names[0], id(tensor) in trained_ids))
    spans.sort(key=lambda entry: entry[0])
    shared, reaching = [], None    # reaching: the entry reaching furthest so far in the current storage
    for entry in spans:
        (storage, first, end), _, _, _ = entry
        if reaching is not None and reaching[0][0] == storage and first < reaching[0][2]:
            if entry[3] or reaching[3]:
                shared.append((reaching, entry))
            if end <= reaching[0][2]:
                continue
        reaching = entry
    if shared:
        pairs = "; ".join(f"{a[1]} {a[2]!r} and {b[1]} {b[2]!r}" for a, b in shared)
        raise ConfigError(
            f"the model has tensors that share memory without being one tensor: {pairs}. nn.Parameter(tensor) keeps "
            "tensor's memory (self.head.weight = nn.Parameter(self.embed.weight), or of its .t()), as does a buffer "
            "registered as a parameter's .data: eager's optimizer then updates that memory through each of them and "
            "every one sees the others' updates, where the step keeps each trained parameter apart. To tie weights, "
            "assign the same Parameter (self.head.weight = self.embed.weight; for a transpose, use "
            "F.linear(x, self.embed.weight.t()) in forward); to copy one, nn.Parameter(tensor.detach().clone())")


def _in_backward(error: BaseException) -> bool:
    """Whether ``error`` was raised inside autograd's engine: by a backward formula of the step's differentiation."""
    return any(frame.name == "_engine_run_backward" for frame in traceback.extract_tb(error.__traceback__))


_ANOMALY_REPORT = re.compile(r"Error detected in (\w+)\. Traceback of forward call that caused the error:\n(.*)", re.S)


def _forward_line_of_failed_backward(trace_again: Callable[[], Any]) -> str | None:
    """Where the forward op is whose backward failed, as 'file:line: code (its backward: NameBackward0)': the step
    traced again under autograd's anomaly detection, which reports the forward stack of the node that raised
    (a backward formula of PyTorch's has no frame of the user's on the stack when it fails)."""
    with warnings.catch_warnings(record=True) as caught, torch.autograd.set_detect_anomaly(True, check_nan=False):
        warnings.simplefilter("always")
        try:
            trace_again()
        except Exception:
            pass
    for warning in caught:
        found = _ANOMALY_REPORT.search(str(warning.message))
        if found is None:
            continue
        frames = [traceback.FrameSummary(filename, int(line), "")
                  for filename, line in re.findall(r'File "([^"]+)", line (\d+)', found.group(2))]
        line = innermost_frame(frames, is_users)
        return None if line is None else f"{line} (the backward of its {found.group(1)})"
    return None


def _fake_value_hint(error: BaseException) -> str:
    """Why a tensor used as a Python number fails while tracing, and the way out (PackedSequence: pad instead)."""
    if ".numpy() is not supported for tensor subclasses" in str(error):
        return ("\n  why: a tensor's values were taken to the host as a NumPy array (.numpy(); scipy's "
                "linear_sum_assignment in a Hungarian matcher such as DETR's loss does so); zerocc traces the step on "
                "fake tensors, which hold no values, and one program cannot run host code on the values it computes"
                "\n  fix: compute it with tensor ops, or outside the step: e.g. match on the outputs of a no_grad "
                "forward in the training loop and pass the matched indices to the step as tensors of the batch")
    if "FakeTensor" not in str(error):
        return ""
    hint = ("\n  why: a tensor's value was used where PyTorch needs a Python number (a size, an index); zerocc traces "
            "the step on fake tensors, which hold no values")
    tb = error.__traceback__
    while tb is not None:
        if any(isinstance(value, torch.nn.utils.rnn.PackedSequence) for value in tb.tb_frame.f_locals.values()):
            return hint + (" (a PackedSequence's batch_sizes, computed from the lengths, give the RNN's sizes)"
                           "\n  fix: run the RNN on the padded batch (no pack_padded_sequence) and mask or gather "
                           "the padded positions, e.g. the last hidden state at index lengths - 1")
        tb = tb.tb_next
    return hint + "\n  fix: compute that number outside the step and pass it as a Python int, or keep it a tensor"


def _gradient_hooks_of(trained) -> list[list]:
    """Each trained parameter's ``register_hook`` functions, in order: they are traced into the step on its gradient.

    ``register_post_accumulate_grad_hook`` runs after ``.grad`` is accumulated, which the step never does
    (optimizer-in-backward): refused, naming the parameter.
    """
    after_accumulation = [names[0] for names, tensor in trained if getattr(tensor, "_post_accumulate_grad_hooks", None)]
    if after_accumulation:
        raise CaptureError(
            f"parameter(s) {', '.join(repr(n) for n in after_accumulation)} have a post-accumulate-grad hook "
            "(register_post_accumulate_grad_hook): the compiled step never accumulates .grad, so it would not run. "
            "Remove it: zerocc's step runs the optimizer itself, after backward (hooks registered with "
            "register_hook, on the gradient, are traced into the step)")
    return [list((getattr(tensor, "_backward_hooks", None) or {}).values()) for _, tensor in trained]


def trace_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: Sequence[Any],
    *,
    loss_fn: Callable | None,
    num_targets: int,
    fake_mode,
    optimizer_state: Sequence[dict[str, torch.Tensor]] | None = None,
    check_update_elementwise: bool = True,
    parameter_shapes: dict[str, tuple[int, ...]] | None = None,
    parameter_layouts: dict[str, tuple[int, ...]] | None = None,
    grad_accumulation: int = 1,
    precision: mixed.Precision | None = None,
    autocast: tuple = (),
    layout: BatchLayout | None = None,
    metrics_fn: Callable | None = None,
    drop_state_of_unused: bool = False,
    stamp: bool = False,
) -> Captured:
    """Trace one training step of ``model`` and ``optimizer`` on ``inputs``.

    ``inputs`` is the flat batch (``zerocc/batch.py``): its first
    ``layout.positional`` entries are positional arguments (the last
    ``num_targets`` of them the loss's targets), the rest the model's keyword
    arguments named by ``layout.keywords``; without ``layout``, all positional.

    ``parameter_shapes`` gives the true shapes of parameters whose storage the
    runtime released (stage 3). ``parameter_layouts`` gives the strides of parameters the user's model lays
    out otherwise than contiguously (``parameter_layouts(model)`` before the step took them over): forward and
    backward read them in those strides, as eager does. ``optimizer_state`` gives, per trained parameter, the state tensors to trace
    with (defaults to ``optimizer.state``); empty dicts mean "first step": the
    optimizer initializes its state inside the graph the way it always does.
    ``grad_accumulation`` (K) splits every batch tensor along dim 0 into K
    micro-batches, each run forward and backward before the next (so only one
    micro-batch's activations are alive), as eager code does with
    ``(loss / K).backward()`` per micro-batch: gradients are summed in order,
    the loss is the sum of the K scaled losses, and the optimizer runs once.
    ``precision`` (``zerocc/precision.py``) traces forward and backward in its
    ``param_dtype`` and, with loss scaling, adds the scale as a placeholder.
    ``metrics_fn`` (``metrics_of``) adds what it returns on each micro-batch as outputs, each replacing a
    ``METRIC_PREFIX`` slot. ``drop_state_of_unused`` leaves out the ``optimizer_state`` of the parameters the loss
    turns out not to reach (``_drop_state_of_unused``): the state the step makes before the first step, which eager
    makes for a parameter only once it has a gradient. ``stamp`` traces the first call of each kind of look-alike
    block and copies it for the others (zerocc/stamping.py; ``NotStampable`` where it cannot be exact).
    """
    params_all = named_tensors(model, "param")
    buffers_all = named_tensors(model, "buffer")
    group_of_id = _group_of_id(model, optimizer)
    trained = [(names, t) for names, t in params_all if t.requires_grad and id(t) in group_of_id]
    frozen = [(names, t) for names, t in params_all if not (t.requires_grad and id(t) in group_of_id)]
    if not trained:
        raise ConfigError("the model has no parameter that both requires grad and is in the optimizer")
    refuse_shared_memory(params_all, buffers_all, {id(t) for _, t in trained})
    gradient_hooks = _gradient_hooks_of(trained)
    parameter_shapes = parameter_shapes or {}
    parameter_layouts = parameter_layouts or {}

    def shape_of(names, tensor):
        return tuple(parameter_shapes.get(names[0], tensor.shape))

    param_infos = [TensorInfo(n, shape_of(n, t), t.dtype, group_of_id[id(t)]) for n, t in trained]
    frozen_infos = [TensorInfo(n, shape_of(n, t), t.dtype) for n, t in frozen]
    buffer_infos = [TensorInfo(n, tuple(t.shape), t.dtype) for n, t in buffers_all]

    if optimizer_state is None:
        optimizer_state = [
            {k: v for k, v in sorted(optimizer.state.get(t, {}).items()) if isinstance(v, torch.Tensor)}
            for _, t in trained
        ]
    # states are traced in sorted key order, the order their placeholders are labelled in
    optimizer_state = [dict(sorted(s.items())) for s in optimizer_state]
    state_keys = [tuple(s) for s in optimizer_state]
    from .optimizer_step import live_layout, live_settings
    learning_rates = live_settings(optimizer)   # the lr of each group, and its betas (live_layout)
    settings_layout = live_layout(optimizer)
    layout = layout or BatchLayout(len(inputs))
    num_model_inputs = layout.positional - num_targets
    if num_model_inputs < 0:
        raise ConfigError(f"the step got {layout.positional} positional argument(s) but {num_targets} target(s) "
                          "were declared (targets are the last positional arguments; keyword arguments go to the model)")
    group_of = [info.group for info in param_infos]
    check_micro_batches(inputs, grad_accumulation, layout)

    def whole_step(params, frozen_params, buffers, states, lrs, batch, loss_scale):
        computed, frozen_computed = params, frozen_params
        if precision is not None:   # forward and backward in param_dtype (zerocc/precision.py)
            computed, frozen_computed, _ = mixed.compute_values(precision, params, frozen_params, ())
        for value in (*params, *computed):   # the fakes of the real parameters carry their .grad (an eager step
            value.grad = None                # before compiling): only what the step's own backward writes counts
        for value, hooks in zip(computed, gradient_hooks):   # param.register_hook(fn): fn(grad) as eager's backward
            for hook in hooks:
                value.register_hook(hook)
        tensors = {}
        for info, value in zip(param_infos, computed):
            tensors[info.name] = laid_out(value, parameter_layouts.get(info.name))
        for info, value in zip(frozen_infos, frozen_computed):
            tensors[info.name] = value
        for info, value in zip(buffer_infos, buffers):
            tensors[info.name] = value
        total, grads, metrics = None, None, []
        # the model's checkpointing replays its dropout masks (model_recomputation.py); what Python's and
        # NumPy's generators give is noted: the trace would keep it as a constant (host_random.py)
        with traced_recomputation(fake_mode, generators), host_draws.recording():
            for micro in micro_batches(batch, grad_accumulation):
                positional, keyword = layout.split(micro)
                micro_inputs = tuple(positional[:num_model_inputs])
                if precision is not None:   # the model's floating inputs in param_dtype too
                    cast = mixed.compute_values(precision, (), (), (*micro_inputs, *keyword.values()))[2]
                    micro_inputs, keyword = tuple(cast[:num_model_inputs]), dict(zip(keyword, cast[num_model_inputs:]))
                # the traced tensors stay the module's through backward: a recomputation there (torch.utils.checkpoint,
                # Hugging Face's activation_checkpointing_enable) calls the module again and must read them, not the
                # user's real parameters (they would be baked into the program as constants)
                with torch.enable_grad(), _reparametrize_module(model, tensors, tie_weights=True, strict=False):
                    with autocast_as(autocast):   # the caller's torch.autocast, as eager casts forward and loss
                        output = model(*micro_inputs, **keyword)
                        loss = extract_loss(output, positional[num_model_inputs:], loss_fn)
                    if metrics_fn is not None:   # as a loop reads them after forward: outside autocast, no gradient
                        with torch.no_grad():
                            metrics.append(metrics_of(metrics_fn, output, layout.split(micro)))
                    if precision is not None:
                        loss = loss.float()
                    if grad_accumulation > 1:
                        loss = loss / grad_accumulation
                    differentiated = loss * loss_scale[0] if loss_scale else loss
                    micro_grads = torch.autograd.grad(differentiated, computed, allow_unused=True)
                    micro_grads = _plus_gradients_written_into_grad(micro_grads, computed, params, param_infos, precision)
                buffers = reassigned_buffers(buffer_infos, buffers, tensors)
                if precision is not None:
                    micro_grads = mixed.master_grads(micro_grads, params)
                # as AccumulateGrad does into .grad: the running sum, then this micro-batch's gradient
                grads = micro_grads if grads is None else tuple(
                    new if old is None else old if new is None else old + new for old, new in zip(grads, micro_grads))
                total = loss.detach() if total is None else total + loss.detach()
        # the optimizer's step is spliced in after tracing
        return total, grads, list(buffers), stacked_metrics(metrics)

    started = time.perf_counter()
    stats = CompileStats("capture")
    record_source_lines_of(loss_fn)
    record_source_lines_of(metrics_fn)
    real_args = (
        [t for _, t in trained], [t for _, t in frozen], [t for _, t in buffers_all],
        [dict(s) for s in optimizer_state], learning_rates, list(inputs),
        [torch.ones(())] if precision is not None and precision.loss_scale is not None else [],
    )

    def fake_arguments():
        fake_args = fakeify(fake_mode, real_args)
        with fake_mode:   # parameters released by the runtime: fakes of their true shape
            for position, (names, tensor) in enumerate(trained):
                if names[0] in parameter_shapes:
                    fake_args[0][position] = torch.empty(parameter_shapes[names[0]], dtype=tensor.dtype,
                                                         device=tensor.device).requires_grad_(True)
        return fake_args

    fake_args = fake_arguments()
    leaves = _placeholder_layout(fake_args, settings_layout)
    # branches on batch values are decided on the real batch and kept as guards (zerocc/data_guards.py)
    input_positions = {position: index for position, (role, index, _) in enumerate(leaves) if role == g.ROLE_INPUT}
    recorder = GuardRecorder(inputs, input_positions)
    attributes = tensor_attributes(model)
    host_draws = HostDraws(model, loss_fn)
    generators = generators_reached(model, loss_fn, inputs)   # torch.Generator objects the step may draw from

    def traced(recorder, fake_args, stats=stats):
        with recording(fake_mode, recorder), _restored(attributes), \
                no_traced_values_left(model, loss_fn) as reassigned, \
                module_conversions_as_eager(), synchronized_batch_norm_traceable():
            stamper = stamping.Stamper(model, lambda: (len(recorder.guards), host_draws.drew), any(gradient_hooks)) \
                if stamp else None
            found = trace_functional(whole_step, fake_args, fake_mode, stats,
                                     lambda written: _refuse_writes_to_constants(written, attributes), stamper)
        reassigned_state_read(found[0], reassigned)
        return found

    try:
        try:
            gm, out_spec = traced(recorder, fake_args)
        except Exception as error:
            if not recorder.unread_batch_values:
                raise
            # values read from the batch alone (.tolist(), .item()) stayed symbols, one program for every batch,
            # and the trace failed on them (a size F.pad needs, a dict key): traced again with their values read
            recorder = GuardRecorder(inputs, input_positions, read_values=True,
                                     needed_at=user_frame(error.__traceback__) or "")
            gm, out_spec = traced(recorder, fake_arguments())
        # Python's or NumPy's random numbers: traced again from other ones, is it the same program?
        for extreme in EXTREMES if host_draws.drew else ():
            with host_draws.advanced(extreme):
                again, _ = traced(GuardRecorder(inputs, input_positions, recorder.read_values), fake_arguments(),
                                  stats=None)
            if not same_program(gm, again):
                raise host_draws.error()
    except (GuardOnDataDependentSymNode, DynamicOutputShapeException, DataDependentOutputException) as error:
        batch_norm = _cumulative_batch_norm(error.__traceback__, model)
        if batch_norm is not None:
            where = user_frame(error.__traceback__)   # none where the BatchNorm sits in an nn.Sequential
            raise CaptureError(
                f"the step cannot be traced at {batch_norm}{f' (called at {where})' if where else ''}\n"
                "  why: a BatchNorm with momentum=None (a cumulative average of the batch statistics) divides by "
                "its num_batches_tracked read as a Python number, another value every step, which one graph cannot "
                "represent.\n  fix: give the BatchNorm a momentum (0.1 is PyTorch's default)") from error
        raise _data_dependent_error(user_frame(error.__traceback__), type(error).__name__, str(error),
                                    recorder.random_branch, _in_fake_quantize(error.__traceback__)) from error
    except (ZeroccError, stamping.NotStampable):
        raise
    except Exception as error:
        if recorder.guards and raised_by_user_code(error):   # on a side this batch's values decided: as eager
            error.add_note(f"zerocc: raised while tracing the step on this batch, after deciding the branch at "
                           f"{recorder.guards[-1].where} on its values")
            raise
        where = user_frame(error.__traceback__)
        if where is None and _in_backward(error):   # no user code on the stack: name the forward line instead
            where = _forward_line_of_failed_backward(
                lambda: traced(GuardRecorder(inputs, input_positions, recorder.read_values), fake_arguments(), None))
        if where is None and isinstance(error, TypeError) and f"{type(model).__name__}.forward()" in str(error):
            # the model's own call failed (the step's split of its arguments): no line of the user's ran
            where = f"the step's call of the model ({type(model).__name__}.forward at {_defined_at(type(model).forward)})"
        raise CaptureError(f"tracing the training step failed at {where or '(no user frame found)'}: "
                           f"{type(error).__name__}: {error}"
                           f"{_fake_value_hint(error)}{_split_hint(error, num_model_inputs, num_targets, model)}"
                           f"{_empty_hint(inputs)}") from error

    _refuse_writes_to_parameters(gm, leaves, param_infos, frozen_infos)
    _refuse_writes_to_the_batch(gm, leaves, layout)
    if drop_state_of_unused:
        leaves, state_keys = _drop_state_of_unused(gm, out_spec, leaves, state_keys)
    _tag_placeholders(gm, leaves, param_infos, frozen_infos, buffer_infos, state_keys)
    if precision is not None:
        mixed.tag_parameter_casts(gm, precision)
    # outputs: loss, grads (None for unused), buffers; then the optimizer's step over the used parameters
    out_nodes = list(g.output_node(gm).args[0])
    import torch.utils._pytree as pytree
    structured = pytree.tree_unflatten(out_nodes, out_spec)
    loss_node, grad_nodes, new_buffer_nodes, metric_nodes = structured
    sparse = [param_infos[i].name for i, grad in enumerate(grad_nodes)
              if grad is not None and grad.meta[g.VAL].layout != torch.strided]
    if sparse:
        lookups = "".join(f"\n  - {line}" for line in _sparse_lookups(gm))
        raise ConfigError(f"parameter(s) {', '.join(sparse)} get sparse gradients, from the lookup(s) built with "
                          f"sparse=True (nn.Embedding, nn.EmbeddingBag, F.embedding) at:{lookups or ' (no user frame found)'}"
                          "\n  why: zerocc reduces and shards dense gradients only.\n  fix: build them with sparse=False "
                          "(the default); the optimizer then gets dense gradients (SparseAdam needs sparse ones: use Adam).")
    step_nodes = set(gm.graph.nodes)   # forward and backward, before the optimizer's update is spliced in
    with stats.timed(compile_stats.OPTIMIZER_TRACE):
        new_param_nodes, new_state_dicts = _splice_optimizer(gm, fake_mode, optimizer, grad_nodes, group_of)
    check_state_shapes(new_state_dicts, [info.shape for info in param_infos], [info.name for info in param_infos],
                       optimizer)
    new_state_keys = [tuple(sorted(d)) for d in new_state_dicts]
    unused = [i for i, grad in enumerate(grad_nodes) if grad is None]
    for i, grad in enumerate(grad_nodes):
        if grad is not None:   # one node can be the gradient of several (an LSTM's two biases)
            grad.meta[g.GRAD_OF] = grad.meta.get(g.GRAD_OF, ()) + (i,)
    flat_states = [d[k] for d, keys in zip(new_state_dicts, new_state_keys) for k in keys]
    written_buffers = tuple(info.name for info, new, old in zip(buffer_infos, new_buffer_nodes,
                                                                g.placeholders(gm, g.ROLE_BUFFER)) if new is not old)
    output = g.output_node(gm)
    output.args = ([loss_node, *new_param_nodes, *new_buffer_nodes, *flat_states, *metric_nodes.values()],)
    gm.meta[g.OUTPUT_SLOTS] = (
        [decisions.param_slot(info.name) for info in param_infos]
        + [decisions.buffer_slot(info.name) for info in buffer_infos]
        + [decisions.state_slot(param_infos[i].name, key) for i, keys in enumerate(new_state_keys) for key in keys]
        + [METRIC_PREFIX + name for name in metric_nodes]
    )
    gm.graph.eliminate_dead_code()
    _tag_phases(gm, loss_node, [x for x in grad_nodes if x is not None], new_buffer_nodes, step_nodes)
    for i in unused:   # a parameter the loss does not reach: not trained in this step
        placeholder = g.placeholders(gm, g.ROLE_PARAM)[i]
        placeholder.meta[g.UNUSED] = True
    if check_update_elementwise:
        check_elementwise([n for n in gm.graph.nodes if n.meta.get(g.PHASE) == g.OPTIMIZER], optimizer)
    gm.recompile()
    stats.add(compile_stats.CAPTURE_REST, time.perf_counter() - started - stats.total)
    return Captured(gm, param_infos, frozen_infos, buffer_infos, state_keys, len(optimizer.param_groups),
                    len(inputs), new_state_keys, tuple(recorder.guards), stats, written_buffers)


def _plus_gradients_written_into_grad(grads, computed, params, param_infos, precision) -> tuple:
    """Add what a ``backward()`` inside the model's own backward accumulated into ``.grad`` of the parameters.

    A custom ``autograd.Function`` may compute its parameters' gradients itself: Reformer's reversible layers
    recompute each layer in ``backward`` and call ``output.backward(grad)`` there, which accumulates into
    ``param.grad`` and returns nothing for the parameters. Eager's ``loss.backward()`` ends with those in
    ``.grad`` beside what the graph gave; ``torch.autograd.grad`` returns only the latter. Each traced
    parameter's ``.grad`` is taken (and cleared, for the next micro-batch) and added, as ``AccumulateGrad``
    adds into ``.grad``: the two terms sum alike in either order.
    """
    if precision is not None:
        written = [info.name for info, master in zip(param_infos, params) if master.grad is not None]
        if written:
            raise CaptureError(
                f"a backward() inside the model's own backward (a custom autograd.Function, as Reformer's reversible "
                f"layers) wrote the gradients of {', '.join(written[:3])}{' ...' if len(written) > 3 else ''} into "
                ".grad; with param_dtype they would accumulate in fp32 through the cast instead of in param_dtype "
                "as in eager: compile without param_dtype (torch.autocast computes such a model in bf16 with fp32 "
                "parameters)")
        return grads
    summed = []
    for grad, leaf in zip(grads, computed):
        written = leaf.grad
        if written is not None:
            leaf.grad = None
            grad = written if grad is None else grad + written
        summed.append(grad)
    return tuple(summed)


def _cumulative_batch_norm(tb, model: nn.Module) -> str | None:
    """The BatchNorm whose momentum is None that the traceback passes through, named as in the model
    (``model.1 (BatchNorm1d(4, momentum=None, ...))``), or None."""
    for frame, _ in traceback.walk_tb(tb):
        module = frame.f_locals.get("self")
        if isinstance(module, nn.modules.batchnorm._NormBase) and module.momentum is None:
            name = next((name for name, m in model.named_modules() if m is module), None)
            return f"{'model.' + name if name else 'the model'} ({module})"
    return None


# torch's message for a branch on whether a size the data decides is zero: ``Eq(u3, 0)``, ``u3 > 0``, ...
_ZERO_SIZE_BRANCH = re.compile(r"data-dependent expression (Eq\(u\d+, 0\)|Ne\(u\d+, 0\)|u\d+ (> 0|>= 1|< 1|<= 0))[ .]")


def _in_fake_quantize(traceback) -> bool:
    """The branch is torch.ao.quantization's ``FakeQuantize`` (``if self.observer_enabled[0] == 1``) or its observer's
    (``if min_val == float("inf")``): branches on buffers the loop or the first step change, which the fused fake
    quantize takes as tensors instead."""
    while traceback is not None:
        if re.search(r"torch[/\\]ao[/\\]quantization[/\\](fake_quantize|observer)\.py$", traceback.tb_frame.f_code.co_filename):
            return True
        traceback = traceback.tb_next
    return False


def _data_dependent_error(where: str | None, why: str, message: str = "", random_branch: bool = False,
                          fake_quantize: bool = False) -> CaptureError:
    if fake_quantize:
        note = ("\n  note: torch.ao.quantization's FakeQuantize (tq.default_qat_qconfig, get_default_qat_qconfig with "
                "version=0) branches in Python on its observer_enabled and fake_quant_enabled buffers and on whether "
                "its observer has seen a batch; the fused FakeQuantize of get_default_qat_qconfig(\"x86\") (or "
                "get_default_qat_qconfig_mapping(\"x86\") for prepare_qat_fx) passes them to one op as tensors: "
                "model.apply(disable_observer) between steps then trains as eager.")
    elif random_branch:
        note = ("\n  note: the branch is on a random draw (LayerDrop's `torch.rand([]) < layerdrop`, stochastic depth), "
                "which would skip a layer in some steps and not in others; a transformers model turns it off with "
                "its config's probability set to 0 (layerdrop=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0).")
    elif where and re.search(r":\d+: if .*\.any\(\):", where):
        note = ("\n  note: the branch asks whether a mask computed from activations has any True element; where its body "
                "only writes where the mask is True (`if mask.any(): x[mask] = value`), it does nothing on an all-False "
                "mask: drop the `if` (or write `x = x.masked_fill(mask, value)`), and the program computes what eager "
                "does on either side.")
    elif where and re.search(r":\d+: for .+ in .+:", where):
        note = ("\n  note: the loop runs once per element of a tensor whose length the data decides (the experts that "
                "received tokens): loop over a fixed `range(num_experts)` instead, where an expert without tokens "
                "runs on zero rows and adds nothing; a transformers model whose config has experts_implementation "
                "trains with \"grouped_mm\" (its default) or \"batched_mm\".")
    elif "extract specialized integer" in message and where and "bincount(" in where:
        note = ("\n  note: torch.bincount's length is the largest value plus one (at least minlength), which the data "
                "decides: count with F.one_hot(x, n).sum(0) or torch.histc, whose length is n; one program then "
                "serves every routing. A branch on the counts must go too (`if counts[i] == 0: continue`, the "
                "experts without tokens skipped: a branch on a size the data decides): the loop then runs every "
                "expert, and one without tokens runs on zero rows and adds nothing.")
    elif "extract specialized integer" in message and where and re.search(r"\b(int|float)\(", where):
        note = ("\n  note: int() or float() makes a number the data decides (a count read with .tolist() or .item()) "
                "a Python number: drop it and pass the value to the op itself (`x.split(counts.tolist())`, "
                "`x.new_zeros(count)`); it then stays a symbol, and one program serves every routing.")
    elif _ZERO_SIZE_BRANCH.search(message):
        note = ("\n  note: the branch asks whether a size the data decides is 0 (an expert that received no tokens, "
                "`if tokens.numel() == 0: continue`): drop the check, as the ops after it run on zero rows and add "
                "nothing; one program then serves every routing.")
    else:
        note = ""
    return CaptureError(
        f"the step cannot be traced at {where or '(no user frame found)'}\n"
        f"  why: it depends on the values in a tensor (data-dependent control flow or output shape: {why}), "
        "which one graph cannot represent; only branches on values computed from the batch alone, and sizes and "
        "values read from it (.tolist(), .item()), are decided, on each real batch (zerocc/data_guards.py; not when "
        f"planning with meta or fake example inputs).{note}\n"
        "  fix: compute it with tensor ops (torch.where, masking) instead of Python control flow, "
        "or move it out of the model.")


def _drop_state_of_unused(gm, out_spec, leaves, state_keys) -> tuple[list, list]:
    """The placeholders of the optimizer state of the parameters without a gradient, taken out of the traced graph:
    it is what the trace makes of the same step given no state for them (forward and backward never read the
    state, and the optimizer's update, spliced in after, skips a parameter without a gradient).

    Which parameters the loss reaches is known only once traced (DeepSeek-V3's gate bias only chooses the
    experts, through ``topk``'s indices). Tracing the step again without their state took as long as the first
    trace: half the compile of a model with such a parameter (37 s of a MoE whose experts loop over
    ``torch.where``). Returns the layout and the state keys without them; ``WRITTEN_INPUTS`` is renumbered.
    """
    import torch.utils._pytree as pytree
    grads = pytree.tree_unflatten(list(g.output_node(gm).args[0]), out_spec)[1]
    unused = {i for i, grad in enumerate(grads) if grad is None}
    dropped = [position for position, (role, index, _) in enumerate(leaves) if role == g.ROLE_STATE and index in unused]
    if not dropped:
        return leaves, state_keys
    nodes = g.placeholders(gm)
    for position in dropped:
        assert not nodes[position].users, nodes[position]
        gm.graph.erase_node(nodes[position])
    shift = [bisect.bisect_left(dropped, position) for position in range(len(leaves))]
    written = gm.meta.get(g.WRITTEN_INPUTS)
    if written:
        gm.meta[g.WRITTEN_INPUTS] = {position - shift[position]: node for position, node in written.items()}
    gone = set(dropped)
    return ([leaf for position, leaf in enumerate(leaves) if position not in gone],
            [() if i in unused else keys for i, keys in enumerate(state_keys)])


def _splice_optimizer(gm, fake_mode, optimizer, grad_nodes, group_of):
    """The optimizer's own ``step()`` over the parameters the loss reaches, traced apart and spliced in.

    Returns, per parameter, its new value and new state (the placeholders
    themselves for a parameter the loss does not reach). Tracing the update
    apart lets it be traced once per class of look-alike parameters when the
    update is elementwise (``optimizer_step.splice_update``).
    """
    params = g.placeholders(gm, g.ROLE_PARAM)
    states: list[dict[str, fx.Node]] = [{} for _ in params]
    for node in g.placeholders(gm, g.ROLE_STATE):
        states[node.meta[g.INDEX]][node.meta[g.STATE_KEY]] = node
    used = [i for i, grad in enumerate(grad_nodes) if grad is not None]
    stepped, stepped_states, _ = splice_update(
        gm, fake_mode, optimizer, [params[i] for i in used], [grad_nodes[i] for i in used],
        [states[i] for i in used], g.placeholders(gm, g.ROLE_HYPER), [group_of[i] for i in used],
        replicate=REPLICATE_IF_ELEMENTWISE)
    new_params, new_states = list(params), [dict(s) for s in states]
    for position, i in enumerate(used):
        new_params[i] = stepped[position]
        new_states[i] = stepped_states[position]
    return new_params, new_states


def _writes_into_inputs(gm, leaves, roles) -> list[tuple[str, int, str]]:
    """Each graph input of ``roles`` an op writes in place: (role, index, 'by <op> at <user line>')."""
    found = []
    for position, node in sorted(gm.meta.get(g.WRITTEN_INPUTS, {}).items()):
        role, index, _ = leaves[position]
        if role in roles:
            where = user_line_of_node(node) or "(no user frame found)"
            found.append((role, index, f"by {g.short_name(node.target)} at {where}"))
    return found


def _refuse_writes_to_parameters(gm, layout, param_infos, frozen_infos) -> None:
    """A parameter written in place inside the step (not by the optimizer) would be silently lost: refuse it."""
    problems = [f"  - parameter {(param_infos if role == g.ROLE_PARAM else frozen_infos)[index].name!r} {how}"
                for role, index, how in _writes_into_inputs(gm, layout, (g.ROLE_PARAM, g.ROLE_FROZEN))]
    if problems:
        renorm = any(" by embedding_renorm_ at " in problem for problem in problems)
        raise CaptureError(
            "the model writes into its parameters in place during the step:\n" + "\n".join(problems) + "\n"
            "  why: the compiled step is one functional graph over the sharded parameters; only the optimizer "
            "updates them, so this write would be lost.\n"
            + ("  note: embedding_renorm_ is nn.Embedding's or nn.EmbeddingBag's max_norm=, which rescales the "
               "rows it looks up in its weight, in place, in every forward (across ranks each rank would rescale "
               "the rows of its own batch).\n  fix: build the embedding with max_norm=None; to keep its vectors "
               "short, renormalize what it returns (v * (max_norm / v.norm(dim=-1, keepdim=True)).clamp(max=1)) "
               "or penalize their norm in the loss." if renorm else
               "  fix: compute a new tensor instead (w = w * s), keep the value in a buffer (register_buffer), "
               "or change the parameters outside the step (before compiling, or through load_checkpoint)."))


def _refuse_writes_to_the_batch(gm, leaves, layout: BatchLayout) -> None:
    """A batch tensor the model writes in place: eager changes the caller's tensor, the program would not."""
    problems = [f"  - {layout.name_of(index)} {how}" for _, index, how in _writes_into_inputs(gm, leaves, (g.ROLE_INPUT,))]
    if problems:
        raise CaptureError(
            "the model writes into its batch in place during the step:\n" + "\n".join(problems) + "\n"
            "  why: eager changes your batch tensor, which a later step reusing it (or your code reading it "
            "afterwards) then sees; the compiled step reads the batch and never writes it, so it would train "
            "differently.\n"
            "  fix: compute a new tensor instead (x = x * s, x = x.clamp(...), y = y.masked_fill(...)), or do "
            "the in-place preprocessing before calling the step.")


def tensor_attributes(model: nn.Module) -> dict[int, tuple[str, torch.Tensor]]:
    """Tensors held as plain module attributes (neither parameters nor buffers), by id: (qualified name, tensor)."""
    found: dict[int, tuple[str, torch.Tensor]] = {}
    for module_name, module in model.named_modules():
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                found.setdefault(id(value), (f"{module_name}.{name}" if module_name else name, value))
    return found


@contextlib.contextmanager
def _restored(attributes: dict[int, tuple[str, torch.Tensor]]):
    """Tracing never changes the user's tensors: put back any attribute an op wrote while tracing.

    make_fx computes ops on one-element real constants for real (constant
    propagation), so ``self.counter += 1`` in forward would add to the
    user's tensor at every trace. The copies cost the attributes' size once,
    while tracing (models keep large tensors in buffers, not attributes).
    """
    saved = {key: (tensor._version, tensor.detach().clone()) for key, (_, tensor) in attributes.items()}
    try:
        yield
    finally:
        with torch.no_grad():
            for key, (_, tensor) in attributes.items():
                version, value = saved[key]
                if tensor._version != version:
                    tensor.copy_(value)


def _refuse_writes_to_constants(written: dict[int, fx.Node], attributes) -> None:
    """A tensor the step writes in place that is none of its inputs (a tensor attribute that is no buffer, a
    global tensor): a constant of the traced program, whose new value would be lost."""
    if not written:
        return

    def where(node):
        return f"by {g.short_name(node.target)} at {user_line_of_node(node) or '(no user frame found)'}"
    on_the_model = [(attributes[key][0], node) for key, node in written.items() if key in attributes]
    if on_the_model:
        problems = [f"  - {name!r} {where(node)}" for name, node in on_the_model]
        name = on_the_model[0][0].rsplit(".", 1)[-1]
        raise CaptureError(
            "the model writes in place into tensor attributes that are neither parameters nor buffers:\n"
            + "\n".join(problems) + "\n"
            "  why: the compiled step carries parameters, buffers and optimizer state from one step to the next; "
            "a plain tensor attribute is a constant of the traced program, so its updates would be lost or "
            "repeated.\n"
            f"  fix: register it as a buffer in the module's __init__, e.g. self.register_buffer({name!r}, "
            "torch.zeros(())) (persistent=False keeps it out of state_dict); the step then carries it.")
    problems = [f"  - written {where(node)}" for node in written.values()]
    raise CaptureError(
        "the step writes in place into tensors that are not the model's (a global tensor, or one a closure holds):\n"
        + "\n".join(problems) + "\n"
        "  why: the compiled step carries only parameters, buffers and optimizer state from one step to the next; "
        "any other tensor is a constant of the traced program, so its updates would be lost or repeated.\n"
        "  fix: keep it in a buffer of a module of the model (self.register_buffer(name, tensor, persistent=False)); "
        "the step then carries it, and you read it from the model after each step.")


def _placeholder_layout(fake_args, settings_layout) -> list[tuple[str, int, str]]:
    """(role, index within role, readable name) for each flattened leaf, in placeholder order."""
    params, frozen, buffers, states, lrs, batch, loss_scale = fake_args
    layout = []
    layout += [(g.ROLE_PARAM, i, "") for i in range(len(params))]
    layout += [(g.ROLE_FROZEN, i, "") for i in range(len(frozen))]
    layout += [(g.ROLE_BUFFER, i, "") for i in range(len(buffers))]
    for i, state in enumerate(states):
        layout += [(g.ROLE_STATE, i, key) for key in sorted(state)]
    assert len(lrs) == len(settings_layout)
    layout += [(g.ROLE_HYPER, group, name) for group, name in settings_layout]
    import torch.utils._pytree as pytree
    for i, leaf in enumerate(pytree.tree_leaves(batch)):
        layout.append((g.ROLE_INPUT, i, ""))
    layout += [(g.ROLE_LOSS_SCALE, i, "") for i in range(len(loss_scale))]
    return layout


def readable(name: str) -> str:
    return name.replace(".", "_")


def _sparse_lookups(gm) -> list[str]:
    """The user's lines of the forward ops that make a sparse gradient: those called with ``sparse=True``
    (``embedding``, ``_embedding_bag``), once each. The backward ops that build it carry no stack trace."""
    lines = []
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for position, argument in enumerate(schema.arguments):
            if argument.name == "sparse":
                value = node.kwargs.get("sparse", node.args[position] if position < len(node.args) else False)
                line = user_line_of_node(node)   # None on the backward's ops (_embedding_bag_backward)
                if value is True and line is not None and line not in lines:
                    lines.append(line)
    return lines


def _tag_placeholders(gm, layout, param_infos, frozen_infos, buffer_infos, state_keys) -> None:
    nodes = g.placeholders(gm)
    assert len(nodes) == len(layout), (len(nodes), len(layout))
    infos = {g.ROLE_PARAM: param_infos, g.ROLE_FROZEN: frozen_infos, g.ROLE_BUFFER: buffer_infos}
    for node, (role, index, key) in zip(nodes, layout):
        node.meta[g.ROLE] = role
        node.meta[g.INDEX] = index
        slot = None
        if role in infos:
            name = infos[role][index].name
            base = readable(name)
            slot = {g.ROLE_PARAM: decisions.param_slot, g.ROLE_FROZEN: decisions.frozen_slot,
                    g.ROLE_BUFFER: decisions.buffer_slot}[role](name)
        elif role == g.ROLE_STATE:
            base = f"state_{readable(param_infos[index].name)}_{key}"
            node.meta[g.STATE_KEY] = key
            slot = decisions.state_slot(param_infos[index].name, key)
        elif role == g.ROLE_HYPER:
            base = f"{key}_group{index}"
            slot = decisions.setting_slot(index, key)
        elif role == g.ROLE_LOSS_SCALE:
            base, slot = "loss_scale", mixed.SCALE_SLOT
        else:
            base = f"input{index}"
        node.meta[g.SLOT] = slot
        node._rename(base)
        node.target = node.name


def _tag_phases(gm, loss, grads, new_buffers, step_nodes) -> None:
    """Each node's phase: forward (what the loss and the written buffers need), backward (what the gradients need
    besides), optimizer (the update spliced in after the trace). A node of the traced forward and backward that
    neither needs is a draw whose value the step does not use (``shift = torch.randint(...)`` left over in an
    augmentation), kept because it advances the generator as eager's does: it is forward's, where it was drawn."""
    forward = g.ancestors([loss, *[b for b in new_buffers if b.op != "placeholder"]])
    backward = g.ancestors(grads) - forward
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if node in forward or (node in step_nodes and node not in backward):
            node.meta[g.PHASE] = g.FORWARD
        elif node in backward:
            node.meta[g.PHASE] = g.BACKWARD
        else:
            node.meta[g.PHASE] = g.OPTIMIZER
