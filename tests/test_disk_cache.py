"""The compile cache on disk (``cache_dir``, ``zerocc/disk_cache.py``): a later process loads what an earlier one
compiled, trains bit for bit as eager, and misses, saying why, when anything the program depends on changed.

Loads are checked in new processes (``tests/distributed.py`` forks each run): nothing of the first run's
compile may survive in memory. Misses are checked in one process with new models: the entry on disk is
all the second compile could find.
"""
from __future__ import annotations

import copy
import errno
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

import zerocc
from tests import distributed
from tests.architectures import architecture_batches, build_architecture
from tests.models import batches, build, eager_step
from tests.reference import train_eagerly, two_groups
from zerocc.errors import CompileCacheWarning

STEPS = 3


def _eager_losses(name, seed, steps, data, lr=1e-2):
    model, _, loss_fn = build(name, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return [eager_step(model, optimizer, loss_fn, batch) for batch in data[:steps]]


def _train(rank, world_size, folder, stage=3, name="gpt"):
    model, _, loss_fn = build(name, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=loss_fn, cache_dir=folder)
    per_rank = 8 // world_size
    data = [tuple(t[rank * per_rank:(rank + 1) * per_rank] for t in batch) for batch in batches(name, STEPS, 8)]
    losses = [step(*batch) for batch in data]
    report = step.report()
    return (losses, report["compile_cache"], report["compile_seconds_by_phase"], str(step.graph("insert_collectives")),
            report["measured_peak_bytes"])


@pytest.mark.multirank   # new processes, each with the environment at its call
def test_memory_pools_set_to_the_default_by_the_environment_loads_and_set_off_misses(tmp_path, monkeypatch):
    """$ZEROCC_MEMORY_POOLS=1 asks for the default's program; the fingerprint read the raw $ZEROCC_* settings, so an
    entry stored without the variable missed (and said the settings changed). The options hold it resolved."""
    folder = str(tmp_path / "cache")
    monkeypatch.delenv("ZEROCC_MEMORY_POOLS", raising=False)
    [(cold, cold_outcome, *_)] = distributed.run(_train, 1, folder)
    monkeypatch.setenv("ZEROCC_MEMORY_POOLS", "1")
    [(warm, warm_outcome, *_)] = distributed.run(_train, 1, folder)
    monkeypatch.setenv("ZEROCC_MEMORY_POOLS", "0")
    [(off, off_outcome, *_)] = distributed.run(_train, 1, folder)
    assert cold_outcome.startswith("miss (no entry), then stored") and warm_outcome == "loaded", (cold_outcome, warm_outcome)
    assert off_outcome.startswith("miss (changed since the entry for this program: options"), off_outcome
    assert all(torch.equal(a, b) for a, b in zip(cold, warm)) and all(torch.equal(a, b) for a, b in zip(cold, off))


def _without_symbolic_annotations(code: str) -> str:
    """A loaded graph keeps no symbolic scalar values (they belong to the tracing process): their annotations go."""
    return re.sub(r': "Sym\([^"]*\)"', "", code)


@pytest.mark.multirank   # one rank, but through tests/distributed.py's process group: a new process per run
def test_a_new_process_loads_what_an_earlier_one_stored_and_trains_as_eager(tmp_path):
    folder = str(tmp_path / "cache")
    [(cold, cold_outcome, cold_phases, cold_graph, cold_peak)] = distributed.run(_train, 1, folder)
    [(warm, warm_outcome, warm_phases, warm_graph, warm_peak)] = distributed.run(_train, 1, folder)
    assert cold_outcome.startswith("miss (no entry), then stored"), cold_outcome
    assert warm_outcome == "loaded"
    assert "capture: trace" in cold_phases and "capture: trace" not in warm_phases   # nothing traced
    assert not any(phase.startswith("pass ") for phase in warm_phases)   # no pass ran
    expected = _eager_losses("gpt", 0, STEPS, batches("gpt", STEPS, 8))
    assert all(torch.equal(a, b) for a, b in zip(cold, expected)), (cold, expected)
    assert all(torch.equal(a, b) for a, b in zip(warm, expected)), (warm, expected)
    assert _without_symbolic_annotations(warm_graph) == _without_symbolic_annotations(cold_graph)
    assert warm_peak == cold_peak > 0   # the storing run's measurement, kept with the entry


@pytest.mark.multirank
def test_two_ranks_load_together_and_a_rank_without_its_entry_makes_every_rank_compile(tmp_path):
    folder = str(tmp_path / "cache")
    cold = distributed.run(_train, 2, folder)
    warm = distributed.run(_train, 2, folder)
    assert [outcome for _, outcome, *_ in warm] == ["loaded", "loaded"]
    for (a, *_), (b, *_) in zip(cold, warm):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    shutil.rmtree(os.path.join(folder, "GPT-rank1of2"))   # rank 1 finds nothing: loading alone would hang
    again = distributed.run(_train, 2, folder)
    assert again[0][1].startswith("miss (another rank has no entry), then stored"), again[0][1]
    assert again[1][1].startswith("miss (no entry), then stored"), again[1][1]
    for (a, *_), (b, *_) in zip(cold, again):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _compiled(folder, name="gpt", seed=0, **options):
    model, _, loss_fn = build(name, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return zerocc.compile(model, optimizer, stage=3, loss_fn=loss_fn, cache_dir=folder, **options)


def test_changed_options_miss_and_say_which_part_changed(tmp_path):
    data = batches("gpt", 2, 8)
    _compiled(tmp_path)(*data[0])
    step = _compiled(tmp_path, bucket_bytes=1 << 12)
    with pytest.warns(CompileCacheWarning, match="changed since the entry for this program: options") as caught:
        loss = step(*data[0])
    assert [w.filename for w in caught] == [__file__]   # the user's call, not the line that called its function
    assert step.report()["compile_cache"].startswith("miss (changed since the entry for this program: options), then stored")
    assert torch.equal(loss, _eager_losses("gpt", 0, 1, data)[0])
    # the learning rate is read every step: a new one loads the stored program
    step = _compiled(tmp_path, bucket_bytes=1 << 12)
    step.optimizer.param_groups[0]["lr"] = 5e-3
    step(*data[0])
    assert step.report()["compile_cache"] == "loaded"


MODEL_SOURCE = '''
import torch


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(8, 16)
        self.second = torch.nn.Linear(16, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.second(torch.relu(self.first(x))), y)
'''


def _import(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules.pop(name, None)
    return module


def _small_step_and_eager(module, folder):
    torch.manual_seed(0)
    model = module.Small()
    reference = copy.deepcopy(model)
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3, cache_dir=folder)
    batch = (torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.randn(4, 1))
    expected = eager_step(reference, torch.optim.SGD(reference.parameters(), lr=0.1), None, batch)
    return step, batch, expected


def test_an_edited_model_source_misses_and_names_the_file(tmp_path):
    source = tmp_path / "small_model.py"
    source.write_text(MODEL_SOURCE)
    step, batch, expected = _small_step_and_eager(_import(source, "small_model"), tmp_path / "cache")
    assert torch.equal(step(*batch), expected)
    source.write_text(MODEL_SOURCE.replace("torch.relu", "torch.tanh"))   # the module tree and shapes are the same
    step, batch, expected = _small_step_and_eager(_import(source, "small_model"), tmp_path / "cache")
    with pytest.warns(CompileCacheWarning, match="source changed: .*small_model.py"):
        loss = step(*batch)
    assert torch.equal(loss, expected)   # the edited model's numbers, not the stored program's
    step, batch, expected = _small_step_and_eager(_import(source, "small_model"), tmp_path / "cache")
    assert torch.equal(step(*batch), expected) and step.report()["compile_cache"] == "loaded"


HELPER_SOURCE = '''
import torch


def activation(x):
    return torch.relu(x)
'''


def test_an_edited_helper_module_the_model_calls_misses_and_names_the_file(tmp_path, monkeypatch):
    """make_fx keeps only ``forward`` frames in a node's stack trace: the ops of a helper function in another
    file (an activation, an attention function, a library's loss) named only the model's file, so editing the
    helper loaded the old program and trained the old model."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "small_helper.py").write_text(HELPER_SOURCE)
    model_source = tmp_path / "small_model_with_helper.py"
    model_source.write_text(MODEL_SOURCE.replace("import torch\n", "import torch\nfrom small_helper import activation\n")
                            .replace("torch.relu(", "activation("))

    def step_and_eager():
        for name in ("small_helper", "small_model_with_helper"):
            sys.modules.pop(name, None)
        return _small_step_and_eager(_import(model_source, "small_model_with_helper"), tmp_path / "cache")

    step, batch, expected = step_and_eager()
    assert torch.equal(step(*batch), expected)
    (tmp_path / "small_helper.py").write_text(HELPER_SOURCE.replace("torch.relu", "torch.tanh"))
    step, batch, expected = step_and_eager()
    with pytest.warns(CompileCacheWarning, match="source changed: .*small_helper.py"):
        loss = step(*batch)
    assert torch.equal(loss, expected)   # the edited helper's numbers, not the stored program's
    step, batch, expected = step_and_eager()
    assert torch.equal(step(*batch), expected) and step.report()["compile_cache"] == "loaded"


def test_an_unreadable_entry_is_compiled_again_and_replaced(tmp_path):
    data = batches("gpt", 1, 8)
    _compiled(tmp_path)(*data[0])
    [entry] = [os.path.join(root, f) for root, _, files in os.walk(tmp_path) for f in files if f.endswith(".pkl") and "history" not in f]
    with open(entry, "r+b") as file:
        file.truncate(1000)
    step = _compiled(tmp_path)
    with pytest.warns(CompileCacheWarning, match="could not read") as caught:
        loss = step(*data[0])
    assert [w.filename for w in caught] == [__file__]
    assert torch.equal(loss, _eager_losses("gpt", 0, 1, data)[0])
    assert step.report()["compile_cache"].startswith("miss (unreadable entry), then stored")
    step = _compiled(tmp_path)
    step(*data[0])
    assert step.report()["compile_cache"] == "loaded"


def test_a_compile_that_cannot_be_pickled_trains_and_says_it_was_not_stored(tmp_path):
    def marks_with_a_lambda(gm, ctx):
        next(iter(gm.graph.nodes)).meta["user_note"] = lambda: None   # nothing pickle can write
        return gm

    zerocc.register_pass(marks_with_a_lambda, after="shard")
    try:
        data = batches("gpt", 1, 8)
        step = _compiled(tmp_path)
        assert torch.equal(step(*data[0]), _eager_losses("gpt", 0, 1, data)[0])
        assert step.report()["compile_cache"].startswith("miss (no entry), then not stored:")
    finally:
        zerocc.unregister_pass("marks_with_a_lambda")


class DistilledFrom(torch.nn.Module):
    """A policy kept close to a frozen reference model it does not register (RL's KL penalty, distillation)."""

    def __init__(self, reference):
        super().__init__()
        self.linear = torch.nn.Linear(6, 3)
        object.__setattr__(self, "reference", reference)   # out of parameters() and state_dict()

    def forward(self, x):
        with torch.no_grad():
            target = self.reference(x)
        return torch.nn.functional.mse_loss(self.linear(x), target)


def test_a_reference_model_outside_the_model_is_not_stored_with_its_weights(tmp_path):
    """The program reads a tensor held outside the model (here a frozen reference model's weights) as a constant:
    the entry on disk held a copy of the storing run's weights, and a later run with another reference model (a
    run resumed after the reference was refreshed) loaded it and trained silently against the old one. Such a
    compile is not stored."""
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    for seed in (1, 2):
        torch.manual_seed(seed)
        reference = torch.nn.Linear(6, 3).requires_grad_(False)
        torch.manual_seed(0)
        model = DistilledFrom(reference)
        eager = copy.deepcopy(model)
        object.__setattr__(eager, "reference", reference)
        step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=0, cache_dir=str(tmp_path))
        expected = eager(x)
        assert torch.equal(step(x), expected.detach()), seed
        assert step.report()["compile_cache"].startswith("miss (no entry), then not stored: the step reads model "
                                                         "reference"), step.report()["compile_cache"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_resume_from_a_checkpoint_compiles_once_then_loads(tmp_path):
    """A checkpoint loaded before the first call gives the program the saved optimizer state to read: another
    entry than a fresh start's, stored by the first resume and loaded by the next."""
    data = batches("gpt", 4, 8)
    first = _compiled(tmp_path / "cache")
    for batch in data[:2]:
        first(*batch)
    zerocc.save_checkpoint(first, tmp_path / "ckpt")
    expected = [first(*batch) for batch in data[2:]]
    outcomes = []
    for _ in range(2):
        resumed = _compiled(tmp_path / "cache", seed=5)
        zerocc.load_checkpoint(resumed, tmp_path / "ckpt")
        with warnings.catch_warnings():
            warnings.simplefilter("error", CompileCacheWarning)   # another program of the step, not a changed one
            losses = [resumed(*batch) for batch in data[2:]]
        assert all(torch.equal(a, b) for a, b in zip(losses, expected)), (losses, expected)
        outcomes.append(resumed.report()["compile_cache"])
    assert outcomes[0].startswith("miss (no entry), then stored"), outcomes[0]
    assert outcomes[1] == "loaded"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_resume_loads_whatever_order_the_optimizer_state_was_loaded_in(tmp_path):
    """A new process loads a checkpoint's optimizer state in an order that followed the hash seed (a set of its
    keys): the fingerprint read that order, so every resume missed and stored one more entry. The state now goes
    in in the model's parameter order, as an eager first step creates it, and the fingerprint does not read it."""
    data = batches("gpt", 3, 8)
    first = _compiled(tmp_path / "cache")
    first(*data[0])
    zerocc.save_checkpoint(first, tmp_path / "ckpt")
    expected = [first(*batch) for batch in data[1:]]
    outcomes = []
    for reverse in (False, True):
        resumed = _compiled(tmp_path / "cache", seed=5)
        zerocc.load_checkpoint(resumed, tmp_path / "ckpt")
        state = resumed.optimizer.state
        assert list(state) == list(resumed.model.parameters())
        if reverse:   # what another process's hash seed did
            for param in reversed(list(state)):
                state[param] = state.pop(param)
        losses = [resumed(*batch) for batch in data[1:]]
        assert all(torch.equal(a, b) for a, b in zip(losses, expected)), (losses, expected)
        outcomes.append(resumed.report()["compile_cache"])
    assert outcomes[0].startswith("miss (no entry), then stored"), outcomes[0]
    assert outcomes[1] == "loaded", outcomes[1]


def test_a_loaded_compile_still_writes_its_dumps(tmp_path):
    data = batches("gpt", 1, 8)
    _compiled(tmp_path / "cache")(*data[0])
    step = _compiled(tmp_path / "cache", dump_dir=str(tmp_path / "dumps"))
    step(*data[0])
    assert step.report()["compile_cache"] == "loaded"
    written = sorted(os.listdir(tmp_path / "dumps"))
    # capture first; the memory plan too, as a compile writes it
    assert written == [f"{i:03d}_{name}.py" for i, name in enumerate(step.passes)] + ["memory_plan.json"], written


def test_the_cache_folder_is_checked_and_off_without_one(tmp_path, monkeypatch):
    monkeypatch.delenv("ZEROCC_CACHE_DIR", raising=False)
    with pytest.raises(zerocc.ConfigError, match="cache_dir must be a folder's path"):
        _compiled(3)
    step = _compiled(None)
    step(*batches("gpt", 1, 8)[0])
    assert step.report()["compile_cache"] == "off"
    monkeypatch.setenv("ZEROCC_CACHE_DIR", str(tmp_path))
    step = _compiled(None)
    step(*batches("gpt", 1, 8)[0])
    assert step.report()["compile_cache"].startswith("miss (no entry), then stored")
    monkeypatch.setenv("HOME", str(tmp_path))   # "~/..." is the user's home, as in a shell
    step = _compiled("~/cache")
    step(*batches("gpt", 1, 8)[0])
    assert os.path.isdir(tmp_path / "cache" / "GPT-rank0of1")


def _architecture_through_the_cache(name, folder):
    reference = build_architecture(name)
    reference_optimizer = two_groups(reference)
    model = build_architecture(name)
    step = zerocc.compile(model, two_groups(model), stage=3, cache_dir=folder)
    for batch in architecture_batches(name, 3, 4):
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, None, batch))
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key
    return step.report()["compile_cache"]


# resnet: batch norm's running statistics are written in place (capture's tracing meta names nodes of another
# graph); unet: its skip connections; two param groups each
@pytest.mark.parametrize("name", ["resnet", "unet"])
def test_model_families_load_and_train_as_eager(tmp_path, name):
    assert _architecture_through_the_cache(name, tmp_path).startswith("miss (no entry), then stored")
    assert _architecture_through_the_cache(name, tmp_path) == "loaded"


def _zoo_model_through_the_cache(name, folder, steps=3, **config):
    """Train the zoo's ``name`` (a keyword batch, the model's own loss) beside eager: every loss equal."""
    from tests.zoo import ZOO, batches as zoo_batches
    reference, model = ZOO[name].build(), ZOO[name].build()
    for key, value in config.items():
        setattr(reference.config, key, value)
        setattr(model.config, key, value)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=3, cache_dir=folder)
    for number, batch in enumerate(zoo_batches(name, steps)):
        expected = train_eagerly(reference, reference_optimizer, batch, seed=100 + number)
        torch.manual_seed(100 + number)
        assert torch.equal(step(**batch), expected), number
    return step.report()["compile_cache"]


