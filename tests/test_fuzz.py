"""Differential fuzzing: drawn combinations of compile options against the eager reference they define.

``draw_case`` picks a model (MLP, tied-embedding GPT, BatchNorm CNN; in the long runs also Llama, GPT-2,
BERT, T5, Mixtral, a ResNet and a U-Net), a stage,
an optimizer, param groups, frozen parameters, mixed precision and loss
scaling, gradient accumulation, clipping, a memory budget (a fraction of the
unbudgeted planned peak), memory pools, prefetch and bucket sizes;
``tests/fuzz_reference.py`` trains the compiled step and the eager reference
on the same batches and compares them (bit for bit at world size 1, within
the tolerances stated there across ranks).

The default suite runs a short derandomized slice (5 cases at world size 1,
2 cases inside one 2-rank run, one Mixtral case, one case of the training-loop dimensions, one of round 24's).
The long runs also draw those (``draw_loop``: eval_forward between steps, changing batch shapes, max_programs=1, a checkpoint
resumed in new processes at another stage or world size, a shared compile cache; ``draw_recent``: live optimizer
settings, metrics_fn, the caller's autocast, and two more models). The long run, and the regression cases it
found, are in ``docs/fuzzing.md``:

    ZEROCC_FUZZ_EXAMPLES=200 python -m pytest -m slow tests/test_fuzz.py
    python -m tests.test_fuzz --examples 200 --seed 1 [--world-size 2]   # logs every case, keeps going
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import math
import os
import random
import sys
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zerocc
from tests import distributed
from tests.helpers import foreach_as_on_cuda
from tests.fuzz_reference import (ALL_MODELS, EVERY_MODEL, FREEZABLE, OPTIMIZERS, PRECISIONS, Case, case_batches,
                                  compare, compile_options, describe, make_model, make_optimizer, precisions_of,
                                  run_case, run_resumed, run_whole_case)

LONG_EXAMPLES = int(os.environ.get("ZEROCC_FUZZ_EXAMPLES", "200"))


def draw_case(choose, models=ALL_MODELS, loop=False, resume_world_sizes=(None, 1, 2), recent=False) -> Case:
    """A case, each field picked by ``choose(options)`` (Hypothesis' draw or a seeded Random's choice).

    Options are listed simplest first: Hypothesis shrinks a failure towards them. ``loop`` also draws what a
    training loop does around the step (``draw_loop``), after the rest, so that a seed draws the same options
    as before these existed; ``resume_world_sizes`` are the resumed runs' world sizes it may draw (None: the same).
    ``recent`` draws what round 24 added (``draw_recent``) after those, the same way: callers pass the models
    ``fuzz_reference.EVERY_MODEL`` with it (a longer model list changes every draw of a seed, so without ``recent``
    a seed's cases are the ones it drew before).
    """
    model = choose(models)
    # eager BatchNorm refuses bf16 inputs with fp32 running statistics: the CNN and the ResNet have no mixed
    # reference (precisions_of); a single option draws nothing, so the seeded draws stay as they were
    precisions = precisions_of(model)
    precision = choose(sorted(precisions, key=lambda name: name != "fp32")) if len(precisions) > 1 else "fp32"
    clip = choose((None, 1.0, 0.05))
    frozen_sets = [()] + [c for n in (1, 2) for c in itertools.combinations(FREEZABLE[model], n)]
    case = Case(
        model=model,
        stage=choose((3, 0, 1, 2)),
        optimizer=choose(sorted(OPTIMIZERS, key=lambda name: name != "adamw")),
        precision=precision,
        grad_accumulation=choose((1, 2, 4)),
        clip_grad_norm=clip,
        clip_norm_type=choose((2.0, math.inf)) if clip is not None else 2.0,
        memory_budget_fraction=choose((None, 1.0, 0.9, 0.75)),
        memory_pools=choose((False, True)),
        prefetch_bytes=choose((None, 0, 4096)),
        bucket_bytes=choose((None, 16384, 2048)),
        frozen=choose(frozen_sets),
        frozen_in_optimizer=choose((True, False)),
        param_groups=choose((False, True)),
    )
    case = draw_loop(choose, case, resume_world_sizes) if loop else case
    return draw_recent(choose, case) if recent else case


def draw_recent(choose, case: Case) -> Case:
    """What round 24 added, drawn onto ``case``: float settings changed between steps (OneCycleLR with its momentum
    cycle, or lr, weight decay, momentum, betas, alpha set by hand), ``metrics_fn=`` read from ``step.last_metrics``,
    and the step called under the caller's ``torch.autocast`` (bf16 on the CPU; with ``param_dtype`` bf16 or none:
    another ``param_dtype`` fails as eager does, docs/guide/mixed-precision.md). The models with a buffer forward
    reassigns and with routed experts are in ``EVERY_MODEL``."""
    autocast_ok = PRECISIONS[case.precision][0] in (None, torch.bfloat16)
    return dataclasses.replace(
        case,
        live_settings=choose((None, "one_cycle", "by_hand")),
        metrics=choose((False, True)),
        autocast=choose((False, True)) if autocast_ok else False,
    )


def draw_loop(choose, case: Case, resume_world_sizes) -> Case:
    """What users do around the step, drawn onto ``case``: ``eval_forward`` after every step, a batch of another
    shape every other step (a program per shape; ``max_programs=1`` drops and compiles them again), and a
    ``save_checkpoint`` after 1 or 2 of 3 steps resumed in new processes, at another stage or world size, with a
    compile cache the resumed run loads from (``fuzz_reference.resume_case``)."""
    shape_change = choose((False, True))
    resume_after = choose((None, 1, 2))
    resumed = resume_after is not None
    return dataclasses.replace(
        case,
        eval_between=choose((False, True)),
        shape_change=shape_change,
        max_programs=choose((None, 1)) if shape_change else None,
        resume_after=resume_after,
        resume_stage=choose((None, 0, 1, 2, 3)) if resumed else None,
        resume_world_size=choose(resume_world_sizes) if resumed else None,
        cache_dir=choose((False, True)) if resumed else False,
        steps=3 if resumed or shape_change else case.steps,
    )


@st.composite
def cases(draw, models=ALL_MODELS, loop=False, resume_world_sizes=(None,), recent=False):
    return draw_case(lambda options: draw(st.sampled_from(options)), models, loop, resume_world_sizes, recent)


def random_cases(count: int, seed: int, models=ALL_MODELS, loop=False, recent=False) -> list[Case]:
    generator = random.Random(seed)
    return [draw_case(generator.choice, models, loop, recent=recent) for _ in range(count)]


# the default suite's slice trains the cheap models (a GPT case compiles for 10-60 s on a loaded 2-core
# machine, the MLP's and CNN's for 3-15 s); the long runs draw the GPT and the real architectures too
# (fuzz_reference.ARCHITECTURE_MODELS: Llama, GPT-2, BERT, T5, Mixtral, a ResNet, a U-Net)
CHEAP = ("mlp", "cnn")


# -- world size 1: bit for bit ---------------------------------------------------------

SHORT = settings(max_examples=5, derandomize=True, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow])


@SHORT
@given(cases(CHEAP))
def test_world_size_1_equals_the_eager_reference(case):
    compare(run_case(case))


@pytest.mark.slow
@settings(max_examples=LONG_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(cases(EVERY_MODEL, loop=True, recent=True))
def test_world_size_1_long(case):
    for _, (outcome,) in run_whole_case(case):   # resumed at world size 1 (in new processes): not multirank
        compare(outcome)


# -- world size 2: within tolerance, several cases in one process group ----------------------

def _run_cases(rank, world_size, drawn, foreach_as_on_cuda=False, folders=None):
    """Each case on this rank; a resumed case saves into its folder (``run_across_ranks`` resumes it)."""
    folders = folders or [None] * len(drawn)
    with foreach_as_on_cuda_if(foreach_as_on_cuda):
        return [run_case(case, rank, world_size, folder) for case, folder in zip(drawn, folders)]


def run_across_ranks(drawn, world_size, foreach_as_on_cuda=False):
    """Per case, (world size, outcomes by rank) of each run: the run on ``world_size`` ranks, then the resumed one."""
    with contextlib.ExitStack() as stack:
        folders = [stack.enter_context(tempfile.TemporaryDirectory()) for _ in drawn]
        per_rank = distributed.run(_run_cases, world_size, drawn, foreach_as_on_cuda, folders)
        runs = []
        for case, folder, first in zip(drawn, folders, zip(*per_rank)):
            runs.append([(world_size, list(first))] + run_resumed(case, world_size, folder, list(first)))
        return runs


def foreach_as_on_cuda_if(wanted: bool):
    """``tests.helpers.foreach_as_on_cuda`` (the update torch.optim picks on CUDA, on the CPU) if ``wanted``."""
    return foreach_as_on_cuda() if wanted else contextlib.nullcontext()


DEFAULT_RANK_SEED = 7   # 2 cases: a CNN at stage 2, an MLP at stage 3 in fp16 with loss scaling


def _check_across_ranks(drawn, world_size=2):
    for runs in run_across_ranks(drawn, world_size):
        for size, outcomes in runs:
            for rank, outcome in enumerate(outcomes):
                compare(outcome, size, where=f" rank {rank}")


@pytest.mark.multirank
def test_world_size_2_matches_the_eager_reference():
    _check_across_ranks(random_cases(2, seed=DEFAULT_RANK_SEED, models=CHEAP))


@pytest.mark.slow
@pytest.mark.multirank
def test_world_size_2_long():
    _check_across_ranks(random_cases(max(1, LONG_EXAMPLES // 4), seed=int(os.environ.get("ZEROCC_FUZZ_SEED", "3")),
                                     models=EVERY_MODEL, loop=True, recent=True))


def test_a_real_architecture_equals_the_eager_reference():
    """The default suite's one real-architecture case: a keyword batch (input_ids=, labels=) split into
    micro-batches, the model's output.loss, mixed precision, clipping and pools over Mixtral's routed experts.
    The long runs draw all of fuzz_reference.ARCHITECTURE_MODELS."""
    compare(run_case(Case(model="mixtral", stage=3, precision="bf16", grad_accumulation=2, clip_grad_norm=1.0,
                          memory_pools=True)))


def test_a_training_loop_case_equals_the_eager_reference():
    """The default suite's one case of what the long runs draw around the step (draw_loop): eval_forward after
    every step, a batch of twice the rows every other step under max_programs=1 (each step compiles again), and a
    checkpoint after the first step resumed at another stage in a new process."""
    runs = run_whole_case(Case(model="mlp", stage=3, eval_between=True, shape_change=True, max_programs=1,
                               resume_after=1, resume_stage=1, steps=3))
    assert [len(outcome.losses) for _, (outcome,) in runs] == [1, 2]
    for _, (outcome,) in runs:
        compare(outcome)


def test_a_recent_features_case_equals_the_eager_reference():
    """The default suite's one case of what draw_recent adds: DINO's center, which forward reassigns, carried through
    accumulation and eval_forward (which reassigns it too), OneCycleLR cycling lr and betas between steps,
    metrics_fn's values stacked per micro-batch, and every step under the caller's bf16 autocast."""
    compare(run_case(Case(model="centered", stage=3, grad_accumulation=2, eval_between=True, live_settings="one_cycle",
                          metrics=True, autocast=True)))


# -- what the fuzzer found: each failure, as the smallest case that still shows it -------------

@pytest.mark.multirank
def test_memory_budget_with_memory_pools_holds_at_world_size_2():
    _check_across_ranks([Case(model="mlp", stage=1, memory_budget_fraction=0.9, memory_pools=True)])


def test_a_budget_of_the_planned_pooled_peak_is_accepted_on_the_first_step(monkeypatch):
    """Found by the long run of 2026-11-24 (seed 23): the first step's program created the optimizer state
    outside the arenas and peaked above the steady state's plan, so a budget of exactly that plan was refused.
    Fixed: place_buffers writes the new state into the tensor the step created for it. (AdamW's first step
    now runs the steady program, zerocc/optimizer_init.py; the switch keeps the first step's own program.)"""
    monkeypatch.setenv("ZEROCC_TRACE_FIRST_STEP", "1")
    compare(run_case(Case(model="mlp", stage=0, memory_budget_fraction=1.0, memory_pools=True)))


def test_a_resumed_run_fits_the_budget_the_run_that_saved_it_fit(tmp_path):
    """Found by the 2026-12-07 run (seed 1813, world sizes 1 and 2): under fp16 dynamic loss scaling the first call
    compiled a first-step program (the optimizer state made at the update's end, 68,672 bytes), a run resumed from
    its checkpoint the steady state's (108,352: every old and new state held to the end for the overflow's where):
    the saving run fit a budget its own second step and its resume were refused under. Now the first call runs the
    steady state's program (the initial state made beforehand) and each where follows its update: a budget of the
    saving run's peak is met by its later steps and by the resumed run, which trains bit for bit as it would have."""
    case = Case(model="mlp", stage=3, optimizer="adam_amsgrad", precision="fp16_dynamic", memory_pools=True,
                prefetch_bytes=4096, frozen=("net.0.bias", "net.2.bias"), frozen_in_optimizer=False, steps=3)
    batches = case_batches(case, 1)

    def compiled(budget=None):
        model, loss_fn = make_model(case)
        optimizer = make_optimizer(case, model)
        options = compile_options(case, model, optimizer, loss_fn, batches[0], 1)
        return zerocc.compile(model, optimizer, memory_budget=budget, **options)

    free = compiled()
    free(*batches[0][0])
    budget = free.report()["planned_peak_bytes"]   # what the saving run fits: its first call's peak
    saving = compiled(budget)
    saving(*batches[0][0])
    zerocc.save_checkpoint(saving, str(tmp_path / "checkpoint"))
    expected = [saving(*args) for args, _ in batches[1:]]   # its later steps fit the budget too
    resumed = compiled(budget)
    zerocc.load_checkpoint(resumed, str(tmp_path / "checkpoint"))
    refused = None
    try:
        losses = [resumed(*args) for args, _ in batches[1:]]
    except zerocc.MemoryBudgetError as error:
        refused = str(error)
    assert refused is None
    assert all(torch.equal(a, b) for a, b in zip(losses, expected)), (losses, expected)
    assert resumed.report()["planned_peak_bytes"] <= budget
    state, expected_state = resumed.full_state_dict(), saving.full_state_dict()
    assert [k for k in expected_state if not torch.equal(state[k], expected_state[k])] == []


def test_a_budget_the_steady_step_misses_is_refused_at_the_first_call_not_after_a_save():
    """The fuzzer's case (0.75 of the steady state's planned peak): the first call compiles the steady state's
    program, so the run is refused before it trains (a run resumed from its checkpoint would be refused too),
    where it used to train its first step, save, and then be refused at its second step or on resuming."""
    runs = run_whole_case(Case(model="mlp", stage=3, optimizer="adam_amsgrad", precision="fp16_dynamic",
                               memory_budget_fraction=0.75, memory_pools=True, prefetch_bytes=4096,
                               frozen=("net.0.bias", "net.2.bias"), frozen_in_optimizer=False, resume_after=1))
    assert len(runs) == 1 and runs[0][1][0].refused and "cannot be met" in runs[0][1][0].refused
    compare(runs[0][1][0])


# -- the long run as a script: every case logged, failures collected, none stops the run -----

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="zerocc's differential fuzzer, logging every case")
    parser.add_argument("--examples", type=int, default=LONG_EXAMPLES)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--foreach-as-on-cuda", action="store_true",
                        help="eager and zerocc run the optimizers' foreach update, as torch.optim picks on CUDA")
    parser.add_argument("--no-loop", action="store_true",
                        help="draw no training-loop dimensions (eval, shape changes, resume, cache): the cases a seed "
                             "drew before they existed")
    parser.add_argument("--no-recent", action="store_true",
                        help="draw nothing round 24 added (live optimizer settings, metrics_fn, autocast, the models "
                             f"{', '.join(m for m in EVERY_MODEL if m not in ALL_MODELS)}): the cases a seed drew before")
    parser.add_argument("--models", default=None,
                        help=f"comma-separated models to draw from (default: all of {', '.join(EVERY_MODEL)}; "
                             f"with --no-recent {', '.join(ALL_MODELS)})")
    args = parser.parse_args(argv)
    models = tuple(args.models.split(",")) if args.models else ALL_MODELS if args.no_recent else EVERY_MODEL
    unknown = set(models) - set(EVERY_MODEL)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; choose from {', '.join(EVERY_MODEL)}")
    drawn = random_cases(args.examples, args.seed, models, loop=not args.no_loop, recent=not args.no_recent)
    if args.world_size == 1:   # one at a time, logged as it ends (a resumed case: one more run, in a new process)
        def one(case):
            with foreach_as_on_cuda_if(args.foreach_as_on_cuda):
                return run_whole_case(case)
        runs_of_cases = (one(case) for case in drawn)
    else:
        runs_of_cases = run_across_ranks(drawn, args.world_size, args.foreach_as_on_cuda)
    failures = 0
    for runs in runs_of_cases:
        try:
            for size, per_rank in runs:
                for rank, outcome in enumerate(per_rank):
                    compare(outcome, size, where=f" rank {rank}")
            print("ok   ", " | ".join(describe(per_rank[0], n == 0) for n, (_, per_rank) in enumerate(runs)), flush=True)
        except AssertionError as error:
            failures += 1
            print("FAIL ", " | ".join(describe(per_rank[0], n == 0) for n, (_, per_rank) in enumerate(runs)), "\n      ",
                  str(error).splitlines()[0][:600], flush=True)
    print(f"{failures} of {len(drawn)} cases failed (seed {args.seed}, world size {args.world_size})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
