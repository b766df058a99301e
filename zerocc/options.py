"""The keywords of ``zerocc.compile`` and ``zerocc.plan``, checked once, here, into a frozen ``CompileOptions``.

Both entry points validate through ``CompileOptions.validate`` and the
``check_*`` functions below, so a keyword means the same and fails with the
same message in both. Checks of the user's objects (a ``model`` that is a
module and not on the meta device, an ``optimizer``) sit here too: they run
before anything is traced. The compile driver (``zerocc/driver.py``) reads
the options to build the pipeline.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import datetime
import functools
import inspect
import os
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from . import precision as mixed
from .device_budget import DEFAULT_PLAN_PEAK, DeviceBudget
from .disk_cache import cache_dir_of
from .errors import ConfigError
from .pipeline import DEFAULT_PREFETCH_BYTES, Pass, build_pipeline, memory_pools_of
from .progress import check_progress

STAGES = (0, 1, 2, 3)

# Target bucket size. Small enough that a 5M-parameter model gets several
# buckets to overlap, large enough that biases and norms ride along.
DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024

# Programs a step keeps, by input shape (and optimizer-state structure) before dropping the least
# recently used: the first step and the steady state take two, leaving room for a few batch shapes.
DEFAULT_MAX_PROGRAMS = 8


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """What a compilation is asked for, checked: ``compile``'s keywords less the process group.

    ``clip`` is ``(max_norm, norm_type)`` or None, ``precision`` the resolved
    mixed precision settings (None: the model's dtype), ``memory_pools`` the
    setting with ``$ZEROCC_MEMORY_POOLS`` read, ``cache_dir`` the compile
    cache's folder with ``$ZEROCC_CACHE_DIR`` read (None: no cache,
    ``zerocc/disk_cache.py``). ``timeout``, ``static_shapes``,
    ``max_programs``, ``cache_dir`` and ``progress`` concern a running step only.
    ``device_budget`` is not a keyword: with no ``memory_budget``, what the
    rank's device offers, read at each compile (``zerocc/device_budget.py``;
    on CPU, and for ``zerocc.plan`` without ``device_memory``, the default
    plan's peak; None: no budget at all). ``hardware`` is not a keyword either: the
    profile ``place_remat`` compares the plans that fit a budget by (a
    ``HardwareProfile``, or a function that measures this machine's when first
    needed; None: a named one, ``place_remat.DEFAULT_HARDWARE``).
    """
    stage: int = 3
    loss_fn: Callable | None = None
    num_targets: int = 0
    metrics_fn: Callable | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    prefetch_bytes: int = DEFAULT_PREFETCH_BYTES
    disable: tuple[str, ...] = ()
    verify: bool = False
    dump_dir: str | None = None
    grad_accumulation: int = 1
    clip: tuple[float, float] | None = None
    memory_budget: int | None = None
    device_budget: DeviceBudget | None = None
    hardware: Any = None
    precision: mixed.Precision | None = None
    gather_per_micro_batch: bool = True
    memory_pools: bool = True
    timeout: float | None = None
    static_shapes: bool = False
    max_programs: int = DEFAULT_MAX_PROGRAMS
    cache_dir: str | None = None
    progress: Any = None

    @classmethod
    def validate(cls, model: nn.Module, *, stage: int = 3, loss_fn: Callable | None = None,
                 num_targets: int | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 timeout: float | None = None, prefetch_bytes: int = DEFAULT_PREFETCH_BYTES,
                 disable: Sequence[str] = (), verify: bool = False, dump_dir: str | None = None,
                 grad_accumulation: int = 1, clip_grad_norm: float | None = None, clip_norm_type: float = 2.0,
                 static_shapes: bool = False, max_programs: int = DEFAULT_MAX_PROGRAMS,
                 memory_budget: int | None = None, param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, loss_scale=None, cast_forward_inputs: bool = True,
                 memory_pools: bool | None = None, gather_per_micro_batch: bool = True,
                 cache_dir: str | None = None, progress=None, metrics_fn: Callable | None = None) -> "CompileOptions":
        """Check every keyword (``ConfigError`` naming it and the fix); ``passes()`` checks ``disable``."""
        check_stage(stage)
        check_loss_fn(loss_fn, num_targets)
        check_metrics_fn(metrics_fn)
        check_bucket_bytes(bucket_bytes)
        check_timeout(timeout)
        check_prefetch_bytes(prefetch_bytes)
        check_disable(disable)
        check_flag("verify", verify)
        check_flag("static_shapes", static_shapes)
        check_folder("dump_dir", dump_dir)
        check_memory_budget(memory_budget)
        memory_pools = memory_pools_of(memory_pools, disable)
        check_gather_per_micro_batch(gather_per_micro_batch)
        check_grad_accumulation(grad_accumulation)
        clip = check_clipping(clip_grad_norm, clip_norm_type)
        check_max_programs(max_programs)
        check_progress(progress)
        return cls(stage=stage, loss_fn=loss_fn,
                   num_targets=targets_of(loss_fn) if num_targets is None else num_targets,
                   bucket_bytes=bucket_bytes, prefetch_bytes=prefetch_bytes, disable=tuple(disable),
                   verify=verify, dump_dir=dump_dir, grad_accumulation=grad_accumulation, clip=clip,
                   memory_budget=memory_budget,
                   precision=mixed.resolve(param_dtype, reduce_dtype, loss_scale, cast_forward_inputs, model),
                   gather_per_micro_batch=gather_per_micro_batch, memory_pools=memory_pools, timeout=timeout,
                   static_shapes=static_shapes, max_programs=max_programs, cache_dir=cache_dir_of(cache_dir),
                   progress=progress, metrics_fn=metrics_fn)

    def for_pipeline(self, *, stage: int, disable: Sequence[str] = (), verify: bool = False,
                     dump_dir: str | None = None, memory_pools: bool | None = None,
                     memory_budget: int | None = None, device_memory: int | None = None) -> "CompileOptions":
        """These options with the pipeline's own keywords replaced and checked, ``disable`` included
        (``Planner.plan``: one capture's options, planned for many stages; ``device_memory``: the bytes per
        rank a plan's device offers, as a device budget)."""
        check_stage(stage)
        check_disable(disable)
        check_flag("verify", verify)
        check_folder("dump_dir", dump_dir)
        check_memory_budget(memory_budget)
        check_memory_budget(device_memory, "device_memory")
        # without device_memory a plan is made as a CPU compile makes it: under the default plan's peak
        device = None if memory_budget is not None else DEFAULT_PLAN_PEAK._replace(
            source="zerocc.plan without device_memory: the default plan's peak") if device_memory is None else \
            DeviceBudget(device_memory, "device_memory= given to zerocc.plan")
        options = dataclasses.replace(self, stage=stage, disable=tuple(disable), verify=verify, dump_dir=dump_dir,
                                      memory_pools=memory_pools_of(memory_pools, disable), memory_budget=memory_budget,
                                      device_budget=device)
        options.passes()
        return options

    def passes(self) -> list[Pass]:
        """The passes a compilation with these options runs, in order (registered passes included)."""
        return build_pipeline(self.stage, self.disable, self.prefetch_bytes, clip=self.clip,
                              memory_budget=self.memory_budget, device_budget=self.device_budget,
                              mixed_precision=self.precision is not None,
                              memory_pools=self.memory_pools, hardware=self.hardware)


def targets_of(loss_fn: Callable | None) -> int:
    """How many of the step's last positional arguments are the loss's targets, when ``num_targets`` is not given.

    ``loss_fn(output, *targets)``: its required positional parameters after
    the output (``nn.CrossEntropyLoss()`` and ``F.mse_loss`` take one target;
    ``lambda out, y, w: ...`` two), none when it takes the output alone
    (``lambda out: out.sum()``), and one where its signature cannot say
    (``*args``, a builtin). An ``nn.Module`` loss is called through
    ``Module.__call__(*args, **kwargs)``: its ``forward`` says, as it does
    under a ``functools.partial``.
    """
    if loss_fn is None:
        return 0
    try:
        parameters = inspect.signature(called_function(loss_fn)).parameters.values()
    except (TypeError, ValueError):
        return 1
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_POSITIONAL for p in parameters) or not positional:
        return 1
    if len(positional) == 1:
        return 0
    return max(1, sum(p.default is p.empty for p in positional) - 1)


