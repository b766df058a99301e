"""Sharded checkpoints: a step's state by parameter name, saved with torch.distributed.checkpoint (DCP).

Sits beside the runtime: it reads and writes the runtime's slots (see
``zerocc/runtime/slots.py``) through the ``ShardPlan``, never the graph.

Format, independent of world size and stage. Every tensor is flattened to
1-D and keyed by the parameter's fully qualified name (fqn, its first name
when weights are tied):

    model/<fqn>              parameter, frozen parameter or buffer, flat (a 0-dim
                             parameter too, as 1 element: at stage 3 it is a piece of
                             one rank's shard; a 0-dim buffer stays 0-dim). Not a buffer
                             registered persistent=False: model.state_dict() has none
    optim/<fqn>/<key>        optimizer-state tensor (``exp_avg``), flat; a
                             0-dim one (Adam's ``step``) stays 0-dim
    zerocc/steps             how many steps the compiled step has run
    zerocc/param_groups      the optimizer's param_groups as ``Optimizer.state_dict()`` has them
                             (lr, betas, weight decay, a scheduler's initial_lr, ...), each
                             group's ``params`` given by fqn; a Python object, saved once

A tensor this rank holds whole (a replicated parameter at stages 0-2, a
buffer, a scalar) is a plain tensor: DCP writes it once. A tensor that is
split across ranks (a stage-3 parameter, optimizer state at stages 1-3) is a
``ShardedTensor`` whose local shards are views of this rank's slots at the
element offsets the plan gives; its global layout is computed from the plan,
so building it needs no collective and saving needs no gather. DCP stores
each shard as a chunk with its offset, and a load reads whichever saved
chunks overlap what the loading rank needs: that is the resharding, to any
world size and any stage. ``zerocc.json`` beside DCP's files records the
shapes and every state-dict name, for ``export_full_state_dict``.

Saves are atomic: the data goes into a fresh directory ``<path>.v<n>``,
fsynced; after a barrier rank 0 points the symlink ``<path>`` at it with one
``rename`` and only then removes the previous version. A save killed at any
moment leaves ``<path>`` pointing at the previous, complete checkpoint.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import re
import shutil
import socket
import struct
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from . import decisions, precision as mixed
from .capture import named_tensors, state_dict_names
from .optimizer_step import initial_state_layout
from .runtime import failures, slots as slot_store
from .runtime.release import HeldInterrupt
from .errors import CheckpointError, ConfigError
from .user_views import refuse_inside_full_model

META_FILE = "zerocc.json"
FORMAT_VERSION = 1
STEPS_KEY = "zerocc/steps"
PARAM_GROUPS_KEY = "zerocc/param_groups"   # optional on load: checkpoints of older versions lack it
SCALER_PREFIX = "zerocc/loss_scale/"   # optional on load: a step without loss scaling ignores it, one with starts afresh


@contextlib.contextmanager
def _in_one_process():
    """DCP's save and load warn, with ``no_dist``, that they assume "the intent is to save (load) in a single
    process": at world size 1 and in an export that is what zerocc asks for, and the warning, pointing into
    torch, told a user of a plain process nothing."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                                category=UserWarning)
        yield


def model_key(fqn: str) -> str:
    return f"model/{fqn}"


def optim_key(fqn: str, key: str) -> str:
    return f"optim/{fqn}/{key}"


@dataclasses.dataclass
class _Part:
    """One checkpoint entry as this rank holds it."""
    key: str
    numel: int                                     # of the whole flattened tensor
    scalar: bool                                   # a 0-dim tensor (held whole, equal on every holder)
    local: list[tuple[int, torch.Tensor]]          # (flat offset, 1-D view into a slot), non-overlapping
    owners: list[tuple[int, int, int]] | None      # (rank in group, offset, numel) of every shard; None: replicated
    like: torch.Tensor | None = None               # gives dtype and device when this rank holds no piece
    # optimizer state no rank holds (a parameter the loss never reached, every update so far skipped by the loss
    # scale): the zeros its first update starts from, saved so that a state dict built before a first call, which
    # names them, finds them; loaded only as zeros (still no state)
    absent: bool = False
    # a frozen parameter's optimizer state (trained before, frozen on resume): no part of the program, it stays in
    # optimizer.state, as eager's optimizer keeps it; saved whole from there, loaded back there
    frozen: bool = False


# -- what this rank holds ---------------------------------------------------------
def _parts(step) -> dict[str, _Part]:
    parts = _parts_before_compile(step) if not step.state.started else _parts_of_slots(step)
    for slot, tensor in step.state.scaler_state().items():   # the dynamic loss scale (zerocc/precision.py)
        parts[SCALER_PREFIX + slot.split(":", 1)[1]] = _whole(SCALER_PREFIX + slot.split(":", 1)[1], tensor)
    return parts


def _parts_before_compile(step) -> dict[str, _Part]:
    """Before the first step the model and optimizer are whole on every rank: all replicated.

    A trained parameter the optimizer has no state for yet gets the state its
    first step would create, as zeros: a state dict that ``dcp.load`` fills
    must name every entry it is to read, or the saved optimizer state is
    silently left behind (DCP loads only the keys it is given).
    """
    parts = {}
    unsaved = _non_persistent_buffers(step.model)
    for kind in ("param", "buffer"):
        for names, tensor in named_tensors(step.model, kind):
            if names[0] in unsaved:
                continue
            parts[model_key(names[0])] = (_flat if kind == "param" else _whole)(model_key(names[0]), tensor.detach())
            for key, value in step.optimizer.state.get(tensor, {}).items() if kind == "param" else ():
                if isinstance(value, torch.Tensor):
                    parts[optim_key(names[0], key)] = _whole(optim_key(names[0], key), value.detach())
    trained_ids = {id(p) for group in step.optimizer.param_groups for p in group["params"] if p.requires_grad}
    stateless = [(names[0], t, tuple(t.shape)) for names, t in named_tensors(step.model, "param")
                 if id(t) in trained_ids and not step.optimizer.state.get(t)]
    parts.update(_first_state_as_zeros(step, stateless))
    return parts


def _frozen_optimizer_state(step, params: dict[str, torch.Tensor]) -> dict[str, _Part]:
    """The optimizer state of the frozen parameters the optimizer lists, whole on every rank, from optimizer.state.
    No zeros where one has none: a frozen base the optimizer lists (LoRA over ``model.parameters()``) would cost
    its size twice over in every state dict and checkpoint."""
    parts = {}
    for name in _frozen_listed(step):
        for key, value in step.optimizer.state.get(params[name], {}).items():
            if isinstance(value, torch.Tensor):
                parts[optim_key(name, key)] = dataclasses.replace(_whole(optim_key(name, key), value.detach()),
                                                                  frozen=True)
    return parts