def test_a_mixture_of_experts_loads_and_trains_as_eager(tmp_path):
    """Hugging Face's Mixtral with grouped_mm experts: zerocc's own fake kernel, routing that differs per batch."""
    pytest.importorskip("transformers")
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)   # eager's index_put_ sums duplicates in a run-dependent order otherwise
    try:
        outcomes = [_zoo_model_through_the_cache("mixtral", tmp_path) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(previous)
    assert outcomes[0].startswith("miss (no entry), then stored") and outcomes[1] == "loaded", outcomes


_ZOO_STEP_IN_A_NEW_INTERPRETER = """
import sys, torch, zerocc
from tests.reference import train_eagerly
from tests.zoo import ZOO, batches
torch.use_deterministic_algorithms(True)
reference, model = ZOO["mixtral"].build(), ZOO["mixtral"].build()
batch = batches("mixtral", 1)[0]
expected = train_eagerly(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), batch, seed=100)
step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=3, cache_dir=sys.argv[1])
torch.manual_seed(100)
assert torch.equal(step(**batch), expected)
print(step.report()["compile_cache"])
"""


def test_a_hugging_face_model_loads_in_an_interpreter_with_another_hash_seed(tmp_path):
    """A new Python process hashes strings with a new seed. A causal LM's GenerationConfig keeps ``hash(self)``
    (a hash of its JSON text), which the fingerprint read: every new process missed on "model modules" (25
    of the zoo's 36 models). Forked test processes share the hash seed, so this one starts interpreters."""
    pytest.importorskip("transformers")
    outcomes = []
    for seed in ("1", "2"):
        environment = dict(os.environ, PYTHONHASHSEED=seed,
                           PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                       os.environ.get("PYTHONPATH", "")]))
        done = subprocess.run([sys.executable, "-c", _ZOO_STEP_IN_A_NEW_INTERPRETER, str(tmp_path)], env=environment,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        outcomes.append(done.stdout.strip().splitlines()[-1])
    assert outcomes[0].startswith("miss (no entry), then stored"), outcomes
    assert outcomes[1] == "loaded", outcomes


# the end of the scripts below: two SGD steps of the script's ``model`` beside eager, then the cache's outcome
_TRAINED_BESIDE_EAGER = """\
reference = copy.deepcopy(model)
x, y = torch.randn(4, 6), torch.randn(4, 2)
step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3, loss_fn=F.mse_loss,
                      cache_dir=sys.argv[1])
optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
for _ in range(2):
    expected = F.mse_loss(reference(x), y)
    optimizer.zero_grad()
    expected.backward()
    optimizer.step()
    assert torch.equal(step(x, y), expected.detach()), "trained otherwise than eager"
print(step.report()["compile_cache"])
"""


_SCRIPT_WITH_A_SET_OF_NAMES = """
import copy, sys, torch, torch.nn.functional as F, zerocc
class Net(torch.nn.Module):
    def __init__(self, activations):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 2)
        self.activations = set(activations)   # iterated in the process's string-hash order
        self.scales = {"hidden": 1.0}
    def forward(self, x):
        x = self.a(x)
        for name in sorted(self.activations):
            x = getattr(F, name)(x)
        return self.b(x * self.scales["hidden"])
torch.manual_seed(0)
model = Net(sys.argv[2].split(","))
""" + _TRAINED_BESIDE_EAGER


@pytest.mark.slow   # three new interpreters
def test_a_set_of_names_the_model_reads_loads_under_another_hash_seed_and_another_set_misses(tmp_path):
    """Sets (and dicts) of Python values a module holds were no part of the fingerprint (a set was the text
    "set"): a run whose model read another set loaded the first run's program and trained with the first set.
    They are keyed now, a set's items sorted, as a set of strings iterates in each process's own hash order."""
    outcomes = []
    for seed, activations in (("1", "gelu,relu,silu,tanh,sigmoid"), ("2", "gelu,relu,silu,tanh,sigmoid"),
                              ("3", "gelu,relu")):
        environment = dict(os.environ, PYTHONHASHSEED=seed,
                           PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                       os.environ.get("PYTHONPATH", "")]))
        done = subprocess.run([sys.executable, "-c", _SCRIPT_WITH_A_SET_OF_NAMES, str(tmp_path), activations],
                              env=environment, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        outcomes.append(done.stdout.strip().splitlines()[-1])
    assert outcomes[0].startswith("miss (no entry), then stored"), outcomes
    assert outcomes[1] == "loaded", outcomes
    assert outcomes[2].startswith("miss (changed since the entry for this program: ") and "python values" in outcomes[2]


_SCRIPT_WITH_ITS_OWN_NET = """
import copy, sys, torch, torch.nn.functional as F, zerocc
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 2)
    def forward(self, x):
        return self.b(F.ACTIVATION(self.a(x)))
torch.manual_seed(0)
model = Net()
""" + _TRAINED_BESIDE_EAGER


@pytest.mark.slow   # four new interpreters
def test_two_scripts_each_with_its_own_net_do_not_load_each_others_program(tmp_path):
    """Two scripts sharing a cache folder, each defining its own ``Net`` (one gelu, one relu): both were
    ``__main__.Net`` in the fingerprint and the entry's source check read only the first script's file, so the
    second loaded the first's program and trained with gelu. From standard input (a notebook alike) no file was
    checked at all: an edited forward loaded the program traced before the edit."""
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")]))

    def run(activation, folder, from_file):
        source = _SCRIPT_WITH_ITS_OWN_NET.replace("ACTIVATION", activation)
        script = tmp_path / f"train_{activation}.py"
        script.write_text(source)
        done = subprocess.run([sys.executable, str(script) if from_file else "-", str(tmp_path / folder)],
                              input=None if from_file else source, env=environment, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()[-1]

    for from_file, folder in ((True, "scripts"), (False, "stdin")):
        first, second = run("gelu", folder, from_file), run("relu", folder, from_file)
        assert first.startswith("miss (no entry), then stored"), first
        assert second.startswith("miss (changed since the entry for this program: code), then stored"), second


_SCRIPT_WITH_ITS_OWN_ACTIVATION = """
import copy, sys, torch, torch.nn.functional as F, zerocc
from shared_net import Net
def act(x):
    return F.ACTIVATION(x)
torch.manual_seed(0)
model = Net(act)
""" + _SCRIPT_WITH_ITS_OWN_NET.split("model = Net()")[1]


@pytest.mark.slow   # two new interpreters
def test_two_scripts_handing_their_own_function_to_one_model_class_do_not_load_each_others_program(tmp_path):
    """The model's class in a shared module, each script's own ``act`` function an attribute of it: both were
    ``__main__.act`` in the fingerprint, and the second script loaded the first's program."""
    (tmp_path / "shared_net.py").write_text(
        "import torch\n\n\nclass Net(torch.nn.Module):\n    def __init__(self, act):\n        super().__init__()\n"
        "        self.a, self.b, self.act = torch.nn.Linear(6, 8), torch.nn.Linear(8, 2), act\n\n"
        "    def forward(self, x):\n        return self.b(self.act(self.a(x)))\n")
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    outcomes = []
    for activation in ("gelu", "relu"):
        script = tmp_path / f"train_{activation}.py"
        script.write_text(_SCRIPT_WITH_ITS_OWN_ACTIVATION.replace("ACTIVATION", activation))
        done = subprocess.run([sys.executable, str(script), str(tmp_path / "cache")], env=environment,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        outcomes.append(done.stdout.strip().splitlines()[-1])
    assert outcomes[0].startswith("miss (no entry), then stored"), outcomes
    assert outcomes[1].startswith("miss (changed since the entry for this program: model modules"), outcomes


def test_every_program_of_a_step_is_stored_and_a_new_step_loads_each(tmp_path):
    """A second batch shape compiles a second program over the first one's buckets: both are stored, and a
    new step loads both, in the same order."""
    full, half = batches("gpt", 1, 8)[0], batches("gpt", 1, 4, seed=2)[0]
    expected = _eager_losses("gpt", 0, 2, [full, half])
    outcomes = []
    for _ in range(2):
        step = _compiled(tmp_path)
        with warnings.catch_warnings():
            warnings.simplefilter("error", CompileCacheWarning)   # a new shape is a new program, not a change
            losses = [step(*full)]
            outcomes.append(step.report()["compile_cache"])
            losses.append(step(*half))
        outcomes.append(step.report()["compile_cache"])
        assert all(torch.equal(a, b) for a, b in zip(losses, expected)), (losses, expected)
    assert [o.split(",")[0] for o in outcomes] == ["miss (no entry)", "miss (no entry)", "loaded", "loaded"], outcomes


class _Noising(torch.nn.Module):
    """A denoiser whose forward draws its noise and timesteps from a generator it holds."""

    def __init__(self, seed):
        super().__init__()
        self.net = torch.nn.Linear(9, 8)
        self.generator = torch.Generator().manual_seed(seed)

    def forward(self, x):
        noise = torch.randn(x.shape, generator=self.generator)
        t = torch.randint(0, 10, (x.shape[0], 1), generator=self.generator).float()
        return ((self.net(torch.cat([x + noise, t / 10], 1)) - noise) ** 2).mean()


_GLOBAL_GENERATOR = torch.Generator().manual_seed(1)


class _NoisingFromAGlobal(_Noising):
    def forward(self, x):
        return ((self.net(torch.cat([x, x[:, :1]], 1)) - torch.randn(x.shape, generator=_GLOBAL_GENERATOR)) ** 2).mean()


def test_a_loaded_program_draws_from_the_models_own_generator(tmp_path):
    """A program that draws from a torch.Generator the model holds was stored with a copy of that generator: a
    later process loading it drew from the copy (in the state it had when stored), and the model's own generator,
    seeded otherwise, never moved. The entry names the generator, as it names the modules; a generator held
    elsewhere (a global) is not stored."""
    data = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for seed in (1, 2):   # the second model's generator is seeded otherwise: only the entry can be the same
        torch.manual_seed(0)
        model = _Noising(seed)
        reference = copy.deepcopy(model)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=3, cache_dir=tmp_path)
        for batch in data:
            assert torch.equal(step(batch), eager_step(reference, reference_optimizer, None, (batch,)))
        assert torch.equal(model.generator.get_state(), reference.generator.get_state())
    assert step.report()["compile_cache"] == "loaded"
    model = _NoisingFromAGlobal(1)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters()), cache_dir=tmp_path / "global")
    step(data[0])
    assert step.report()["compile_cache"] == ("miss (no entry), then not stored: the step draws from a torch.Generator "
                                              "that is no attribute of the model's modules")