def called_function(loss_fn: Callable) -> Callable:
    """What calling ``loss_fn`` runs, for its signature: a module's ``forward``, also inside partials."""
    if isinstance(loss_fn, functools.partial):
        return functools.partial(called_function(loss_fn.func), *loss_fn.args, **loss_fn.keywords)
    if isinstance(loss_fn, nn.Module):
        return loss_fn.forward
    return loss_fn


def check_stage(stage) -> None:
    """``stage`` is one of the ints 0-3: ``True`` and ``3.0`` compare equal to 1 and 3 but are not stages."""
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in STAGES:
        raise ConfigError(f"stage={stage!r} is not a ZeRO stage; use 0 (plain data parallel), 1, 2 or 3, "
                          "as an int")


def check_model_and_optimizer(model, optimizer) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(optimizer, (list, tuple)) and optimizer and all(
            isinstance(o, torch.optim.Optimizer) for o in optimizer):
        raise ConfigError(
            f"zerocc.compile takes one optimizer, got a {type(optimizer).__name__} of {len(optimizer)} "
            f"({', '.join(type(o).__name__ for o in optimizer)}): the step traces one optimizer's step() after "
            "backward.\n  fix: one torch.optim.Optimizer whose param groups choose their update (a flag in each "
            "group, as Muon-with-AdamW recipes keep: `use_muon=True` for the hidden matrices, AdamW for embeddings, "
            "norms and biases), its state tensors shaped like their parameters or 0-dim; an update that is not "
            "elementwise (Muon's) trains at stage=0 only. zerocc's docs/guide/stages.md has an example")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if type(optimizer).__name__ == "ZeroRedundancyOptimizer" and type(optimizer).__module__.startswith(
            "torch.distributed.optim"):
        raise ConfigError(
            "the optimizer is a ZeroRedundancyOptimizer: it shards its state across ranks and broadcasts the "
            "updated parameters itself (ZeRO-1), which zerocc does (stage=1; stages 2 and 3 shard more).\n"
            f"  fix: pass the optimizer it wraps, built on the model's parameters: "
            f"{optimizer.optim.__class__.__name__}(model.parameters(), ...), to zerocc.compile(model, optimizer, "
            "stage=1)")
    check_not_an_optimizer_wrapper(optimizer)
    if next(model.parameters(), None) is None:
        raise ConfigError(f"the model ({type(model).__name__}) has no parameters: there is nothing to train or shard; "
                          "pass the module that holds the trained parameters")
    check_not_parallelized(model)