def _frozen_listed(step) -> list[str]:
    """A started step's frozen parameters the optimizer lists (their state, if any, stays in optimizer.state)."""
    listed = {id(p) for group in step.optimizer.param_groups for p in group["params"]}
    params = step.state.tensors("param")
    return [info.name for info in step.state.captured.frozen if id(params[info.name]) in listed]


def _first_state_as_zeros(step, stateless: list[tuple[str, torch.Tensor, tuple[int, ...]]]) -> dict[str, _Part]:
    """Per (name, parameter, shape) without optimizer state: the state its first update creates, as zeros."""
    parts = {}
    if stateless:
        layouts = initial_state_layout(step.optimizer, [t for _, t, _ in stateless], [s for _, _, s in stateless])
        for (name, tensor, _), layout in zip(stateless, layouts):
            for key, (shape, dtype) in layout.items():
                part = _whole(optim_key(name, key), torch.zeros(shape, dtype=dtype, device=tensor.device))
                parts[part.key] = dataclasses.replace(part, absent=True)
    return parts


def _whole(key: str, tensor: torch.Tensor) -> _Part:
    if tensor.dim() == 0:
        return _Part(key, 1, True, [(0, tensor)], None)
    return _flat(key, tensor)


def _flat(key: str, tensor: torch.Tensor) -> _Part:
    """A tensor held whole, as a flat entry even when it is 0-dim (a parameter, saved flat at every stage)."""
    return _Part(key, tensor.numel(), False, [(0, tensor.reshape(-1))], None)


def _parts_of_slots(step) -> dict[str, _Part]:
    plan, captured, slots = step.state.plan, step.state.captured, step.state.slots
    parts: dict[str, _Part] = {}
    bucketed = {}
    for bucket in plan.buckets:
        for segment in bucket.segments:
            bucketed[segment.param] = (bucket, segment)
    for index, info in enumerate(captured.params):
        key = model_key(info.name)
        if index not in bucketed:
            parts[key] = _flat(key, slots[decisions.param_slot(info.name)])
            continue
        bucket, segment = bucketed[index]
        flat = slots[decisions.bucket_slot(bucket.index)]
        if plan.holds_shard(bucket) and bucket.shards > 1:   # stage 3, or fp32 masters under mixed precision
            local = [(p.param_offset, flat[p.shard_offset: p.shard_offset + p.numel])
                     for p in bucket.pieces(plan.rank) if p.param == index]
            parts[key] = _Part(key, info.numel, False, local, _owners(bucket, index), like=flat)
        else:
            parts[key] = _Part(key, info.numel, False, [(0, flat[segment.offset: segment.offset + segment.numel])], None)
    # optimizer state: one slot per piece this rank owns (the whole parameter at stage 0)
    pieces = {decisions.piece_owner(b.index, number): (b, piece) for b, number, piece in plan.owned_pieces()}
    for slot, value in slots.items():
        if not slot.startswith("state:"):
            continue
        _, owner, state = slot.split(":", 2)
        if owner in pieces:
            bucket, piece = pieces[owner]
            info = captured.params[piece.param]
            key = optim_key(info.name, state)
            if value.dim() == 0:
                parts[key] = _Part(key, 1, True, [(0, value)], None)
            elif bucket.shards > 1:
                part = parts.setdefault(key, _Part(key, info.numel, False, [], _owners(bucket, piece.param)))
                part.local.append((piece.param_offset, value))
            else:
                parts[key] = _Part(key, info.numel, False, [(0, value)], None)
        else:   # a parameter outside every bucket keeps its whole state
            key = optim_key(owner, state)
            parts[key] = _whole(key, value)
    # trained parameters no rank holds optimizer state for: one the loss does not reach (no state in its program's
    # signature), or every one after a first update the loss scale skipped (no state slot at all; a rank that owns
    # no piece, of buckets smaller than the world, holds none either way and leaves it to the others)
    made = bool(step.state.state_key()) or not pieces
    params = {names[0]: t for names, t in named_tensors(step.model, "param")}
    parts.update(_first_state_as_zeros(step, [
        (info.name, params[info.name], info.shape)
        for info, signature in zip(captured.params, step.state.state_signature or [{}] * len(captured.params))
        if not (made and signature)]))
    for info in captured.frozen:
        parts[model_key(info.name)] = _flat(model_key(info.name), slots[decisions.frozen_slot(info.name)])
    parts.update(_frozen_optimizer_state(step, params))
    unsaved = _non_persistent_buffers(step.model)
    for info in captured.buffers:
        if info.name not in unsaved:
            parts[model_key(info.name)] = _whole(model_key(info.name), slots[decisions.buffer_slot(info.name)])
    return parts


def _non_persistent_buffers(model) -> set[str]:
    """Buffers registered with ``persistent=False`` (under their first name): as ``model.state_dict()`` leaves them out,
    a checkpoint neither saves nor loads them, so a resumed model keeps its own (a RoPE table built from the config)."""
    non_persistent = {f"{prefix}.{name}" if prefix else name
                      for prefix, module in model.named_modules(remove_duplicate=False)
                      for name in module._non_persistent_buffers_set}
    return {names[0] for names, _ in named_tensors(model, "buffer") if all(n in non_persistent for n in names)}


def _owners(bucket: decisions.Bucket, param: int) -> list[tuple[int, int, int]]:
    return [(rank, p.param_offset, p.numel) for rank in range(bucket.shards) for p in bucket.pieces(rank)
            if p.param == param]


# -- CompiledStep.state_dict / load_state_dict --------------------------------------
def state_dict(step) -> dict[str, object]:
    """This rank's state, keyed by name; values are views of the live state (nothing is copied)."""
    return _state_of(step, _parts(step))


def _state_of(step, parts: dict[str, _Part]) -> dict[str, object]:
    """``state_dict`` of the parts ``_parts(step)`` made (a load reads them too)."""
    result: dict[str, object] = {}
    for key, part in parts.items():
        if part.scalar:
            result[key] = part.local[0][1]
        elif part.owners is None:
            result[key] = part.local[0][1]
        else:
            result[key] = _sharded(part, step.ranks)
    result[STEPS_KEY] = torch.tensor(step.steps, dtype=torch.int64)
    # A tuple is one entry to DCP (pickled whole): a list of dicts would be flattened into one entry per
    # setting, which DCP's load failed to match across ranks when the state also held ShardedTensors.
    result[PARAM_GROUPS_KEY] = tuple(_param_groups(step))
    return result


def _param_groups(step) -> list[dict]:
    """The optimizer's groups, hyper-parameters copied, parameters by fqn (tied weights under their first name)."""
    fqn = {id(t): names[0] for names, t in named_tensors(step.model, "param")}
    return [{**{k: v for k, v in group.items() if k != "params"}, "params": [fqn[id(p)] for p in group["params"]]}
            for group in step.optimizer.param_groups]


# keys torch.optim.lr_scheduler (and swa_utils.SWALR) add to an optimizer's param groups
SCHEDULER_GROUP_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "swa_lr"})


