"""``zerocc.compile``: a model and its optimizer in, one callable training step out."""
from __future__ import annotations

import collections
import contextlib
import math
import time
import warnings
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from . import state_dict as state_dict_module   # its functions share the methods' names
from . import graph as g
from . import guards
from . import decisions
from . import precision
from . import user_views
from . import precision as precision_module   # where a parameter named ``precision`` shadows it
from .precision import DynamicLossScale
from .batch import BatchLayout, FirstBatch, agreement_lines, check_batch
from .capture import Captured, capture, named_tensors
from .data_guards import all_hold
from .user_tooling import suspended_user_tooling
from .context import CompileContext
from .errors import ConfigError, RecompileWarning
from .optimizer_step import hyperparameter_signature, live_hyperparameters
from .passes.clip_gradients import GRAD_NORM_SLOT
from .pipeline import DEFAULT_PREFETCH_BYTES, GraphSnapshot, build_pipeline, dump_dir_of, memory_pools_of, run_pipeline
from .memory_plan import MemoryPlan
from .runtime import failures
from .runtime import slots as slot_store
from .runtime.arenas import Arenas
from .runtime.memory import LiveBytesTracker
from .runtime.process_group import Ranks, resolve
from .runtime.program import Program
from .tracing import make_fake_mode

# Target bucket size. Small enough that a 5M-parameter model gets several
# buckets to overlap, large enough that biases and norms ride along.
DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024

# Programs a step keeps, by input shape (and optimizer-state structure) before dropping the least
# recently used: the first step and the steady state take two, leaving room for a few batch shapes.
DEFAULT_MAX_PROGRAMS = 8


def describe_signature(signature: tuple) -> str:
    """A batch signature as a person reads it: 'shapes (8, 12) float32, (8, 5) float32'."""
    def describe(entry):
        if entry[0] == "keyword":
            return f"{entry[1]}={describe(entry[2])}"
        if entry[0] == "python":
            return f"{entry[1]} {entry[2]}"
        shape, dtype = entry[0], str(entry[1]).replace("torch.", "")
        return f"{shape} {dtype}"
    return "shapes " + ", ".join(describe(entry) for entry in signature)


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
) -> "CompiledStep":
    """Compile one training step of ``model`` with ``optimizer`` under ZeRO ``stage`` (0-3).

    The returned step is called with one batch (this rank's slice of the
    global batch): ``loss = step(*inputs, **keyword_inputs)``. It runs
    forward, loss, backward and the optimizer update. The loss is the model's
    output if it is a scalar tensor, its ``loss`` entry (Hugging Face style,
    e.g. ``step(input_ids=ids, labels=ids)``), or
    ``loss_fn(model(*inputs[:-num_targets], **keyword_inputs), *inputs[-num_targets:])``:
    the targets are the last positional arguments, keyword arguments go to the model.
    Gradients are averaged over the ranks of ``group`` (default: the default
    process group, initialized from torchrun's environment if needed; world
    size 1 without one). ``prefetch_bytes`` bounds the gathered parameter
    bytes (and the unreduced gradient bytes) that may be in flight at once.
    ``timeout`` (seconds) bounds how long a collective waits for the other
    ranks: a rank that died turns into a ``RankFailureError`` on the others
    instead of a hang. Without it collectives wait as long as the process
    group does (torch.distributed's default: 30 minutes on gloo, 10 on
    NCCL). Every call also checks, with one all-reduce of two integers, that
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
    the ``place_checkpoints`` pass recomputes in backward the forward values
    that cost least to recompute per byte until the scheduled step fits, and
    raises ``MemoryBudgetError`` naming the smallest peak it can reach when
    it cannot. ``step.checkpoint_plan`` says what it recomputes.

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
    micro-batches: README, "Training-loop features", has the numbers).

    ``memory_pools=True`` allocates each pool of the memory plan once, as an
    arena, and has every op that can write there (through its ``out=``
    variant) place its output at its planned offset, and writes the
    optimizer's updates into the slots they replace (the ``place_buffers``
    pass); ``False`` leaves every tensor to PyTorch's allocator. ``None``
    (the default) reads ``$ZEROCC_MEMORY_POOLS`` (``1`` on; unset or ``0``
    off, README "Memory pools" says why).
    """
    guards.check_stage(stage)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    guards.check_not_meta(model)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ConfigError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if not isinstance(prefetch_bytes, int) or prefetch_bytes < 0:
        raise ConfigError(f"prefetch_bytes must be a non-negative int, got {prefetch_bytes!r}")
    if memory_budget is not None and (not isinstance(memory_budget, int) or memory_budget <= 0):
        raise ConfigError(f"memory_budget must be a positive int (bytes per rank) or None, got {memory_budget!r}")
    if num_targets is None:
        num_targets = 1 if loss_fn is not None else 0
    memory_pools = memory_pools_of(memory_pools)
    if not isinstance(gather_per_micro_batch, bool):
        raise ConfigError(f"gather_per_micro_batch must be True or False, got {gather_per_micro_batch!r}")
    check_grad_accumulation(grad_accumulation)
    clip = _check_clipping(clip_grad_norm, clip_norm_type)
    if isinstance(max_programs, bool) or not isinstance(max_programs, int) or max_programs < 1:
        raise ConfigError(f"max_programs must be a positive int (compiled programs kept, by input shape), "
                          f"got {max_programs!r}")
    _refuse_a_second_step(model, optimizer)
    mixed = precision.resolve(param_dtype, reduce_dtype, loss_scale, cast_forward_inputs, model)
    build_pipeline(stage, disable, clip=clip, mixed_precision=mixed is not None,
                   memory_pools=memory_pools)   # unknown or essential names fail here
    return CompiledStep(model, optimizer, stage, loss_fn, num_targets, group, bucket_bytes,
                        prefetch_bytes=prefetch_bytes, timeout=timeout,
                        disable=tuple(disable), verify=verify, dump_dir=dump_dir,
                        grad_accumulation=grad_accumulation, clip=clip, static_shapes=bool(static_shapes),
                        max_programs=max_programs, memory_budget=memory_budget, precision=mixed,
                        gather_per_micro_batch=gather_per_micro_batch, memory_pools=memory_pools)


