"""Interactive use: notebook cells (code with no file on disk), cells run again, Ctrl-C in a checkpoint's load.

Every result is compared with eager training of a copy of the model.
"""
from __future__ import annotations

import copy
import linecache
import os
import signal
import sys
import types

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import zerocc
from tests.models import batches, build, eager_step

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

CELL = '''
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.bn, self.fc2 = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.fc2(self.bn(torch.relu(self.fc1(x)))), y)

class Branching(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:
            h = h * 2
        return h.sum()

class NormalizedSGD(torch.optim.Optimizer):
    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                n = p.grad.norm()
                p.sub_(group["lr"] * p.grad / n)
'''


def _run_cell(source: str, number: int = 1) -> dict:
    """``source`` run as terminal IPython runs a cell: compiled under ``<ipython-input-N-hash>`` with its lines in
    ``linecache`` only, in a module that has no ``__file__`` (IPython's user namespace, ``__main__``)."""
    filename = f"<ipython-input-{number}-0123456789ab>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    module = types.ModuleType(f"notebook_cell_{number}")   # classes' __module__: inspect.getfile finds no file
    sys.modules[module.__name__] = module
    exec(compile(source, filename, "exec"), module.__dict__)
    return module.__dict__


@pytest.fixture
def cell():
    names = set(sys.modules)
    yield _run_cell(CELL)
    for name in set(sys.modules) - names:
        if name.startswith("notebook_cell_"):
            del sys.modules[name]


def _data(steps: int):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=generator), torch.randint(0, 4, (8,), generator=generator)) for _ in range(steps)]


def _eager(model, optimizer, batch):
    optimizer.zero_grad()
    loss = model(*batch)
    loss.backward()
    optimizer.step()
    return loss.detach()


@pytest.mark.parametrize("stage", [0, 3])
def test_a_model_defined_in_a_notebook_cell_trains_as_eager_and_its_errors_name_the_cell_line(cell, stage, tmp_path):
    """A cell-defined optimizer that is not elementwise failed with ``OSError: source code not available`` (zerocc
    asked ``inspect`` for its class's file); a data-dependent branch in a cell-defined model was named at "(no user
    frame found)", where the same model in a file named its line."""
    model = cell["Net"]()
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=stage, cache_dir=str(tmp_path))
    for batch in _data(3):
        assert torch.equal(step(*batch), _eager(reference, reference_optimizer, batch))

    branching = cell["Branching"]()
    step = zerocc.compile(branching, torch.optim.SGD(branching.parameters(), lr=0.1), stage=stage)
    with pytest.raises(zerocc.CaptureError, match=r"at <ipython-input-1-0123456789ab>:\d+: if h.sum\(\) > 0:"):
        step(torch.randn(2, 4))

    linear = torch.nn.Linear(4, 4)
    step = zerocc.compile(linear, cell["NormalizedSGD"](linear.parameters()), stage=max(stage, 1),
                          loss_fn=torch.nn.functional.mse_loss)
    with pytest.raises(zerocc.UnsupportedOptimizerError, match=r"first at <ipython-input-1-0123456789ab>:\d+: "
                                                               r"n = p.grad.norm\(\)"):
        step(torch.randn(4, 4), torch.randn(4, 4))


def test_a_step_shows_where_it_stands_and_a_closed_one_says_it_was_closed():
    """A notebook showed ``<zerocc.api.CompiledStep object at 0x...>``; ``report()`` of a step closed by compiling
    its model again said "has not been compiled yet: call it once with a batch first", which it had been."""
    model, _, loss_fn = build("mlp")
    reference, _, _ = build("mlp")
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches("mlp", 3, 8)
    first = zerocc.compile(model, optimizer, stage=3, loss_fn=loss_fn)
    assert repr(first) == "<zerocc step: MLP with AdamW, stage 3, rank 0 of 1; not compiled yet (compiles at its first call)>"
    assert torch.equal(first(*data[0]), eager_step(reference, reference_optimizer, loss_fn, data[0]))
    assert repr(first).endswith("; 1 steps, 1 program>")
    second = zerocc.compile(model, optimizer, stage=3, loss_fn=loss_fn)   # the compile cell run again
    assert repr(first).endswith("; closed>")
    for inspect in (first.report, first.explain, lambda: first.memory_plan, first.graph):
        with pytest.raises(zerocc.ConfigError, match="this compiled step was closed"):
            inspect()
    for batch in data[1:]:
        assert torch.equal(second(*batch), eager_step(reference, reference_optimizer, loss_fn, batch))
    assert repr(second).endswith("; 3 steps, 1 program>")