# the way out where a checkpoint is refused for another model or optimizer: what a fine-tuning run means to do
WEIGHTS_ONLY = ("to start another model or optimizer from its weights (a new head, one more layer, a resized vocabulary, "
                "an optimizer over fewer parameters), load them into the model before zerocc.compile: "
                "zerocc.export_full_state_dict(path, 'model.safetensors'); "
                "model.load_state_dict(zerocc.state_dict.read_safetensors('model.safetensors'), strict=False) "
                "(zerocc's docs/guide/checkpoints.md, 'Resuming with changes')")


def _load_param_groups(step, saved: list[dict]) -> None:
    """Set every group's hyper-parameters to the saved ones, as ``Optimizer.load_state_dict`` does, then let the
    optimizer type's ``__setstate__`` see them, as that load ends: it fills settings an older checkpoint lacks and
    overrides some. Without it an Adam checkpoint loaded into AdamW kept Adam's ``decoupled_weight_decay=False``
    and trained Adam's coupled weight decay, where eager's ``AdamW.__setstate__`` sets it back to True."""
    for group, settings in zip(step.optimizer.param_groups, saved):
        group.update({k: v for k, v in settings.items() if k != "params"})
    _as_setstate_leaves(step.optimizer)


def _as_setstate_leaves(optimizer) -> None:
    """Run ``type(optimizer).__setstate__`` over the optimizer's own group dicts (edited in place) on a stand-in
    with no state: the step holds the state, and the user's optimizer object is left as it is otherwise."""
    stand_in = object.__new__(type(optimizer))
    stand_in.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k not in ("state", "param_groups")})
    stand_in.__setstate__({"state": collections.defaultdict(dict), "param_groups": optimizer.param_groups})


def _check_param_groups(step, saved: list[dict]) -> None:
    """Refuse saved groups over other parameters, or with settings of another optimizer type."""
    own = _param_groups(step)
    if [g["params"] for g in saved] != [g["params"] for g in own]:
        where = next((i for i, (a, b) in enumerate(zip(saved, own)) if a["params"] != b["params"]), min(len(saved), len(own)))
        differ = ""
        if where < min(len(saved), len(own)):
            a, b = saved[where]["params"], own[where]["params"]
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            differ = (f"; group {where} differs at its parameter {at}: the checkpoint's "
                      f"{a[at] if at < len(a) else '(none)'!r} ({len(a)} in all), this one's "
                      f"{b[at] if at < len(b) else '(none)'!r} ({len(b)} in all)")
        raise ConfigError(
            f"the checkpoint's optimizer has {len(saved)} param group(s) over parameters "
            f"{[g['params'][:3] for g in saved]}, this one {len(own)} over {[g['params'][:3] for g in own]}{differ}; "
            "build the optimizer with the same param groups, in the same order, as the run that saved it; " + WEIGHTS_ONLY)
    # a setting this optimizer does not have (AdamW's betas in an SGD): saved with another optimizer type, whose
    # state and settings would otherwise go in silently before the first call (lr and weight decay included).
    # What LR schedulers and SWA add to the groups is no optimizer's: a resume loads the checkpoint, then makes
    # its scheduler with last_epoch, which reads the initial_lr the checkpoint brings (as eager's load does)
    foreign = sorted({k for g in saved for k in g} - {k for g in own for k in g} - SCHEDULER_GROUP_KEYS)
    if foreign:
        raise ConfigError(
            f"the checkpoint's optimizer has settings {type(step.optimizer).__name__} does not have: "
            f"{', '.join(foreign)}; it was saved with another optimizer type (or a torch whose optimizer has them): "
            "build the same optimizer as the run that saved it")


def whole_optimizer_state(step) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter fqn, its optimizer state whole and shaped like it (copies); this rank must hold all of it."""
    shapes = {info.name: info.shape for info in [*step.state.captured.params, *step.state.captured.frozen]}
    result: dict[str, dict[str, torch.Tensor]] = {}
    for key, part in _parts(step).items():
        if not key.startswith("optim/") or part.absent:   # no state, as eager's optimizer has none
            continue
        _, fqn, name = key.split("/", 2)
        if part.scalar:
            value = part.local[0][1].clone()
        else:
            value = torch.empty(part.numel, dtype=part.local[0][1].dtype, device=part.local[0][1].device)
            _copy_into(_Part(key, part.numel, False, [(0, value)], None), part.local)
            value = value.reshape(shapes[fqn])
        result.setdefault(fqn, {})[name] = value
    return {fqn: dict(sorted(entries.items())) for fqn, entries in result.items()}


def gathered_optimizer_state(step) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter fqn, its whole optimizer state shaped like it, on every rank (a collective at stages 1-3).

    What ``CompiledStep.close`` hands back to ``optimizer.state``. Each piece
    is broadcast from the rank that owns it, copied as it is (no sum over
    ranks, which would turn a -0.0 into 0.0); an entry every holder keeps
    whole (a scalar, a parameter outside the buckets) from its first holder.
    """
    ranks = step.ranks
    if ranks.world_size == 1 or step.stage == 0:   # every rank holds all of it
        return whole_optimizer_state(step)
    parts = {key: part for key, part in _parts(step).items() if key.startswith("optim/") and not part.absent}
    mine = {key: (part.numel, part.scalar, part.owners, part.local[0][1].dtype) for key, part in parts.items()}
    held: list = [None] * ranks.world_size
    dist.all_gather_object(held, mine, group=ranks.group)
    device = next(iter(step.state.slots.values())).device
    shapes = {info.name: info.shape for info in [*step.state.captured.params, *step.state.captured.frozen]}
    result: dict[str, dict[str, torch.Tensor]] = {}
    for key in sorted(set().union(*held)):
        holders = [rank for rank in range(ranks.world_size) if key in held[rank]]
        numel, scalar, owners, dtype = held[holders[0]][key]
        part = parts.get(key)
        value = torch.zeros((), dtype=dtype, device=device) if scalar else \
            torch.zeros(numel, dtype=dtype, device=device)
        for offset, piece in part.local if part is not None else ():   # this rank's pieces, then everyone's
            value.reshape(-1)[offset: offset + piece.numel()].copy_(piece.reshape(-1))
        pieces = [(holders[0], 0, numel)] if owners is None or scalar else owners
        for rank, offset, count in pieces:
            box = value.reshape(-1)[offset: offset + count]
            dist.broadcast(box, src=dist.get_global_rank(ranks.group, rank), group=ranks.group)
        _, fqn, name = key.split("/", 2)
        result.setdefault(fqn, {})[name] = value if scalar else value.reshape(shapes[fqn])
    return {fqn: dict(sorted(entries.items())) for fqn, entries in result.items()}