def check_not_an_optimizer_wrapper(optimizer) -> None:
    """An Optimizer subclass that never ran ``Optimizer.__init__`` and forwards to another optimizer
    (accelerate's ``AcceleratedOptimizer`` from ``accelerator.prepare``, Lightning's ``LightningOptimizer``): its
    ``step()`` is the wrapper's bookkeeping (skipping steps under its gradient accumulation or loss scaler) around
    the wrapped optimizer's, and it lacks the hook tables the step reads."""
    if hasattr(optimizer, "_optimizer_step_pre_hooks"):
        return
    kind = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    inner = next((value for value in vars(optimizer).values() if isinstance(value, torch.optim.Optimizer)), None)
    if inner is None:
        raise ConfigError(
            f"the optimizer ({kind}) never ran torch.optim.Optimizer.__init__, so it has no hooks or defaults of its "
            f"own.\n  fix: call super().__init__(params, defaults) in {type(optimizer).__name__}.__init__")
    attribute = next(name for name, value in vars(optimizer).items() if value is inner)
    raise ConfigError(
        f"the optimizer ({kind}) wraps the optimizer {type(inner).__name__} (accelerator.prepare returns such a wrapper): "
        "its step() is the wrapper's bookkeeping around the wrapped optimizer's, which zerocc replaces (the "
        "gradient accumulation, loss scaling and data parallelism are the step's options).\n"
        f"  fix: pass the optimizer it wraps, zerocc.compile(model, optimizer.{attribute}, ...), or the one you "
        "built before prepare; use grad_accumulation=, clip_grad_norm= and param_dtype= for what the "
        "wrapper did")