def test_a_hugging_face_config_switch_misses(tmp_path):
    """The attention implementation lives in the model's config (a private attribute), not in its modules'
    structure or its source: the fingerprint reads config objects whole."""
    pytest.importorskip("transformers")
    outcomes = []
    for implementation in ("eager", "sdpa"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CompileCacheWarning)
            outcomes.append(_zoo_model_through_the_cache("llama", tmp_path, steps=1,
                                                         _attn_implementation=implementation))
    # the config's value is also one of the Python values forward reads (program_cache.values_read)
    assert outcomes[1].startswith("miss (changed since the entry for this program: model modules, python values)"), \
        outcomes


def _train_with_a_cache_on_rank_0_only(rank, world_size, folder):
    return _train(rank, world_size, folder if rank == 0 else None)


@pytest.mark.multirank
def test_a_cache_on_some_ranks_only_compiles_everywhere_without_hanging(tmp_path, monkeypatch):
    """$ZEROCC_CACHE_DIR set on one node and not another: the ranks without a cache still take part in the
    all-reduce that decides whether to load, so nobody waits for them; every rank compiles."""
    monkeypatch.delenv("ZEROCC_CACHE_DIR", raising=False)
    folder = str(tmp_path / "cache")
    distributed.run(_train, 2, folder)   # both ranks' entries exist: rank 0 alone would load
    runs = distributed.run(_train_with_a_cache_on_rank_0_only, 2, folder, timeout=300)
    assert runs[0][1].startswith("miss (another rank has no entry), then stored"), runs[0][1]
    assert runs[1][1] == "off"