def _sharded(part: _Part, ranks) -> ShardedTensor:
    like = part.local[0][1] if part.local else part.like

    def placement(rank):
        return f"rank:{dist.get_global_rank(ranks.group, rank)}/{like.device}"
    metadata = [ShardMetadata([offset], [numel], placement(rank)) for rank, offset, numel in part.owners]
    local = [Shard(view, ShardMetadata([offset], [view.numel()], placement(ranks.rank)))
             for offset, view in part.local]
    properties = TensorProperties.create_from_tensor(like)
    global_metadata = ShardedTensorMetadata(metadata, torch.Size([part.numel]), properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, global_metadata, process_group=ranks.group)


def _sources(value) -> list[tuple[int, torch.Tensor]]:
    """(flat offset, flat tensor) for each piece of ``value`` this rank has."""
    if isinstance(value, ShardedTensor):
        return [(shard.metadata.shard_offsets[0], shard.tensor.reshape(-1)) for shard in value.local_shards()]
    if not isinstance(value, torch.Tensor):
        raise ConfigError(f"a checkpoint entry must be a tensor or ShardedTensor, got {type(value).__name__}")
    return [(0, value.reshape(-1))]


def load_state_dict(step, state: dict[str, object]) -> None:
    """Copy ``state`` (as from ``state_dict()``, after ``dcp.load`` filled it) into the step."""
    if not step.state.started:   # checked before anything changes
        _refuse_pieces_before_the_first_call(state)
    if PARAM_GROUPS_KEY in state:   # checked before anything changes
        _check_param_groups(step, list(state[PARAM_GROUPS_KEY]))
    # saved before any step: its optimizer state entries are the zeros a first update starts from, standing for no
    # state (zeros are not that for every optimizer: SGD's dampened momentum, NAdam's mu_product)
    before_any_step = step.state.started and STEPS_KEY in state and int(state[STEPS_KEY]) == 0
    if STEPS_KEY in state:
        step.steps = int(state[STEPS_KEY])
    if PARAM_GROUPS_KEY in state:
        _load_param_groups(step, list(state[PARAM_GROUPS_KEY]))
    parts = _parts(step)
    given = {k for k in state if k not in (STEPS_KEY, PARAM_GROUPS_KEY)}
    frozen_listed = set(_frozen_listed(step)) if step.state.started else set()
    missing = sorted(k for k in parts if k not in given and not (not step.state.started and k.startswith("optim/"))
                     and not k.startswith(SCALER_PREFIX) and not parts[k].absent and not parts[k].frozen)
    frozen_keys = {k for k in given if k.startswith("optim/") and k.split("/", 2)[1] in frozen_listed}
    unknown = sorted(k for k in given if k not in parts and not (not step.state.started and k.startswith("optim/"))
                     and not k.startswith(SCALER_PREFIX) and k not in frozen_keys)
    if missing or unknown:
        raise ConfigError(
            "the state dict does not fit this model and optimizer:\n"
            + "".join(f"  - missing: {k}\n" for k in missing[:10])
            + "".join(f"  - not in this model/optimizer: {k}\n" for k in unknown[:10])
            + "  load a checkpoint of the same model, with the same optimizer type")
    if step.state.started:   # checked before anything is copied: nothing is half-loaded
        _refuse_state_without_a_place(parts, state)
    optimizer_entries = set()
    if not step.state.started:
        optimizer_entries = {k for k in given if k.startswith("optim/")}
        _install_optimizer_state(step, {k: state[k] for k in optimizer_entries})
    elif before_any_step:   # as eager's optimizer.load_state_dict of a state dict without state: the next update is
        # a first update again (a program traced without optimizer state, as after an fp16 first step that overflowed)
        optimizer_entries = {k for k in given if k.startswith("optim/")}
        for slot in [slot for slot in step.state.slots if slot.startswith("state:")]:
            del step.state.slots[slot]
    if step.state.started:   # frozen parameters' state: replaced by the checkpoint's, as eager's load_state_dict does
        optimizer_entries |= frozen_keys
        _install_frozen_optimizer_state(step, {k: state[k] for k in frozen_keys})
    with torch.no_grad():
        for key in (given & parts.keys()) - optimizer_entries:
            _copy_into(parts[key], _sources(state[key]))
        if not any(k.startswith(SCALER_PREFIX) for k in given):   # saved without loss scaling: the scale starts afresh
            scaler = step.state.scaler_state()
            for slot, value in mixed.initial_scaler_slots(step.precision, "cpu").items():
                scaler[slot].copy_(value)
        if step.state.started:   # the param_dtype copies of loaded masters (stages 1-2; a collective)
            slot_store.refresh_compute_copies(step.state.plan, step.state.slots, step.ranks.group)


def _refuse_pieces_before_the_first_call(state: dict[str, object]) -> None:
    """Before its first call a step takes every tensor whole: refuse one that holds only some of its elements here (a
    ShardedTensor of a started step's ``state_dict()``, saved with ``torch.save`` on each rank and loaded back)."""
    pieces = sorted(k for k, v in state.items() if isinstance(v, ShardedTensor)
                    and sum(shard.tensor.numel() for shard in v.local_shards()) != _numel(v.size()))
    if pieces:
        raise ConfigError(
            f"{', '.join(pieces[:3])}{' ...' if len(pieces) > 3 else ''} ({len(pieces)} entries) hold only this "
            "rank's pieces (ShardedTensors of a step that ran: its state_dict() saved with torch.save on each rank?), "
            "but before its first call the step needs every tensor whole. Save with zerocc.save_checkpoint(step, "
            "path) or dcp.save(step.state_dict(), checkpoint_id=path) and load with zerocc.load_checkpoint(step, "
            "path) or sd = step.state_dict(); dcp.load(sd, checkpoint_id=path); step.load_state_dict(sd): each rank "
            "then reads the pieces it needs, at any world size and stage")


def _refuse_state_without_a_place(parts: dict[str, _Part], state: dict[str, object]) -> None:
    """A started step has no slot for optimizer state no rank held at its first call: refuse it, rather than drop it."""
    made = sorted(k for k in state if k in parts and parts[k].absent and not parts[k].frozen
                  and any(bool(source.any()) for _, source in _sources(state[k])))
    if made:
        raise ConfigError(
            f"the checkpoint holds optimizer state for {', '.join(made[:5])}, which this step's optimizer has none "
            "for (the loss did not reach the parameter, or every update so far was skipped by the loss scale): its "
            "program has no place for it. Load the checkpoint before the step's first call")


def _copy_into(part: _Part, sources: list[tuple[int, torch.Tensor]]) -> None:
    for offset, target in part.local:
        target_flat = target.reshape(-1)
        covered = 0
        for source_offset, source in sources:
            lo = max(offset, source_offset)
            hi = min(offset + target_flat.numel(), source_offset + source.numel())
            if lo < hi:
                target_flat[lo - offset: hi - offset].copy_(source[lo - source_offset: hi - source_offset])
                covered += hi - lo
        if covered != target_flat.numel():
            raise ConfigError(f"{part.key}: the state dict covers {covered} of the {target_flat.numel()} elements "
                              f"this rank needs at offset {offset}; build it with step.state_dict() before loading")