class _InterruptedRead:
    """``DefaultLoadPlanner.commit_tensor`` (a tensor read from the checkpoint into the step) that, after the
    ``after``-th tensor, sends this process SIGINT ``interrupts`` times (Ctrl-C) or raises ``error``."""

    def __init__(self, monkeypatch, after: int, interrupts: int = 0, error: BaseException | None = None):
        self.count = 0
        original = DefaultLoadPlanner.commit_tensor

        def commit_tensor(planner, read_item, tensor):
            original(planner, read_item, tensor)
            self.count += 1
            if self.count == after:
                if error is not None:
                    raise error
                for _ in range(interrupts):
                    os.kill(os.getpid(), signal.SIGINT)
        monkeypatch.setattr(DefaultLoadPlanner, "commit_tensor", commit_tensor)


def _trained_and_saved(stage: int, folder: str):
    """A step and an eager reference trained 2 steps, the step saved after the first; the reference as it was then."""
    model, _, loss_fn = build("mlp")
    reference, _, _ = build("mlp")
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=stage, loss_fn=loss_fn)
    data = batches("mlp", 4, 8)
    assert torch.equal(step(*data[0]), eager_step(reference, reference_optimizer, loss_fn, data[0]))
    zerocc.save_checkpoint(step, os.path.join(folder, "ckpt"))
    saved = copy.deepcopy((reference, reference_optimizer))
    assert torch.equal(step(*data[1]), eager_step(reference, reference_optimizer, loss_fn, data[1]))
    return step, saved, loss_fn, data


def _trains_on_from(step, saved, loss_fn, data) -> None:
    reference, reference_optimizer = saved
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key
    for batch in data[2:]:
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, loss_fn, batch))


@pytest.mark.parametrize("stage", [0, 3])
def test_ctrl_c_in_load_checkpoint_is_raised_once_the_checkpoint_is_loaded(stage, tmp_path, monkeypatch):
    """The load reads the checkpoint into the step's own tensors: Ctrl-C in the read (a notebook's interrupt)
    raised at once and left the step holding some of the checkpoint's tensors and its own trained values for the
    rest; the next call trained on the mix, silently."""
    step, saved, loss_fn, data = _trained_and_saved(stage, str(tmp_path))
    read = _InterruptedRead(monkeypatch, after=1, interrupts=1)
    with pytest.raises(KeyboardInterrupt):
        zerocc.load_checkpoint(step, tmp_path / "ckpt")
    assert read.count > 1   # the load went on after the interrupt
    monkeypatch.undo()
    _trains_on_from(step, saved, loss_fn, data)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_load_that_fails_after_it_began_to_write_refuses_every_call_until_a_load_ends(stage, tmp_path, monkeypatch):
    """A load failing part way (an unreadable shard file; Ctrl-C pressed three times) left a step that trained,
    saved and evaluated on part of the checkpoint and part of its own state."""
    step, saved, loss_fn, data = _trained_and_saved(stage, str(tmp_path))
    _InterruptedRead(monkeypatch, after=1, interrupts=3)   # the third is raised at once
    with pytest.raises(KeyboardInterrupt):
        zerocc.load_checkpoint(step, tmp_path / "ckpt")
    monkeypatch.undo()
    _InterruptedRead(monkeypatch, after=2, error=RuntimeError("Input/output error"))
    with pytest.raises(zerocc.CheckpointError, match="Input/output error"):
        zerocc.load_checkpoint(step, tmp_path / "ckpt")
    monkeypatch.undo()
    half = r"an earlier zerocc.load_checkpoint\(step, .*ckpt'\) failed after it began to write"
    for call in (lambda: step(*data[2]), step.full_state_dict, lambda: step.eval_forward(data[2][0]),
                 lambda: zerocc.save_checkpoint(step, tmp_path / "other"),
                 step.close,   # it handed the mix back to the model and optimizer
                 lambda: zerocc.compile(step.model, step.optimizer, stage=stage, loss_fn=loss_fn)):   # closes it
        with pytest.raises(zerocc.ConfigError, match=half):
            call()
    assert "failed: calls refused" in repr(step)
    zerocc.load_checkpoint(step, tmp_path / "ckpt")
    _trains_on_from(step, saved, loss_fn, data)