def test_a_stored_program_larger_than_what_the_device_offers_now_misses(tmp_path, monkeypatch):
    """CUDA's free memory changes between runs and is not in the fingerprint: a stored program whose peak the
    device no longer fits is compiled again, against the device (faked here: CPU offers no budget)."""
    from zerocc import api
    from zerocc.device_budget import DeviceBudget
    data = batches("gpt", 2, 8)
    first = _compiled(tmp_path)
    first(*data[0])
    peak = first.report()["planned_peak_bytes"]
    monkeypatch.setattr(api, "device_budget", lambda device, held=(): DeviceBudget(peak * 10, "a roomy device"))
    roomy = _compiled(tmp_path)
    roomy(*data[0])
    assert roomy.report()["compile_cache"] == "loaded"
    small = int(peak * 0.95)
    monkeypatch.setattr(api, "device_budget", lambda device, held=(): DeviceBudget(small, "a smaller device"))
    step = _compiled(tmp_path)
    assert torch.equal(step(*data[0]), _eager_losses("gpt", 0, 1, data)[0])
    assert step.report()["compile_cache"].startswith(
        "miss (its peak does not fit what the device offers now (a smaller device)), then stored")
    assert step.report()["planned_peak_bytes"] <= small and step.remat_plan.budget_source == "a smaller device"