def check_not_parallelized(model: nn.Module) -> None:
    """A model already wrapped for data parallelism (DDP, DataParallel, FSDP) or sharded into DTensors: zerocc is
    the data parallelism, and tracing the wrapper would trace its collectives (or fail on DTensors) too."""
    from torch.distributed._composable.contract import _get_registry
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel, FullyShardedDataParallel)
    for name, module in model.named_modules():
        if isinstance(module, wrappers):
            where = f"the model{f' (its submodule {name!r})' if name else ''}"
            raise ConfigError(
                f"{where} is wrapped in {type(module).__name__}: zerocc does the data parallelism itself (stage 0 "
                "is DDP's), and would trace the wrapper's own communication. Pass the module inside "
                f"(model.{name + '.' if name else ''}module) to zerocc.compile, and build the optimizer over its "
                "parameters")
    for name, module in model.named_modules():
        # torch.distributed's composable replicate() (DDP as hooks: the module keeps its class and plain parameters,
        # and tracing it failed inside torch on its flattened gradient buckets)
        if "replicate" in (_get_registry(module) or {}):
            where = f"the model{f' (its submodule {name!r})' if name else ''}"
            raise ConfigError(
                f"{where} is under torch.distributed's replicate() (DDP as hooks): zerocc does the data parallelism "
                "itself (stage 0 is DDP's), and would trace its communication. Pass the model as built, before "
                "replicate(), to zerocc.compile")
    distributed = [name for name, param in model.named_parameters() if isinstance(param, DTensor)]
    if distributed:
        raise ConfigError(
            f"the model's parameters are DTensors ({', '.join(distributed[:3])}{', ...' if len(distributed) > 3 else ''}"
            "): FSDP2's fully_shard or tensor parallelism already sharded them. zerocc shards plain tensors itself: "
            "pass the model as built, before fully_shard or parallelize_module (zerocc has no tensor parallelism of "
            "its own: a model split across ranks by hand, with functional collectives in forward, compiles over one "
            "group per replica set, group=; zerocc's docs/guide/your-model.md, 'Collectives in the step')")
    distributed = [name for name, buffer in model.named_buffers() if isinstance(buffer, DTensor)]
    if distributed:   # broadcast from rank 0 at compile, a DTensor failed inside torch (no sharding strategy)
        raise ConfigError(
            f"the model's buffers are DTensors ({', '.join(distributed[:3])}{', ...' if len(distributed) > 3 else ''}"
            "): zerocc's steps hold plain tensors. Register the buffer's full value instead (buffer.full_tensor())")


def check_not_meta(model: nn.Module) -> None:
    """A model on the meta device holds no data: a step on it would return a meta loss and train nothing."""
    on_meta = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if on_meta:
        raise ConfigError(
            f"the model's tensors are on the meta device ({', '.join(on_meta[:3])}"
            f"{', ...' if len(on_meta) > 3 else ''}): they hold no values, so a step would train nothing. "
            "To plan memory without materializing the model, use zerocc.plan(model, optimizer, stage=..., "
            "world_size=..., example_inputs=...); to train, materialize it first "
            "(model.to_empty(device='cpu'), then initialize its weights)")


def check_metrics_fn(metrics_fn) -> None:
    if metrics_fn is not None and not callable(metrics_fn):
        raise ConfigError(f"metrics_fn must be callable (called as metrics_fn(output, *arguments, **keyword_arguments) "
                          f"with the step's arguments, returning a dict of tensors) or None, got {metrics_fn!r}")


def check_loss_fn(loss_fn, num_targets) -> None:
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError(f"loss_fn must be callable (called as loss_fn(output, *targets)) or None, got {loss_fn!r}")
    if num_targets is not None and (isinstance(num_targets, bool) or not isinstance(num_targets, int)
                                    or num_targets < 0):
        raise ConfigError(f"num_targets must be a non-negative int (how many of the step's last positional arguments "
                          f"go to loss_fn) or None, got {num_targets!r}")


