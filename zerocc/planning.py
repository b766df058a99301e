"""``zerocc.plan``: the same pipeline on fake tensors, for any world size, without devices.

The model may live on the meta device and the optimizer may be built over
its meta parameters: capture traces on fake tensors, no process group is
created (collectives name a placeholder group; the graph is never run) and
no tensor of the model's size is allocated. The plan is of the steady state:
capture is given fake optimizer state whose structure comes from one real
``step()`` of the user's optimizer over a one-element tensor per param group.

The keywords are ``zerocc.compile``'s, with the same meaning and the same
checks: ``param_dtype`` / ``reduce_dtype`` / ``loss_scale`` run the
``mixed_precision`` pass, ``grad_accumulation`` traces K micro-batches,
``clip_grad_norm`` adds the ``clip_gradients`` pass, ``memory_pools`` the
``place_buffers`` pass; the report counts the bytes of the planned graph.
``timeout``, ``static_shapes``, ``max_programs`` and ``cache_dir`` only
concern a running step (accepted, no effect on the plan); ``group`` is refused: a plan has a
``world_size`` and no process group.

``accounting_dtype`` is the ZeRO paper's accounting instead (its Table 1:
fp16 parameters and gradients, fp32 master parameters and optimizer state,
2 + 2 + 12 bytes per parameter with Adam): the graph stays in the model's
dtype and parameters, gradients and communication are counted in
``accounting_dtype`` bytes, an fp32 master copy of the parameters this rank
updates with the optimizer state. The compiled layout differs from it (the
gradients zerocc keeps are in ``reduce_dtype``, and at stage 3 the rank
holds only the fp32 master shard), so use ``param_dtype`` to plan what
``compile`` will run.
"""
from __future__ import annotations

import collections
import dataclasses
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
import torch.nn as nn

from . import compile_stats
from . import graph as g
from . import decisions
from .analysis.step_time import HardwareProfile, StepTime, predict
from .batch import BatchLayout
from .capture import Captured, capture, named_tensors
from .compile_stats import CompileStats
from .context import CompileContext
from .driver import fewer_collections, run_passes
from .errors import ConfigError
from .hardware import profile_of
from .memory_plan import memory_plan_entries
from .options import DEFAULT_BUCKET_BYTES, CompileOptions, check_model_and_optimizer, check_stage
from . import precision as mixed
from .pipeline import DEFAULT_PREFETCH_BYTES, GraphSnapshot
from .fake_kernels import attention_as_on_cpu
from .tracing import make_fake_mode

# The collectives of a plan name this group; the graph is never run.
PLANNING_GROUP = "zerocc_plan"


def plan(model: nn.Module, optimizer: torch.optim.Optimizer, stage: int = 3, world_size: int = 1, *,
         example_inputs: Sequence[Any] = (), example_keyword_inputs: Mapping[str, Any] | None = None,
         loss_fn: Callable | None = None, num_targets: int | None = None, metrics_fn: Callable | None = None,
         param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None, loss_scale=None,
         cast_forward_inputs: bool = True, grad_accumulation: int = 1, clip_grad_norm: float | None = None,
         clip_norm_type: float = 2.0, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
         prefetch_bytes: int = DEFAULT_PREFETCH_BYTES, rank: int = 0,
         disable: Sequence[str] = (), verify: bool = False, dump_dir: str | None = None,
         progress: bool | Callable[[str], None] = False, memory_pools: bool | None = None,
         accounting_dtype: torch.dtype | None = None, gather_per_micro_batch: bool = True,
         memory_budget: int | None = None, device_memory: int | None = None,
         hardware: HardwareProfile | str | None = None, **runtime_only) -> "Plan":
    """Plan one steady-state training step at ``world_size`` ranks without running it.

    Takes ``zerocc.compile``'s keywords (see the module docstring for the few
    that only concern a running step). Returns a ``Plan`` with the same
    ``report()``, ``graph(name)``, ``passes``, ``explain()`` (and
    ``memory_plan`` when a pass made one) as a compiled step.
    ``memory_budget`` (bytes per rank) plans activation checkpointing as
    ``zerocc.compile`` does; ``Plan.remat_plan`` says what it recomputes.
    ``device_memory`` (bytes per rank) is what the planned job's devices
    offer: without ``memory_budget`` it is planned against as ``compile``
    plans against a CUDA device's free memory (``zerocc/device_budget.py``);
    without it, as ``compile`` plans on CPU: under the default plan's peak.
    ``hardware`` (a name in ``zerocc.hardware.NAMED``, or a ``HardwareProfile``;
    default ``"h100-sxm-bf16"``) is what the plans that fit a budget are compared
    on: the one predicted fastest there is chosen.
    ``example_inputs`` and ``example_keyword_inputs`` are one batch as the
    step would be called with: ``step(*example_inputs, **example_keyword_inputs)``.
    """
    check_runtime_only(runtime_only)
    return Planner(model, optimizer, example_inputs=example_inputs, example_keyword_inputs=example_keyword_inputs,
                   loss_fn=loss_fn, num_targets=num_targets, metrics_fn=metrics_fn,
                   param_dtype=param_dtype, reduce_dtype=reduce_dtype, loss_scale=loss_scale,
                   cast_forward_inputs=cast_forward_inputs, grad_accumulation=grad_accumulation,
                   clip_grad_norm=clip_grad_norm, clip_norm_type=clip_norm_type, prefetch_bytes=prefetch_bytes,
                   bucket_bytes=bucket_bytes, progress=progress, accounting_dtype=accounting_dtype,
                   gather_per_micro_batch=gather_per_micro_batch, **runtime_only,
                   ).plan(stage, world_size, rank=rank, disable=disable, verify=verify, dump_dir=dump_dir,
                          memory_pools=memory_pools, memory_budget=memory_budget, device_memory=device_memory,
                          hardware=hardware)