def test_a_deleted_step_keeps_the_model_until_closed_and_compiling_again_hands_it_back():
    """``del step`` in a notebook left a stage-3 model of empty placeholders whose forward said to use
    ``step.full_model()``, with no step left to call it on. The message names the way back; compiling again over
    the model and optimizer closes the deleted step, the model holds plain whole parameters, trained as eager's, and
    the deleted step is freed."""
    import gc
    import weakref
    model, _, loss_fn = build("mlp")
    reference, _, _ = build("mlp")
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = zerocc.compile(model, optimizer, stage=3, loss_fn=loss_fn)
    data = batches("mlp", 3, 8)
    for batch in data[:2]:
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, loss_fn, batch))
    deleted = weakref.ref(step)
    del step
    gc.collect()
    with pytest.raises(zerocc.ConfigError, match=r"`del step` does not.*zerocc.compile\(model, optimizer\).close\(\)"):
        model(data[2][0])
    zerocc.compile(model, optimizer, stage=3, loss_fn=loss_fn).close()
    gc.collect()
    assert deleted() is None
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    for (key, value), expected in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(value, expected), key
    assert torch.equal(eager_step(model, optimizer, loss_fn, data[2]),
                       eager_step(reference, reference_optimizer, loss_fn, data[2]))


def _interrupted_at_every_line(enter, function) -> int:
    """Run ``enter()`` (a ``with`` over the context manager ``function``) once per line of ``function`` before its
    ``yield`` (where it wraps what it undoes on exit), raising ``KeyboardInterrupt`` there as Ctrl-C would; returns
    how many runs were interrupted. (Ctrl-C in the undoing itself, after the ``yield``, is out of any Python code's
    reach.)"""
    import inspect
    function = inspect.unwrap(function)
    code = function.__code__
    source, first = inspect.getsourcelines(function)
    end = first + next(i for i, text in enumerate(source) if text.strip() == "yield")
    lines = sorted({line for _, _, line in code.co_lines() if line is not None and line < end})
    interrupted = 0
    for target in lines:
        def local(frame, event, arg, target=target):
            if event == "line" and frame.f_lineno == target:
                raise KeyboardInterrupt
            return local

        def tracer(frame, event, arg):
            return local if frame.f_code is code else None
        sys.settrace(tracer)
        try:
            enter()
        except KeyboardInterrupt:
            interrupted += 1
        finally:
            sys.settrace(None)
    return interrupted


def test_ctrl_c_while_capture_wraps_torch_and_random_functions_leaves_none_wrapped():
    """Capture wraps ``torch.get_rng_state``, ``torch.manual_seed``, checkpointing's functions and Python's own
    ``random`` draws for the trace: Ctrl-C between two of the wraps (before the ``try`` that undoes them) left them
    wrapped for the rest of the notebook's session."""
    import random

    import torch.utils.checkpoint as checkpointing

    from zerocc.host_random import HostDraws
    from zerocc.model_recomputation import traced_recomputation
    from zerocc.tracing import make_fake_mode

    def torch_functions():
        return ([getattr(module, name) for module in (torch, torch.random, torch.cuda)
                 for name in ("get_rng_state", "set_rng_state", "manual_seed", "seed") if hasattr(module, name)]
                + [checkpointing.CheckpointFunction.__dict__.get("apply"), checkpointing._is_compiling,
                   dict(checkpointing._allowed_determinism_checks_to_fns)])
    before = torch_functions()

    def recomputation():
        with traced_recomputation(make_fake_mode()):
            pass
    assert _interrupted_at_every_line(recomputation, traced_recomputation) > 10
    assert torch_functions() == before

    python_random = {name: getattr(random, name) for name in dir(random)}

    def host_draws():
        with HostDraws(torch.nn.Linear(2, 2), None).recording():
            pass
    assert _interrupted_at_every_line(host_draws, HostDraws.recording) > 5
    assert {name: getattr(random, name) for name in dir(random)} == python_random

