"""``step.eval_forward(*inputs)``: the model's forward in eval mode on the step's own parameters.

No backward, no optimizer, no parameter or optimizer state written. The forward is traced (on fake
tensors, like capture) with the model in eval mode and gradients off, into a
graph whose placeholders are the runtime's slots: each bucket (at stage 3
this rank's shard, all-gathered first, the same buckets the training step
gathers), frozen parameters, buffers, then the batch. Parameters are views of
the buckets, exactly as in the training step. Programs are cached by the
batch's shapes, apart from the training step's, at most ``max_programs``.
A buffer the forward writes in eval mode (a count of the tokens each expert
received, as torchtitan's MoE keeps it) or assigns a new tensor (DINO's
``self.center = ...``) is written as eager writes it: the program returns its
new value, copied into the buffer's slot, which the user's module holds and
the next training step reads (BatchNorm's statistics, written in training
mode only, stay as they were).

At stage 3 over several ranks the gathers are collectives: every rank must
call ``eval_forward`` at the same point, as it calls the step (a rank left
waiting gets a ``RankFailureError`` that says so).
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from . import decisions
from . import graph as g
from .capture import laid_out, reassigned_buffers
from .autocast import autocast_as, autocast_state, outside_autocast
from .batch import BatchLayout, check_batch, with_arrays_copied
from .data_guards import GuardRecorder, all_hold, recording
from .program_cache import attention_backends, input_signature
from .errors import CaptureError, RecompileWarning, ZeroccError, note_failing_node, user_frame, user_stacklevel
from .runtime import failures
from .runtime.program import forget_source_when_freed
from .tracing import fakeify, make_fake_mode, module_conversions_as_eager, no_traced_values_left, trace_functional
from .user_tooling import suspended_user_tooling

c10d = torch.ops._c10d_functional


@dataclasses.dataclass
class EvalProgram:
    """A traced forward: which slot (or batch leaf) each placeholder reads, and the output's structure."""
    gm: fx.GraphModule
    slots: list[str | None]        # per placeholder: the slot it reads, None for a batch leaf
    output_spec: pytree.TreeSpec
    guards: tuple = ()             # data guards (zerocc/data_guards.py): the batches this program is for
    written: tuple = ()            # (slot, position among the returned buffers) of each buffer forward writes

    def __post_init__(self):
        forget_source_when_freed(self.gm)   # dropped past max_programs: its generated Python goes too

    def run(self, slots: dict[str, torch.Tensor], batch: list) -> Any:
        leaves = iter(pytree.tree_leaves(list(batch)))
        arguments = [slots[slot] if slot is not None else next(leaves) for slot in self.slots]
        try:
            with outside_autocast():   # a caller's autocast is traced into the program (zerocc/autocast.py)
                outputs = self.gm.forward(*arguments)   # not gm(): user module hooks stay out (user_tooling.py)
        except Exception as error:
            note_failing_node(error, self.gm, "eval_forward", batch)   # the user's line, not <eval_with_key>
            raise
        output, buffers = pytree.tree_unflatten(list(outputs), self.output_spec)
        for slot, position in self.written:
            slots[slot].copy_(buffers[position])
        return output


