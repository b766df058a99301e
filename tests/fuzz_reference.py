"""The differential fuzzer's cases and the eager reference each case defines (``tests/test_fuzz.py`` draws them).

A ``Case`` is one combination of ``zerocc.compile`` options over one small
model of ``tests/models.py`` (the MLP, the example GPT with tied embeddings,
the CNN with BatchNorm) or one real architecture (``ARCHITECTURE_MODELS``:
Hugging Face Llama, GPT-2, BERT, T5 and Mixtral on keyword batches, the ResNet
and U-Net of ``tests/architectures.py``), one optimizer, frozen parameters and
param groups.
``run_case`` trains the compiled step and the eager reference the options
define on the same batches, on this rank, and returns both; ``compare``
checks them, bit for bit where the docs promise it, within a stated
tolerance otherwise (``tolerance_of``).

The reference is eager PyTorch doing what the options say:

- ``grad_accumulation=K``: K micro-batches along dim 0, ``(loss / K).backward()``
  each, one update (``tests/test_training_loop.eager_accumulated_step``);
- ``clip_grad_norm``: ``torch.nn.utils.clip_grad_norm_`` on the averaged gradients;
- ``param_dtype``: the forward and backward on the fp32 masters cast to it
  (``torch.func.functional_call``, so BatchNorm updates the master's own
  buffers), each micro-batch's gradients cast to fp32 and summed, reduced in
  ``reduce_dtype`` (``tests/test_mixed_precision.mixed_eager_step``, which
  this generalizes to accumulation and clipping);
- ``loss_scale="dynamic"``: ``torch.amp.GradScaler``, unscaling before the clip;
- across N ranks: buffers (BatchNorm statistics) broadcast from rank 0 at the
  start of the step, each rank's summed gradients all_reduced and divided by
  N (what DDP does), then the same update on every rank.

Options that must not change the numbers (``memory_budget``, ``memory_pools``,
``prefetch_bytes``, ``bucket_bytes``, the stage) have no counterpart in the
reference: that is the point of comparing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

import zerocc
from zerocc.errors import MemoryBudgetError, RecompileWarning
from tests.models import ZOO, build

MODELS = ("mlp", "gpt", "cnn")
# drawn by the long runs since round 24 (after the others: a seed drawn with recent=False draws what it drew before)
RECENT_MODELS = ("centered", "moe")   # tests/models.py: a buffer forward reassigns (DINO); routed experts + aux loss
# real architectures (tests/zoo.py's Hugging Face models, tests/architectures.py's CNNs): the long runs draw them
ARCHITECTURE_MODELS = ("llama", "gpt2", "bert", "t5", "mixtral", "resnet", "unet")
ALL_MODELS = MODELS + ARCHITECTURE_MODELS
EVERY_MODEL = ALL_MODELS + RECENT_MODELS

# parameters a case may freeze, per model: a leading layer (its output still feeds trained ones)
FREEZABLE = {
    "mlp": ("net.0.weight", "net.0.bias", "net.2.bias"),
    "gpt": ("wpe.weight", "blocks.0.ln1.weight", "blocks.0.ln1.bias", "blocks.1.fc.weight"),
    "cnn": ("conv1.weight", "bn1.weight", "bn1.bias"),
    "llama": ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.input_layernorm.weight"),
    "gpt2": ("transformer.wpe.weight", "transformer.h.0.ln_1.weight", "transformer.h.0.attn.c_attn.bias"),
    "bert": ("bert.embeddings.position_embeddings.weight", "bert.embeddings.LayerNorm.bias"),
    "t5": ("encoder.block.0.layer.0.SelfAttention.q.weight",
           "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
    "mixtral": ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate.weight"),
    "resnet": ("stem.weight", "bn.weight", "bn.bias"),
    "unet": ("enc1.weight", "enc1.bias"),
    "centered": ("net.0.weight", "net.0.bias"),
    "moe": ("norm.weight", "router.weight"),
}
# models gathering rows by index (x[token], Mixtral's experts): eager's CPU index_put_(accumulate=True) backward sums
# in a run-dependent order unless deterministic algorithms are on
DETERMINISTIC = {"llama", "gpt2", "bert", "t5", "mixtral", "resnet", "unet", "moe"}


@dataclasses.dataclass(frozen=True)
class Architecture:
    """A real architecture the fuzzer draws: a seeded build, its batches, and what the reference must do for it."""
    build: Callable[[], torch.nn.Module]
    batch: Callable[[torch.Generator, int], Any]     # (generator, rows) -> a tuple of arguments or a keyword dict
    bf16: bool = True                                # False: eager refuses the mixed reference (BatchNorm)


def _hf(name):
    def build_model():
        from tests.zoo import ZOO as HF   # transformers loads only for a case that draws it
        return HF[name].build()

    def batch(generator, rows):
        from tests.zoo import ZOO as HF
        return HF[name].batch(generator, rows)
    return Architecture(build_model, batch)


def _architecture(name, **options):
    from tests.architectures import ARCHITECTURES, build_architecture
    return Architecture(lambda: build_architecture(name), ARCHITECTURES[name][1], **options)


# dropout stays on (GPT-2, BERT, T5: 0.1): both sides seed the generator before each step, so they draw the same masks
ARCHITECTURES = {
    "llama": _hf("llama"), "gpt2": _hf("gpt2"), "bert": _hf("bert"), "t5": _hf("t5"), "mixtral": _hf("mixtral"),
    # eager BatchNorm refuses bf16 inputs with fp32 running statistics, as for the CNN: no mixed reference
    "resnet": _architecture("resnet", bf16=False),
    "unet": _architecture("unet"),   # the model returns the loss; its float target is a model input (cast too)
}


def precisions_of(model: str) -> tuple[str, ...]:
    """The precisions a model can be drawn with (the CNN's and the ResNet's BatchNorm: fp32 only)."""
    if model == "cnn" or (model in ARCHITECTURES and not ARCHITECTURES[model].bf16):
        return ("fp32",)
    return tuple(PRECISIONS)

# name -> (optimizer class, keyword arguments): elementwise optimizers the docs say compile exactly
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adam_amsgrad": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    "sgd": (torch.optim.SGD, dict(lr=0.1)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.05)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-3, momentum=0.5, centered=True)),
}

# name -> (param_dtype, reduce_dtype, loss_scale)
PRECISIONS = {
    "fp32": (None, None, None),
    "bf16": (torch.bfloat16, torch.float32, None),
    "bf16_reduce_bf16": (torch.bfloat16, None, None),       # reduce_dtype defaults to param_dtype
    "fp16_dynamic": (torch.float16, torch.float32, "dynamic"),
}

TIMEOUT_S = 120   # a collective that waits longer than this on a peer turns a hang into an error


@dataclasses.dataclass(frozen=True)
class Case:
    """One drawn combination; ``repr`` is a runnable ``Case(...)`` for a regression test."""
    model: str = "mlp"
    stage: int = 3
    optimizer: str = "adamw"
    precision: str = "fp32"
    grad_accumulation: int = 1
    clip_grad_norm: float | None = None
    clip_norm_type: float = 2.0
    memory_budget_fraction: float | None = None   # of the unbudgeted planned peak (zerocc.plan)
    memory_pools: bool = False
    prefetch_bytes: int | None = None              # None: the default
    bucket_bytes: int | None = None
    frozen: tuple[str, ...] = ()
    frozen_in_optimizer: bool = True               # frozen parameters handed to the optimizer too
    param_groups: bool = False                     # two groups: weights, and the rest with another lr and no decay
    steps: int = 2
    batch_size: int = 8                            # per rank
    # what a training loop does between and around steps (the long runs draw them: docs/fuzzing.md)
    eval_between: bool = False                     # step.eval_forward on the step's inputs after every step
    shape_change: bool = False                     # every odd-numbered step's batch has twice the rows (a new program)
    max_programs: int | None = None                # None: the default; 1 with shape_change: every step compiles again
    resume_after: int | None = None                # save_checkpoint after this many steps, resume in new processes
    resume_stage: int | None = None                # the resumed step's stage (None: the same)
    resume_world_size: int | None = None           # the resumed run's world size (None: the same)
    cache_dir: bool = False                        # a compile cache both runs share (the resumed one loads from it)
    # drawn since round 24 (draw_recent), after the rest
    live_settings: str | None = None               # "one_cycle" (OneCycleLR stepped after each step) or "by_hand"
    metrics: bool = False                          # metrics_fn= (fuzz_metrics); step.last_metrics after each step
    autocast: bool = False                         # each step called under torch.autocast("cpu", dtype=bfloat16)

    @property
    def resumed(self) -> bool:
        return self.resume_after is not None


def make_optimizer(case: Case, model: torch.nn.Module) -> torch.optim.Optimizer:
    cls, options = OPTIMIZERS[case.optimizer]
    params = [(n, p) for n, p in model.named_parameters() if case.frozen_in_optimizer or p.requires_grad]
    if not case.param_groups:
        return cls([p for _, p in params], **options)
    weights = [p for _, p in params if p.dim() >= 2]
    rest = [p for _, p in params if p.dim() < 2]
    other = {"lr": options["lr"] * 0.3}
    if "weight_decay" in options:
        other["weight_decay"] = 0.0
    return cls([{"params": weights}, {"params": rest, **other}], **options)


def make_schedule(case: Case, optimizer: torch.optim.Optimizer):
    """The case's ``live_settings`` schedule on ``optimizer``: a callable run after each step with its number (both
    sides alike; zerocc reads every float setting each step, docs: tests/test_live_settings.py). Made on the new
    optimizer before anything is planned or loaded, on both sides: OneCycleLR adds float keys to the param groups
    (``initial_lr``, ``max_lr``, ...) that the plan of the budget's baseline must see, and a resume then loads the
    saved groups over them (its step count restarts on both sides alike)."""
    if case.live_settings == "one_cycle":
        # cycle_momentum moves momentum (SGD, RMSprop) or betas[0] (Adam); Adagrad has neither
        cycle = "betas" in optimizer.defaults or "momentum" in optimizer.defaults
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=OPTIMIZERS[case.optimizer][1]["lr"],
                                                       total_steps=10, cycle_momentum=cycle)
        return lambda number: schedule.step()
    if case.live_settings == "by_hand":
        return lambda number: set_by_hand(optimizer, number)
    return lambda number: None


def set_by_hand(optimizer: torch.optim.Optimizer, number: int) -> None:
    """What a loop sets on the param groups itself after step ``number``: lr decayed, weight decay annealed from
    whatever it was (0 in the second of two groups: it crosses zero, where step() branches), momentum, betas,
    RMSprop's alpha moved."""
    for group in optimizer.param_groups:
        group["lr"] *= 0.8
        if "weight_decay" in group:
            group["weight_decay"] = 0.01 * (number + 1)
        if group.get("momentum"):
            group["momentum"] = 0.9 - 0.1 * (number + 1)
        if "betas" in group:
            group["betas"] = (0.9 - 0.05 * (number + 1), 0.999 - 0.001 * (number + 1))
        if "alpha" in group:
            group["alpha"] = 0.99 - 0.01 * (number + 1)


