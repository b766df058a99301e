"""Mixed precision settings: what ``compile(param_dtype=..., reduce_dtype=..., loss_scale=...)`` means.

The semantics are FSDP2's ``MixedPrecisionPolicy``, with ZeRO's layout:

  - the persistent parameters (the buckets, or at stage 3 this rank's shard)
    stay in the model's dtype (fp32): they are the master copy the optimizer
    updates, and the optimizer state lives beside them in the same dtype;
  - forward and backward compute in ``param_dtype``: capture traces the step
    on parameters cast to it (``capture.py``), and the ``mixed_precision``
    pass (``passes/mixed_precision.py``) casts each bucket once, before its
    all_gather at stage 3, so gathers move ``param_dtype`` bytes;
  - floating inputs of the model are cast to ``param_dtype``
    (``cast_forward_inputs``); the targets handed to ``loss_fn`` are not;
    buffers (BatchNorm statistics) keep their dtype; the loss is returned in
    fp32;
  - gradients are cast to the master dtype per parameter (capture), then each
    bucket is reduced in ``reduce_dtype`` (``param_dtype`` when not given, as
    FSDP2 does) and cast back to the master dtype for the optimizer;
  - ``loss_scale`` (``"dynamic"`` or a ``DynamicLossScale``) multiplies the
    loss by a scale held in a slot, unscales the reduced gradients, skips the
    update when any of them is not finite and updates the scale exactly as
    ``torch.amp.GradScaler`` does.

This module holds the settings and the names of the slots they add; it
imports nothing from capture or the passes, which both read it.
"""
from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from . import graph as g
from .errors import ConfigError, user_stacklevel

# The runtime's slots for loss scaling (``decisions`` names the others). The
# scale and the growth tracker persist from step to step and are
# checkpointed; ``found_inf`` is written by every step (1.0 when it skipped).
SCALE_SLOT = "loss_scale:scale"
GROWTH_TRACKER_SLOT = "loss_scale:growth_tracker"
FOUND_INF_SLOT = "loss_scale:found_inf"
SCALER_SLOTS = (SCALE_SLOT, GROWTH_TRACKER_SLOT)


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """Dynamic loss scaling, as ``torch.amp.GradScaler`` does it (same defaults)."""
    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def check(self) -> None:
        problems = []
        if not (isinstance(self.init_scale, (int, float)) and self.init_scale > 0):
            problems.append(f"init_scale must be a positive number, got {self.init_scale!r}")
        if not (isinstance(self.growth_factor, (int, float)) and self.growth_factor > 1):
            problems.append(f"growth_factor must be > 1, got {self.growth_factor!r}")
        if not (isinstance(self.backoff_factor, (int, float)) and 0 < self.backoff_factor < 1):
            problems.append(f"backoff_factor must be in (0, 1), got {self.backoff_factor!r}")
        if not (isinstance(self.growth_interval, int) and self.growth_interval >= 1):
            problems.append(f"growth_interval must be a positive int, got {self.growth_interval!r}")
        if problems:
            raise ConfigError("loss_scale: " + "; ".join(problems))


@dataclasses.dataclass(frozen=True)
class Precision:
    """The dtypes a compiled step computes and reduces in, and its loss scaling (None: none)."""
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    loss_scale: DynamicLossScale | None = None
    cast_forward_inputs: bool = True

    def compute_dtype(self, master: torch.dtype) -> torch.dtype:
        return (self.param_dtype or master) if master.is_floating_point else master

    def reduction_dtype(self, master: torch.dtype) -> torch.dtype:
        """The dtype a bucket of ``master`` parameters' gradients is reduced in: a complex bucket keeps its own
        (``param_dtype`` and ``reduce_dtype`` are real dtypes: a cast to one discards the imaginary part)."""
        return (self.reduce_dtype or self.param_dtype or master) if master.is_floating_point else master

    def describe(self) -> str:
        def name(dtype):
            return str(dtype).replace("torch.", "") if dtype is not None else "the model's dtype"
        text = f"compute in {name(self.param_dtype)}, reduce in {name(self.reduce_dtype or self.param_dtype)}"
        if self.loss_scale is not None:
            text += f", dynamic loss scale from {self.loss_scale.init_scale:g}"
        return text


def _check_dtype(keyword: str, dtype) -> None:
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"{keyword} must be a torch.dtype (torch.bfloat16, torch.float16, torch.float32), got {dtype!r}")
    if not dtype.is_floating_point or dtype.itemsize < 2:
        raise ConfigError(f"{keyword}={dtype} is not supported: mixed precision computes and reduces in a "
                          "floating dtype of 16 bits or more (torch.bfloat16, torch.float16, torch.float32)")