# The step that holds a model's (and its optimizer's) state, once its first call has moved it into slots.
_OWNERS: "weakref.WeakKeyDictionary[Any, weakref.ref]" = weakref.WeakKeyDictionary()


def _refuse_a_second_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A model or optimizer whose state a compiled step already holds cannot start a second step over it.

    The first step owns the parameters (released at stage 3) and the
    optimizer's state (sharded): a second step would start from the stale
    copies the user's objects still have, silently restarting Adam's moments.
    """
    for thing, what in ((model, "model"), (optimizer, "optimizer")):
        owner = _OWNERS.get(thing)
        if owner is not None and owner() is not None:
            raise ConfigError(
                f"this {what} is already trained by a compiled step (stage {owner().stage}, {owner().steps} steps "
                "run): its parameters and optimizer state live in that step now, and a second compile would start "
                "from stale copies. Keep calling the first step; to change compile options, "
                "zerocc.save_checkpoint(first_step, path), build a new model and optimizer, compile them, and "
                "zerocc.load_checkpoint(new_step, path)")


def check_grad_accumulation(grad_accumulation) -> None:
    if isinstance(grad_accumulation, bool) or not isinstance(grad_accumulation, int) or grad_accumulation < 1:
        raise ConfigError(f"grad_accumulation must be a positive int (the number of micro-batches a batch is split "
                          f"into), got {grad_accumulation!r}")


def _check_clipping(max_norm, norm_type) -> tuple[float, float] | None:
    """``(max_norm, norm_type)`` for the clip_gradients pass, or None when no clipping was asked for."""
    if max_norm is None:
        return None
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0 or math.isinf(max_norm):
        raise ConfigError(f"clip_grad_norm must be a positive finite number (the largest global gradient norm "
                          f"allowed), got {max_norm!r}; leave it None not to clip")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise ConfigError(f"clip_norm_type must be a positive number or float('inf'), got {norm_type!r} "
                          "(2.0 is the Euclidean norm clip_grad_norm_ uses by default)")
    return float(max_norm), float(norm_type)


class CompiledStep:
    """A compiled training step and the sharded state it keeps between calls.

    Compilation happens at the first call (it needs an example batch) and again
    when the batch's shapes, the optimizer state's structure (the first step
    creates it) or a baked-in hyper-parameter change. The learning rate is read
    at every call.
    """

    def __init__(self, model, optimizer, stage, loss_fn, num_targets, group, bucket_bytes, *,
                 prefetch_bytes=DEFAULT_PREFETCH_BYTES, timeout=None, disable=(), verify=False, dump_dir=None,
                 grad_accumulation=1, clip=None, static_shapes=False, max_programs=DEFAULT_MAX_PROGRAMS,
                 memory_budget=None, precision=None, gather_per_micro_batch=True, memory_pools=False):
        self.model = model
        self.optimizer = optimizer
        self.stage = stage
        self.loss_fn = loss_fn
        self.num_targets = num_targets
        self.bucket_bytes = bucket_bytes
        self.prefetch_bytes = prefetch_bytes
        self.memory_budget = memory_budget
        self.disable = tuple(disable)
        self.verify = verify
        self.dump_dir = dump_dir
        self.grad_accumulation = grad_accumulation
        self.gather_per_micro_batch = gather_per_micro_batch
        self.clip = clip                      # (max_norm, norm_type) or None
        self.static_shapes = static_shapes
        self.max_programs = max_programs
        self._eval_programs: dict[Any, Any] = {}   # zerocc/eval.py: forward-only programs, by input signature
        self.precision = precision
        self.memory_pools = memory_pools
        self._scaler = precision_module.initial_scaler_slots(precision, next(model.parameters()).device)
        device = next(model.parameters()).device
        self.timeout = timeout
        self.ranks: Ranks = failures.with_timeout(resolve(group, device), timeout)
        self.steps = 0   # steps run, saved in checkpoints
        # least recently used first: a hit moves a program to the end, max_programs drops from the front
        self._programs: collections.OrderedDict[Any, tuple[Program, CompileContext, list[GraphSnapshot]]] = \
            collections.OrderedDict()
        self._slots: dict[str, torch.Tensor] | None = None
        self._plan: decisions.ShardPlan | None = None
        self._captured: Captured | None = None
        self._state_signature: list[dict[str, tuple[bool, torch.dtype]]] | None = None
        self._released_shapes: dict[str, tuple[int, ...]] = {}
        self._last: tuple[Program, CompileContext, list[GraphSnapshot]] | None = None
        self._measured_peak_bytes: dict[int, int] = {}   # by id(program): measured at its first run
        self._arenas = Arenas()   # the memory pools' arenas, shared by this step's programs
        self.compile_seconds = 0.0
        self._user_hooks: list = []          # zerocc/user_views.py, installed at the first compile
        self._full_model_depth = 0           # inside step.full_model(): the module holds the whole parameters
        self._reading_model_keys = False     # model.state_dict() called for its keys only
        self._param_groups: tuple[tuple[int, ...], ...] | None = None   # guards.param_groups_of at the first call
        self._first_batch: FirstBatch | None = None   # zerocc/batch.py: later batches keep its dtypes and devices
        if self.ranks.world_size > 1:
            self._sync_initial_state()

    # -- the step ----------------------------------------------------------------
    def __call__(self, *inputs, **keyword_inputs):
        layout = BatchLayout.of(inputs, keyword_inputs)
        batch = layout.flatten(inputs, keyword_inputs)   # zerocc/batch.py: the program reads one flat list
        check_batch(batch, layout, self._first_batch)   # dtypes, devices, requires_grad: before any program runs
        if self._param_groups is not None:
            guards.check_param_groups_unchanged(self._param_groups, self.optimizer)
        with self._undone_if_first_call_fails(), failures.collective_failures(self.ranks, self.steps + 1, self.timeout):
            # every call: a rank whose batch changed shape would compile while the others run a cached program
            failures.check_batches_agree(self.ranks, agreement_lines(batch, layout))
            program, ctx, _ = self._program_for(batch, layout)   # compiling compares the program across ranks
            if self._param_groups is None:
                self._param_groups = guards.param_groups_of(self.optimizer)   # what the buckets are laid out for
                self._first_batch = FirstBatch.of(batch, layout)   # what later batches are checked against
            for group_index, value in enumerate(live_hyperparameters(self.optimizer)):
                self._slots[decisions.lr_slot(group_index)] = value
            if id(program) in self._measured_peak_bytes:
                loss = program.run(self._slots, batch)
            else:   # the first run of a program also measures its peak of live tensor bytes
                tensors = [t for t in [*self._slots.values(), *batch, *self._arenas.tensors()]
                           if isinstance(t, torch.Tensor)]
                with LiveBytesTracker(tensors) as tracker:
                    del tensors
                    loss = program.run(self._slots, batch)
                self._measured_peak_bytes[id(program)] = tracker.peak_bytes
            self._drop_state_of_skipped_first_step(program, batch, layout)
        self.steps += 1
        self._after_step(ctx)
        # the step ran the optimizer's update; tell LR schedulers so, as optimizer.step() would
        self.optimizer._opt_called = True
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
        if self._slots is not None:
            yield
            return
        tensors = [(t, t.data) for t in [*self.model.parameters(), *self.model.buffers()]]
        optimizer_state = dict(self.optimizer.state)
        try:
            yield
        except BaseException:
            for tensor, data in tensors:
                tensor.data = data
            self.optimizer.state.clear()
            self.optimizer.state.update(optimizer_state)
            self._slots = self._plan = self._captured = self._state_signature = self._last = None
            self._param_groups = self._first_batch = None
            self._released_shapes = {}
            self._programs.clear()
            self._eval_programs.clear()
            self._measured_peak_bytes.clear()
            _OWNERS.pop(self.model, None)
            _OWNERS.pop(self.optimizer, None)
            for handle in self._user_hooks:
                handle.remove()
            self._user_hooks = []
            raise

    def _drop_state_of_skipped_first_step(self, program, batch, layout) -> None:
        """A first step that overflowed under loss scaling leaves no optimizer state, as GradScaler would.

        The graph keeps parameters and existing state with ``where``; state the
        step creates has no old value to keep, so it is dropped here (one host
        read of the flag, on programs that create state only).
        """
        created = [s for s in program.output_slots if s.startswith("state:") and s not in program.argument_slots]
        if created and precision.FOUND_INF_SLOT in self._slots and bool(self._slots[precision.FOUND_INF_SLOT] > 0):
            for slot in created:
                del self._slots[slot]
            # the next step is a first step again: the same program
            self._programs[(self._input_signature(batch, layout), self._state_key(),
                            hyperparameter_signature(self.optimizer))] = self._last

    @property
    def loss_scale(self) -> float | None:
        """The current dynamic loss scale (None without loss scaling); reading it waits for the step."""
        scale = self.scaler_state().get(precision.SCALE_SLOT)
        return None if scale is None else float(scale)

    def scaler_state(self) -> dict[str, torch.Tensor]:
        """The loss scale and its growth tracker, by slot (empty without loss scaling); checkpoints save them."""
        if self._slots is None:
            return dict(self._scaler)
        return {slot: self._slots[slot] for slot in precision.SCALER_SLOTS if slot in self._slots}

    def _program_for(self, batch, layout):
        key = (self._input_signature(batch, layout), self._state_key(), hyperparameter_signature(self.optimizer))
        found = self._programs.get(key)
        if found is not None and not all_hold(found[0].guards, batch):
            found = None   # the batch takes another side of a branch decided on values: trace it (zerocc/data_guards.py)
        if found is None:
            self._check_static_shapes(key[0])
            started = time.perf_counter()
            with suspended_user_tooling():   # the user's MemTracker, profilers, global hooks (zerocc/user_tooling.py)
                found = self._compile(batch, layout)
            self.compile_seconds += time.perf_counter() - started
            self._programs[key] = found
            if key[1] == ("initial",) and self._state_key():
                # traced with existing state (a checkpoint loaded before the first call): it is the steady state
                self._programs[(key[0], self._state_key(), key[2])] = found
            self._evict_beyond_limit(key[0])
        self._programs.move_to_end(key)
        self._last = found
        return found

    def _check_static_shapes(self, signature) -> None:
        """static_shapes=True: a batch unlike the one compiled is an error, not a new program."""
        compiled = {key[0] for key in self._programs}
        if self.static_shapes and compiled and signature not in compiled:
            raise ConfigError(
                f"static_shapes=True, but this batch is {describe_signature(signature)} and the step was compiled "
                f"for {' and '.join(describe_signature(s) for s in compiled)}; pad or cut the batch to the compiled "
                "shape (the last batch of an epoch: drop_last=True), or compile with static_shapes=False to compile "
                "a program per shape")

    def _evict_beyond_limit(self, signature) -> None:
        """Keep at most ``max_programs`` programs, dropping the least recently used with a warning."""
        while len({id(found[0]) for found in self._programs.values()}) > self.max_programs:
            old_key, (program, _, _) = next(iter(self._programs.items()))
            for key in [k for k, found in self._programs.items() if found[0] is program]:
                del self._programs[key]
            self._measured_peak_bytes.pop(id(program), None)
            warnings.warn(
                f"zerocc: more than max_programs={self.max_programs} compiled programs (a new batch of "
                f"{describe_signature(signature)}); dropped the least recently used, compiled for "
                f"{describe_signature(old_key[0])}. Each new shape costs a compilation: pad batches to a few shapes, "
                "raise max_programs, or set static_shapes=True to make a new shape an error", RecompileWarning,
                stacklevel=4)

    def _compile(self, batch, layout: BatchLayout | None = None):
        layout = layout or BatchLayout(len(batch))   # all positional
        fake_mode = make_fake_mode()
        optimizer_state = None
        if self._state_signature is not None:
            optimizer_state = self._fake_state(fake_mode)
        captured = capture(self.model, self.optimizer, batch, layout=layout, loss_fn=self.loss_fn,
                           num_targets=self.num_targets,
                           fake_mode=fake_mode, optimizer_state=optimizer_state,
                           check_update_elementwise=self.stage != 0,
                           parameter_shapes=self._released_shapes, grad_accumulation=self.grad_accumulation,
                           precision=self.precision)
        state_signature = _state_signature_of(captured)
        ctx = CompileContext(self.stage, self.ranks.world_size, self.ranks.rank, self.ranks.group_name,
                             self.optimizer, captured, fake_mode, self.bucket_bytes, previous_plan=self._plan,
                             precision=self.precision, gather_per_micro_batch=self.gather_per_micro_batch)
        passes = build_pipeline(self.stage, self.disable, self.prefetch_bytes, clip=self.clip,
                                memory_budget=self.memory_budget, mixed_precision=self.precision is not None,
                                memory_pools=self.memory_pools)
        gm, history = run_pipeline(captured.gm, ctx, passes,
                                   verify=self.verify, dump_dir=dump_dir_of(self.dump_dir))
        failures.check_ranks_agree(self.ranks, gm, ctx.shard_plan)   # before any of its collectives can hang
        program = Program.from_graph(gm, self._arenas)
        program.guards = captured.guards
        if self._slots is None:
            self._captured = captured
            self._plan = ctx.shard_plan
            self._slots = slot_store.initial_slots(ctx.shard_plan, captured, self.model, self.optimizer)
            self._slots.update(self._scaler)   # created (or loaded from a checkpoint) before the first step
            self.optimizer.state.clear()   # the step owns the (sharded) optimizer state from now on
            _OWNERS[self.model] = _OWNERS[self.optimizer] = weakref.ref(self)
            self._user_hooks = user_views.install(self)
            self._release_model_parameters()
        self._state_signature = state_signature
        return program, ctx, history

    def _after_step(self, ctx: CompileContext) -> None:
        """Keep the user's module current: its buffers are the step's, its parameters view the new buckets.

        Parameters of buckets whose masters are sharded (stage 3, and mixed
        precision at stages 1-2) stay released: no rank holds them whole
        (``step.full_model()`` gathers them).
        """
        buffers = {names[0]: t for names, t in named_tensors(self.model, "buffer")}
        for info in self._captured.buffers:
            buffers[info.name].data = self._slots[decisions.buffer_slot(info.name)]
        if self.stage == 3:
            return
        views = slot_store.parameter_views(self._plan, self._captured, {
            b.index: self._slots[decisions.bucket_slot(b.index)] for b in self._plan.buckets
            if not self._plan.holds_shard(b)})
        tensors = {names[0]: t for names, t in named_tensors(self.model, "param")}
        for index, view in views.items():
            tensors[self._captured.params[index].name].data = view

    def _release_model_parameters(self) -> None:
        tensors = {names[0]: t for names, t in named_tensors(self.model, "param")}
        for index in self._plan_param_indices(sharded_only=True):
            info = self._captured.params[index]
            param = tensors[info.name]
            self._released_shapes[info.name] = info.shape
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self._after_step(None)

    def _plan_param_indices(self, sharded_only: bool = False):
        return [s.param for b in self._plan.buckets for s in b.segments
                if not sharded_only or self._plan.holds_shard(b)]

    def _sync_initial_state(self) -> None:
        """Every rank starts from rank 0's parameters and buffers, as DDP does."""
        with torch.no_grad():
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                dist.broadcast(tensor.data, src=0, group=self.ranks.group)

    def _input_signature(self, batch, layout: BatchLayout) -> tuple:
        """What a program is compiled for: each entry's shape and dtype (or Python value), keywords by name."""
        signature = []
        for index, value in enumerate(batch):
            if isinstance(value, torch.Tensor):
                entry = (tuple(value.shape), value.dtype, str(value.device), value.requires_grad)
            else:
                entry = ("python", type(value).__name__, repr(value))
            if index >= layout.positional:
                entry = ("keyword", layout.keywords[index - layout.positional], entry)
            signature.append(entry)
        return tuple(signature)

    def _state_key(self) -> tuple:
        if self._slots is None:
            return ("initial",)
        return tuple(sorted(s for s in self._slots if s.startswith("state:")))

    def _fake_state(self, fake_mode) -> list[dict[str, torch.Tensor]]:
        states = []
        params = {names[0]: t for names, t in named_tensors(self.model, "param")}
        for info, signature in zip(self._captured.params, self._state_signature):
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
        return state_dict_module.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict from ``state_dict()`` that ``dcp.load`` filled (any world size or stage saved it)."""
        state_dict_module.load_state_dict(self, state_dict)

    # -- reading it back --------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters and buffers, keyed as ``model.state_dict()`` (a collective at stage 3)."""
        if self._slots is None:
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self._reading_model_keys = True   # zerocc/user_views.py: the keys only, the values come from the slots
        try:
            keys = list(self.model.state_dict().keys())
        finally:
            self._reading_model_keys = False
        buckets = slot_store.full_buckets(self._plan, self._slots, self.ranks.group)
        views = slot_store.parameter_views(self._plan, self._captured, buckets)
        by_name: dict[str, torch.Tensor] = {}
        for index, info in enumerate(self._captured.params):
            value = views[index] if index in views else self._slots[decisions.param_slot(info.name)]
            for name in info.names:
                by_name[name] = value.clone()
        for info in self._captured.frozen:
            for name in info.names:
                by_name[name] = self._slots[decisions.frozen_slot(info.name)].clone()
        for info in self._captured.buffers:
            for name in info.names:
                by_name[name] = self._slots[decisions.buffer_slot(info.name)].clone()
        return {key: by_name[key] for key in keys if key in by_name}

    def full_model(self, writeback: bool = True):
        """``with step.full_model(): model(x)``: the whole parameters in the user's module for the block.

        As FSDP's ``summon_full_params`` and DeepSpeed's ``GatheredParameters``:
        a collective at stage 3 over several ranks (every rank enters it); with
        ``writeback`` the module's parameter values go back into the step on
        exit, so edits there train on; ``writeback=False`` drops them.
        """
        return user_views.full_model(self, writeback)

    @property
    def passes(self) -> list[str]:
        """The passes a compilation runs, in order (registered passes included, disabled ones not)."""
        return ["capture", *[p.name for p in build_pipeline(self.stage, self.disable, clip=self.clip,
                                                             mixed_precision=self.precision is not None,
                                                             memory_pools=self.memory_pools)]]

    # -- training-loop features ---------------------------------------------------
    @property
    def last_grad_norm(self) -> torch.Tensor | None:
        """The global gradient norm of the last step, before clipping (None without ``clip_grad_norm``)."""
        if self._slots is None:
            return None
        return self._slots.get(GRAD_NORM_SLOT)

    def eval_forward(self, *inputs, **keyword_inputs):
        """The model's output on ``inputs`` in eval mode: forward only, no gradient, no update (``zerocc/eval.py``)."""
        from .eval import eval_forward
        return eval_forward(self, inputs, keyword_inputs)

    def graph(self, name: str = "insert_collectives") -> GraphSnapshot:
        """The program after pass ``name`` (of the plan the last call ran), printable as Python."""
        history = self._require_compiled()[2]
        for snapshot in history:
            if snapshot.name == name:
                return snapshot
        raise ConfigError(f"no pass named {name!r}; the passes are: {', '.join(s.name for s in history)}")

    @property
    def shard_plan(self) -> decisions.ShardPlan:
        return self._require_compiled()[1].shard_plan

    @property
    def memory_plan(self) -> MemoryPlan:
        """Where every tensor of the last program lives: ``print`` it for the table, ``.summary()``, ``.plot(path)``."""
        return self._require_compiled()[1].memory_plan

    @property
    def checkpoint_plan(self) -> decisions.CheckpointPlan | None:
        """What ``memory_budget`` made backward recompute (None without a budget): print it for the table."""
        return self._require_compiled()[1].checkpoint_plan

    def _require_compiled(self):
        if self._last is None:
            raise ConfigError("the step has not been compiled yet: call it once with a batch first")
        return self._last

    def explain(self) -> str:
        """A short human report of what every pass decided for the last compiled program."""
        from .explain import explain
        _, ctx, history = self._require_compiled()
        return explain(ctx, history, self.report())

    def report(self) -> dict:
        """What the current plan does per step and holds per rank, from the compiler's own accounting."""
        program, ctx, _ = self._require_compiled()
        plan = ctx.shard_plan
        comm = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "broadcast": 0}
        counts = collections.Counter()
        for node in program.gm.graph.nodes:
            if g.is_all_gather(node):
                comm["all_gather"] += g.nbytes(node)
                counts["all_gather"] += 1
            elif g.is_reduce_scatter(node):
                comm["reduce_scatter"] += g.nbytes(node.args[0])
                counts["reduce_scatter"] += 1
            elif g.is_all_reduce(node):
                comm["all_reduce"] += 2 * g.nbytes(node)
                counts["all_reduce"] += 1
            elif g.is_broadcast(node):
                comm["broadcast"] += g.nbytes(node)
                counts["broadcast"] += 1
        held = {"params": 0, "grads": 0, "optimizer": 0}
        for node in g.placeholders(program.gm):
            role = node.meta[g.ROLE]
            if role in (g.ROLE_PARAM, g.ROLE_FROZEN):
                held["params"] += g.nbytes(node)
            elif role == g.ROLE_STATE:
                held["optimizer"] += g.nbytes(node)
        for bucket in plan.buckets:
            reduced_early = self.stage >= 2
            held["grads"] += (bucket.shard_numel if reduced_early else bucket.numel) * \
                precision.gradient_dtype(self.precision, bucket.dtype).itemsize
        param_count = sum(info.numel for info in self._captured.params) + sum(i.numel for i in self._captured.frozen)
        return {
            "stage": self.stage,
            "world_size": self.ranks.world_size,
            "rank": self.ranks.rank,
            "param_count": param_count,
            "param_bytes": sum(i.numel * i.dtype.itemsize for i in [*self._captured.params, *self._captured.frozen]),
            **precision.report_entries(self.precision, self._captured.params[0].dtype),
            "buckets": len(plan.buckets),
            "padding_elements": plan.padding_elements,
            "comm_bytes_per_step": comm,
            "collectives_per_step": dict(counts),
            "model_state_bytes_per_rank": held,
            **_memory_plan_entries(ctx.memory_plan),   # None each with disable=["plan_memory"]
            "arena_bytes": self._arenas.nbytes,
            "measured_peak_bytes": self._measured_peak_bytes.get(id(program)),
            "compile_seconds": round(self.compile_seconds, 3),
            "checkpoint": ctx.checkpoint_plan.to_dict() if ctx.checkpoint_plan is not None else None,
        }


def _memory_plan_entries(memory_plan: MemoryPlan | None) -> dict:
    """The report's entries read from the memory plan; None each when no plan was made."""
    if memory_plan is None:
        return {"memory_pools": False, "planned_peak_bytes": None, "lower_bound_bytes": None,
                "unplanned_bytes": None, "live_peak_bytes": None}
    return {"memory_pools": bool(memory_plan.arenas), "planned_peak_bytes": memory_plan.planned_peak_bytes,
            "lower_bound_bytes": memory_plan.lower_bound_peak_bytes, "unplanned_bytes": memory_plan.unplanned_bytes,
            "live_peak_bytes": memory_plan.live_peak_bytes}


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