def _entry_files(folder, suffix):
    return sorted(os.path.join(root, f) for root, _, files in os.walk(folder) for f in files if f.endswith(suffix)
                  and not f.startswith("."))


def test_a_file_that_is_not_the_one_its_entry_was_written_with_is_never_loaded(tmp_path):
    """An entry's index records its files' digests: a program file replaced by another entry's (copied over, or
    rewritten by another process between this one's reads of the index and of the file) was loaded, and the
    step ran the other batch shape's program (a RuntimeError inside the step, or wrong training)."""
    full, half = batches("gpt", 1, 8)[0], batches("gpt", 1, 4, seed=2)[0]
    _compiled(tmp_path)(*full)
    [full_entry] = [p for p in _entry_files(tmp_path, ".pkl") if "history" not in p]
    step = _compiled(tmp_path)
    step(*half)
    [half_entry] = [p for p in _entry_files(tmp_path, ".pkl") if "history" not in p and p != full_entry]
    shutil.copyfile(half_entry, full_entry)   # a complete, readable program: of the other entry
    step = _compiled(tmp_path)
    with pytest.warns(CompileCacheWarning, match="could not read .*not what the entry's index was written with"):
        loss = step(*full)
    assert torch.equal(loss, _eager_losses("gpt", 0, 1, [full])[0])
    assert step.report()["compile_cache"].startswith("miss (unreadable entry), then stored")