def check_flag(name: str, value) -> None:
    """A keyword that is True or False: ``static_shapes="no"`` would otherwise read as True."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")


def check_folder(name: str, folder) -> None:
    """``dump_dir``: a folder's path or None; a path that exists as a file is refused before anything is compiled."""
    if folder is None:
        return
    if not isinstance(folder, (str, os.PathLike)):
        raise ConfigError(f"{name} must be a folder's path (str or os.PathLike) or None, got {folder!r}")
    path = os.path.expanduser(os.fspath(folder))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{name}={os.fspath(folder)!r} is a file, not a folder; give a folder's path (it is created "
                          "if missing)")


def check_bucket_bytes(bucket_bytes) -> None:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ConfigError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")


def check_timeout(timeout) -> None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or
                                not timeout > 0):
        raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if timeout is not None and not timeout < datetime.timedelta.max.total_seconds():   # a process group's timedelta
        raise ConfigError(f"timeout={timeout!r} is beyond what a process group can wait; leave it None to wait as "
                          "long as the process group does (torch.distributed's default: 30 minutes on gloo)")


def check_disable(disable) -> None:
    """A list of pass names: a bare string would be taken letter by letter, None is no list."""
    if isinstance(disable, str) or not isinstance(disable, collections.abc.Collection) or \
            not all(isinstance(name, str) for name in disable):
        hint = f"; write disable=[{disable!r}]" if isinstance(disable, str) else ""
        raise ConfigError(f"disable must be a list of pass names (step.passes lists them), got {disable!r}{hint}")


def check_prefetch_bytes(prefetch_bytes) -> None:
    if isinstance(prefetch_bytes, bool) or not isinstance(prefetch_bytes, int) or prefetch_bytes < 0:
        raise ConfigError(f"prefetch_bytes must be a non-negative int, got {prefetch_bytes!r}")


def check_memory_budget(memory_budget, name: str = "memory_budget") -> None:
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, int)
                                      or memory_budget <= 0):
        raise ConfigError(f"{name} must be a positive int (bytes per rank) or None, got {memory_budget!r}")


def check_gather_per_micro_batch(gather_per_micro_batch) -> None:
    if not isinstance(gather_per_micro_batch, bool):
        raise ConfigError(f"gather_per_micro_batch must be True or False, got {gather_per_micro_batch!r}")


def check_grad_accumulation(grad_accumulation) -> None:
    if isinstance(grad_accumulation, bool) or not isinstance(grad_accumulation, int) or grad_accumulation < 1:
        raise ConfigError(f"grad_accumulation must be a positive int (the number of micro-batches a batch is split "
                          f"into), got {grad_accumulation!r}")


def check_clipping(max_norm, norm_type) -> tuple[float, float] | None:
    """``(max_norm, norm_type)`` for the clip_gradients pass, or None when no clipping was asked for."""
    if max_norm is None:
        if norm_type != 2.0:
            raise ConfigError(f"clip_norm_type={norm_type!r} without clip_grad_norm clips nothing: pass "
                              f"clip_grad_norm=<max norm> too (float('inf') computes the norm without clipping)")
        return None
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ConfigError(f"clip_grad_norm must be a positive number (the largest global gradient norm allowed; "
                          f"float('inf') computes the norm, step.last_grad_norm, without clipping), got "
                          f"{max_norm!r}; leave it None not to clip")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise ConfigError(f"clip_norm_type must be a positive number or float('inf'), got {norm_type!r} "
                          "(2.0 is the Euclidean norm clip_grad_norm_ uses by default)")
    return float(max_norm), float(norm_type)


def check_max_programs(max_programs) -> None:
    if isinstance(max_programs, bool) or not isinstance(max_programs, int) or max_programs < 1:
        raise ConfigError(f"max_programs must be a positive int (compiled programs kept, by input shape), "
                          f"got {max_programs!r}")