# compile keywords that only concern a running step: a plan accepts them and they change nothing in it
RUNTIME_ONLY = ("timeout", "static_shapes", "max_programs", "cache_dir")


def check_runtime_only(keywords: dict) -> None:
    """Refuse what a plan cannot honour (a process group, unknown keywords); accept the runtime-only ones."""
    if "group" in keywords:
        raise ConfigError("zerocc.plan does not take group=: a plan runs no collective, it has a world_size "
                          "(and rank) instead; pass world_size=<the group's size>")
    unknown = sorted(k for k in keywords if k not in RUNTIME_ONLY)
    if unknown:
        raise TypeError(f"zerocc.plan() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}")


def check_no_meta_inputs(model: nn.Module, example_inputs, example_keyword_inputs) -> None:
    """Meta example inputs for a model that is not on the meta device: the trace would fail deep inside the model
    on a device mismatch, and the values a model reads from its batch (a mask, token ids) are not there to read."""
    flat, _ = pytree.tree_flatten((tuple(example_inputs), example_keyword_inputs or {}))
    if any(isinstance(t, torch.Tensor) and t.is_meta for t in flat):
        device = next(model.parameters()).device
        raise ConfigError(
            f"zerocc.plan: the example inputs are on the meta device but the model's parameters are on {device}: "
            f"give the batch on {device} (its values are read where the model branches on them), or build the "
            "model under torch.device('meta') too (its example inputs are then taken to the meta device)")


def check_example_batch(example_inputs, example_keyword_inputs) -> None:
    """One batch as the step is called with: a tensor given as ``example_inputs`` was iterated into its rows (a
    (4, 8) batch reached forward as 4 positional arguments, "takes 3 positional arguments but 5 were given")."""
    if not isinstance(example_inputs, (tuple, list)):
        raise ConfigError(
            f"zerocc.plan: example_inputs must be a tuple (or list) of the step's positional arguments, got a "
            f"{type(example_inputs).__name__}: for one input write example_inputs=(x,); inputs the model takes by "
            "keyword go in example_keyword_inputs={'input_ids': ..., ...}")
    if example_keyword_inputs is not None and not isinstance(example_keyword_inputs, Mapping):
        raise ConfigError(
            f"zerocc.plan: example_keyword_inputs must be a dict of the step's keyword arguments, got a "
            f"{type(example_keyword_inputs).__name__}; positional inputs go in example_inputs=(...)")


def check_one_device(model: nn.Module) -> None:
    """Part of a model on the meta device and part with values (a layer built outside ``torch.device('meta')``, or
    loaded with ``assign=True``): the trace failed inside forward on "found at least two devices, meta and cpu"."""
    tensors = [(name, t) for name, t in [*model.named_parameters(), *model.named_buffers()] if t.dim() > 0]
    on_meta = [name for name, t in tensors if t.is_meta]
    elsewhere = [(name, t.device) for name, t in tensors if not t.is_meta]
    if on_meta and elsewhere:
        def listed(names):
            return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise ConfigError(
            f"zerocc.plan: the model is partly on the meta device ({listed(on_meta)}) and partly on "
            f"{elsewhere[0][1]} ({listed([name for name, _ in elsewhere])}): a plan needs no values, so build the "
            "whole model under `with torch.device('meta'):` (or the whole model with values)")