def _install_frozen_optimizer_state(step, state: dict[str, object]) -> None:
    """A started step: the frozen parameters' optimizer state in optimizer.state becomes ``state``'s (copies)."""
    params = step.state.tensors("param")
    for info in step.state.captured.frozen:
        step.optimizer.state.pop(params[info.name], None)
    _install_optimizer_state(step, state, {info.name: info.shape for info in step.state.captured.frozen})


def _install_optimizer_state(step, state: dict[str, object], shapes: dict | None = None) -> None:
    """Before the first step: put whole optimizer state where the first compile reads it (and, ``shapes`` given, a
    started step's frozen parameters' state where it stays)."""
    params = {names[0]: t for names, t in named_tensors(step.model, "param")}
    by_param: dict[str, list[torch.Tensor]] = {}
    for key, value in state.items():
        by_param.setdefault(key.split("/", 2)[1], []).append(value)
    # all zeros: saved before any step ran (the state a first step would create, not yet created); an
    # optimizer without state takes its first step exactly as eager does, so leave it without state
    never_stepped = {fqn for fqn, values in by_param.items()
                     if fqn in params and not step.optimizer.state.get(params[fqn])
                     and not any(isinstance(v, torch.Tensor) and bool(v.any()) for v in values)}
    # in the model's parameter order, as an eager first step creates it: the checkpoint's metadata lists its
    # keys in no fixed order, and the compile cache's fingerprint reads this dict's order
    order = {fqn: index for index, fqn in enumerate(params)}
    for key, value in sorted(state.items(), key=lambda item: (order.get(item[0].split("/", 2)[1], len(order)),
                                                              item[0])):
        if key.split("/", 2)[1] in never_stepped:
            continue
        _, fqn, name = key.split("/", 2)
        if fqn not in params:
            raise ConfigError(f"{key}: the model has no parameter {fqn!r}")
        param = params[fqn]
        shape = (shapes or {}).get(fqn, param.shape)   # a started step's: the module may hold a placeholder
        sources = _sources(value)
        if len(sources) != 1 or sources[0][1].numel() != (1 if value.dim() == 0 else _numel(shape)):
            raise ConfigError(f"{key}: before the first step the whole tensor is needed")
        tensor = value if value.dim() == 0 else value.reshape(shape)
        step.optimizer.state[param][name] = tensor.detach().clone()
    # capture labels state placeholders in sorted key order but traces them in dict order: keep the two equal
    for param, entries in list(step.optimizer.state.items()):
        step.optimizer.state[param] = dict(sorted(entries.items()))


# -- save and load with atomic commit ---------------------------------------------
def save_checkpoint(step, path: str) -> str:
    """Save ``step``'s sharded state to ``path`` (a symlink to a complete version directory); returns the version.

    What rank 0 does alone (choosing the version, publishing it) ends in a broadcast of its outcome, not a
    barrier: where it fails, every rank raises the same error instead of the others waiting for rank 0.

    Ctrl-C is held until the save ends, then raised: the save a loop makes in ``except KeyboardInterrupt:`` is
    where torchrun's own SIGINT lands (it forwards the terminal's Ctrl-C to every worker, a second one), and a
    rank interrupted in the middle left the others waiting in the save's collectives and no checkpoint. A third
    Ctrl-C is raised at once (a save that hangs can still be interrupted: one press under torchrun is two).
    """
    _check_step_and_path("zerocc.save_checkpoint", step, path)
    held = HeldInterrupt(let_through=2)
    held.hold()
    try:
        with failures.collective_failures(step.ranks, step.steps, step.timeout, call="zerocc.save_checkpoint"):
            version = _save(step, os.path.abspath(path))
    except BaseException:
        held.release(deliver=False)
        raise
    held.release(deliver=True)
    return version


def _raise_own_interrupt(error: CheckpointException, ranks) -> None:
    """This rank's Ctrl-C as ``KeyboardInterrupt``: DCP wraps whatever a rank raised in a ``CheckpointException``, so
    Ctrl-C let through in a save or load (the third press) came out as ``CheckpointError: ... KeyboardInterrupt``,
    which a loop's ``except KeyboardInterrupt:`` missed. The other ranks' errors say which rank was interrupted."""
    failure = error.failures.get(ranks.rank if ranks.group is not None else 0)
    if failure is not None and isinstance(failure[0], KeyboardInterrupt):
        raise KeyboardInterrupt(*failure[0].args) from error


def _check_step_and_path(call: str, step, path, loading: bool = False) -> None:
    """``call(step, path)``'s arguments: the step ``zerocc.compile`` returned (still open) and a path."""
    from .api import CompiledStep
    if not isinstance(step, CompiledStep):
        raise ConfigError(f"{call}(step, path) takes the step zerocc.compile returned first, got "
                          f"{type(step).__name__}{' (the path first?)' if isinstance(step, (str, os.PathLike)) else ''}")
    step._check_open(loading=loading)
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ConfigError(f"{call}(step, path): path must be a checkpoint's path (str or os.PathLike), got {path!r}")


def _save(step, path: str) -> str:
    ranks = step.ranks
    failures.meet(ranks, "zerocc.save_checkpoint", step.steps, step.timeout)   # every rank saves, or all fail
    version = _on_rank_0(ranks, lambda: _new_version(path))
    _check_every_rank_sees(ranks, path, version)
    state = state_dict(step)
    writer = dcp.FileSystemWriter(version, sync_files=True)
    # a tensor every rank holds whole is written by rank 0: buffers the step updates (BatchNorm statistics) differ
    # across ranks until the next step broadcasts rank 0's, and DCP's default writes whichever rank it balances to
    planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    try:   # DCP gathers every rank's outcome: where one rank's write fails, every rank raises
        with _in_one_process():
            dcp.save(state, storage_writer=writer, planner=planner, process_group=ranks.group,
                     no_dist=ranks.group is None)
    except CheckpointException as error:   # a BaseException: ``except Exception`` in a training loop would not see it
        _raise_own_interrupt(error, ranks)
        raise CheckpointError(f"saving {path} failed: {_first_line(error)}; {path} still holds the previous "
                              "checkpoint, if any (the next save removes the incomplete version)") from error
    _barrier(ranks)   # every rank's files are written and fsynced

    def publish():
        _check_every_shard_written(path, version)
        _write_meta(step, version)
        _fsync_tree(version)
        _publish(path, version)
    _on_rank_0(ranks, publish)
    return version


