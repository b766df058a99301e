"""Suite-wide settings: what the default run leaves to ``-m slow``, the order it runs in, the multirank check.

The default suite must stay under 15-20 minutes on a 2-core machine (``.ci/run``). SLOW_REPEATS are cases that
repeat, at a bigger size or another stage, what a faster test in the default run already checks; each names the
test that stays. Measured with ``--durations`` on runs of the whole suite (2026-11-23, 2026-12-07). The slowest tests
run first (tests/durations.py says why), and a test that starts several ranks unmarked fails.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests import distributed, durations

# node id -> the default-suite test that covers the same path
SLOW_REPEATS = {
    "tests/test_numerics.py::test_world_size_n_matches_ddp[gpt-4-None]": "the 4-rank MLP and CNN, the 2-rank GPT",
    "tests/test_numerics.py::test_world_size_n_matches_ddp[cnn-4-None]": "the 4-rank MLP, the 2-rank CNN",
    "tests/test_numerics.py::test_world_size_n_matches_ddp[gpt-2-True]":
        "test_memory_pools::test_world_size_2_places_gathered_parameters_and_gradients_exactly",
    "tests/test_hf_models.py::test_tiny_transformers_train_bit_for_bit[t5-1]": "the keyword-batch T5 test, stage 3",
    "tests/test_hf_models.py::test_tiny_transformers_train_bit_for_bit[t5-2]": "the keyword-batch T5 test, stage 3",
    "tests/test_hf_models.py::test_tiny_transformers_train_bit_for_bit[t5-3]": "the keyword-batch T5 test, stage 3",
    "tests/test_resume.py::test_fresh_process_resume_resharded_to_one_rank_at_stage_2":
        "test_state_dict::test_reshard_2_to_4_to_1_across_stages",
    "tests/test_gather_by_send_recv.py::test_two_ranks_train_bit_for_bit_as_with_all_gather[1-options0]":
        "the same test at stage 3",
    "tests/test_scatter_by_all_to_all.py::test_two_ranks_train_bit_for_bit_as_with_reduce_scatter[1]":
        "the same test at stage 3",
    "tests/test_launch.py::test_two_nodes_train_bit_for_bit_like_one_node": "tests/test_numerics' 2-rank runs",
    "tests/test_numerics.py::test_world_size_n_matches_ddp[mlp-2-None]": "the 4-rank MLP, the 2-rank GPT and CNN",
    # at world size 1 stages 1 and 2 differ from 3 only in the passes, which test_numerics runs at every stage;
    # what a model family adds is its capture, which stage 3 (every pass) exercises
    **{f"tests/test_hf_models.py::test_tiny_transformers_train_bit_for_bit[{name}-{stage}]": "the same model, stage 3"
       for name in ("gpt2", "llama", "bert") for stage in (1, 2)},
    # added 2026-12-07, when the default suite reached 20 min: repeats at other stages or sizes
    **{f"tests/test_group_traces.py::test_layerwise_groups_each_read_their_own_settings[{stage}-adamw_one_group_maximizes]":
       "the same case at stages 0 and 3" for stage in (1, 2)},
    **{f"tests/test_layout_identity.py::test_tiny_models_lay_out_and_recompute_as_the_reference[2-{name}]":
       "the same models at stages 1 and 3" for name in ("gpt", "cnn")},
    "tests/test_layout_identity.py::test_the_benchmark_gpt_lays_out_and_recomputes_as_the_reference":
        "the tiny GPT and CNN at stages 1 and 3",
    **{f"tests/test_plain_fake_values.py::test_programs_are_the_ones_dispatching_makes[{case}]":
       "the same comparison on gpt-3-4-meta and cnn-2-1-cpu" for case in ("gpt-3-1-cpu", "gpt-1-2-meta", "cnn-0-2-meta")},
    "tests/test_budget_choice.py::test_the_budget_search_chooses_the_plan_it_chose_on_main[1-True]":
        "the same test at stage 3 with pools (the default)",
    "tests/test_overlap_updates.py::test_an_update_left_after_the_last_ones_lowers_the_planned_peak_as_counted":
        "tests/test_planning.py's stage-2-under-stage-1 case of the same 98M plan",
    "tests/test_resume_changes.py::test_a_resume_with_other_options_equals_loading_the_eager_state_before_compile"
    "[saved_options0-2-options0]": "the same test's stage 3 case",
}


@pytest.hookimpl(tryfirst=True)   # before pytest's own -m selection reads the marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in SLOW_REPEATS:
            item.add_marker(pytest.mark.slow)


class SlowestFirst:
    """Orders what -m and -k left (pytest's own selection is a plain hook: trylast runs after it)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        items[:] = slowest_first(items, workers(config))


def pytest_configure(config):
    config.pluginmanager.register(SlowestFirst(), "zerocc-slowest-first")


def workers(config) -> int:
    """How many pytest-xdist workers share the run (1 without -n). The workers collect, and each knows the count
    from its environment; the controller's own order is not used."""
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT") or getattr(config.option, "numprocesses", None)
    return int(count) if str(count).isdigit() and int(count) > 0 else 1


def slowest_first(items, workers: int):
    """The items in the order that keeps a worksteal run's tail short (tests/durations.py says why).

    worksteal hands worker k the k-th of ``workers`` equal contiguous blocks of the collection, and an idle worker
    steals from the end of a busy one's block. So each block starts with its share of the slow tests, dealt
    round-robin, slowest first; the fast ones fill the blocks in collection order (a module's tests stay together,
    so its cached compiles are made once).
    """
    seconds = durations.load()
    slow = sorted((item for item in items if item.nodeid in seconds), key=lambda item: -seconds[item.nodeid])
    fast = [item for item in items if item.nodeid not in seconds]
    ordered = []
    for k in range(workers):
        block = slow[k::workers]
        size = len(items) // workers if k < workers - 1 else len(items) - len(ordered)   # as xdist splits them
        take = max(0, size - len(block))
        ordered += block + fast[:take]
        fast = fast[take:]
    return ordered + fast


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test that starts several ranks must say so (``@pytest.mark.multirank``): ``-m 'not multirank'`` is then
    the suite that needs one core per test."""
    runs = distributed.multirank_runs
    result = yield
    if distributed.multirank_runs > runs and item.get_closest_marker("multirank") is None:
        raise AssertionError(f"{item.nodeid} started several ranks (tests/distributed.py) but is not marked "
                             "multirank: add @pytest.mark.multirank")
    return result

@pytest.fixture
def deterministic():
    """Deterministic algorithms on for the test, restored after it: gathering by index (MoE expert weights, token
    rows) backpropagates through CPU index_put_(accumulate=True), which eager PyTorch sums in a run-dependent order
    unless they are on."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


# torch.distributions' default argument checks as a process starts (on, unless python -O), before any test module
# is imported: dynamo turns them off for the rest of the process at its first use (TorchPatcher.patch), which a test
# module decorating a function with torch.compiler.disable at import, or compiling a reference, does
VALIDATE_ARGS_AT_START = torch.distributions.Distribution._validate_args


@pytest.fixture(autouse=True)
def distributions_validate_their_arguments():
    """``torch.distributions``' default argument checks as a new process has them, for every test: after
    tests/test_torch_compile_models.py was collected on a worker, the tests of checks in the program
    (tests/test_data_guards.py) found eager raising nothing there."""
    torch.distributions.Distribution.set_default_validate_args(VALIDATE_ARGS_AT_START)
    yield
    torch.distributions.Distribution.set_default_validate_args(VALIDATE_ARGS_AT_START)