def fuzz_metrics(output, *args, **kwargs):
    """The case's ``metrics_fn``: a statistic of the model's output (the loss, or a Hugging Face output's logits)."""
    value = output if isinstance(output, torch.Tensor) else output.logits
    return {"mean_square": value.detach().float().square().mean()}


def autocast_of(case: Case):
    """The caller's autocast around each step (the reference's forward and loss), or none."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if case.autocast else contextlib.nullcontext()


def make_model(case: Case) -> tuple[torch.nn.Module, object]:
    """The case's model (frozen parameters frozen) and its loss_fn; the same weights on every call."""
    if case.model in ARCHITECTURES:   # each returns its loss (a Hugging Face model: output.loss)
        model, loss_fn = ARCHITECTURES[case.model].build(), None
    else:
        model, _, loss_fn = build(case.model)
    for name, param in model.named_parameters():
        if name in case.frozen:
            param.requires_grad_(False)
    return model, loss_fn


Batch = tuple[tuple, dict]   # (positional arguments, keyword arguments): step(*args, **kwargs)


def case_batches(case: Case, world_size: int, seed: int = 1) -> list[Batch]:
    """The global batches (``batch_size`` per rank, twice that on odd steps with ``shape_change``); rank r trains on
    its r-th slice. ``world_size`` is the first run's: a resumed run at another world size splits the same batches."""
    generator = torch.Generator().manual_seed(seed)
    make = ARCHITECTURES[case.model].batch if case.model in ARCHITECTURES else ZOO[case.model][1]
    batches = [make(generator, case.batch_size * world_size * (2 if case.shape_change and number % 2 else 1))
               for number in range(case.steps)]
    return [((), batch) if isinstance(batch, dict) else (tuple(batch), {}) for batch in batches]