def _new_version(path: str) -> str:
    """A fresh version directory beside ``path``, after removing the leftovers of interrupted saves."""
    if os.path.lexists(path) and not _is_checkpoint_link(path):
        what = f"a symlink to {os.readlink(path)}" if os.path.islink(path) else "a directory" if os.path.isdir(path) \
            else "a file"
        raise ConfigError(f"{path} exists and is not a zerocc checkpoint (a symlink to a version directory "
                          f"{os.path.basename(path)}.v<n> beside it) but {what}, which the save would replace and "
                          "the next one delete; choose a new path")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    current = os.path.realpath(path) if os.path.islink(path) else None
    for stale in _versions(path):      # leftovers of interrupted saves
        if stale != current:
            shutil.rmtree(stale, ignore_errors=True)
    numbers = [int(v.rsplit(".v", 1)[1]) for v in _versions(path)]
    version = f"{path}.v{max(numbers, default=0) + 1}"
    os.makedirs(version)
    return version


SHARED_STORAGE = ("every rank writes its own shards into the one checkpoint folder, so the path must be on storage every "
                  "node mounts at the same path (NFS, Lustre, a mounted bucket); see zerocc's docs/guide/checkpoints.md")


def _node() -> str:
    """This rank's node as torchrun names it, for errors naming ranks on other machines."""
    group = os.environ.get("GROUP_RANK")
    return f"host {socket.gethostname()}" + (f", node {group}" if group is not None else "")


def _check_every_rank_sees(ranks, path: str, version: str) -> None:
    """Every rank sees the version folder rank 0 created, or no rank writes: a rank on a node whose ``path`` is on
    its own disk wrote its shards there, where no load ever finds them, and the save reported success while no
    node held a whole checkpoint (and that node's folders were never cleaned up).

    A brief retry: a shared filesystem may show another node's new folder a moment late."""
    deadline = time.monotonic() + 2.0
    while not os.path.isdir(version) and time.monotonic() < deadline:
        time.sleep(0.1)
    failed = failures.failed_ranks(ranks, None if os.path.isdir(version) else _node())
    if not failed:
        return
    if ranks.rank == 0:
        shutil.rmtree(version, ignore_errors=True)
    raise ConfigError(f"zerocc.save_checkpoint({path!r}): rank(s) " + ", ".join(f"{rank} ({where})" for rank, where in failed)
                      + f" do not see the folder {version} rank 0 created for this save: the path is on each node's own "
                      f"disk, not shared. Nothing was written; {SHARED_STORAGE}")


def _check_every_shard_written(path: str, version: str) -> None:
    """On rank 0 before publishing: every file the checkpoint's metadata names is in the version folder. Where a rank
    wrote elsewhere (a node-local folder of the same name left by an earlier save), the checkpoint would load
    nowhere: refused, the previous checkpoint kept."""
    names = {info.relative_path for info in dcp.FileSystemReader(version).read_metadata().storage_data.values()}
    missing = sorted(name for name in names if not os.path.exists(os.path.join(version, name)))
    if missing:
        shutil.rmtree(version, ignore_errors=True)
        raise ConfigError(f"zerocc.save_checkpoint({path!r}): {version} on rank 0 lacks {', '.join(missing[:8])}"
                          f"{' ...' if len(missing) > 8 else ''} (__<rank>_<n>.distcp: written by that rank, on its own "
                          f"node's disk); {path} still holds the previous checkpoint, if any. "
                          + SHARED_STORAGE[0].upper() + SHARED_STORAGE[1:])


def _on_rank_0(ranks, work):
    """``work()`` on rank 0, its result broadcast; where it raises, every rank raises (a ConfigError as it is, an
    OSError as a CheckpointError), rather than the other ranks waiting in a collective rank 0 never reaches."""
    result, failure = None, None
    if ranks.rank == 0:
        try:
            result = work()
        except (ConfigError, OSError) as error:
            failure = (type(error) is ConfigError, str(error) if isinstance(error, ConfigError)
                       else f"{type(error).__name__}: {error}")
    result, failure = _broadcast((result, failure), ranks)
    if failure is not None:
        refused, message = failure
        raise ConfigError(message) if refused else CheckpointError(f"saving the checkpoint failed on rank 0: {message}")
    return result


def _versions(path: str) -> list[str]:
    folder, base = os.path.split(path)
    pattern = re.compile(re.escape(base) + r"\.v\d+$")
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if pattern.match(n))


def _is_checkpoint_link(path: str) -> bool:
    """Whether ``path`` is the symlink a save publishes: to a version directory ``<name>.v<n>`` beside it."""
    return os.path.islink(path) and re.fullmatch(re.escape(os.path.basename(path)) + r"\.v\d+", os.readlink(path)) is not None


def _publish(path: str, version: str) -> None:
    """Point ``path`` at ``version`` with one atomic rename, then drop the previous version."""
    previous = os.path.realpath(path) if _is_checkpoint_link(path) else None
    link = f"{path}.link"
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(os.path.basename(version), link)
    os.replace(link, path)
    _fsync_dir(os.path.dirname(path))
    if previous is not None and previous != os.path.realpath(version):
        shutil.rmtree(previous, ignore_errors=True)


def _shapes(step) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """Per model key (tied weights under each name): its first name, its shape and dtype."""
    shapes = {}
    for kind in ("param", "buffer"):
        for names, tensor in named_tensors(step.model, kind):
            shape = tuple(tensor.shape)
            if step.state.started:
                shape = tuple(step.state.released_shapes.get(names[0], shape))
            for name in names:
                shapes[name] = (names[0], shape, str(tensor.dtype).removeprefix("torch."))
    return shapes


def _check_shapes(step, path: str) -> None:
    """Entries are saved flat: a tensor of another shape with as many elements (a transposed weight) would load
    scrambled, and one of another size fails deep in DCP. The shapes ``_write_meta`` kept are compared first."""
    with open(os.path.join(path, META_FILE)) as handle:
        saved = json.load(handle).get("model", [])
    own = _keyed_shapes(step)
    differ = [f"{key}: {tuple(shape)} in the checkpoint, {own[key][1]} here"
              for key, _, shape, _ in saved if key in own and tuple(shape) != own[key][1]]
    if differ:
        raise ConfigError(f"{path} holds {len(differ)} tensor(s) of other shapes than this model's: "
                          + "; ".join(differ[:5]) + "; it was saved from a different model; " + WEIGHTS_ONLY)


def _keyed_shapes(step) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """``_shapes`` per key of ``model.state_dict()`` (a hook may rename keys: ``checkpoint_wrapper``'s)."""
    shapes = _shapes(step)
    with step.state.reading_keys_only():   # zerocc/user_views.py: only the keys are read, no current values
        names = state_dict_names(step.model)
    return {key: shapes[name] for key, name in names.items() if name in shapes}