def resolve(param_dtype, reduce_dtype, loss_scale, cast_forward_inputs, model: torch.nn.Module) -> Precision | None:
    """Check ``compile``'s precision keywords against the model; None when they ask for nothing.

    Called by ``CompileOptions.validate``: its warning names the frame that called ``zerocc.compile``.
    """
    _check_dtype("param_dtype", param_dtype)
    _check_dtype("reduce_dtype", reduce_dtype)
    if loss_scale == "dynamic":
        loss_scale = DynamicLossScale()
    if loss_scale is not None and not isinstance(loss_scale, DynamicLossScale):
        raise ConfigError(f"loss_scale must be None, 'dynamic' or zerocc.DynamicLossScale(...), got {loss_scale!r}")
    if loss_scale is not None:
        loss_scale.check()
    if not isinstance(cast_forward_inputs, bool):
        raise ConfigError(f"cast_forward_inputs must be a bool, got {cast_forward_inputs!r}")
    if param_dtype is None and reduce_dtype is None and loss_scale is None:
        return None
    masters = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})
    narrow = [d for d in masters if param_dtype is not None and getattr(torch, d.split(".")[1]).itemsize < param_dtype.itemsize]
    if narrow:
        raise ConfigError(f"param_dtype={param_dtype} is wider than the model's parameters ({', '.join(narrow)}): "
                          "the parameters are the master copy, so they must be at least as wide; "
                          "build the model in torch.float32 and pass param_dtype=torch.bfloat16")
    if param_dtype is torch.float16 and loss_scale is None:
        warnings.warn("param_dtype=torch.float16 without loss scaling: small gradients underflow to zero in "
                      "float16; pass loss_scale='dynamic' (or use torch.bfloat16)", UserWarning, stacklevel=user_stacklevel())
    return Precision(param_dtype, reduce_dtype, loss_scale, cast_forward_inputs)


def gradient_dtype(precision: Precision | None, master: torch.dtype) -> torch.dtype:
    """The dtype of the gradient buckets a rank holds until they are reduced (``mixed_precision`` builds them so)."""
    return master if precision is None else precision.reduction_dtype(master)


def report_entries(precision: Precision | None, master: torch.dtype) -> dict[str, str]:
    """``step.report()``'s precision lines: the dtypes parameters compute in and gradients are reduced in."""
    def name(dtype):
        return str(dtype).replace("torch.", "")
    if precision is None:
        return {"param_dtype": name(master), "reduce_dtype": name(master)}
    entries = {"param_dtype": name(precision.compute_dtype(master)), "reduce_dtype": name(precision.reduction_dtype(master))}
    if precision.loss_scale is not None:
        entries["loss_scale"] = "dynamic"
    return entries


def initial_scaler_slots(precision: Precision | None, device) -> dict[str, torch.Tensor]:
    """The loss scale and growth tracker a step starts with, as GradScaler initializes them."""
    if precision is None or precision.loss_scale is None:
        return {}
    return {SCALE_SLOT: torch.full((), float(precision.loss_scale.init_scale), dtype=torch.float32, device=device),
            GROWTH_TRACKER_SLOT: torch.zeros((), dtype=torch.int32, device=device)}


# -- used by capture while it traces ------------------------------------------------
# torch.amp.GradScaler.state_dict()'s keys: the scale and tracker a step keeps in slots, the rest its settings
_GRAD_SCALER_SETTINGS = ("growth_factor", "backoff_factor", "growth_interval")
_GRAD_SCALER_KEYS = ("scale", *_GRAD_SCALER_SETTINGS, "_growth_tracker")


def grad_scaler_state(precision: Precision | None, slots: dict[str, torch.Tensor]) -> dict[str, float | int]:
    """``slots`` (the scale and growth tracker) as ``torch.amp.GradScaler.state_dict()`` gives them: Python numbers,
    the scale read from its float32 slot (exactly), with the step's settings; empty without loss scaling."""
    if not slots:
        return {}
    scaling = precision.loss_scale
    return {"scale": float(slots[SCALE_SLOT]), "growth_factor": float(scaling.growth_factor),
            "backoff_factor": float(scaling.backoff_factor), "growth_interval": int(scaling.growth_interval),
            "_growth_tracker": int(slots[GROWTH_TRACKER_SLOT])}


