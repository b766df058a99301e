"""A warm compile cache's first call does no compiler work it can read instead (issue 21: the first step at most
1.2x a steady step): the optimizer settings' probe (``optimizer_step.live_modes``) is read from the ``.modes``
file stored beside an entry, and the loaded captured graph's Python is not written unless it is used; and it
trains bit for bit as the cold run and eager did. A folder without the file (an entry of an earlier zerocc), a
file that cannot be read, or one for other settings, is a probe, never an error.

One process, new models and optimizers per run: ``live_modes`` remembers modes per optimizer object, and a
loaded program shares nothing in memory with the compile that stored it.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.fx as fx

import zerocc
from tests.models import batches, build, eager_step
from tests.reference import two_groups
from zerocc import disk_cache, optimizer_step

STEPS = 3


@pytest.fixture
def counted(monkeypatch):
    """Counts of the settings' probes and of fx Python written, while the test runs."""
    counts = {"probes": 0, "python written": 0}
    probe, python_code = optimizer_step._probe, fx.Graph.python_code

    def counted_probe(*args):
        counts["probes"] += 1
        return probe(*args)

    def counted_python_code(self, *args, **kwargs):
        counts["python written"] += 1
        return python_code(self, *args, **kwargs)

    monkeypatch.setattr(optimizer_step, "_probe", counted_probe)
    monkeypatch.setattr(fx.Graph, "python_code", counted_python_code)
    return counts


def _run(folder, optimizer_of=lambda model: torch.optim.AdamW(model.parameters(), lr=1e-2), data=None):
    model, _, loss_fn = build("gpt", 0)
    optimizer = optimizer_of(model)
    step = zerocc.compile(model, optimizer, stage=3, loss_fn=loss_fn, cache_dir=folder)
    losses = [step(*batch) for batch in data or batches("gpt", STEPS, 8)]
    with step.full_model() as full:
        params = [p.detach().clone() for p in full.parameters()]
    return step, losses, params


def _eager(optimizer_of=lambda model: torch.optim.AdamW(model.parameters(), lr=1e-2)):
    model, _, loss_fn = build("gpt", 0)
    optimizer = optimizer_of(model)
    losses = [eager_step(model, optimizer, loss_fn, batch) for batch in batches("gpt", STEPS, 8)]
    return losses, [p.detach() for p in model.parameters()]


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _modes_files(folder):
    return sorted(os.path.join(root, f) for root, _, files in os.walk(folder) for f in files if f.endswith(".modes"))


def test_a_warm_first_call_probes_nothing_writes_no_python_and_trains_as_cold_and_eager(tmp_path, counted):
    """Before: a warm first call traced the settings' probe (two fake AdamW steps) and wrote and compiled the
    captured graph's Python, which a loaded compile never runs (together a third of its compiler CPU time)."""
    cold, cold_losses, cold_params = _run(tmp_path)
    assert cold.report()["compile_cache"].startswith("miss (no entry), then stored") and counted["probes"] > 0
    assert len(_modes_files(tmp_path)) == 1
    counted.update(probes=0, **{"python written": 0})
    warm, warm_losses, warm_params = _run(tmp_path)
    assert warm.report()["compile_cache"] == "loaded"
    assert counted == {"probes": 0, "python written": 0}
    eager_losses, eager_params = _eager()
    assert _equal(warm_losses, cold_losses) and _equal(warm_params, cold_params)
    assert _equal(warm_losses, eager_losses) and _equal(warm_params, eager_params)


def test_the_loaded_captured_graphs_python_is_written_when_read(tmp_path):
    """Deferred, not dropped: read, it is the cold compile's."""
    cold, *_ = _run(tmp_path, data=batches("gpt", 1, 8))
    warm, *_ = _run(tmp_path, data=batches("gpt", 1, 8))
    assert warm.report()["compile_cache"] == "loaded"
    code = warm.state.captured.gm.code
    assert "def forward" in code and code == cold.state.captured.gm.code


@pytest.mark.parametrize("damage", ["missing", "unreadable", "another format", "another number of groups"])
def test_an_entry_without_a_readable_modes_file_loads_probes_and_trains_as_eager(tmp_path, counted, damage):
    """What an earlier zerocc stored (an entry, no ``.modes`` file), a truncated or hand-edited file: the entry is
    loaded, the probe runs, and the step trains as eager (only a store writes the file)."""
    _run(tmp_path)
    [modes] = _modes_files(tmp_path)
    if damage == "missing":
        os.unlink(modes)
    else:
        with open(modes, "w") as file:
            file.write({"unreadable": '{"modes": [[["lr", nu', "another format": '{"modes": {"lr": "free"}}',
                        "another number of groups": '{"modes": [[], []]}'}[damage])
    counted["probes"] = 0
    warm, losses, params = _run(tmp_path)
    assert warm.report()["compile_cache"] == "loaded" and counted["probes"] > 0
    eager_losses, eager_params = _eager()
    assert _equal(losses, eager_losses) and _equal(params, eager_params)


def test_modes_stored_for_other_settings_are_not_read(tmp_path, counted):
    """The file is keyed on what the probe reads: another optimizer class, another group structure or a setting's
    sign is another file, probed and stored beside the first."""
    _run(tmp_path)
    for optimizer_of in (lambda model: torch.optim.Adam(model.parameters(), lr=1e-2),
                         two_groups,
                         lambda model: torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)):
        counted["probes"] = 0
        step, losses, params = _run(tmp_path, optimizer_of)
        assert counted["probes"] > 0, step.report()["compile_cache"]
        eager_losses, eager_params = _eager(optimizer_of)
        assert _equal(losses, eager_losses) and _equal(params, eager_params)
    assert len(_modes_files(tmp_path)) == 4
    counted["probes"] = 0
    _run(tmp_path, two_groups)   # each read back by its own optimizer
    assert counted["probes"] == 0


def test_the_modes_key_follows_the_optimizers_source(tmp_path, monkeypatch):
    """An edited ``step()`` (its class's file) may branch on another setting: another key."""
    model, _, _ = build("gpt", 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    key = disk_cache.settings_modes_key(optimizer)
    assert disk_cache.settings_modes_key(torch.optim.AdamW(model.parameters(), lr=5e-3)) == key   # a float's value
    monkeypatch.setattr(disk_cache, "_file_digest", lambda path: "edited" if path.endswith("adamw.py") else "same")
    assert disk_cache.settings_modes_key(optimizer) != key