def chunks(batch: Batch, count: int) -> list[Batch]:
    """``batch`` split along dim 0 into ``count`` pieces (ranks, micro-batches); other values (flags) go to every piece."""
    def split(value):
        return value.chunk(count) if isinstance(value, torch.Tensor) else [value] * count
    args, kwargs = batch
    pieces_of_args = [split(value) for value in args]
    pieces_of_kwargs = {key: split(value) for key, value in kwargs.items()}
    return [(tuple(pieces[i] for pieces in pieces_of_args), {k: pieces[i] for k, pieces in pieces_of_kwargs.items()})
            for i in range(count)]


def local(batch: Batch, rank, world_size) -> Batch:
    return chunks(batch, world_size)[rank]


def compile_options(case: Case, model, optimizer, loss_fn, example, world_size) -> dict:
    """``zerocc.compile`` keywords of the case; the budget is a fraction of what ``zerocc.plan`` plans without one."""
    param_dtype, reduce_dtype, loss_scale = PRECISIONS[case.precision]
    options = dict(stage=case.stage, loss_fn=loss_fn, grad_accumulation=case.grad_accumulation,
                   metrics_fn=fuzz_metrics if case.metrics else None,
                   clip_grad_norm=case.clip_grad_norm, clip_norm_type=case.clip_norm_type,
                   param_dtype=param_dtype, reduce_dtype=reduce_dtype, loss_scale=loss_scale,
                   memory_pools=case.memory_pools)
    if case.prefetch_bytes is not None:
        options["prefetch_bytes"] = case.prefetch_bytes
    if case.bucket_bytes is not None:
        options["bucket_bytes"] = case.bucket_bytes
    if case.max_programs is not None:
        options["max_programs"] = case.max_programs
    if case.memory_budget_fraction is not None:
        # the budget bounds the highest rank's peak (ranks own different optimizer pieces), and a plan is
        # one rank's: each rank plans its own, the highest is the baseline
        rank = dist.get_rank() if world_size > 1 else 0
        planned = zerocc.plan(model, optimizer, world_size=world_size, rank=rank, example_inputs=example[0],
                              example_keyword_inputs=example[1], **options).memory_plan
        peak = torch.tensor(getattr(planned, budgeted_peak(case)))
        if world_size > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        options["memory_budget"] = int(int(peak) * case.memory_budget_fraction)
    return options