def _write_meta(step, folder: str) -> None:
    shapes = _keyed_shapes(step)
    meta = {"format": FORMAT_VERSION, "world_size": step.ranks.world_size, "stage": step.stage, "steps": step.steps,
            "model": [[key, model_key(first), list(shape), dtype] for key, (first, shape, dtype) in shapes.items()]}
    target = os.path.join(folder, META_FILE)
    with open(target, "w") as handle:
        json.dump(meta, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_tree(folder: str) -> None:
    for name in os.listdir(folder):
        file = os.path.join(folder, name)
        if os.path.isfile(file):
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(folder)


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _broadcast(value, ranks):
    if ranks.group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(ranks.group, 0), group=ranks.group)
    return box[0]


def _barrier(ranks) -> None:
    if ranks.group is not None:
        dist.barrier(group=ranks.group)


def load_checkpoint(step, path: str) -> None:
    """Load a checkpoint saved at any world size and stage into ``step`` (before or after its first call).

    The checkpoint is read straight into the step's own tensors (no second copy of the model's state), so a load
    cut short leaves the step holding part of the checkpoint and part of its own training: Ctrl-C (a notebook's
    interrupt, a load of the wrong checkpoint stopped) did so, and the next call trained on the mix silently. Ctrl-C
    is now held until the load ends, then raised, as in ``save_checkpoint`` (a third is raised at once); a load that
    fails after it began to write (that third Ctrl-C, an unreadable shard file) leaves the step refusing every call
    but another ``load_checkpoint`` (``step.state.half_loaded``).
    """
    _check_step_and_path("zerocc.load_checkpoint", step, path, loading=True)
    refuse_inside_full_model(step, "zerocc.load_checkpoint")
    held = HeldInterrupt(let_through=2)
    held.hold()
    try:
        with failures.collective_failures(step.ranks, step.steps, step.timeout, call="zerocc.load_checkpoint"):
            _load(step, os.path.abspath(path))
    except BaseException:
        held.release(deliver=False)
        raise
    held.release(deliver=True)