def test_a_dump_dir_over_an_entry_whose_graphs_are_unreadable_compiles_instead_of_raising(tmp_path):
    """A loaded program writes its graphs after each pass into dump_dir, read from the entry's history file: an
    empty one raised CompileCacheError out of the step's first call."""
    data = batches("gpt", 1, 8)
    _compiled(tmp_path / "cache")(*data[0])
    [history] = _entry_files(tmp_path, ".history.pkl")
    open(history, "wb").close()
    step = _compiled(tmp_path / "cache", dump_dir=str(tmp_path / "dumps"))
    with pytest.warns(CompileCacheWarning, match="could not read .*history.pkl"):
        loss = step(*data[0])
    assert torch.equal(loss, _eager_losses("gpt", 0, 1, data)[0])
    assert step.report()["compile_cache"].startswith("miss (unreadable entry), then stored")
    assert len(os.listdir(tmp_path / "dumps")) == len(step.passes) + 1   # and memory_plan.json


def test_an_index_of_another_format_is_no_entry(tmp_path):
    """An index another version wrote (its parts not a mapping) crashed the explanation of a miss."""
    data = batches("gpt", 1, 8)
    _compiled(tmp_path)(*data[0])
    [index] = _entry_files(tmp_path, ".json")
    with open(index, "w") as file:
        file.write('{"parts": ["format 3"], "sources": {}}')
    step = _compiled(tmp_path, bucket_bytes=1 << 12)   # a miss, explained against the entries there
    assert torch.equal(step(*data[0]), _eager_losses("gpt", 0, 1, data)[0])
    assert step.report()["compile_cache"].startswith("miss (no entry), then stored")