def budgeted_peak(case: Case) -> str:
    """The memory plan's peak (and report entry) that ``memory_budget`` bounds: with memory pools, the pooled layout's peak (the arenas,
    allocated whole, plus what lives outside them: ``passes/place_remat.py``), else the live peak."""
    return "planned_peak_bytes" if case.memory_pools else "live_peak_bytes"


def _loss(output):
    """The model's loss: the output itself, or its ``loss`` entry (Hugging Face)."""
    return output if isinstance(output, torch.Tensor) else output.loss


def loss_of(model, loss_fn, batch, metrics):
    """The loss of ``batch``; ``metrics`` (a list, or None) gets ``fuzz_metrics`` of the output, computed as the step
    computes it: without gradient and outside the caller's autocast (docs/guide/training-loops.md)."""
    args, kwargs = batch
    output = model(*args, **kwargs) if loss_fn is None else model(*args[:-1], **kwargs)
    if metrics is not None:
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            metrics.append(fuzz_metrics(output, *args, **kwargs))
    return _loss(output) if loss_fn is None else loss_fn(output, args[-1])


def _cast(value, dtype):
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def _micro_gradients(case, model, loss_fn, micro, dtype, scale, metrics):
    """(loss / K, this micro-batch's gradients in fp32 by parameter name) on ``dtype`` copies of the masters."""
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    computed = {n: p.detach().to(dtype).requires_grad_(p.requires_grad) for n, p in model.named_parameters()}
    # floating model inputs are cast (docs/guide/mixed-precision.md); a loss_fn's target keeps its dtype. Without
    # a loss_fn every argument is a model input
    args, kwargs = micro
    targets = [args[-1]] if loss_fn else []
    inputs = [_cast(t, dtype) for t in (args[:-1] if loss_fn else args)]
    kwargs = {key: _cast(value, dtype) for key, value in kwargs.items()}

    def forward():
        return torch.func.functional_call(model, computed, tuple(inputs), kwargs, tie_weights=True, strict=False)
    with autocast_of(case):
        output = forward()
        if metrics is not None:
            with torch.no_grad(), torch.autocast("cpu", enabled=False):
                metrics.append(fuzz_metrics(output, *args, **micro[1]))
        loss = _loss(output) if loss_fn is None else loss_fn(output, *targets)
    loss = loss.float()
    if case.grad_accumulation > 1:
        loss = loss / case.grad_accumulation
    differentiated = loss * scale if scale is not None else loss
    names = list(trained)
    grads = torch.autograd.grad(differentiated, [computed[n] for n in names], allow_unused=True)
    return loss.detach(), {n: None if g is None else g.to(trained[n].dtype) for n, g in zip(names, grads)}