def _load(step, path: str) -> None:
    failures.meet(step.ranks, "zerocc.load_checkpoint", step.steps, step.timeout)   # every rank loads, or all fail
    # what each rank checks alone (a folder on one node's disk only): every rank hears of it
    _on_every_rank(step.ranks, lambda: _check_complete(step, path))
    reader = dcp.FileSystemReader(path)
    saved = reader.read_metadata().state_dict_metadata
    parts = _parts(step)
    state = _state_of(step, parts)
    frozen_listed = set(_frozen_listed(step)) if step.state.started else set()
    for key, entry in saved.items():
        if key not in state and key.startswith("optim/") and (not step.state.started
                                                               or key.split("/", 2)[1] in frozen_listed):
            state[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
        elif _one_element_of_another_shape(state.get(key), entry):   # a 0-dim parameter in older checkpoints
            state[key] = state[key].view(entry.size)
    if not step.state.started:   # before the first step, optimizer state the checkpoint lacks starts afresh
        state = {k: v for k, v in state.items() if k in saved or not k.startswith("optim/")}
    # a checkpoint saved without loss scaling (fp32, bf16) lacks the scale: a step with one starts it afresh
    state = {k: v for k, v in state.items() if k in saved or not k.startswith(SCALER_PREFIX)}
    # optimizer state no rank holds, as zeros: checkpoints written before those were saved lack it
    stateless = {key for key, part in parts.items() if part.absent and not part.frozen}
    # a frozen parameter's optimizer state the checkpoint lacks: none after the load, as eager's load_state_dict
    frozen = {key for key, part in parts.items() if part.frozen}
    state = {k: v for k, v in state.items() if k in saved or k not in stateless | frozen}
    groups_saved = PARAM_GROUPS_KEY in saved
    if not groups_saved:
        del state[PARAM_GROUPS_KEY]
    absent = sorted(k for k in state if k not in saved and k != PARAM_GROUPS_KEY)
    if absent:
        raise ConfigError(f"{path} lacks {len(absent)} entr{'y' if len(absent) == 1 else 'ies'} this step needs: "
                          f"{', '.join(absent[:5])}; it was saved from a different model or optimizer"
                          + ("; " + WEIGHTS_ONLY if any(k.startswith("model/") for k in absent) else ""))
    try:
        with _in_one_process():
            if groups_saved:   # refused before the load writes into the step's buckets (views at stages 1-3)
                groups = {PARAM_GROUPS_KEY: state[PARAM_GROUPS_KEY]}
                dcp.load(groups, storage_reader=reader, process_group=step.ranks.group,
                         no_dist=step.ranks.group is None)
                _check_param_groups(step, list(groups[PARAM_GROUPS_KEY]))
            if step.state.started:   # read first (on every rank: a collective): the load below writes into the buckets
                without_a_place = {k: v for k, v in state.items() if k in stateless}
                dcp.load(without_a_place, storage_reader=reader, process_group=step.ranks.group,
                         no_dist=step.ranks.group is None)
                # each rank reads its own pieces: every rank refuses if any finds state there
                _on_every_rank(step.ranks, lambda: _refuse_state_without_a_place(parts, without_a_place))
            step.state.half_loaded = path   # from here the load writes into the step, until load_state_dict ends
            dcp.load(state, storage_reader=reader, process_group=step.ranks.group, no_dist=step.ranks.group is None)
    except CheckpointException as error:   # a BaseException: ``except Exception`` would not see it
        _raise_own_interrupt(error, step.ranks)
        why = _first_line(error)
        if "FileNotFoundError" in why:
            why += ("; every rank reads the pieces it needs from any rank's files, so the whole checkpoint folder must be "
                    "readable on every node (storage every node mounts, or copied whole to each)")
        raise CheckpointError(f"loading {path} failed: {why}") from error
    load_state_dict(step, state)
    step.state.half_loaded = None


def _check_complete(step, path: str) -> None:
    if not os.path.exists(os.path.join(path, META_FILE)):
        raise ConfigError(_not_a_checkpoint(path) + (
            "; load it with sd = step.state_dict(); dcp.load(sd, checkpoint_id=path); step.load_state_dict(sd)"
            if _written_by_dcp(path) and _of_a_step(path) else ""))
    _check_shapes(step, path)


def _written_by_dcp(path: str) -> bool:
    return os.path.exists(os.path.join(path, ".metadata"))   # DCP's FileSystemWriter's metadata file


def _of_a_step(path: str) -> bool:
    """Whether the DCP checkpoint at ``path`` holds a step's state dict (keys ``model/<fqn>``), or is unreadable."""
    try:
        keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception:   # noqa: BLE001  (a broken folder: say what the folder name says, as before)
        return True
    return any(key.startswith("model/") for key in keys)


def _not_a_checkpoint(path: str) -> str:
    """Why ``path`` is no zerocc checkpoint: it is missing, a DCP checkpoint ``dcp.save`` wrote, or incomplete."""
    if not os.path.exists(path):
        return f"{path} is not a complete zerocc checkpoint: it does not exist"
    if _written_by_dcp(path) and not _of_a_step(path):   # FSDP2's, torchtitan's, a plain model's
        keys = sorted(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
        return (f"{path} is a checkpoint dcp.save wrote of another state dict than a zerocc step's (its keys: "
                f"{', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}), such as FSDP2's get_model_state_dict and "
                "get_optimizer_state_dict: load it into the model and optimizer before zerocc.compile, as that run "
                "saved it (sd = {'model': get_model_state_dict(model), 'optim': get_optimizer_state_dict(model, "
                "optimizer)}; dcp.load(sd, checkpoint_id=path); set_model_state_dict(model, sd['model']); "
                "set_optimizer_state_dict(model, optimizer, sd['optim']), from torch.distributed.checkpoint.state_dict)"
                ", then compile: the step takes them over")
    if _written_by_dcp(path):
        return (f"{path} is not a complete zerocc checkpoint (no {META_FILE}): it holds a checkpoint dcp.save wrote "
                "(torch.distributed.checkpoint, of step.state_dict())")
    return f"{path} is not a complete zerocc checkpoint (no {META_FILE})"


def _on_every_rank(ranks, check) -> None:
    """``check()`` on every rank; where it raises on any, every rank raises: that error on its rank, a ``ConfigError``
    naming the rank and why on the others (``_on_rank_0``'s counterpart for what each rank checks alone). A rank that
    refused alone left the others waiting in the load's collectives until its process ended (or, where the script
    caught the error and trained on, failing with a mismatch of calls)."""
    try:
        check()
        problem = None
    except Exception as error:
        problem = error
    failed = failures.failed_ranks(ranks, None if problem is None else f"{type(problem).__name__}: {problem}")
    if problem is not None:
        raise problem
    if failed:
        unseen = any(message.endswith("it does not exist") for _, message in failed)
        raise ConfigError("the checkpoint cannot be loaded on every rank, so no rank loads it:\n"
                          + "\n".join(f"  rank {rank}: {message}" for rank, message in failed)
                          + (f"\n  rank {ranks.rank} sees it: the path must be on storage every node reads at the same path "
                             "(or the checkpoint copied whole to every node)" if unseen else ""))


def _one_element_of_another_shape(value, saved) -> bool:
    """Whether ``value`` is a plain one-element tensor saved as 0-dim where it is flat, or the other way round."""
    return (isinstance(value, torch.Tensor) and not isinstance(value, ShardedTensor) and value.numel() == 1
            and isinstance(saved, TensorStorageMetadata) and _numel(saved.size) == 1 and value.shape != saved.size)


# -- one file for plain PyTorch ----------------------------------------------------
_SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "complex64": "C64",   # an FNO's spectral weights, a rotary embedding's freqs_cis buffer (safetensors.torch reads C64)
}


def export_full_state_dict(checkpoint_dir: str, out_path: str) -> dict:
    """Write the checkpoint's model as one safetensors file, one tensor in memory at a time.

    No process group is needed. The file loads with ``safetensors.torch.load_file``
    or ``zerocc.state_dict.read_safetensors``, then ``model.load_state_dict``.
    Returns what it wrote: ``tensors``, ``bytes`` and ``largest_tensor_bytes``
    (the most tensor memory it held at once).
    """
    if not os.path.exists(os.path.join(checkpoint_dir, META_FILE)):
        raise CheckpointError(_not_a_checkpoint(checkpoint_dir) + (
            ", which lacks the shapes an export needs: load it into a step with dcp.load and save that with "
            "zerocc.save_checkpoint" if _written_by_dcp(checkpoint_dir) and _of_a_step(checkpoint_dir) else
            "; compile a model it loads into, then save that with zerocc.save_checkpoint" if _written_by_dcp(checkpoint_dir) else
            "; export the path zerocc.save_checkpoint wrote"))
    with open(os.path.join(checkpoint_dir, META_FILE)) as handle:
        meta = json.load(handle)
    reader = dcp.FileSystemReader(checkpoint_dir)
    saved = reader.read_metadata().state_dict_metadata
    header, offset = {}, 0
    unwritable = sorted(f"{name} ({dtype})" for name, _, _, dtype in meta["model"] if dtype not in _SAFETENSORS_DTYPES)
    if unwritable:   # refused before any file is written
        raise CheckpointError(f"export_full_state_dict: safetensors has no dtype for {', '.join(unwritable)}; "
                              "read the checkpoint with zerocc.load_checkpoint into a compiled step and save "
                              "step.full_state_dict() with torch.save instead")
    for name, _, shape, dtype in meta["model"]:
        size = _numel(shape) * getattr(torch, dtype).itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    largest = 0
    partial = f"{out_path}.partial"
    folder = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(folder):   # it raised FileNotFoundError naming the .partial file, not the missing folder
        raise ConfigError(f"export_full_state_dict: the folder of {out_path} ({folder}) does not exist; "
                          "create it first (os.makedirs), as torch.save needs")
    try:
        with open(partial, "wb") as out:
            out.write(struct.pack("<Q", len(encoded)) + encoded)
            for name, key, shape, dtype in meta["model"]:
                # read as saved: flat, or 0-dim (BatchNorm's num_batches_tracked; a 0-dim parameter in older checkpoints)
                tensor = torch.empty(saved[key].size, dtype=getattr(torch, dtype))
                try:
                    with _in_one_process():
                        dcp.load({key: tensor}, storage_reader=reader, no_dist=True)
                except CheckpointException as error:
                    raise CheckpointError(f"exporting {checkpoint_dir}: reading {name} ({key}) failed: "
                                          f"{_first_line(error)}") from error
                largest = max(largest, tensor.numel() * tensor.element_size())
                out.write(tensor.reshape(-1).view(torch.uint8).numpy().data if tensor.numel() else b"")
                del tensor
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, out_path)
    except BaseException:   # nothing half-written is left behind, whatever stopped the export
        if os.path.exists(partial):
            os.remove(partial)
        raise
    return {"tensors": len(header), "bytes": offset, "largest_tensor_bytes": largest}


def _first_line(error: BaseException) -> str:
    """What went wrong in one line: for DCP's CheckpointException, each failed rank's own exception."""
    if isinstance(error, CheckpointException) and error.failures:
        return "; ".join(f"rank {rank}: {type(failure).__name__}: {failure}"
                         for rank, (failure, _) in sorted(error.failures.items()))
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """A safetensors file as a state dict (for environments without the safetensors package)."""
    by_name = {v: getattr(torch, k) for k, v in _SAFETENSORS_DTYPES.items()}
    with open(path, "rb") as handle:
        length = struct.unpack("<Q", handle.read(8))[0]
        header = json.loads(handle.read(length))
        base = 8 + length
        result = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            start, stop = entry["data_offsets"]
            handle.seek(base + start)
            data = bytearray(handle.read(stop - start))
            dtype = by_name[entry["dtype"]]
            flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
            result[name] = flat.reshape(entry["shape"])
    return result