def test_a_miss_names_what_changed_since_the_nearest_entry(tmp_path):
    """With entries of the same model under other options, a miss was explained against whichever entry's file
    name sorted first: a changed model read as "model modules, options" where the options were the same."""
    data = batches("gpt", 1, 8)
    for bucket_bytes in (None, 1 << 12, 1 << 13, 1 << 14, 1 << 15, 1 << 16):
        _compiled(tmp_path, **({} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}))(*data[0])
    step = _compiled(tmp_path)
    step.model.note = "changed"   # a plain attribute of a module: part of the fingerprint
    with pytest.warns(CompileCacheWarning, match="changed since the entry for this program: model modules") as caught:
        step(*data[0])
    assert "options" not in str(caught[0].message), caught[0].message   # the default options' entry is there


def test_a_full_disk_leaves_no_part_of_an_entry_and_the_step_trains(tmp_path, monkeypatch):
    from zerocc import disk_cache
    written = disk_cache._write_atomically

    def disk_full_at_the_history(path, data):
        if path.endswith(".history.pkl"):
            raise OSError(errno.ENOSPC, "No space left on device")
        written(path, data)

    monkeypatch.setattr(disk_cache, "_write_atomically", disk_full_at_the_history)
    data = batches("gpt", 1, 8)
    step = _compiled(tmp_path)
    with pytest.warns(CompileCacheWarning, match="could not write .*No space left on device"):
        assert torch.equal(step(*data[0]), _eager_losses("gpt", 0, 1, data)[0])
    assert step.report()["compile_cache"].startswith("miss (no entry), then not stored: [Errno 28]")
    assert _entry_files(tmp_path, "") == []   # not the program file written before the history
    monkeypatch.setattr(disk_cache, "_write_atomically", written)
    _compiled(tmp_path)(*data[0])
    step = _compiled(tmp_path)
    step(*data[0])
    assert step.report()["compile_cache"] == "loaded"


def test_an_entry_copied_under_another_entrys_name_is_not_loaded(tmp_path):
    """An entry's files (index, program, graphs) copied under another fingerprint's name (another rank's folder, a
    warmed cache copied to another node) were loaded: rank 0's program ran on rank 1 of two, both ranks 'loaded',
    and trained 4.05 away from eager. The index's parts must be the fingerprint's."""
    data = batches("gpt", 2, 8)
    _compiled(tmp_path)(*data[0])
    [plain] = _entry_files(tmp_path, ".json")
    _compiled(tmp_path, clip_grad_norm=1e-3)(*data[0])
    [clipped] = [p for p in _entry_files(tmp_path, ".json") if p != plain]
    for suffix in (".json", ".pkl", ".history.pkl"):
        shutil.copyfile(clipped[:-len(".json")] + suffix, plain[:-len(".json")] + suffix)
    step = _compiled(tmp_path)
    with pytest.warns(CompileCacheWarning, match="the entry under this name was stored for another step: options"):
        losses = [step(*batch) for batch in data]
    assert all(torch.equal(a, b) for a, b in zip(losses, _eager_losses("gpt", 0, 2, data)))
    assert step.report()["compile_cache"].startswith("miss (the entry under this name was stored for another step")