def reference_step(case, model, optimizer, loss_fn, batch, scaler, world_size):
    """One eager step as the case's options define it; returns (loss, norm before clipping or None, metrics or None:
    each micro-batch's ``fuzz_metrics``, stacked along a new first dimension with accumulation)."""
    param_dtype, reduce_dtype, _ = PRECISIONS[case.precision]
    optimizer.zero_grad(set_to_none=True)
    for buffer in model.buffers() if world_size > 1 else ():   # DDP: every rank starts from rank 0's statistics
        dist.broadcast(buffer, 0)
    micro_batches = chunks(batch, case.grad_accumulation)
    metrics = [] if case.metrics else None
    total = None
    if param_dtype is None:   # fp32: the documented reference, (loss / K).backward() per micro-batch
        for micro in micro_batches:
            with autocast_of(case):
                loss = loss_of(model, loss_fn, micro, metrics)
            if case.grad_accumulation > 1:
                loss = loss / case.grad_accumulation
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
    else:
        grads = {}
        for micro in micro_batches:
            scale = scaler.scale(torch.ones(())).reshape(()) if scaler is not None else None   # also creates it
            loss, micro_grads = _micro_gradients(case, model, loss_fn, micro, param_dtype, scale, metrics)
            for name, grad in micro_grads.items():   # AccumulateGrad's order: the running sum, then the new one
                old = grads.get(name)
                grads[name] = grad if old is None else old if grad is None else old + grad
            total = loss if total is None else total + loss
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.grad = grads.get(name)
    reduce = reduce_dtype or param_dtype
    for param in model.parameters():
        if param.grad is None:
            continue
        if reduce is not None and reduce != param.grad.dtype:   # reduced in reduce_dtype, cast back
            reduced = param.grad.to(reduce)
            if world_size > 1:
                dist.all_reduce(reduced)
                reduced.div_(world_size)
            param.grad = reduced.to(param.dtype)
        elif world_size > 1:
            dist.all_reduce(param.grad)
            param.grad.div_(world_size)
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = None
    if case.clip_grad_norm is not None:
        trained = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(trained, case.clip_grad_norm, norm_type=case.clip_norm_type)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    if metrics is not None:
        metrics = metrics[0] if case.grad_accumulation == 1 else \
            {key: torch.stack([m[key] for m in metrics]) for key in metrics[0]}
    return total.float(), norm, metrics


@dataclasses.dataclass
class Outcome:
    """What one case did on one rank: the reference's and the compiled step's losses, norms and final state."""
    case: Case
    expected_losses: list
    expected_norms: list
    expected_state: dict
    expected_scale: float | None
    expected_evals: list = dataclasses.field(default_factory=list)   # eval_forward's outputs (eval_between)
    expected_metrics: list = dataclasses.field(default_factory=list)  # fuzz_metrics per step (metrics)
    losses: list = dataclasses.field(default_factory=list)
    norms: list = dataclasses.field(default_factory=list)
    state: dict = dataclasses.field(default_factory=dict)
    scale: float | None = None
    evals: list = dataclasses.field(default_factory=list)
    metrics: list = dataclasses.field(default_factory=list)
    budget: int | None = None
    peak_bytes: int | None = None  # what the budget bounds (budgeted_peak)
    refused: str | None = None     # a documented refusal (MemoryBudgetError): not a failure
    error: str | None = None       # anything else raised: a failure
    seconds: float = 0.0
    resumed_from: int | None = None   # the resumed run's outcome: the first run's world size
    compile_cache: str | None = None  # report()["compile_cache"] after the last step (cache_dir)


def run_case(case: Case, rank: int = 0, world_size: int = 1, folder: str | None = None) -> Outcome:
    """Train the reference and the compiled step on this rank's slices of the same batches.

    A resumed case (``resume_after``) trains that many steps here and saves both sides into ``folder`` (the step
    with ``zerocc.save_checkpoint``, the reference's state dicts from rank 0); ``resume_case`` trains the rest."""
    if case.resumed and folder is None:
        raise ValueError(f"{case!r} saves a checkpoint: pass a folder (run_whole_case does)")
    with _deterministic(case.model in DETERMINISTIC):
        return _run_case(case, rank, world_size, folder)