class Planner:
    """Captures a model's step once (per stage kind) and plans it for many stages and world sizes."""

    def __init__(self, model, optimizer, *, example_inputs, example_keyword_inputs=None, loss_fn=None,
                 num_targets=None, metrics_fn=None, param_dtype=None, reduce_dtype=None, loss_scale=None, cast_forward_inputs=True,
                 grad_accumulation=1, clip_grad_norm=None, clip_norm_type=2.0, prefetch_bytes=DEFAULT_PREFETCH_BYTES,
                 bucket_bytes=DEFAULT_BUCKET_BYTES, progress=False, accounting_dtype=None,
                 gather_per_micro_batch=True, **runtime_only):
        check_model_and_optimizer(model, optimizer)
        if accounting_dtype is not None and not (isinstance(accounting_dtype, torch.dtype)
                                                 and accounting_dtype.is_floating_point):
            raise ConfigError(f"accounting_dtype must be a floating torch.dtype (torch.bfloat16, ...), "
                              f"got {accounting_dtype!r}")
        if accounting_dtype is not None and param_dtype is not None:
            raise ConfigError("give param_dtype (plan the mixed precision compile runs) or accounting_dtype "
                              "(the ZeRO paper's accounting over a full-precision graph), not both")
        check_runtime_only(runtime_only)
        check_example_batch(example_inputs, example_keyword_inputs)
        check_one_device(model)
        # the stage and the pipeline's keywords come with each plan() (CompileOptions.for_pipeline)
        self.options = CompileOptions.validate(
            model, loss_fn=loss_fn, num_targets=num_targets, metrics_fn=metrics_fn, bucket_bytes=bucket_bytes,
            prefetch_bytes=prefetch_bytes, grad_accumulation=grad_accumulation, clip_grad_norm=clip_grad_norm,
            clip_norm_type=clip_norm_type, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
            loss_scale=loss_scale, cast_forward_inputs=cast_forward_inputs,
            gather_per_micro_batch=gather_per_micro_batch, memory_pools=False, **runtime_only)
        self.model, self.optimizer = model, optimizer
        if any(param.is_meta for param in model.parameters()):   # a batch built on the CPU would meet meta weights
            example_inputs, example_keyword_inputs = pytree.tree_map_only(
                torch.Tensor, lambda t: t.to("meta"), (tuple(example_inputs), example_keyword_inputs))
        else:
            check_no_meta_inputs(model, example_inputs, example_keyword_inputs)
        self.layout = BatchLayout.of(tuple(example_inputs), example_keyword_inputs or {})
        self.example_inputs = tuple(self.layout.flatten(tuple(example_inputs), example_keyword_inputs or {}))
        self.param_dtype = accounting_dtype   # the paper's accounting (None: count the graph as compiled)
        self.say = (lambda line: print(f"[zerocc plan] {line}", file=sys.stderr, flush=True)) if progress is True \
            else (progress or None)
        self._captures: dict[bool, tuple[Captured, Any, float]] = {}
        self._traces: dict[bool, dict] = {}   # optimizer subgraphs, per fake mode

    def _captured(self, elementwise_check: bool) -> tuple[Captured, Any, float]:
        if elementwise_check not in self._captures:
            started = time.perf_counter()
            fake_mode = make_fake_mode()
            state = fake_optimizer_state(self.model, self.optimizer, fake_mode)
            with attention_as_on_cpu():   # a model built on meta: the attention kernel a device runs
                captured = capture(self.model, self.optimizer, self.example_inputs, layout=self.layout,
                                   loss_fn=self.options.loss_fn,
                                   num_targets=self.options.num_targets, fake_mode=fake_mode, optimizer_state=state,
                                   check_update_elementwise=elementwise_check,
                                   grad_accumulation=self.options.grad_accumulation, precision=self.options.precision,
                                   metrics_fn=self.options.metrics_fn)
            seconds = time.perf_counter() - started
            if self.say:
                self.say(f"capture: {len(captured.gm.graph.nodes)} nodes, {seconds:.1f} s")
            self._captures[elementwise_check] = (captured, fake_mode, seconds)
        return self._captures[elementwise_check]

    def plan(self, stage: int, world_size: int, *, rank: int = 0, disable: Sequence[str] = (), verify: bool = False,
            dump_dir: str | None = None, memory_pools: bool | None = None, memory_budget: int | None = None,
             device_memory: int | None = None, hardware: HardwareProfile | str | None = None) -> "Plan":
        check_stage(stage)
        if not isinstance(world_size, int) or world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"world_size must be a positive int and 0 <= rank < world_size, got {world_size!r}, {rank!r}")
        options = self.options.for_pipeline(stage=stage, disable=disable, verify=verify, dump_dir=dump_dir,
                                            memory_pools=memory_pools, memory_budget=memory_budget,
                                            device_memory=device_memory)   # as compile()
        options = dataclasses.replace(options, hardware=None if hardware is None else profile_of(hardware))
        with fewer_collections():
            captured, fake_mode, capture_seconds = self._captured(stage != 0)
            started = time.perf_counter()
            compiled = run_passes(captured, fake_mode, options, self.optimizer, world_size=world_size, rank=rank,
                                  group_name=PLANNING_GROUP if world_size > 1 else None, planning=True,
                                  traces=self._traces.setdefault(stage != 0, {}), progress=self.say,
                                  keep_capture=True)
        seconds = {"capture": capture_seconds, "passes": time.perf_counter() - started}
        if self.say:
            self.say(f"planned stage {stage} at world size {world_size}: {seconds['passes']:.1f} s")
        return Plan(compiled.gm, compiled.ctx, compiled.history, self.param_dtype, seconds, options.precision,
                    compiled.stats)