def eval_forward(step, inputs: tuple, keyword_inputs: dict | None = None) -> Any:
    """Run (compiling on first sight of these shapes) the forward-only program of ``step`` on ``inputs``."""
    keyword_inputs = keyword_inputs or {}
    layout = BatchLayout.of(inputs, keyword_inputs)
    batch = layout.flatten(inputs, keyword_inputs)
    if not step.state.started:
        return _eager_before_training(step.model, inputs, keyword_inputs)
    check_batch(batch, layout, step.state.first_batch, where="eval_forward")
    autocast = autocast_state()   # the casts are traced into the program: its own program per state
    # the Python values and tensors forward reads are traced as constants (program_cache.values_read), so are
    # its hooks, factories read the default dtype and SDPA picks its kernel: as the training step's key
    # (CompiledStep._cache_key)
    signature = (input_signature(batch, layout), autocast, *step.values_read(), step.hook_ids(),
                 torch.get_default_dtype(), attention_backends())
    programs = step.eval_programs
    kept = programs.get(signature, [])   # one program per side of the data guards its trace decided
    program = next((p for p in reversed(kept) if all_hold(p.guards, batch)), None)
    failed = None
    if program is None:
        try:
            program = _compile(step, with_arrays_copied(batch), layout, autocast)   # no constant shares a loader's buffer
        except Exception as error:   # noqa: BLE001 - raised below, after every rank that gathers heard of it
            if not step._gathers:
                raise
            failed = error
    if step._gathers:   # the program gathers the shards: every rank must be here (runtime/failures.py)
        # a rank whose trace failed says so here, where the others would otherwise wait for it in the gathers
        failures.meet(step.ranks, "step.eval_forward", step.steps, step.timeout, failed=failed,
                      what="tracing eval_forward on its batch")
    programs.pop(signature, None)
    programs[signature] = [p for p in kept if p is not program] + [program]   # most recently used last
    if len(programs) > step.max_programs:
        dropped = next(iter(programs))
        del programs[dropped]
        warnings.warn(f"zerocc: more than max_programs={step.max_programs} eval_forward programs; dropped "
                      "the least recently used. Pad evaluation batches to a few shapes", RecompileWarning,
                      stacklevel=user_stacklevel())
    with torch.no_grad(), failures.collective_failures(step.ranks, step.steps, step.timeout, call="step.eval_forward"):
        return program.run(step.state.slots, batch)


def _eager_before_training(model, inputs: tuple, keyword_inputs: dict) -> Any:
    """Before the step's first call: the model's own forward, in eval mode, without gradients.

    Training scripts evaluate before they train (nanoGPT's ``estimate_loss()`` at iteration 0, a baseline
    validation loss): the buckets do not exist until the first ``step(*batch)`` lays them out, but the module
    still holds its whole parameters then, so its forward is the evaluation eager computes (on this rank alone:
    no gather). Training modes are restored; a generation cache comes back as ``None``, as from a program.
    """
    with _in_eval_mode(model), torch.no_grad():
        output = model(*inputs, **keyword_inputs)
    return _without_generation_cache(output)


@contextlib.contextmanager
def _in_eval_mode(model: torch.nn.Module):
    """``model.eval()`` inside, every module's own training flag as it was after (an eval module stays one)."""
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for module, training in modes.items():
            module.training = training


def _without_generation_cache(output):
    if any(_is_generation_cache(leaf) for leaf in pytree.tree_leaves(output)):
        output = pytree.tree_map(lambda leaf: None if _is_generation_cache(leaf) else leaf, output)
        warnings.warn("zerocc: eval_forward returns the model's generation cache (past_key_values) as None: "
                      "a compiled forward returns tensors only. A Hugging Face model in eval mode makes one "
                      "by default; pass use_cache=False to leave it out", UserWarning, stacklevel=user_stacklevel())
    return output