def resume_case(rank: int, world_size: int, case: Case, folder: str, first_world_size: int) -> Outcome:
    """The rest of a resumed case, in new processes (``tests/distributed.py``'s ``run`` target): the reference loads
    the saved state dicts, the compiled step is compiled at ``resume_stage`` on fresh objects and loads the
    checkpoint with ``zerocc.load_checkpoint``, as a user's restarted job does."""
    with _deterministic(case.model in DETERMINISTIC):
        return _run_case(case, rank, world_size, folder, first_world_size)


def run_whole_case(case: Case) -> list[tuple[int, list[Outcome]]]:
    """A world-size-1 case, resumed in new processes if it says so: (world size, outcomes by rank) of each run."""
    if not case.resumed:
        return [(1, [run_case(case)])]
    with tempfile.TemporaryDirectory() as folder:
        first = run_case(case, folder=folder)
        return [(1, [first])] + run_resumed(case, 1, folder, [first])


def run_resumed(case: Case, world_size: int, folder: str, first: list[Outcome]) -> list[tuple[int, list[Outcome]]]:
    """The resumed runs after the first run's ``first`` (outcomes by rank), each as (world size, outcomes by rank),
    in new processes (multi-rank or not): none if the first was refused or failed (no checkpoint to resume from).
    With ``cache_dir`` the restart runs twice: the first restart's compiles miss (a step that loaded optimizer
    state before its first call is another program than the first run's) and store, the second loads them."""
    from tests import distributed
    if not case.resumed or any(o.refused or o.error for o in first):
        return []
    size = case.resume_world_size or world_size
    return [(size, distributed.run(resume_case, size, case, folder, world_size)) for _ in range(2 if case.cache_dir else 1)]


def resumed_world_size(outcome: Outcome, world_size: int) -> int:
    """The world size whose tolerance an outcome trained at ``world_size`` is held to: for a resumed run the larger
    of both runs' (it starts from state trained across ranks, within their tolerance of the reference's)."""
    return max(world_size, outcome.resumed_from or 1)


def _rows(batch: Batch) -> int:
    args, kwargs = batch
    return next(v.shape[0] for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))


def _eval_inputs(loss_fn, batch: Batch) -> Batch:
    args, kwargs = batch
    return (args[:-1] if loss_fn is not None else args), kwargs


def _eval_value(output) -> torch.Tensor:
    """A tensor of what eval_forward returns: the output, or its loss (Hugging Face, labels given), else logits."""
    if isinstance(output, torch.Tensor):
        return output.detach().clone()
    return (output.loss if getattr(output, "loss", None) is not None else output.logits).detach().clone()


def reference_eval(model, loss_fn, batch: Batch) -> torch.Tensor:
    """``step.eval_forward``'s meaning (docs/guide/eval.md): the forward in eval mode, no gradients, the fp32 masters."""
    args, kwargs = _eval_inputs(loss_fn, batch)
    model.eval()
    try:
        with torch.no_grad():
            return _eval_value(model(*args, **kwargs))
    finally:
        model.train()