class Plan:
    """The outcome of ``zerocc.plan``: what one rank would hold and send per step, and the graphs that say so."""

    def __init__(self, gm: fx.GraphModule, ctx: CompileContext, history: list[GraphSnapshot],
                 param_dtype: torch.dtype | None, seconds: dict[str, float], precision=None,
                 stats: CompileStats | None = None):
        self.gm, self.ctx, self.history = gm, ctx, history
        self.compile_stats = stats   # seconds per phase; a Planner's later plans reuse its capture's
        self.stage, self.world_size, self.rank = ctx.stage, ctx.world_size, ctx.rank
        self.param_dtype = param_dtype   # accounting_dtype: the ZeRO paper's accounting
        self.precision = precision
        self.seconds = seconds

    @property
    def passes(self) -> list[str]:
        return [s.name for s in self.history]

    def graph(self, name: str = "insert_collectives") -> GraphSnapshot:
        for shot in self.history:
            if shot.name == name:
                return shot
        raise ConfigError(f"no pass named {name!r}; the passes are: {', '.join(self.passes)}")

    @property
    def shard_plan(self) -> decisions.ShardPlan:
        return self.ctx.shard_plan

    @property
    def memory_plan(self):
        """The memory plan, when the pipeline has a pass that makes one (else None)."""
        return getattr(self.ctx, "memory_plan", None)

    @property
    def remat_plan(self) -> decisions.RematPlan | None:
        """What ``memory_budget`` made backward recompute (None without a budget)."""
        return self.ctx.remat_plan

    @property
    def checkpoint_plan(self):
        """Renamed ``remat_plan``: reading it says so."""
        raise AttributeError(decisions.CHECKPOINT_PLAN_RENAMED)

    def predicted_step_time(self, profile: HardwareProfile | str) -> StepTime:
        """The planned step's time on ``profile`` (a name in ``zerocc.hardware.NAMED`` such as
        ``"h100-sxm-bf16"``, or ``zerocc.measure_hardware()``'s), from ``zerocc/analysis/step_time.py``."""
        return predict(self.gm, self.world_size, profile_of(profile))

    def report(self) -> dict:
        captured = self.ctx.captured
        infos = [*captured.params, *captured.frozen]
        comm, counts = communication(self.gm, self.param_dtype)
        return {
            "stage": self.stage,
            "world_size": self.world_size,
            "rank": self.rank,
            "param_count": sum(i.numel for i in infos),
            "param_bytes": sum(i.numel * (self.param_dtype or i.dtype).itemsize for i in infos),
            **mixed.report_entries(self.precision, captured.params[0].dtype),
            **({"param_dtype": str(self.param_dtype).replace("torch.", "")} if self.param_dtype else {}),
            "buckets": len(self.shard_plan.buckets),
            "padding_elements": self.shard_plan.padding_elements,
            "comm_bytes_per_step": comm,
            "collectives_per_step": counts,
            "model_state_bytes_per_rank": model_state_bytes(self.gm, self.ctx, self.param_dtype),
            **memory_plan_entries(self.memory_plan),   # the planned peaks a compiled step's report() gives
            "plan_seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "compile_seconds_by_phase": compile_stats.by_phase([self.compile_stats] if self.compile_stats else []),
            "remat": self.ctx.remat_plan.to_dict() if self.ctx.remat_plan is not None else None,
            "accounting": ("the ZeRO paper's mixed precision accounting (accounting_dtype): params and grads in "
                           "accounting_dtype, fp32 master params counted with optimizer state")
                          if self.param_dtype else "as compiled",
        }

    def explain(self) -> str:
        from .explain import explain
        return explain(self.ctx, self.history, self.report())