def scaler_slot_values(precision: Precision | None, state: dict) -> dict[str, float | int]:
    """The scale and growth tracker ``state`` (GradScaler's ``state_dict()`` or the slots by name) gives, by slot;
    ConfigError where the step cannot go on from it (its settings are constants of the program)."""
    scaling = precision.loss_scale if precision is not None else None
    if not isinstance(state, dict):
        raise ConfigError(f"load_scaler_state takes a dict (GradScaler.state_dict() or step.scaler_state()), got "
                          f"{type(state).__name__}")
    if scaling is None:
        if state:
            raise ConfigError("load_scaler_state: this step has no dynamic loss scale to load into; compile with "
                              "loss_scale='dynamic' (or zerocc.DynamicLossScale(...)) to go on from a GradScaler")
        return {}
    if set(state) == set(SCALER_SLOTS):   # the slots an earlier zerocc's scaler_state() gave
        return {SCALE_SLOT: float(state[SCALE_SLOT]), GROWTH_TRACKER_SLOT: int(state[GROWTH_TRACKER_SLOT])}
    if not state:
        raise ConfigError("load_scaler_state: the state is empty (a disabled GradScaler's state_dict(), or a step's "
                          "without loss scaling), but this step scales its loss: give the state of a scaler that ran")
    missing = [key for key in _GRAD_SCALER_KEYS if key not in state]
    if missing:
        raise ConfigError(f"load_scaler_state: the state lacks {', '.join(missing)}; give torch.amp.GradScaler's "
                          f"state_dict() (keys {', '.join(_GRAD_SCALER_KEYS)}) or step.scaler_state()")
    differ = [f"{key} {state[key]!r} (the step's {getattr(scaling, key)!r})" for key in _GRAD_SCALER_SETTINGS
              if state[key] != getattr(scaling, key)]
    if differ:
        raise ConfigError(
            f"load_scaler_state: the scaler's {'; '.join(differ)} differ from the step's, which are compiled into "
            f"its program; compile with loss_scale=zerocc.DynamicLossScale(growth_factor={state['growth_factor']!r}, "
            f"backoff_factor={state['backoff_factor']!r}, growth_interval={state['growth_interval']!r}) to go on "
            "from this scaler")
    return {SCALE_SLOT: float(state["scale"]), GROWTH_TRACKER_SLOT: int(state["_growth_tracker"])}


def compute_values(precision: Precision, params, frozen, model_inputs):
    """Parameters, frozen parameters and the model's floating inputs, cast to ``param_dtype``."""
    dtype = precision.param_dtype
    if dtype is None:
        return params, frozen, model_inputs

    def cast(value):
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value
    if precision.cast_forward_inputs:
        model_inputs = pytree.tree_map(cast, model_inputs)
    return [cast(p) for p in params], [cast(p) for p in frozen], model_inputs


def master_grads(grads, params):
    """Each gradient in its parameter's (master) dtype; the bucket is cast to ``reduce_dtype`` later."""
    return [None if grad is None else grad.to(param.dtype) for grad, param in zip(grads, params)]


def tag_parameter_casts(gm: fx.GraphModule, precision: Precision) -> None:
    """Mark the casts of trained parameters to ``param_dtype``: the mixed_precision pass moves them to buckets.

    Only ``compute_values``' casts: other casts of a parameter (the caller's ``torch.autocast`` casting a linear's
    weight to float16 under ``loss_scale`` without ``param_dtype``, a ``w.half()`` in forward) stay per-parameter
    ops. Tagged, the pass cast the whole bucket to their dtype, and at stage 3 gathered that cast: every other
    parameter of the bucket (a LayerNorm autocast keeps in float32) was read rounded to float16."""
    if precision.param_dtype is None:
        return
    for placeholder in g.placeholders(gm, g.ROLE_PARAM):
        for cast in _casts_to(placeholder, precision.param_dtype):
            cast.meta[g.PRECISION_CAST] = "param"
    _cast_where_first_read(gm, precision)


def _casts_to(placeholder: fx.Node, dtype: torch.dtype) -> list[fx.Node]:
    """The ops that cast ``placeholder`` to ``dtype`` (``compute_values``' casts)."""
    return [user for user in placeholder.users if user.op == "call_function"
            and user.target is torch.ops.aten._to_copy.default and user.meta[g.VAL].dtype == dtype]


def _cast_where_first_read(gm: fx.GraphModule, precision: Precision) -> None:
    """Move each parameter's cast to ``param_dtype`` to just before the first op that reads the cast.

    ``compute_values`` casts every parameter before forward's first op; ``shard`` makes a bucket's views just
    before the first reader of its parameters, and the schedule waits for a gather at its views: left there,
    stage 3 gathered the whole model before forward's first op (a 2-layer 7B-width Llama at world size 64
    held 1.33 GB of gathered bf16 parameters at its peak instead of one layer's)."""
    order = g.topological_index(gm)   # only the casts move: the readers keep their order
    for placeholder in [*g.placeholders(gm, g.ROLE_PARAM), *g.placeholders(gm, g.ROLE_FROZEN)]:
        for cast in _casts_to(placeholder, precision.param_dtype):
            if cast.users:
                first = min(cast.users, key=order.__getitem__)
                if first is not cast.next:
                    first.prepend(cast)