@contextlib.contextmanager
def _deterministic(on: bool):
    """Mixtral gathers expert weights by index: eager's CPU index_put_(accumulate=True) backward sums in a
    run-dependent order unless deterministic algorithms are on (tests/test_model_zoo.py)."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on or previous)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def _seed(step: int) -> None:
    """Seeded before each step on both sides: dropout (GPT-2, BERT, T5) draws the same masks."""
    torch.manual_seed(100 + step)


def _run_case(case: Case, rank: int, world_size: int, folder: str | None, first_world_size: int | None = None
              ) -> Outcome:
    start = time.perf_counter()
    resuming = first_world_size is not None
    batches = case_batches(case, first_world_size or world_size)
    numbers = range(case.resume_after, case.steps) if resuming else range(case.resume_after or case.steps)
    data = {number: local(batches[number], rank, world_size) for number in numbers}
    reference, loss_fn = make_model(case)
    reference_optimizer = make_optimizer(case, reference)
    scaler = torch.amp.GradScaler("cpu") if PRECISIONS[case.precision][2] else None
    schedule = make_schedule(case, reference_optimizer)
    if resuming:   # eager's resume: the state dicts rank 0 saved (its BatchNorm statistics, as DDP's users save)
        saved = torch.load(os.path.join(folder, "reference.pt"), weights_only=False)
        reference.load_state_dict(saved["model"])
        reference_optimizer.load_state_dict(saved["optimizer"])
        if scaler is not None:
            scaler.load_state_dict(saved["scaler"])
    expected, expected_evals = [], []
    for number, batch in data.items():
        _seed(number)
        expected.append(reference_step(case, reference, reference_optimizer, loss_fn, batch, scaler, world_size))
        schedule(number)
        if case.eval_between:
            expected_evals.append(reference_eval(reference, loss_fn, batch))
    if case.resumed and not resuming and rank == 0:
        torch.save({"model": reference.state_dict(), "optimizer": reference_optimizer.state_dict(),
                    "scaler": scaler.state_dict() if scaler is not None else None},
                   os.path.join(folder, "reference.pt"))
    outcome = Outcome(case, [e for e, _, _ in expected], [n for _, n, _ in expected],
                      {k: v.clone() for k, v in reference.state_dict().items()},
                      scaler.get_scale() if scaler is not None else None, expected_evals, [m for _, _, m in expected],
                      resumed_from=first_world_size)
    model, _ = make_model(case)
    optimizer = make_optimizer(case, model)
    schedule = make_schedule(case, optimizer)
    if resuming:   # the budget's baseline is planned on the settings the step will load (a weight decay set by hand
        # from 0 to nonzero before the save is another update, which peaks higher): the saved groups' settings
        for group, saved_group in zip(optimizer.param_groups, saved["optimizer"]["param_groups"]):
            group.update({key: value for key, value in saved_group.items() if key != "params"})
    stage = case.resume_stage if resuming and case.resume_stage is not None else case.stage
    try:
        # the budget is planned on the largest batch: with shape_change the larger shape peaks higher, and a budget
        # of the smaller one's peak is rightly refused when that shape compiles; under the step's autocast, which
        # makes another program (bf16 activations)
        with autocast_of(case):
            options = compile_options(dataclasses.replace(case, stage=stage), model, optimizer, loss_fn,
                                      max(data.values(), key=_rows), world_size)
        if case.cache_dir:
            options["cache_dir"] = os.path.join(folder, "cache")
        outcome.budget = options.get("memory_budget")
        step = zerocc.compile(model, optimizer, timeout=TIMEOUT_S if world_size > 1 else None, **options)
        if resuming:
            zerocc.load_checkpoint(step, os.path.join(folder, "checkpoint"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RecompileWarning)   # max_programs=1 with shape_change: the point
            for number, (args, kwargs) in data.items():
                _seed(number)
                with autocast_of(case):
                    outcome.losses.append(step(*args, **kwargs))
                outcome.norms.append(step.last_grad_norm)
                if case.metrics:
                    outcome.metrics.append(step.last_metrics)
                schedule(number)
                if case.eval_between:
                    eval_args, eval_kwargs = _eval_inputs(loss_fn, (args, kwargs))
                    outcome.evals.append(_eval_value(step.eval_forward(*eval_args, **eval_kwargs)))
        if case.resumed and not resuming:
            zerocc.save_checkpoint(step, os.path.join(folder, "checkpoint"))
        outcome.state = step.full_state_dict()
        outcome.scale = step.loss_scale if case.precision == "fp16_dynamic" else None
        report = step.report()
        outcome.peak_bytes = report[budgeted_peak(case)]
        outcome.compile_cache = report["compile_cache"]
    except MemoryBudgetError as error:
        outcome.refused = f"{type(error).__name__}: {error}"
    except Exception as error:  # noqa: BLE001  (every other error is a finding, reported with the case)
        outcome.error = f"{type(error).__name__}: {error}"
    outcome.seconds = time.perf_counter() - start
    return outcome


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How close the compiled step must be to the reference: None means bit for bit (torch.equal)."""
    losses: tuple[float, float] | None      # (rtol, atol)
    state: tuple[float, float] | None