def model_state_bytes(gm: fx.GraphModule, ctx: CompileContext, param_dtype: torch.dtype | None = None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state one rank holds, from the planned graph.

    "grads" is what the rank holds when backward ends: full buckets at stages
    0-1, its shard at 2-3, in the dtype gradients are reduced in (the
    ``mixed_precision`` pass builds the buckets in it). With
    ``param_dtype`` (the accounting dtype), see the module docstring.
    """
    held = {"params": 0, "grads": 0, "optimizer": 0}
    for node in g.placeholders(gm):
        role = node.meta.get(g.ROLE)
        value = g.tensor_meta(node)
        if value is None:
            continue
        if role in (g.ROLE_PARAM, g.ROLE_FROZEN):
            held["params"] += value.numel() * (param_dtype or value.dtype).itemsize
        elif role == g.ROLE_STATE:
            held["optimizer"] += value.numel() * value.element_size()
    for bucket in ctx.shard_plan.buckets:
        numel = bucket.shard_numel if ctx.stage >= 2 else bucket.numel
        held["grads"] += numel * (param_dtype or mixed.gradient_dtype(ctx.precision, bucket.dtype)).itemsize
    if param_dtype is not None:   # the fp32 master copy of what this rank updates
        held["optimizer"] += sum(piece.numel * max(bucket.dtype.itemsize, 4)
                                 for bucket, _, piece in ctx.shard_plan.owned_pieces())
    return held


def communication(gm: fx.GraphModule, param_dtype: torch.dtype | None = None) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes each kind of collective moves per step (counted as the ZeRO paper does), and how many there are."""
    comm = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "broadcast": 0}
    counts: collections.Counter = collections.Counter()

    def size(node):
        value = g.tensor_meta(node)
        if value is None:
            return 0
        itemsize = param_dtype.itemsize if param_dtype is not None and value.is_floating_point() else value.element_size()
        return value.numel() * itemsize

    for node in gm.graph.nodes:
        if g.is_all_gather(node):
            kind, moved = "all_gather", size(node)
        elif g.is_reduce_scatter(node):
            kind, moved = "reduce_scatter", size(node.args[0])
        elif g.is_all_reduce(node):
            kind, moved = "all_reduce", 2 * size(node)
        elif g.is_broadcast(node):
            kind, moved = "broadcast", size(node)
        else:
            continue
        comm[kind] += moved
        counts[kind] += 1
    return comm, dict(counts)


def fake_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, fake_mode) -> list[dict[str, torch.Tensor]]:
    """Per trained parameter (in capture's order), fake optimizer state shaped as the steady state's.

    The structure (keys, scalar or not, dtype) comes from one real ``step()``
    of a copy of ``optimizer`` over a one-element tensor per param group.
    """
    group_of_id = {id(p): index for index, group in enumerate(optimizer.param_groups) for p in group["params"]}
    trained = [t for _, t in named_tensors(model, "param") if t.requires_grad and id(t) in group_of_id]
    structures = {}
    for tensor in trained:
        key = (group_of_id[id(tensor)], tensor.dtype)
        if key not in structures:
            structures[key] = probe_state(optimizer, *key)
    states = []
    with fake_mode:
        for tensor in trained:
            state = {}
            structure = structures[(group_of_id[id(tensor)], tensor.dtype)]
            for name, (scalar, dtype, on_cpu) in sorted(structure.items()):   # capture lays state out sorted
                shape = () if scalar else tuple(tensor.shape)
                state[name] = torch.zeros(shape, dtype=dtype, device="cpu" if on_cpu and scalar else tensor.device)
            states.append(state)
    return states


def probe_state(optimizer: torch.optim.Optimizer, group: int, dtype: torch.dtype) -> dict[str, tuple[bool, torch.dtype, bool]]:
    """The state one real step of ``optimizer``'s group ``group`` creates: key -> (scalar, dtype, on CPU)."""
    from .optimizer_init import shadow_of
    tiny = torch.zeros(1, dtype=dtype, requires_grad=True)
    settings = {k: v for k, v in optimizer.param_groups[group].items() if k != "params"}
    settings["params"] = [tiny]
    shadow = shadow_of(optimizer, [settings])
    tiny.grad = torch.zeros_like(tiny)
    with torch.no_grad():
        shadow.step()
    return {key: (value.dim() == 0, value.dtype, value.device.type == "cpu")
            for key, value in shadow.state[tiny].items() if isinstance(value, torch.Tensor)}