def _trained(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` requiring grad, as a trained parameter does, and so every view of it, under no_grad too.

    Eager's ops read it: ``matmul`` of a strided 3-d input (``F.linear`` after a transpose) folds the batch
    into one ``mm`` when the weight requires grad and runs ``bmm`` when not, which rounds otherwise.
    """
    with torch.no_grad():
        return tensor.detach().requires_grad_()


def _is_generation_cache(value) -> bool:
    """transformers' key/value caches (``DynamicCache``, ``HybridCache``, ...): what a causal LM returns as
    ``past_key_values`` in eval mode unless called with ``use_cache=False``."""
    return any(cls.__name__ == "Cache" and cls.__module__.startswith("transformers") for cls in type(value).__mro__)


def _compile(step, batch: list, layout: BatchLayout, autocast: tuple = ()) -> EvalProgram:
    plan, captured, model = step.state.plan, step.state.captured, step.model
    in_plan = {segment.param for bucket in plan.buckets for segment in bucket.segments}
    loose = [info for index, info in enumerate(captured.params) if index not in in_plan]   # trained, but unused
    slots = ([decisions.bucket_slot(b.index) for b in plan.buckets] + [decisions.param_slot(i.name) for i in loose]
             + [decisions.frozen_slot(i.name) for i in captured.frozen] + [decisions.buffer_slot(i.name) for i in captured.buffers])
    gathered = [plan.holds_shard(b) and plan.world_size > 1 for b in plan.buckets]   # masters sharded

    reassigned = []   # positions among the buffers of those forward assigns a new tensor (the last trace's)

    def forward(buckets, tensors, batch):
        by_name = dict(zip([i.name for i in loose + captured.frozen + captured.buffers], tensors))
        given = [by_name[info.name] for info in captured.buffers]
        for info in loose:
            by_name[info.name] = _trained(by_name[info.name])
        for bucket, flat, gather in zip(plan.buckets, buckets, gathered):
            full = flat
            if gather:   # this rank's shard -> the whole bucket, as the training step's forward gathers it
                full = c10d.wait_tensor(c10d.all_gather_into_tensor(flat, plan.world_size, step.ranks.group_name))
            full = _trained(full)
            for segment in bucket.segments:
                info = captured.params[segment.param]
                # in the model's own strides (channels-last), as the training step reads it (capture.laid_out)
                by_name[info.name] = laid_out(full[segment.offset:segment.offset + segment.numel].view(info.shape),
                                               step._parameter_layouts.get(info.name))
        with torch.no_grad(), autocast_as(autocast):
            args, kwargs = layout.split(batch)
            output = torch.func.functional_call(model, by_name, tuple(args), kwargs, tie_weights=True, strict=False)
        output = _without_generation_cache(output)
        opaque = {type(leaf).__name__ for leaf in pytree.tree_leaves(output)
                  if not isinstance(leaf, (torch.Tensor, int, float, bool, type(None)))}
        if opaque:
            raise CaptureError(
                f"eval_forward's output holds objects of type {', '.join(sorted(opaque))}, which a traced program "
                "cannot return (only tensors and Python numbers); return tensors from the model (for a Hugging "
                "Face model pass use_cache=False)")
        # their values after forward: functional_call writes a buffer forward reassigned back into by_name
        after = reassigned_buffers(captured.buffers, given, by_name)
        reassigned[:] = [position for position, (old, new) in enumerate(zip(given, after)) if new is not old]
        return output, after

    fake_mode = make_fake_mode()
    values = [step.state.slots[slot] for slot in slots]
    arguments = fakeify(fake_mode, (values[:len(plan.buckets)], values[len(plan.buckets):], list(batch)))
    # branches on batch values (transformers' all-ones attention mask) are decided on the real batch, as the
    # training step decides them, and kept as the program's guards
    positions = {len(slots) + index: index for index in range(len(batch))}
    recorder = GuardRecorder(batch, positions)

    def traced(recorder):
        with suspended_user_tooling(), outside_autocast(), no_traced_values_left(model), \
                recording(fake_mode, recorder), module_conversions_as_eager():   # user_tooling, autocast,
                # data_guards, and module.to as eager
            return trace_functional(forward, arguments, fake_mode)

    with _in_eval_mode(model):
        try:
            try:
                gm, spec = traced(recorder)
            except Exception:
                if not recorder.unread_batch_values:
                    raise
                recorder = GuardRecorder(batch, positions, read_values=True)   # as capture.trace_step does
                gm, spec = traced(recorder)
        except ZeroccError:
            raise
        except Exception as error:
            where = user_frame(error.__traceback__) or "(no user frame found)"
            raise CaptureError(f"tracing eval_forward failed at {where}: {type(error).__name__}: {error}") from error
    batch_leaves = len(pytree.tree_leaves(list(batch)))
    first_buffer = len(slots) - len(captured.buffers)
    written = {position - first_buffer for position in gm.meta.get(g.WRITTEN_INPUTS, {}) if first_buffer <= position < len(slots)}
    written = tuple((slots[first_buffer + position], position) for position in sorted(written | set(reassigned)))
    return EvalProgram(gm, slots + [None] * batch_leaves, spec, tuple(recorder.guards), written)