EXACT = Tolerance(None, None)
# across ranks, fp32 reductions: gloo sums in another order than one process would (test_numerics' bounds)
ACROSS_RANKS = Tolerance((1e-5, 1e-6), (1e-4, 1e-5))
# gradients reduced in bf16 (8 bits of mantissa): the same sum in another order or another rounding point
# moves a gradient by an ulp of bf16 (4e-3 relative); Adam-like updates normalize the gradient, so a
# parameter near zero may move by up to a learning rate's worth (1e-2) over the case's steps
LOW_PRECISION_REDUCTION = Tolerance((1e-2, 1e-3), (2e-2, 3e-2))


def tolerance_of(case: Case, world_size: int) -> Tolerance:
    """Bit for bit where the docs promise it: world size 1 with fp32 reductions (any stage, any option).

    README and ``zerocc.compile``'s docstring: stages 0-3 at world size 1 equal eager PyTorch bit for bit,
    also with accumulation, clipping, a memory budget (recomputation is exact) and memory pools;
    ``tests/test_mixed_precision.py`` pins bf16 and fp16 with fp32 reductions bit for bit. A bf16
    reduction at world size 1 is a cast round trip the reference also does, so it is exact too.
    """
    reduce = PRECISIONS[case.precision][1] or PRECISIONS[case.precision][0]
    if world_size == 1:
        return EXACT
    return ACROSS_RANKS if reduce in (None, torch.float32) else LOW_PRECISION_REDUCTION


def _close(got, expected, tolerance, what):
    """Bit for bit (rtol = atol = 0) or within ``tolerance``; NaN equals NaN (a skipped fp16 step's norm is NaN)."""
    rtol, atol = tolerance if tolerance is not None else (0.0, 0.0)
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype}, expected {expected.dtype}"
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, equal_nan=True,
                               msg=lambda m: f"{what}: {'not bit for bit' if tolerance is None else 'not close'}: {m}")


def compare(outcome: Outcome, world_size: int = 1, where: str = "") -> None:
    """Assert that the compiled step trained as the reference did (a refusal must be a documented one)."""
    case = outcome.case
    where = f"{case!r}{where}"
    assert outcome.error is None, f"{where}: raised {outcome.error}"
    if outcome.refused is not None:   # a budget below the smallest reachable peak; a budget >= the plan must fit
        assert case.memory_budget_fraction is not None and case.memory_budget_fraction < 1, \
            f"{where}: refused {outcome.refused}"
        return
    if outcome.resumed_from is not None:
        where += f" (resumed from world size {outcome.resumed_from})"
    tolerance = tolerance_of(case, resumed_world_size(outcome, world_size))
    _close(torch.stack(outcome.losses), torch.stack(outcome.expected_losses), tolerance.losses, f"{where} losses")
    assert len(outcome.evals) == len(outcome.expected_evals), where
    for number, (got, expected) in enumerate(zip(outcome.evals, outcome.expected_evals)):
        _close(got, expected, tolerance.state, f"{where} eval_forward after step {number}")
    if case.metrics:
        assert len(outcome.metrics) == len(outcome.expected_metrics), where
        for number, (got, expected) in enumerate(zip(outcome.metrics, outcome.expected_metrics)):
            assert got.keys() == expected.keys(), f"{where} last_metrics after step {number}: {sorted(got)}"
            for key, value in expected.items():
                _close(got[key], value, tolerance.state, f"{where} last_metrics[{key!r}] after step {number}")
    if case.clip_grad_norm is not None:
        _close(torch.stack(outcome.norms), torch.stack(outcome.expected_norms), tolerance.losses, f"{where} norms")
    assert outcome.scale == outcome.expected_scale, f"{where}: loss scale {outcome.scale} != {outcome.expected_scale}"
    assert outcome.state.keys() == outcome.expected_state.keys(), where
    for key, value in outcome.expected_state.items():
        _close(outcome.state[key], value, tolerance.state, f"{where} {key}")
    if outcome.budget is not None:
        assert outcome.peak_bytes <= outcome.budget, \
            f"{where}: {budgeted_peak(case)} {outcome.peak_bytes} over the budget {outcome.budget}"


def describe(outcome: Outcome, with_case: bool = True) -> str:
    """One line for the long run's log (a resumed run's part of it: ``with_case=False``)."""
    status = "ERROR " + outcome.error if outcome.error else "refused" if outcome.refused else "ran"
    if outcome.compile_cache not in (None, "off"):
        status += f" (cache: {outcome.compile_cache[:60]})"
    if outcome.resumed_from is not None:
        status = f"resumed: {status}"
    return f"{outcome.seconds:6.1f}s {status[:300]}" + (f"  {outcome.case!r}" if with_case else "")

