"""``zerocc.compile``: a model and its optimizer in, one callable training step out."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import time
import warnings
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from . import compile_stats
from . import decisions
from . import disk_cache
from . import graph_pickle
from . import graph as g
from . import optimizer_init
from . import precision as mixed   # the step has a ``precision`` property
from . import state_dict as state_dict_module   # its functions share the methods' names
from . import user_views
from .batch import BatchLayout, FirstBatch, agreement_lines, check_batch, with_arrays_copied
from .capture import METRIC_PREFIX, Captured, capture, named_tensors, parameter_layouts, state_dict_names, trained_parameters
from .compile_stats import CompileStats
from .analysis.step_time import HardwareProfile, StepTime, predict
from .data_guards import all_hold, values_that_differ
from .device_budget import DEFAULT_PLAN_PEAK, DeviceBudget, device_budget
from .driver import Compiled, fewer_collections, final_peak, run_passes
from .errors import (CaptureError, CompileCacheWarning, ConfigError, MemoryBudgetWarning, RecompileWarning, ReplicaWarning,
                     user_line_of_node,
                     user_stacklevel)
from .hardware import measure_hardware, profile_of
from .memory_plan import MemoryPlan, memory_plan_entries
from .optimizer_step import Modes, hyperparameter_signature, live_layout, live_modes, live_settings
from .options import (DEFAULT_BUCKET_BYTES, DEFAULT_MAX_PROGRAMS, CompileOptions, check_model_and_optimizer,
                      check_not_meta, check_stage, check_timeout)
from .passes.clip_gradients import GRAD_NORM_SLOT
from .pipeline import DEFAULT_PREFETCH_BYTES, GraphSnapshot, dump_dir_of, write_dumps, write_memory_plan
from .planning import communication, model_state_bytes
from .precision import DynamicLossScale
from .progress import CompileProgress
from .autocast import autocast_state, outside_autocast
from .program_cache import (INITIAL_STATE, attention_backends, CacheEntry, CacheKey, ProgramCache, changed_batch_entries,
                            changed_batch_values,
                            changed_python_values, describe_signature, hook_ids, input_signature, python_sources,
                            training_modes, values_read, ValuesReader)
from .runtime import failures
from .runtime import slots as slot_store
from .runtime.arenas import Arenas
from .runtime.memory import LiveBytesTracker
from .runtime.process_group import Ranks, resolve
from .runtime.program import Program
from .runtime.release import HeldInterrupt
from .step_state import (StepState, check_no_optimizer_step_hooks, check_param_groups_unchanged,
                         check_requires_grad_unchanged, param_groups_of, requires_grad_of,
                         check_module_tensors_unchanged, module_tensors_of, ModuleTree)
from .tracing import make_fake_mode
from .user_tooling import saved_tensors_hooks_state, suspended_user_tooling


# dynamo's message when fullgraph=True refuses the skip (its hint, to remove torch.compiler.disable, is not the user's)
_DYNAMO_SKIPS = ("zerocc's step is a compiled program already: remove torch.compile around the step or zerocc.compile "
                 "(without fullgraph=True, torch.compile runs them as they are; zerocc's docs/guide/your-model.md)")


@torch.compiler.disable(reason=_DYNAMO_SKIPS)
def compile(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    stage: int = 3,
    *,
    loss_fn: Callable | None = None,
    num_targets: int | None = None,
    group=None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    timeout: float | None = None,
    prefetch_bytes: int = DEFAULT_PREFETCH_BYTES,
    disable: Sequence[str] = (),
    verify: bool = False,
    dump_dir: str | None = None,
    grad_accumulation: int = 1,
    clip_grad_norm: float | None = None,
    clip_norm_type: float = 2.0,
    static_shapes: bool = False,
    max_programs: int = DEFAULT_MAX_PROGRAMS,
    memory_budget: int | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    loss_scale: "str | DynamicLossScale | None" = None,
    cast_forward_inputs: bool = True,
    memory_pools: bool | None = None,
    gather_per_micro_batch: bool = True,
    cache_dir: str | None = None,
    progress: "bool | Callable[[str], None] | None" = None,
    metrics_fn: Callable | None = None,
) -> "CompiledStep":
    """Compile one training step of ``model`` with ``optimizer`` under ZeRO ``stage`` (0-3).

    The returned step is called with one batch (this rank's slice of the
    global batch): ``loss = step(*inputs, **keyword_inputs)``. It runs
    forward, loss, backward and the optimizer update. The loss is the model's
    output if it is a scalar tensor, its ``loss`` entry (Hugging Face style,
    e.g. ``step(input_ids=ids, labels=ids)``), or
    ``loss_fn(model(*inputs[:-num_targets], **keyword_inputs), *inputs[-num_targets:])``:
    the targets are the last positional arguments, keyword arguments go to the model; without
    ``num_targets``, as many as ``loss_fn`` requires after the output (``zerocc/options.py``'s ``targets_of``).
    Gradients are averaged over the ranks of ``group`` (default: the default
    process group, initialized from torchrun's environment if needed; world
    size 1 without one): a subgroup (``dist.new_group(ranks)``, ``mesh.get_group(dim)``) trains data parallel
    over its ranks, each rank of it passing the same group object (``docs/launch.md``, "Process groups").
    ``prefetch_bytes`` bounds the gathered parameter
    bytes (and the unreduced gradient bytes) that may be in flight at once.
    ``timeout`` (seconds) bounds how long a collective waits for the other
    ranks: a rank that died turns into a ``RankFailureError`` on the others
    instead of a hang. Without it collectives wait as long as the process
    group does (torch.distributed's default: 30 minutes on gloo, 10 on
    NCCL). Every call also checks, with one all-reduce of five integers, that
    all ranks' batches have the same shapes (``RankMismatchError`` if not).

    ``disable`` drops passes by name (``step.passes`` lists them; passes others
    need are refused, with the reason). ``verify=True`` checks invariants after
    every pass (``zerocc/verify.py``). ``dump_dir`` (or ``$ZEROCC_DUMP_DIR``)
    writes the program after every pass as ``{i:03d}_{pass}.py`` there.

    Training-loop features (``zerocc/passes/clip_gradients.py``, ``zerocc/eval.py``):
    ``grad_accumulation=K`` splits each batch along dim 0 into K micro-batches,
    runs forward and backward on each in turn inside the one compiled step and
    reduces the summed gradients once (the loss is the mean of the K
    micro-batch losses, as ``(loss / K).backward()`` per micro-batch gives).
    ``clip_grad_norm=max_norm`` clips the averaged gradients to a global
    ``clip_norm_type``-norm of at most ``max_norm`` before the update, as
    ``torch.nn.utils.clip_grad_norm_`` does (``step.last_grad_norm`` is the
    norm before clipping). A batch of a new shape compiles a new program, kept
    by shape; at most ``max_programs`` are kept (the least recently used is
    dropped with a warning), and ``static_shapes=True`` makes a new shape an
    error instead. ``step.eval_forward(*inputs)`` runs the model's forward in
    eval mode, without gradients or an update, on the step's parameters.

    ``memory_budget`` (bytes per rank) bounds the step's peak of live tensor
    bytes (model states, activations, gathered parameters, gradient buckets):
    the ``place_remat`` pass measures candidate plans (forward values
    recomputed in backward, at stage 3 forward gathers kept for backward) and
    takes the one predicted fastest among those that fit; across ranks, when no recomputation fits, it compiles again with ``bucket_bytes``
    and ``prefetch_bytes`` halved (down to 512 KiB buckets) while that lowers
    the reachable peak, and raises ``MemoryBudgetError`` naming the smallest
    peak it can reach when nothing fits. ``step.remat_plan`` says what it
    recomputes, ``step.shard_plan.bucket_bytes`` the bucket size it kept.
    Without ``memory_budget`` the budget is what the device offers
    (``zerocc/device_budget.py``: CUDA's free memory less 10%, or
    ``$ZEROCC_DEVICE_MEMORY``): the fastest plan if it fits,
    else planned against the device as against a ``memory_budget``; on CPU
    the default plan's peak, and at stage 3 across ranks a plan keeping every
    forward gather for backward is taken under it when the cost model does
    not predict it slower.

    Mixed precision (``zerocc/precision.py``, FSDP2's ``MixedPrecisionPolicy``
    semantics): ``param_dtype`` is the dtype forward and backward compute in
    (parameters stay fp32 masters, stage 3 gathers in ``param_dtype``),
    ``reduce_dtype`` the one gradients are reduced in (``param_dtype`` if not
    given), ``cast_forward_inputs`` casts the model's floating inputs to
    ``param_dtype``. ``loss_scale="dynamic"`` (or ``DynamicLossScale(...)``)
    scales the loss and skips steps whose gradients overflow, as
    ``torch.amp.GradScaler`` does; ``step.loss_scale`` reads the scale.

    ``gather_per_micro_batch`` (stage 3 with ``grad_accumulation`` > 1):
    gather each bucket again for every micro-batch's forward and backward
    (the default, ZeRO-3's memory: no gathered copy outlives its
    micro-batch), or, with ``False``, once for all forwards and once for all
    backwards (K times fewer gathers; both copies alive across the
    micro-batches: docs/guide/accumulation-clipping.md has the numbers).

    ``memory_pools=True`` allocates each pool of the memory plan once, as an
    arena, and has every op that can write there (through its ``out=``
    variant) place its output at its planned offset, and writes the
    optimizer's updates into the slots they replace (the ``place_buffers``
    pass); ``False`` leaves every tensor to PyTorch's allocator. ``None``
    (the default) reads ``$ZEROCC_MEMORY_POOLS`` (``0`` off, ``1`` on) and
    is on when it is unset: the plan's peak is then the peak of what runs.
    ``report()["memory_pools"]`` says which layout the last program ran.

    ``cache_dir`` (or ``$ZEROCC_CACHE_DIR``) keeps every compiled program in
    that folder, and a later process compiling the same step (the same
    model, its source files, optimizer, options, batch shapes, world size
    and versions) loads it instead of tracing and running the passes
    (``zerocc/disk_cache.py``); ``report()["compile_cache"]`` says whether
    the last compile loaded, stored or missed, and why.

    ``metrics_fn`` (``docs/guide/training-loops.md``, "Metrics and logging"): called inside the step on each
    micro-batch as ``metrics_fn(output, *inputs, **keyword_inputs)`` (the model's output, no gradient), it returns
    a dict of tensors (a training accuracy from the logits, an auxiliary loss, the logits themselves), which
    ``step.last_metrics`` holds after the call: this rank's own, unchanged by later steps, with ``grad_accumulation=K`` the K
    micro-batches' values stacked along a new first dimension.

    ``progress`` (``zerocc/progress.py``): by default a compile that has run 10 s says each phase it ends
    (the trace, each pass, the program) on rank 0's stderr, so a long compile is not taken for a hang;
    ``True`` says every phase of every compile, ``False`` nothing, and a function gets each line instead.
    """
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:   # raised here alone: its members go on
        raise ConfigError(
            f"group= is a group rank {dist.get_rank()} is not in (dist.new_group(ranks) returns "
            "GroupMember.NON_GROUP_MEMBER on the ranks it leaves out): its ranks compile and train without this one\n"
            "  fix: compile only on the group's ranks (`if dist.get_rank() in ranks:`), or pass each rank a group it "
            "is in (groups = [dist.new_group(r) for r in replicas] on every rank, then the one holding this rank)")
    refused = None
    try:
        check_stage(stage)
        check_model_and_optimizer(model, optimizer)
        check_not_meta(model)
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise ConfigError(f"group must be a torch.distributed.ProcessGroup (dist.new_group(...)) or None (the "
                              f"default group, created from torchrun's environment if needed), got {group!r}")
        options = CompileOptions.validate(
            model, stage=stage, loss_fn=loss_fn, num_targets=num_targets, bucket_bytes=bucket_bytes, timeout=timeout,
            prefetch_bytes=prefetch_bytes, disable=disable, verify=verify, dump_dir=dump_dir,
            grad_accumulation=grad_accumulation, clip_grad_norm=clip_grad_norm, clip_norm_type=clip_norm_type,
            static_shapes=static_shapes, max_programs=max_programs, memory_budget=memory_budget,
            param_dtype=param_dtype, reduce_dtype=reduce_dtype, loss_scale=loss_scale,
            cast_forward_inputs=cast_forward_inputs, memory_pools=memory_pools,
            gather_per_micro_batch=gather_per_micro_batch, cache_dir=cache_dir, progress=progress,
            metrics_fn=metrics_fn)
        options.passes()   # unknown or essential names in ``disable`` fail here, before any tracing
    except ConfigError as error:
        refused = error
    ranks = _refused_on_every_rank(refused, model, group, timeout)
    options = _budget_of_every_rank(options, ranks, timeout)
    steps_run, scaler = _close_earlier_steps(model, optimizer)
    step = CompiledStep(model, optimizer, options, group, ranks)
    step.steps = steps_run   # counted on from the step it took over from (checkpoints save the count)
    for slot, value in scaler.items():   # a dynamic loss scale goes on where both steps scale the loss
        if slot in step.state.initial_scaler:
            step.state.initial_scaler[slot].copy_(value)
    return step


def _refused_on_every_rank(refused: ConfigError | None, model, group, timeout) -> Ranks | None:
    """Raise ``refused`` here and a ``ConfigError`` naming it on every other rank: ``zerocc.compile`` is a collective
    (it broadcasts rank 0's parameters, and closes an earlier step), so a keyword one rank alone refused (its own
    ``stage=`` or path) left the others waiting in it for as long as that rank's process lived. Returns the step's
    ranks (on a group with ``timeout``, as the exchange was), None in one process."""
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) <= 1:   # one process
        if refused is not None:
            raise refused
        return None
    parameter = next(model.parameters(), None) if isinstance(model, nn.Module) else None
    try:   # a rank that refused its own timeout still makes the others' group (new_group is collective), without it
        check_timeout(timeout)
    except ConfigError:
        timeout = None
    ranks = resolve(group if isinstance(group, dist.ProcessGroup) else None,
                    None if parameter is None else parameter.device)
    if ranks.group is not None:
        failures.check_same_group(ranks, timeout)
    ranks = failures.with_timeout(ranks, timeout)
    with failures.collective_failures(ranks, 0, timeout, call="zerocc.compile"):
        failed = failures.failed_ranks(ranks, None if refused is None else str(refused))
    if refused is not None:
        raise refused
    if failed:
        raise ConfigError("zerocc.compile was refused on another rank, so no rank compiles (every rank must compile "
                          "the same step):\n" + "\n".join(f"  rank {rank}: {message}" for rank, message in failed))
    return ranks


def _budget_of_every_rank(options: CompileOptions, ranks: Ranks | None, timeout) -> CompileOptions:
    """``options`` with the smallest ``memory_budget`` any rank gave (None only where no rank gave one): every rank
    plans the one step against it, as against the device's budget (``CompiledStep._device_budget``). A budget each
    rank computes from its own device (a fraction of ``torch.cuda.mem_get_info()``) differs between ranks, and
    ``place_remat`` meets the other ranks in a collective for each plan it measures: ranks deciding against their own
    budget measured different plans, and their collectives paired with each other's (a hang, or an AttributeError
    from another rank's object)."""
    if ranks is None or ranks.group is None:
        return options
    with failures.collective_failures(ranks, 0, timeout, call="zerocc.compile"):
        budget = failures.smallest_over_ranks(ranks, options.memory_budget)
    return options if budget == options.memory_budget else dataclasses.replace(options, memory_budget=budget)


# The step that holds a model's (and its optimizer's) state, once its first call has moved it into slots.
_OWNERS: "weakref.WeakKeyDictionary[Any, weakref.ref]" = weakref.WeakKeyDictionary()


def _close_earlier_steps(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, dict[str, torch.Tensor]]:
    """A model or optimizer a started step holds is handed back by that step before a new one compiles it.

    The earlier step owns the parameters (released at stage 3) and the
    optimizer's state (sharded); closing it writes them back whole, so the new
    step starts where training is (new options, a notebook cell run again,
    parameters unfrozen), and the earlier step refuses further calls. Returns the steps the earlier step
    had run (0 if none) and its dynamic loss scale (copies, empty without one).
    """
    steps_run, scaler = 0, {}
    for thing in (model, optimizer):
        owner = _OWNERS.get(thing)
        if owner is not None and (step := owner()) is not None:
            steps_run = max(steps_run, step.steps)
            scaler = {slot: value.clone() for slot, value in step.state.scaler_state().items()}
            try:
                step.close()
            except ConfigError as error:   # its group destroyed (a notebook re-initializing): say who closed it
                raise ConfigError(f"zerocc.compile: this {'model' if thing is model else 'optimizer'} is held by "
                                  f"a step compiled earlier (after {step.steps} steps), which compiling it again "
                                  f"first closes, handing it back whole; that failed:\n{error}") from None
    return steps_run, scaler


def _say_if_replaced_shards(step: "CompiledStep", captured: Captured) -> None:
    """Warn where parameters that differed across ranks were replaced by rank 0's and the step's forward
    communicates between those ranks itself.

    A model split across ranks by hand (Megatron-style column and row parallel layers: each rank holds its slice
    of a weight, forward all-reduces the partial products) compiled over those same ranks trains as replicas:
    compile broadcast rank 0's slices to every rank, as DDP does, and the step averages their gradients, so the
    step trains a model that is not the user's, without an error. Differing parameters alone are common (ranks
    not seeded alike) and so are collectives alone (CLIP's gathered negatives), so only both together warn.
    """
    from torch.distributed.distributed_c10d import _resolve_process_group
    replaced = step._replaced_parameters
    if not replaced:
        return
    mine = set(dist.get_process_group_ranks(step.ranks.group))
    lines = []
    for node in captured.gm.graph.nodes:
        if not g.is_collective(node) or "sync_batch_norm.py" in (node.meta.get(g.STACK_TRACE) or ""):
            continue
        try:
            between = mine & set(dist.get_process_group_ranks(_resolve_process_group(node.args[-1])))
        except (ValueError, RuntimeError, TypeError):
            between = mine
        if len(between) > 1 and (line := user_line_of_node(node)):
            lines.append(line)
    if not lines:
        return
    names = ", ".join(replaced[:3]) + (f" and {len(replaced) - 3} more" if len(replaced) > 3 else "")
    warnings.warn(
        f"this rank's parameters {names} differed from rank 0's and were replaced by them at compile (every rank "
        "starts from rank 0's, as under DDP), and the step's forward communicates between these ranks itself, at "
        f"{'; '.join(dict.fromkeys(lines))}. If the parameters are this rank's shards of a model split across the "
        "ranks (tensor parallelism), the step trains rank 0's shards as replicas on every rank: compile over a "
        "group of the ranks that hold copies of the same shards (group=, one group per replica set; "
        "dist.new_group([rank]) for each rank where no two ranks hold the same shard). If they are replicas "
        "that were only initialized differently, seed every rank alike to silence this.",
        ReplicaWarning, stacklevel=user_stacklevel())


# elements summed at a time by ``_float64_sum``: a float64 copy of 2 MiB, reused from chunk to chunk
_SUM_CHUNK = 1 << 18


def _float64_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor``'s values (real and imaginary parts alike) in float64: a parameter's fingerprint.

    Summed a chunk at a time: ``sum(dtype=torch.float64)`` on the CPU makes a float64 copy of its whole input
    first, so fingerprinting the model wrote a float64 copy of every parameter at compile (a 98M GPT, one
    process: 17k page faults and 0.16-0.20 s of CPU, against 600 faults and 0.13-0.14 s a chunk at a time; how
    much of it a 2-rank run saves depends on whether the allocator keeps those pages for the slots made next).
    Every rank sums the same shapes the same way, so equal parameters still give equal sums.
    """
    values = tensor.detach()
    values = (torch.view_as_real(values) if values.is_complex() else values).reshape(-1)
    if values.numel() <= _SUM_CHUNK or values.dtype == torch.float64:
        return values.sum(dtype=torch.float64)
    # one float64 chunk written over and over: a new one per chunk is 2 MiB, which the C allocator may map afresh
    # each time (its threshold for that moves with the process's history: in a long test run, 21k faults for 64 MiB)
    chunk64 = torch.empty(_SUM_CHUNK, dtype=torch.float64, device=values.device)
    sums = []
    for chunk in values.split(_SUM_CHUNK):
        part = chunk64[: chunk.numel()]
        sums.append(part.copy_(chunk).sum())
    return torch.stack(sums).sum()


def _refuse_tensors_another_step_trains(step: "CompiledStep", captured: Captured | None = None) -> None:
    """A model sharing a parameter with another compiled step's model, trained by either step, is refused.

    Each step keeps what it trains (and the buffers it writes) in its own
    slots and points the user's module at them, releasing them at stage 3;
    parameters it does not train it reads from the module. A second step
    over a model that shares them (a GAN's generator loss reads the
    discriminator another step trains) would read the values of its own
    first call forever (stages 0-2) or the released placeholders (stage 3,
    an obscure failure in tracing), never the other step's updates as eager
    does. Checked at a step's first compile against every step that has
    started: parameters before tracing, then (given this step's
    ``captured``) the buffers either step writes.
    """
    others = {id(other): other for ref in list(_OWNERS.values())
              if (other := ref()) is not None and other is not step and other.state.started}
    if captured is None:   # before tracing: the parameters each step trains
        kind, tensors, verb = "parameter", "param", "trains"
        optimized = {id(p) for group in step.optimizer.param_groups for p in group["params"]}
        ours = {id(t): (names[0], t.requires_grad and id(t) in optimized)
                for names, t in named_tensors(step.model, tensors)}

        def held_by(other) -> set[str]:
            return {info.name for info in other.state.captured.params}
    else:   # after tracing: the buffers each step writes
        kind, tensors, verb = "buffer", "buffer", "writes"
        written = set(captured.written_buffers)
        ours = {id(t): (names[0], names[0] in written) for names, t in named_tensors(step.model, tensors)}

        def held_by(other) -> set[str]:
            return set(other.state.captured.written_buffers)
    for other in others.values():
        held = held_by(other)
        theirs = {id(t): (names[0], names[0] in held) for names, t in named_tensors(other.model, tensors)}
        shared = [(ours[i], theirs[i]) for i in ours.keys() & theirs.keys() if ours[i][1] or theirs[i][1]]
        if not shared:
            continue
        lines = "\n".join(f"  - {kind} {mine!r}: this step {verb if here else 'reads'} it, the other step "
                           f"{verb if there else 'reads'} it (as {other_name!r})"
                           for (mine, here), (other_name, there) in sorted(shared)[:8])
        raise ConfigError(
            f"this model shares {len(shared)} {kind}(s) with the model of another compiled step "
            f"({type(other.model).__name__}, stage {other.stage}), and one of the two steps {verb} them:\n{lines}\n"
            f"Each step keeps what it {verb} in its own copy, so neither would see the other's updates, where "
            "eager reads the shared module's current values. Give this model its own frozen copy of the shared "
            "module (copy.deepcopy(module).requires_grad_(False)) and refresh it in place after every call of "
            "the other step: `with other_step.full_model(writeback=False): my_copy.load_state_dict("
            "module.state_dict())` (zerocc's docs/guide/your-model.md, \"Two steps over one module\")")


def _setting(value) -> str:
    """A setting as ``hyperparameter_signature`` keys it, for a warning: a value, or how it is read every step."""
    if isinstance(value, tuple) and value[:1] == ("read every step",):
        return f"a {value[1]} number read every step" if len(value) > 1 else "a number read every step"
    if isinstance(value, tuple) and value[:1] in (("tuple",), ("list",)):
        return "(" + ", ".join(_setting(item) for item in value[1:]) + ")"
    return repr(value)


class CompiledStep:
    """A compiled training step and the sharded state it keeps between calls.

    Compilation happens at the first call (it needs an example batch) and again
    when the batch's shapes, the optimizer state's structure (the first step
    creates it) or a baked-in hyper-parameter change. The float settings of the
    param groups are read at every call (``optimizer_step.live_modes``). ``options`` are the checked keywords of ``compile``
    (``zerocc/options.py``), ``state`` what the step owns (``zerocc/step_state.py``),
    ``cache`` its programs (``zerocc/program_cache.py``).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, options: CompileOptions, group=None,
                 ranks: Ranks | None = None):
        self.model = model
        self.optimizer = optimizer
        self.options = options
        device = next(model.parameters()).device
        self.state = StepState(mixed.initial_scaler_slots(options.precision, device))
        self.cache = ProgramCache(options.max_programs, options.static_shapes)
        self.eval_programs: collections.OrderedDict[Any, Any] = collections.OrderedDict()   # zerocc/eval.py
        self.ranks: Ranks = ranks if ranks is not None else failures.with_timeout(resolve(group, device), options.timeout)
        self.arenas = Arenas()   # the memory pools' arenas, shared by this step's programs
        self.disk_cache = None if options.cache_dir is None else \
            disk_cache.DiskCache(options.cache_dir, model, self.ranks.rank, self.ranks.world_size)
        self.compile_seconds = 0.0
        self._warned_settings = False   # _say_which_settings_changed: once per step
        self._modules = tuple(model.modules())   # whose training flags and hooks each call's program key reads
        self._parameters = tuple(model.parameters())   # whose hooks each call's program key reads
        # channels-last parameters, read in their strides by every program (the step keeps them in flat buckets)
        self._parameter_layouts = parameter_layouts(model)
        self._python_sources = python_sources(model, options.loss_fn, options.metrics_fn)   # Python values forward, loss, metrics read
        self._metric_slots: list[str] = []   # the slots of metrics_fn's values in the last program run (last_metrics)
        self._values_reader = ValuesReader(self._python_sources)   # values_read at every call, remembered
        self._written_python: frozenset = frozenset()   # those forward writes itself (a counter): not in the key
        self._warned_python = False   # _say_which_python_values_changed: once per step
        self._warned_batch_values = False   # _say_which_batch_values_changed: once per step
        self._warned_read_values = False   # _say_which_read_values_changed: once per step
        # per compiled program: seconds per phase (compile_stats.py), the last compiles' kept, every one counted
        self.compile_stats = compile_stats.CompileHistory()
        self._user_hooks: list = []          # zerocc/user_views.py, installed at the first compile
        self._hardware: HardwareProfile | None = None   # _hardware_profile: measured (or read) when first needed
        self._progress = CompileProgress(False, self.ranks.rank)   # what the compile under way says (_compile_for)
        self.closed = False   # close(): the model and optimizer were handed back
        self._replaced_parameters: list[str] = []   # _sync_initial_state: this rank's, replaced by rank 0's
        if self.ranks.world_size > 1:
            self._sync_initial_state()

    # the options a user reads on the step
    stage = property(lambda self: self.options.stage)
    grad_accumulation = property(lambda self: self.options.grad_accumulation)
    max_programs = property(lambda self: self.options.max_programs)
    timeout = property(lambda self: self.options.timeout)
    precision = property(lambda self: self.options.precision)
    memory_pools = property(lambda self: self.options.memory_pools)

    @property
    def steps(self) -> int:
        """Steps run (saved in checkpoints)."""
        return self.state.steps

    @steps.setter
    def steps(self, value: int) -> None:
        self.state.steps = value

    # -- the step ----------------------------------------------------------------
    # torch.compile around the step (``torch.compile(step)``, or a compiled function that calls it) leaves it to run
    # as it is: the step is zerocc's compiled program, and dynamo, tracing into zerocc, failed inside it
    @torch.compiler.disable(reason=_DYNAMO_SKIPS)
    def __call__(self, *inputs, **keyword_inputs):
        self._check_open()
        user_views.refuse_inside_full_model(self, "the training step")
        if torch.is_inference_mode_enabled():
            raise ConfigError("the training step was called under torch.inference_mode(), where no gradient can be "
                              "computed (eager's loss.backward() fails there too): call it outside inference_mode; "
                              "to evaluate, use step.eval_forward(...)")
        if not torch.is_grad_enabled():   # an evaluation loop calling the training step would train on its batches
            raise ConfigError("the training step was called under torch.no_grad() (gradients disabled), where eager's "
                              "loss.backward() fails: it would train on this batch all the same; call it outside "
                              "no_grad; to evaluate, use step.eval_forward(...)")
        layout = BatchLayout.of(inputs, keyword_inputs)
        batch = layout.flatten(inputs, keyword_inputs)   # zerocc/batch.py: the program reads one flat list
        state = self.state
        check_batch(batch, layout, state.first_batch)   # dtypes, devices, requires_grad: before any program runs
        check_no_optimizer_step_hooks(self.optimizer)
        if state.param_groups is not None:
            check_param_groups_unchanged(state.param_groups, self.optimizer)
            check_requires_grad_unchanged(state.requires_grad, self.model)
            check_module_tensors_unchanged(state, self.model)
            user_views.check_placeholders_unwritten(self)
            user_views.check_parameters_unreplaced(self)
            user_views.adopt_replaced_buffers(self)
        held = HeldInterrupt()   # runtime/release.py: Ctrl-C in the update is raised once the call has its new state
        try:
            with self._undone_if_first_call_fails(), \
                    failures.collective_failures(self.ranks, state.steps + 1, self.options.timeout):
                if self.disk_cache is not None and state.param_groups is None:   # until a first call succeeds
                    self.disk_cache.restore_settings_modes(self.optimizer)   # stored with an entry: no probe's trace
                modes = live_modes(self.optimizer)   # the settings' lookup, once per call (optimizer_step.Modes)
                key = self._cache_key(batch, layout, modes)
                entry = self.cache.lookup(key, batch)   # checks the program's data guards on this rank's batch
                # every call: a rank whose batch changed shape, or took another side of a branch on batch values
                # (zerocc/data_guards.py), would compile while the others run a cached program; one all-reduce checks
                # the shapes and tells every rank whether any rank missed its cache: then every rank compiles
                if failures.check_calls_agree(self.ranks, failures.TRAINING_STEP, agreement_lines(batch, layout),
                                              missed=entry is None):
                    key, entry = self._compile_for(key, batch, layout)   # compiling compares the program across ranks
                self.cache.use(key, entry)
                if state.param_groups is None:
                    state.param_groups = param_groups_of(self.optimizer)   # what the buckets are laid out for
                    state.requires_grad = requires_grad_of(self.model)   # what is trained, what is kept frozen
                    state.first_batch = FirstBatch.of(batch, layout)   # what later batches are checked against
                for (group_index, name), value in zip(live_layout(self.optimizer, modes), live_settings(self.optimizer, modes)):
                    state.slots[decisions.setting_slot(group_index, name)] = value
                if entry.measured_peak_bytes is not None:
                    loss = entry.program.run(state.slots, batch, held.hold)
                else:   # the first run of a program also measures its peak of live tensor bytes
                    entry.program.make_arena_views()   # not through the tracker's dispatch: no bytes, much time
                    tensors = [t for t in [*state.slots.values(), *self.arenas.tensors(), *entry.program.constants()]
                               if isinstance(t, torch.Tensor)]
                    inputs = [t for t in batch if isinstance(t, torch.Tensor)]
                    with LiveBytesTracker(tensors, inputs) as tracker:
                        del tensors, inputs
                        loss = entry.program.run(state.slots, batch, held.hold)
                    entry.measured_peak_bytes = tracker.peak_bytes
                    self._say_if_the_budget_was_exceeded(entry)
                    if entry.stored_as is not None:   # a later process loading it need not measure again
                        self.disk_cache.remember_peak(entry.stored_as, tracker.peak_bytes)
                self._drop_state_of_skipped_first_step(entry, batch, layout)
                self._metric_slots = [slot for slot in entry.program.output_slots if slot.startswith(METRIC_PREFIX)]
            state.steps += 1
            user_views.point_module_at_slots(self)
            # the step ran the optimizer's update; tell LR schedulers so, as optimizer.step() would
            self.optimizer._opt_called = True
        except BaseException as error:
            held.release(deliver=False)
            self._note_lost_state(error)
            raise
        held.release(deliver=True)
        return loss

    @contextlib.contextmanager
    def _undone_if_first_call_fails(self):
        """A first call that fails (a bad batch, a failed compile) leaves the step, model and optimizer as they were.

        The first compile moves the model's parameters and the optimizer's
        state into the step's slots (releasing the parameters at stage 3);
        a failure after that would leave a step that half owns them. Later
        calls need nothing: a failed program rebinds no slot
        (``runtime/program.py``).
        """
        if self.state.started:
            yield
            return
        tensors = [(t, t.data) for t in [*self.model.parameters(), *self.model.buffers()]]
        grads = [(p, p.grad) for p in self.model.parameters()]
        held_state = self.optimizer.state
        optimizer_state = dict(held_state)
        try:
            yield
        except BaseException:
            for tensor, data in tensors:
                user_views.set_data(tensor, data)
                user_views.restore_parameter_class(tensor)
            for parameter, grad in grads:
                parameter.grad = grad
            self.optimizer.state = held_state
            self.optimizer.state.clear()
            self.optimizer.state.update(optimizer_state)
            self.state.reset()
            self.cache.clear()
            self.eval_programs.clear()
            _OWNERS.pop(self.model, None)
            _OWNERS.pop(self.optimizer, None)
            for handle in self._user_hooks:
                handle.remove()
            self._user_hooks = []
            raise

    def _drop_state_of_skipped_first_step(self, entry: CacheEntry, batch, layout) -> None:
        """A first step that overflowed under loss scaling leaves no optimizer state, as GradScaler would.

        The graph keeps parameters and existing state with ``where``; state the
        step creates has no old value to keep, so it is dropped here (one host
        read of the flag, on programs that create state only).
        """
        program, slots = entry.program, self.state.slots
        made, self.state.made_initial_state = self.state.made_initial_state, False
        if mixed.FOUND_INF_SLOT not in slots:   # no loss scaling: nothing to drop (every call comes here)
            return
        arguments = set(program.argument_slots)
        created = [s for s in program.output_slots if s.startswith("state:") and s not in arguments]
        if made and bool(slots[mixed.FOUND_INF_SLOT] > 0):
            # the state the step made before its first step, kept as it was: dropped too. The next call compiles a
            # first-step program (it finds no state), as after a first-step program's skip
            for slot in [s for s in slots if s.startswith("state:")]:
                del slots[slot]
            return
        if created and bool(slots[mixed.FOUND_INF_SLOT] > 0):
            for slot in created:
                del slots[slot]
            # the next step is a first step again: the same program
            self.cache.add(self._cache_key(batch, layout), entry, batch)

    @property
    def loss_scale(self) -> float | None:
        """The current dynamic loss scale (None without loss scaling); reading it waits for the step."""
        scale = self.state.scaler_state().get(mixed.SCALE_SLOT)
        return None if scale is None else float(scale)

    def scaler_state(self) -> dict[str, float | int]:
        """The dynamic loss scale as ``torch.amp.GradScaler.state_dict()`` gives it (``scale``, ``growth_factor``,
        ``backoff_factor``, ``growth_interval``, ``_growth_tracker``; empty without loss scaling, as a disabled
        scaler's), so that an eager loop's ``GradScaler.load_state_dict`` goes on from it; reading it waits for the
        step. ``load_scaler_state`` takes it (or a GradScaler's) back. Checkpoints save the scale themselves."""
        return mixed.grad_scaler_state(self.precision, self.state.scaler_state())

    def load_scaler_state(self, state: dict) -> None:
        """Go on from ``state``'s dynamic loss scale and growth tracker: a ``torch.amp.GradScaler.state_dict()`` (an
        eager AMP loop moving to the step), ``step.scaler_state()``, or the slots an earlier zerocc's
        ``scaler_state()`` gave (``{"loss_scale:scale": ..., "loss_scale:growth_tracker": ...}``). Every rank
        loads it. The growth and backoff factors and the growth interval are compiled into the program: a state
        with others is refused, naming the ``loss_scale=`` to compile with, as is one given to a step without loss
        scaling or an empty one (a disabled GradScaler's) to a step with it."""
        user_views.refuse_inside_full_model(self, "step.load_scaler_state")
        slots = self.state.scaler_state()
        values = mixed.scaler_slot_values(self.precision, state)   # refuses what the program cannot go on from
        with torch.no_grad():
            for slot, value in values.items():
                slots[slot].fill_(value)

    def _cache_key(self, batch, layout: BatchLayout, modes: Modes | None = None) -> CacheKey:
        """``modes``: the optimizer's ``live_modes`` where the call found them (else found here)."""
        python, tensors = self.values_read()
        return CacheKey(input_signature(batch, layout), self.state.state_key(),
                        hyperparameter_signature(self.optimizer, modes), autocast_state(), training_modes(self._modules),
                        self.hook_ids(), python, saved_tensors_hooks_state(), torch.get_default_dtype(), tensors,
                        attention_backends())

    def hook_ids(self) -> tuple:
        """The user's hooks on the model's modules and parameters now (``program_cache.hook_ids``), traced in."""
        return hook_ids(self._modules, self._parameters, frozenset(h.id for h in self._user_hooks))

    def values_read(self) -> tuple[tuple, tuple]:
        """The Python values and tensors forward and the loss read now, which a trace bakes in
        (``program_cache.values_read``), less those forward writes itself."""
        return self._values_reader(self._written_python)

    def _warn_of_float16_autocast_without_loss_scaling(self, autocast: tuple) -> None:
        """As ``param_dtype=torch.float16`` without ``loss_scale`` warns at compile: an AMP loop's GradScaler cannot
        stand in for it (``scaler.scale(loss).backward()`` fails with "element 0 of tensors does not require grad",
        ``scaler.step(optimizer)`` with "No inf checks were recorded"), so the warning says what does."""
        precision = self.options.precision
        if (precision is None or precision.loss_scale is None) and any(dtype is torch.float16 for _, dtype, _ in autocast):
            warnings.warn("the step is called under torch.autocast(dtype=torch.float16) without loss scaling: small "
                          "gradients underflow to zero in float16. Pass loss_scale='dynamic' to zerocc.compile (it "
                          "scales, skips and checkpoints as torch.amp.GradScaler does); a GradScaler of your own cannot "
                          "scale the step, which has run backward and the optimizer's update when it returns the loss",
                          UserWarning, stacklevel=user_stacklevel())

    def _compile_for(self, key: CacheKey, batch, layout) -> tuple[CacheKey, CacheEntry]:
        """Compile the program for ``key`` and ``batch``'s side of its data guards, and keep it: the key it is kept
        under (without the Python values the trace itself changed, ``_written_python``) and the entry.

        With several ranks, every rank compiles when any missed its cache (its own batch: a rank whose batch
        took the side it had compiled compiles that side again), so that the compiles' collectives meet.
        """
        self.cache.check_static_shapes(key.signature)
        self._say_which_settings_changed(key)
        self._warn_of_float16_autocast_without_loss_scaling(key.autocast)
        self._say_which_python_values_changed(key)
        self._say_which_batch_values_changed(key)
        self._say_which_read_values_changed(key, batch)
        started = time.perf_counter()
        before = values_read(self._python_sources)
        self._progress = CompileProgress(self.options.progress, self.ranks.rank)
        # the user's MemTracker, profilers, global hooks (zerocc/user_tooling.py)
        # the placeholders are zerocc's own while it compiles (user_views.HeldParameter refuses the user's reads)
        with suspended_user_tooling(), fewer_collections(), outside_autocast(), user_views.placeholders_as_parameters():
            found = self._compile(batch, layout, autocast=key.autocast, key=key)
        self.compile_seconds += time.perf_counter() - started
        self._progress(f"compiled the step's program for {describe_signature(key.signature)}")
        after = values_read(self._python_sources)
        written = {(label, name) for label, name, *_ in set(sum(before, ())) ^ set(sum(after, ()))}
        if written:   # forward changes them itself (a call counter): keyed on, every call would compile again
            self._written_python |= written
            python, tensors = self.values_read()
            key = dataclasses.replace(key, python=python, tensors=tensors)
        if (hooks := self.hook_ids()) != key.hooks:
            # forward registered them itself, on its first call (transformers' output capturing does): the trace ran
            # them, so the program is the one for the model as it is now; keyed on the old ones, the next call would
            # compile again
            key = dataclasses.replace(key, hooks=hooks)
        self.cache.add(key, found, batch)
        if key.state == INITIAL_STATE and (self.state.state_key() or found.reads_initial_state):
            # traced with existing state (a checkpoint loaded before the first call, or the optimizer's initial
            # state the step made): it is the steady state's program
            self.cache.add(dataclasses.replace(key, state=self.state.state_key()), found, batch)
        self.cache.evict_beyond_limit(key, keep=found)
        return key, found

    def _say_which_settings_changed(self, key: CacheKey) -> None:
        """Warn, once per step, when a program is compiled only because optimizer settings changed.

        Every float setting step() reads is read every step (``optimizer_step.live_modes``); what is traced into the
        program is a flag (nesterov, amsgrad), a number that is not a float, the side of zero of a float step() branches
        on (``if momentum != 0``), and a float another package's step() makes a Python number of: a schedule that
        changes one of those each step compiles a program every step.
        """
        if self._warned_settings:
            return
        for known in list(self.cache.entries):
            if known.signature == key.signature and known.hyperparameters != key.hyperparameters:
                changed = [f"param group {index}'s {name}: {_setting(dict(old).get(name))} -> {_setting(value)}"
                           for index, (old, new) in enumerate(zip(known.hyperparameters, key.hyperparameters))
                           for name, value in new if dict(old).get(name) != value]
                warnings.warn(
                    "zerocc compiles a new program because optimizer settings changed (" + "; ".join(changed[:4]) +
                    "). Float settings are read every step; a flag, a number that is not a float, a float crossing zero where "
                    "step() branches on it (`if momentum != 0`), or one the optimizer's step() turns into a Python number "
                    "is traced into the program, so a schedule that changes one every step compiles every step. "
                    "Said once per zerocc.compile.", stacklevel=user_stacklevel())
                self._warned_settings = True
                return

    def _say_if_the_budget_was_exceeded(self, entry: CacheEntry) -> None:
        """Warn when a program's first run held more than ``memory_budget`` at its peak.

        The plan the budget was met by leaves out the tensors whose size the data decides (an MoE's tokens per
        expert, boolean-mask indexing): their sizes are unbacked symbols, known only as the step runs.
        """
        budget, peak = self.options.memory_budget, entry.measured_peak_bytes
        if budget is None or peak is None or peak <= budget:
            return
        planned = (f" (the plan's: {final_peak(entry.ctx, self.options.memory_pools):,})"
                   if entry.ctx.memory_plan is not None else "")
        lines = list(dict.fromkeys(line for node in entry.program.gm.graph.nodes
                                   if any(g.is_data_dependent(v) for v in g.values_of(node.meta.get(g.VAL)))
                                   and (line := user_line_of_node(node))))
        if lines:
            why = (f"the plan leaves out the tensors whose size the data decides, known only as the step runs, made "
                   f"at {'; '.join(lines[:3])}{f' and {len(lines) - 3} more lines' if len(lines) > 3 else ''}. ")
        else:
            why = "the plan the budget was met by underestimated it. "
        warnings.warn(
            f"memory_budget={budget:,} bytes was exceeded: the step's first run on this batch held {peak:,} bytes at "
            f"its peak{planned}: {why}Lower memory_budget by the difference ({peak - budget:,} bytes, more where "
            f"other batches route more unevenly) to leave them room.", MemoryBudgetWarning, stacklevel=user_stacklevel())

    def _say_which_batch_values_changed(self, key: CacheKey) -> None:
        """Warn, once per step, when a program is compiled because a Python value in the batch changed.

        A number or string in the batch is traced into the program as a constant: a token count passed as an
        ``int`` (``num_items_in_batch=n``, transformers' loss normalization) is another value almost every step,
        and compiled a program per value without a word until ``max_programs`` were exceeded.
        """
        if self._warned_batch_values:
            return
        for known in list(self.cache.entries):
            changed = changed_batch_values(known.signature, key.signature)
            # the optimizer state's key aside: the first step's program (SGD with momentum) was compiled before it
            if changed and dataclasses.replace(known, signature=key.signature, state=key.state) == key:
                warnings.warn(
                    "zerocc compiles a new program because Python values in the batch changed (" + "; ".join(changed[:4])
                    + "): each is traced into the program as a constant, so a value that changes every batch (a token "
                    "count such as num_items_in_batch, a sample id) compiles every batch. Pass such a number as a "
                    "tensor (num_items_in_batch=torch.tensor(n)), which one program reads at every step and which "
                    "trains as eager does with the number; keep a value forward does not read out of the step's "
                    "arguments." + (" A torch.Generator passed to the step is the program's: pass the same one at "
                    "every call (reseed it with manual_seed, as eager would), not a new one per call."
                    if any("Generator" in change for change in changed) else "")
                    + (" A numpy array in the batch is a Python value too: pass torch.from_numpy(array), a tensor that one "
                       "program reads at every step." if any(": ndarray " in change for change in changed) else "")
                    + " Said once per zerocc.compile.", RecompileWarning, stacklevel=user_stacklevel())
                self._warned_batch_values = True
                return

    def _say_which_read_values_changed(self, key: CacheKey, batch) -> None:
        """Warn, once per step, when a program is compiled because values the trace read from the batch as Python
        numbers differ on this batch (``data_guards.ValueGuard``, a size decided as a number).

        Values read with ``.tolist()``/``.item()`` stay symbols unless the trace needs them as numbers
        (``int(count)``): then each program holds the values it was traced with, and a hash-routed MoE's counts
        per expert (another set every batch) compiled every step without a word until ``max_programs``.
        """
        if self._warned_read_values:
            return
        changed = [line for entry in self.cache.entries.get(key, ())
                   for line in values_that_differ(entry.program.guards, batch)]
        if changed:
            changed = list(dict.fromkeys(changed))
            warnings.warn(
                "zerocc compiles a new program for the same shapes because values read from the batch differ ("
                + "; ".join(changed[:4]) + "): the trace needed them as Python numbers, so each program holds the "
                "values it was traced with, and values that change every batch (token counts per expert, sequence "
                "lengths) compile every batch. Keep them symbols: pass what .tolist() or .item() gives straight to "
                "ops (torch.split(x, counts.tolist()), x.new_zeros(n)) without int(), float() or a Python branch on "
                "them, which one program then serves for every batch. Said once per zerocc.compile.",
                RecompileWarning, stacklevel=user_stacklevel())
            self._warned_read_values = True

    def _say_which_python_values_changed(self, key: CacheKey) -> None:
        """Warn, once per step, when a program is compiled because a Python value forward or the loss reads changed.

        Such values (``program_cache.values_read``: dropout's ``p``, a temperature, a loss weight) are traced
        into the program as constants, so one that changes every step compiles every step.
        """
        if self._warned_python:
            return
        for known in list(self.cache.entries):
            if dataclasses.replace(known, python=key.python) == key and known.python != key.python:
                changed = changed_python_values(known.python, key.python)
                warnings.warn(
                    "zerocc compiles a new program because Python values that forward or the loss read changed ("
                    + "; ".join(changed[:4]) + "): they are traced into the program as constants, so a value that "
                    "changes every step compiles every step. Keep such a value in a tensor the program reads, e.g. a "
                    "buffer (self.register_buffer('weight', torch.tensor(1.0), persistent=False)) that you set with "
                    "weight.fill_(value) between steps; keep a value forward does not read (a loop's counter) off the "
                    "model. Said once per zerocc.compile.", RecompileWarning, stacklevel=user_stacklevel())
                self._warned_python = True
                return

    def _compile(self, batch, layout: BatchLayout | None = None, autocast: tuple = (), key: CacheKey | None = None
                 ) -> CacheEntry:
        """Capture the step on this batch, run the pipeline (``zerocc/driver.py``), build the program.

        With a compile cache (``cache_dir``), a compile an earlier process stored for the same fingerprint is
        loaded instead of capture and passes (``zerocc/disk_cache.py``), and a new one is stored.
        """
        layout = layout or BatchLayout(len(batch))   # all positional
        state = self.state
        device = self._device_budget()   # every rank, every compile: it is agreed across ranks
        if not state.started:   # before tracing: stage 3 left another step's parameters released in the module
            _refuse_tensors_another_step_trains(self)
        if self.disk_cache is not None and key is not None:
            fingerprint = disk_cache.fingerprint(self, key, state.released_shapes, state.plan)
            made = self._load_from_disk(fingerprint, batch, device)
        else:   # ranks with and without a cache (set on some nodes only) must still meet in the loaders' all-reduce
            fingerprint = made = None
            failures.every_rank_has(self.ranks, False)
        if made is None:
            # numpy arrays copied: a constant traced from one must not share the memory a data loader reuses
            made = self._capture_and_run_passes(with_arrays_copied(batch), layout, autocast, device)
            if fingerprint is not None and self._store_on_disk(fingerprint, made):
                made = made._replace(stored_as=fingerprint.digest)
        captured, compiled, fresh, state_signature = made.captured, made.compiled, made.fresh, made.state_signature
        with compiled.stats.timed(compile_stats.AGREE):
            failures.check_ranks_agree(self.ranks, compiled.gm, compiled.ctx.shard_plan)   # before its collectives hang
        with compiled.stats.timed(compile_stats.CODEGEN):
            program = Program.from_graph(compiled.gm, self.arenas)
        program.guards = captured.guards
        if not state.started:
            _refuse_tensors_another_step_trains(self, captured)
            _say_if_replaced_shards(self, captured)
            state.captured = captured
            state.module_tensors = module_tensors_of(self.model)
            state.module_tree = ModuleTree(self.model)
            state.plan = compiled.ctx.shard_plan
            with compiled.stats.timed(compile_stats.SLOTS):
                state.slots = slot_store.initial_slots(compiled.ctx.shard_plan, captured, self.model, self.optimizer,
                                                       fresh_state=fresh)
            state.made_initial_state = fresh is not None
            state.slots.update(state.initial_scaler)   # created (or loaded from a checkpoint) before the first step
            # the step owns the (sharded) optimizer state from now on: reading it from optimizer.state says where it is.
            # A frozen parameter's state (trained before, frozen on resume) is no part of the program: it stays in
            # optimizer.state, as eager's optimizer keeps it, and is saved, loaded and handed back with the rest
            held = user_views.HeldOptimizerState(self)
            trained = {id(self.model.get_parameter(info.name)) for info in captured.params}
            held.update({p: s for p, s in self.optimizer.state.items() if id(p) not in trained and s})
            self.optimizer.state = held
            for info in captured.params:   # its gradients live in its buckets: a .grad left by eager steps before
                # compiling would read as the step's own, and hold a whole copy of the parameter on every rank
                self.model.get_parameter(info.name).grad = None
            _OWNERS[self.model] = _OWNERS[self.optimizer] = weakref.ref(self)
            self._user_hooks = user_views.install(self)
            user_views.release_model_parameters(self)
        state.state_signature = state_signature
        self.compile_stats.append(compiled.stats)
        return CacheEntry(program, compiled.ctx, compiled.history, reads_initial_state=fresh is not None,
                          measured_peak_bytes=made.measured_peak_bytes, stored_as=made.stored_as)

    def _refuse_other_trained_parameters(self, captured: Captured, batch, layout: BatchLayout) -> None:
        """Refuse a program whose loss reaches other parameters than the first program's did.

        The buckets and the optimizer state are laid out once, for the parameters the first program trained; a
        parameter the loss reaches only later had no bucket (the step silently never trained it), and one it no
        longer reaches had no gradient to put there (the compile failed inside the shard pass). Eager's optimizer
        skips a parameter without a gradient and starts its state at its first one.
        """
        state = self.state
        if state.plan is None:
            return
        planned = {state.captured.params[segment.param].name for bucket in state.plan.buckets
                   for segment in bucket.segments}
        reached = {info.name for info, node in zip(captured.params, g.placeholders(captured.gm, g.ROLE_PARAM))
                   if not node.meta.get(g.UNUSED)}
        if planned == reached:
            return
        changes = batch_changes = []
        known = next(iter(self.cache.entries), None)
        if known is not None:
            batch_changes = changed_batch_entries(known.signature, input_signature(batch, layout))   # a collator's key
            changes = batch_changes + changed_python_values(known.python, self.values_read()[0])
            if known.training != training_modes(self._modules):
                changes.append("the modules' training modes (model.train()/model.eval())")
        lost, gained = sorted(planned - reached), sorted(reached - planned)
        raise CaptureError(
            "this call's program trains other parameters than the step's first program: "
            + "; ".join(part for part in (
                f"the loss no longer reaches {', '.join(map(repr, lost[:6]))}{', ...' if len(lost) > 6 else ''}"
                if lost else "",
                f"it now reaches {', '.join(map(repr, gained[:6]))}{', ...' if len(gained) > 6 else ''}, which it did "
                "not then" if gained else "") if part)
            + f" (changed since then: {'; '.join(changes[:4]) if changes else 'a branch on the batch or the model'})."
            " The step lays out its buckets and optimizer state once, for the parameters its first program trained, "
            "so it cannot follow a part of the model switched on or off between steps (an auxiliary head, a "
            "warm-up branch). Compile again after the switch: zerocc.compile(model, optimizer, ...) takes the model "
            "and optimizer over from this step, trained, as eager goes on with them."
            + (" A batch that leaves out an entry the first had, or sets it to None, cannot switch a layer off from "
               "step to step: give every batch the same entries (a collator's optional keys in every batch)."
               if batch_changes else "") + " Nothing was changed")

    def _capture_and_run_passes(self, batch, layout: BatchLayout, autocast: tuple,
                                device: DeviceBudget | None = None) -> "_Made":
        state, options = self.state, self.options

        def trace(optimizer_state, drop_state_of_unused=False):
            fake_mode = make_fake_mode()
            if callable(optimizer_state):
                optimizer_state = optimizer_state(fake_mode)
            return fake_mode, capture(
                self.model, self.optimizer, batch, layout=layout, loss_fn=options.loss_fn,
                num_targets=options.num_targets, fake_mode=fake_mode, optimizer_state=optimizer_state,
                check_update_elementwise=options.stage != 0, parameter_shapes=state.released_shapes,
                parameter_layouts=self._parameter_layouts,
                grad_accumulation=options.grad_accumulation, precision=options.precision, autocast=autocast,
                metrics_fn=options.metrics_fn, drop_state_of_unused=drop_state_of_unused)

        # before the first step the step makes the optimizer's initial state itself, when it can learn it
        # (zerocc/optimizer_init.py): the first step then runs the steady state's program, one compile for both
        fresh, failed = None, None
        try:
            if state.state_signature is not None and state.state_key():
                # the optimizer state the slots hold (none after a first step that overflowed under loss scaling:
                # a program compiled then, for another batch shape or mode, is a first step again)
                fake_mode, captured = trace(self._fake_state)
            elif not state.started and (fresh := self._initial_optimizer_state()) is not None:
                # eager makes no state for a parameter the loss does not reach: capture leaves out what was made for
                # those (tracing the step again without it took as long as the trace)
                fake_mode, captured = trace(lambda mode: self._fake_initial_state(mode, fresh), drop_state_of_unused=True)
                unused = [info.name for info, node in zip(captured.params, g.placeholders(captured.gm, g.ROLE_PARAM))
                          if node.meta.get(g.UNUSED) and fresh[info.name]]
                if unused:
                    fresh = {name: {} if name in unused else states for name, states in fresh.items()}
            else:
                fake_mode, captured = trace(None)
            self._refuse_other_trained_parameters(captured, batch, layout)
        except Exception as error:   # noqa: BLE001 - raised below, after every rank heard of it
            failed = error
        # a rank whose trace failed (its batch, its optimizer) would leave the others waiting in the passes' or the
        # agreement's collectives: every rank hears of it and raises
        failures.raise_if_any_rank_failed(self.ranks, failed, "tracing the step on its batch")
        self._progress(f"traced the step: {len(captured.gm.graph.nodes)} nodes")
        state_signature = _state_signature_of(captured)   # before the passes rewrite the captured graph
        options = dataclasses.replace(options, device_budget=device, hardware=self._hardware_profile)
        compiled = run_passes(captured, fake_mode, options, self.optimizer, world_size=self.ranks.world_size,
                              rank=self.ranks.rank, group_name=self.ranks.group_name, previous_plan=state.plan,
                              progress=self._progress)
        return _Made(captured, compiled, fresh, state_signature)

    def _hardware_profile(self) -> HardwareProfile:
        """This machine's profile (``zerocc/hardware.py``: measured once per machine, device, dtype and group size,
        then read from disk) for ``place_remat`` to compare the plans that fit a budget by. Every rank asks at the
        same point of the same pipeline, so every rank takes part in the measurement."""
        if self._hardware is None:
            parameter = next(self.model.parameters())
            precision = self.options.precision
            dtype = precision.compute_dtype(parameter.dtype) if precision is not None else parameter.dtype
            self._hardware = measure_hardware(self.ranks.group, parameter.device, dtype)
        return self._hardware

    def _device_budget(self) -> DeviceBudget | None:
        """Without a ``memory_budget``, what the device offers now (``zerocc/device_budget.py``): its free memory
        plus what the step's tensors already take of it (the model's and optimizer's before the first step, the
        slots and arenas after); the smallest over ranks, so that every rank plans the same step."""
        if self.options.memory_budget is not None:
            return None
        state = self.state
        held = [*self.model.parameters(), *self.model.buffers(), *self.arenas.tensors(),
                *(value for per_param in self.optimizer.state.values() for value in per_param.values()),
                *(state.slots.values() if state.slots else ())]
        mine = device_budget(next(self.model.parameters()).device, held)
        smallest = failures.smallest_over_ranks(self.ranks, None if mine is None else mine.bytes)
        # a rank offering the default plan's peak (CPU) offers less than any number larger than that peak: a
        # number from another rank ($ZEROCC_DEVICE_MEMORY on some ranks only) must not lift it (that rank planned
        # against the number, over its own default plan's peak); every rank plans at the default plan's peak,
        # and under the number as well (zerocc/driver.py)
        at_default_peak = failures.smallest_over_ranks(self.ranks, 0 if mine is not None and mine.bytes is None else 1)
        if at_default_peak == 0 and smallest is not None:
            return DeviceBudget(None, f"{DEFAULT_PLAN_PEAK.source}, a rank's, and at most {smallest / 1e6:.2f} MB, "
                                      "another rank's", also_under=smallest)
        if smallest is None or (mine is not None and smallest == mine.bytes):
            return mine
        return DeviceBudget(smallest, "the smallest a rank's device offers" + (f"; this rank's: {mine.source}"
                                                                                if mine is not None else ""))

    def _load_from_disk(self, fingerprint: disk_cache.Fingerprint, batch, device: DeviceBudget | None = None):
        """A compile stored by an earlier process for this one's fingerprint, as ``_capture_and_run_passes``
        returns it, or None; every rank loads, or none does."""
        cache, state = self.disk_cache, self.state
        stats = CompileStats("loaded")
        dump_dir = dump_dir_of(self.options.dump_dir, self.ranks.rank, self.ranks.world_size)
        with stats.timed(compile_stats.CACHE_FIND):
            index, why = cache.find(fingerprint)
            fresh = None
            if index is not None and not state.started and state.state_signature is None:
                fresh = self._initial_optimizer_state()
        payload = None
        if index is not None:
            with stats.timed(compile_stats.CACHE_LOAD):   # a dump_dir writes its history: read (and checked) now
                payload = cache.load(fingerprint.digest, index, disk_cache.user_objects(self.model, self.optimizer),
                                     make_fake_mode(), history_now=bool(dump_dir))
            if payload is not None and payload["reads_initial_state"] != (fresh is not None):
                payload, why = None, "the optimizer's initial state is made otherwise"
            elif payload is not None and not all_hold(payload["captured"].guards, batch):
                payload, why = None, "the batch takes another branch of the model's data-dependent code"
            elif payload is not None and state.started and payload["ctx"].shard_plan != state.plan:
                payload, why = None, "the step's buckets are laid out otherwise"
            elif payload is not None and device is not None \
                    and (device.bytes or device.also_under) is not None \
                    and final_peak(payload["ctx"], self.options.memory_pools) > (device.bytes or device.also_under):
                payload, why = None, f"its peak does not fit what the device offers now ({device.source})"
            elif payload is None:
                why = "unreadable entry"
        with stats.timed(compile_stats.CACHE_FIND):
            everyone = failures.every_rank_has(self.ranks, payload is not None)
        if not everyone:
            if payload is not None:
                why = "another rank has no entry"
            cache.last_outcome = f"miss ({why})"
            if why.startswith(("changed", "source changed", "the entry under this name")):
                warnings.warn(f"zerocc compile cache: compiling, the stored program for {type(self.model).__name__} "
                              f"does not fit: {why}", CompileCacheWarning, stacklevel=user_stacklevel())
            return None
        cache.last_outcome = "loaded"
        compiled = Compiled(payload["gm"], payload["ctx"], payload["history"], stats)
        if dump_dir:   # a compile writes them as its passes run
            write_dumps(dump_dir, compiled.history)
            write_memory_plan(dump_dir, compiled.ctx)
        return _Made(payload["captured"], compiled, fresh if payload["reads_initial_state"] else None,
                     payload["state_signature"], index.get("measured_peak_bytes"), fingerprint.digest)

    def _store_on_disk(self, fingerprint: disk_cache.Fingerprint, made: "_Made") -> bool:
        """Write what a compile made for later processes; returns whether it was stored."""
        cache, compiled = self.disk_cache, made.compiled
        with compiled.stats.timed(compile_stats.CACHE_STORE):
            graph_pickle.keep_code(compiled.gm)   # written once: for this process's first run and for the entry
            ctx = dataclasses.replace(compiled.ctx, traces=None, rest_of_pipeline=None)
            payload = {"captured": made.captured, "gm": compiled.gm, "ctx": ctx, "history": compiled.history,
                       "reads_initial_state": made.fresh is not None, "state_signature": made.state_signature}
            objects = disk_cache.user_objects(self.model, self.optimizer)
            names = {**disk_cache.held_tensors(self.values_read()[1]), **disk_cache.names_of(objects)}
            outcome = cache.store(fingerprint, disk_cache.source_files(made.captured, self), payload, names)
            if outcome.startswith("stored"):
                cache.store_settings_modes(self.optimizer)
        cache.last_outcome = f"{cache.last_outcome}, then {outcome}" if cache.last_outcome.startswith("miss") else outcome
        return outcome.startswith("stored")

    def _initial_optimizer_state(self):
        """The optimizer's initial state per trained parameter, if learned (``zerocc/optimizer_init.py``).

        Under loss scaling too: the first step then runs the steady state's program, the one a run resumed from a
        checkpoint compiles, so both plan the same peak under a ``memory_budget`` (a first-step program, whose
        state is made at the update's end, peaked lower: a run fit a budget its own second step and its resume
        were refused under). A first step that overflows keeps that state unchanged (``where``) and the step then
        drops it, as GradScaler's optimizer has none (``_drop_state_of_skipped_first_step``).
        """
        return optimizer_init.initial_state(self.optimizer, trained_parameters(self.model, self.optimizer))

    def _fake_initial_state(self, fake_mode, fresh) -> list[dict[str, torch.Tensor]]:
        states = []
        with fake_mode:
            for name, tensor, _ in trained_parameters(self.model, self.optimizer):
                shape = self.state.released_shapes.get(name, tuple(tensor.shape))
                states.append({key: torch.empty(shape if value.fills else (), dtype=value.value.dtype,
                                                device=tensor.device) for key, value in fresh[name].items()})
        return states

    def _sync_initial_state(self) -> None:
        """Every rank starts from rank 0's parameters and buffers, as DDP does.

        The parameters this rank held other values of are remembered (``_replaced_parameters``, found by comparing
        each one's sum with rank 0's): where the step's own collectives run between these ranks, they may be
        shards of a model split across them (``_say_if_replaced_shards``).
        """
        with torch.no_grad():
            named = list(self.model.named_parameters())
            names, params = [name for name, _ in named], [param for _, param in named]
            # which parameters differ from rank 0's, by a float64 sum of each: read in place (a copy of each to
            # compare after the broadcast would write the whole model once more), one broadcast for all of them
            device = params[0].device if params else torch.device("cpu")
            sums = torch.stack([_float64_sum(p).to(device) for p in params]) if params \
                else torch.zeros(0, dtype=torch.float64)
            first = sums.clone()
            dist.broadcast(first, group_src=0, group=self.ranks.group)
            same = (sums == first) | (sums.isnan() & first.isnan())
            for tensor in [*params, *self.model.buffers()]:
                dist.broadcast(tensor.data, group_src=0, group=self.ranks.group)   # the group's first rank
        self._replaced_parameters = [name for name, alike in zip(names, same.tolist()) if not alike]

    def _fake_state(self, fake_mode) -> list[dict[str, torch.Tensor]]:
        states = []
        params = {names[0]: t for names, t in named_tensors(self.model, "param")}
        for info, signature in zip(self.state.captured.params, self.state.state_signature):
            state = {}
            with fake_mode:
                for key, (scalar, dtype) in signature.items():
                    shape = () if scalar else info.shape
                    state[key] = torch.zeros(shape, dtype=dtype, device=params[info.name].device)
            states.append(state)
        return states

    # -- checkpoints (zerocc/state_dict.py) ------------------------------------------
    def state_dict(self) -> dict:
        """This rank's shards of parameters, buffers and optimizer state, and the optimizer's param_groups, by name.

        Ready for ``dcp.save``, and, before or after the first call, for
        ``dcp.load`` then ``load_state_dict`` (it names every entry to read).
        """
        self._check_open()
        return state_dict_module.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict from ``state_dict()`` that ``dcp.load`` filled (any world size or stage saved it)."""
        self._check_open()
        user_views.refuse_inside_full_model(self, "step.load_state_dict")
        state_dict_module.load_state_dict(self, state_dict)

    # -- reading it back --------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters and buffers, keyed as ``model.state_dict()`` (a collective at stage 3)."""
        self._check_open()
        state = self.state
        if not state.started:
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if self._gathers:
            failures.meet(self.ranks, "step.full_state_dict", self.steps, self.timeout)
        with state.reading_keys_only():   # zerocc/user_views.py: the keys only, the values come from the slots
            names = state_dict_names(self.model, [*state.module_tensors["param"], *state.module_tensors["buffer"]])
        by_name = self._whole_tensors("step.full_state_dict")
        return {key: by_name[key if key in by_name else name] for key, name in names.items()}

    def _whole_tensors(self, call: str) -> dict[str, torch.Tensor]:
        """Every parameter, frozen parameter and buffer by each of its names, whole (copies); gathering them is a
        collective where masters are sharded (``call`` names it in a failure)."""
        state = self.state
        with failures.collective_failures(self.ranks, self.steps, self.timeout, call=call):
            buckets = slot_store.full_buckets(state.plan, state.slots, self.ranks.group)
        views = slot_store.parameter_views(state.plan, state.captured, buckets)
        by_name: dict[str, torch.Tensor] = {}
        for index, info in enumerate(state.captured.params):
            value = views[index] if index in views else state.slots[decisions.param_slot(info.name)]
            for name in info.names:
                by_name[name] = value.clone()
        for info in state.captured.frozen:
            for name in info.names:
                by_name[name] = state.slots[decisions.frozen_slot(info.name)].clone()
        for info in state.captured.buffers:
            for name in info.names:
                by_name[name] = state.slots[decisions.buffer_slot(info.name)].clone()
        return by_name

    def full_model(self, writeback: bool = True):
        """``with step.full_model(): model(x)``: the whole parameters in the user's module for the block.

        As FSDP's ``summon_full_params`` and DeepSpeed's ``GatheredParameters``:
        a collective at stage 3 over several ranks (every rank enters it); with
        ``writeback`` the module's parameter values go back into the step on
        exit, so edits there train on; ``writeback=False`` drops them.
        """
        self._check_open()
        if self._gathers:
            failures.meet(self.ranks, "step.full_model", self.steps, self.timeout)
        return user_views.full_model(self, writeback)

    def full_optimizer(self):
        """``with step.full_optimizer(): optimizer.eval()``: the whole parameters in the module and the whole
        optimizer state in ``optimizer.state`` for the block, both written back into the step on exit.

        For an optimizer's own methods that read its state and change the parameters: Schedule-Free's
        ``optimizer.eval()`` before evaluating or saving, ``optimizer.train()`` before training on (a collective at
        stages 1-3 over several ranks: every rank enters it). Anything else in the block sees what
        ``full_model`` shows (``zerocc/user_views.py``).
        """
        self._check_open()
        user_views.refuse_inside_full_model(self, "step.full_optimizer")
        if self._gathers or (self.state.started and self.ranks.world_size > 1 and self.stage > 0):
            failures.meet(self.ranks, "step.full_optimizer", self.steps, self.timeout)
        return user_views.full_optimizer(self)

    def close(self) -> None:
        """Hand the model and optimizer back, trained: the step cannot be called afterwards.

        The module holds its whole parameters and buffers again, the optimizer
        its state in ``optimizer.state`` as eager keeps it (a collective at
        stages 1-3 over several ranks: every rank calls it), and the hooks the
        step put on them are removed. ``zerocc.compile`` over a model or
        optimizer a started step holds closes that step first, so compiling
        again (other options, newly unfrozen parameters) continues training
        from here; a dynamic loss scale goes on in a new step that scales the
        loss too (``step.scaler_state()`` gives it in ``GradScaler.state_dict()``'s format, for a GradScaler of your own).
        """
        if self.closed:
            return
        user_views.refuse_inside_full_model(self, "step.close")
        if self.state.half_loaded is not None:
            # handing back would give the model and optimizer part of a checkpoint and part of the step's own
            # training, silently (``zerocc.compile`` over them closes this step: it refuses too)
            self._check_open()
        if self.state.started:
            if self.ranks.world_size > 1 and (self.stage > 0 or self._gathers):
                failures.meet(self.ranks, "step.close", self.steps, self.timeout)
            user_views.hand_back(self, state_dict_module.gathered_optimizer_state(self))
        for handle in self._user_hooks:
            handle.remove()
        self._user_hooks = []
        for thing in (self.model, self.optimizer):
            if (owner := _OWNERS.get(thing)) is not None and owner() is self:
                del _OWNERS[thing]
        self.state.reset()
        self.cache.clear()
        self.eval_programs.clear()
        self.arenas.clear()   # a closed step kept in a variable held its memory pools (as large as the model's state)
        self.closed = True

    @property
    def _gathers(self) -> bool:
        """Whether reading the whole parameters is a collective: some bucket's masters are sharded across ranks."""
        plan = self.state.plan
        return self.state.started and self.ranks.world_size > 1 and any(plan.holds_shard(b) for b in plan.buckets)

    def _note_lost_state(self, error: BaseException) -> None:
        """A program that failed after its release point (``runtime/program.py``) dropped slots it had not replaced:
        every later call on the step refuses (``_check_open``) instead of tracing a first step again over fresh
        optimizer state (stages 0-2) or failing on a missing slot (stage 3)."""
        cause: BaseException | None = error
        while cause is not None and not hasattr(cause, "zerocc_lost_slots"):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            self.state.lost = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"

    def _check_open(self, loading: bool = False) -> None:
        if self.state.half_loaded is not None and not loading:
            raise ConfigError(
                f"an earlier zerocc.load_checkpoint(step, {self.state.half_loaded!r}) failed after it began to "
                "write the checkpoint into the step: the step holds part of that checkpoint and part of what it "
                "held before, and cannot train, evaluate or save. Call zerocc.load_checkpoint again (that "
                "checkpoint or another) before anything else")
        if self.state.lost is not None:
            raise ConfigError(
                f"an earlier call of this step failed in the optimizer's update ({self.state.lost}), after it had "
                "begun to free the old parameters and optimizer state: they are gone, and the step cannot train, "
                "evaluate or save. Build the model and optimizer again, compile them, and load the last checkpoint "
                "(zerocc.load_checkpoint(step, path))")
        if self.closed:
            raise ConfigError(
                "this compiled step was closed (step.close(), or a later zerocc.compile over its model or "
                "optimizer, which closes it): the model and optimizer were handed back with the state it had "
                "trained. Call the step zerocc.compile returned last")

    @property
    def passes(self) -> list[str]:
        """The passes a compilation runs, in order (registered passes included, disabled ones not)."""
        return ["capture", *[p.name for p in self.options.passes()]]

    # -- training-loop features ---------------------------------------------------
    @property
    def last_grad_norm(self) -> torch.Tensor | None:
        """The global gradient norm of the last step, before clipping (None without ``clip_grad_norm``)."""
        if not self.state.started:
            return None
        return self.state.slots.get(GRAD_NORM_SLOT)

    @property
    def last_metrics(self) -> dict[str, torch.Tensor]:
        """What ``metrics_fn`` returned in the last step, by name (empty without ``metrics_fn``, or before a step).

        Each value is the step's own output tensor: the next steps replace it in the step and never write into
        it, so a list of them kept across steps holds every step's values.
        """
        if not self.state.started:
            return {}
        return {slot[len(METRIC_PREFIX):]: self.state.slots[slot] for slot in self._metric_slots
                if slot in self.state.slots}

    @torch.compiler.disable(reason=_DYNAMO_SKIPS)
    def eval_forward(self, *inputs, **keyword_inputs):
        """The model's output on ``inputs`` in eval mode: forward only, no gradient, no update (``zerocc/eval.py``)."""
        self._check_open()
        if self.state.started:   # it reads the step's slots as the tensors of the first call
            check_module_tensors_unchanged(self.state, self.model)
            user_views.check_placeholders_unwritten(self)
            user_views.check_parameters_unreplaced(self)
            user_views.adopt_replaced_buffers(self)
        from .eval import eval_forward
        return eval_forward(self, inputs, keyword_inputs)

    def graph(self, name: str = "insert_collectives") -> GraphSnapshot:
        """The program after pass ``name`` (of the plan the last call ran), printable as Python."""
        history = self._require_compiled().history
        for snapshot in history:
            if snapshot.name == name:
                return snapshot
        raise ConfigError(f"no pass named {name!r}; the passes are: {', '.join(s.name for s in history)}")

    @property
    def shard_plan(self) -> decisions.ShardPlan:
        return self._require_compiled().ctx.shard_plan

    @property
    def memory_plan(self) -> MemoryPlan:
        """Where every tensor of the last program lives: ``print`` it for the table, ``.summary()``, ``.plot(path)``."""
        return self._require_compiled().ctx.memory_plan

    @property
    def remat_plan(self) -> decisions.RematPlan | None:
        """What ``memory_budget`` made backward recompute (None without a budget): print it for the table."""
        return self._require_compiled().ctx.remat_plan

    def predicted_step_time(self, profile: HardwareProfile | str) -> StepTime:
        """The last program's step time on ``profile`` (``zerocc.measure_hardware()``, or a name in
        ``zerocc.hardware.NAMED``), from ``zerocc/analysis/step_time.py``'s cost model."""
        entry = self._require_compiled()
        return predict(entry.program.gm, self.ranks.world_size, profile_of(profile))

    @property
    def checkpoint_plan(self):
        """Renamed ``remat_plan``: reading it says so."""
        raise AttributeError(decisions.CHECKPOINT_PLAN_RENAMED)

    def _require_compiled(self) -> CacheEntry:
        if self.closed:   # a notebook's earlier step, closed by compiling again: not "call it once with a batch"
            raise ConfigError("this compiled step was closed (step.close(), or a later zerocc.compile over its model or "
                              "optimizer, which closes it): its programs were dropped with it. Inspect the step "
                              "zerocc.compile returned last")
        if self.cache.last is None:
            raise ConfigError("the step has not been compiled yet: call it once with a batch first")
        return self.cache.last

    def __repr__(self) -> str:
        """What a notebook shows for ``step``: the model, optimizer, stage, ranks and where the step stands."""
        if self.closed:
            where = "closed"
        elif self.state.lost is not None or self.state.half_loaded is not None:
            where = "failed: calls refused"
        elif self.cache.last is None:
            where = "not compiled yet (compiles at its first call)"
        else:
            programs = len(self.cache.programs())
            where = f"{self.steps} steps, {programs} program{'s' if programs != 1 else ''}"
        return (f"<zerocc step: {type(self.model).__name__} with {type(self.optimizer).__name__}, stage {self.stage}, "
                f"rank {self.ranks.rank} of {self.ranks.world_size}; {where}>")

    def explain(self) -> str:
        """A short human report of what every pass decided for the last compiled program."""
        from .explain import explain
        entry = self._require_compiled()
        return explain(entry.ctx, entry.history, self.report())

    def report(self) -> dict:
        """What the current plan does per step and holds per rank, from the compiler's own accounting."""
        entry = self._require_compiled()
        ctx, captured = entry.ctx, self.state.captured
        comm, counts = communication(entry.program.gm)
        infos = [*captured.params, *captured.frozen]
        return {
            "stage": self.stage,
            "world_size": self.ranks.world_size,
            "rank": self.ranks.rank,
            "param_count": sum(info.numel for info in infos),
            "param_bytes": sum(i.numel * i.dtype.itemsize for i in infos),
            **mixed.report_entries(self.precision, captured.params[0].dtype),
            "buckets": len(ctx.shard_plan.buckets),
            "padding_elements": ctx.shard_plan.padding_elements,
            "comm_bytes_per_step": comm,
            "collectives_per_step": counts,
            "model_state_bytes_per_rank": model_state_bytes(entry.program.gm, ctx),
            **memory_plan_entries(ctx.memory_plan),   # None each with disable=["plan_memory"]
            "arena_bytes": self.arenas.nbytes,
            "measured_peak_bytes": entry.measured_peak_bytes,
            "compile_seconds": round(self.compile_seconds, 3),
            "compile_seconds_by_phase": compile_stats.by_phase(self.compile_stats),
            # zerocc/disk_cache.py: the last compile "loaded", or "miss (why), then stored (...)" / "then not stored: ..."
            "compile_cache": "off" if self.disk_cache is None else self.disk_cache.last_outcome,
            "remat": ctx.remat_plan.to_dict() if ctx.remat_plan is not None else None,
        }


class _Made(NamedTuple):
    """What a compile made, or loaded from the compile cache on disk (``zerocc/disk_cache.py``)."""
    captured: Captured
    compiled: Compiled
    fresh: dict | None            # the optimizer's initial state the step makes (zerocc/optimizer_init.py), or None
    state_signature: list         # the optimizer state's structure the program reads (_state_signature_of)
    measured_peak_bytes: int | None = None   # loaded: the peak the storing process measured in its first run
    stored_as: str | None = None             # its entry in the compile cache, if stored or loaded


def _state_signature_of(captured: Captured) -> list[dict[str, tuple[bool, torch.dtype]]]:
    """Per trained parameter: its optimizer state after this step, as (is scalar, dtype) by key."""
    output = g.output_node(captured.gm).args[0]
    by_slot = dict(zip(captured.gm.meta[g.OUTPUT_SLOTS], output[1:]))
    signature = []
    for info, keys in zip(captured.params, captured.new_state_keys):
        entry = {}
        for key in keys:
            value = by_slot[decisions.state_slot(info.name, key)].meta[g.VAL]
            entry[key] = (value.dim() == 0, value.dtype)
        signature.append(entry)
    return signature
