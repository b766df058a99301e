"""Failures end cleanly: a dead rank is an error on the others within the timeout; diverged ranks fail at compile."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import zerocc
from tests import distributed
from tests.models import batches, build
from tests.reference import adamw

TIMEOUT = 10   # seconds; gloo reports a closed peer at once, a silent one after this


def _one_rank_dies(rank, world_size, stage, timeout=TIMEOUT):
    model, _, loss_fn = build("mlp")
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn, timeout=timeout)
    data = batches("mlp", 3, 4, seed=rank)
    step(*data[0])
    dist.barrier()
    if rank == world_size - 1:
        time.sleep(1)   # let the others leave the barrier (gloo relays through this rank)
        os._exit(3)     # dies between steps, as a crashed or killed worker does
    started = time.monotonic()
    try:
        step(*data[1])
        step(*data[2])
    except zerocc.RankFailureError as error:
        return "RankFailureError", str(error), time.monotonic() - started
    except Exception as error:   # noqa: BLE001 - the test reports what else came out
        return type(error).__name__, str(error), time.monotonic() - started
    return "no error", "", time.monotonic() - started


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,stage", [(2, 3), (4, 1)])
def test_a_dead_rank_stops_the_others_with_a_clear_error(world_size, stage):
    results, exit_codes = distributed.run_tolerant(_one_rank_dies, world_size, stage)
    assert exit_codes == [0] * (world_size - 1) + [3], exit_codes   # nobody hung
    for rank, result in enumerate(results[:-1]):
        kind, message, seconds = result
        assert kind == "RankFailureError", (rank, kind, message)
        assert f"rank {rank} of {world_size}: a collective of step 2 did not complete within {TIMEOUT} s" in message
        assert "another rank probably died" in message
        assert f"  where: rank {world_size - 1} was not in step 2 (rank {world_size - 1}'s last call: step 1)" in message
        assert seconds < TIMEOUT + 60, seconds   # includes compiling step 2's program on a loaded machine


@pytest.mark.multirank
def test_a_dead_rank_without_a_timeout_is_named_by_no_where_line():
    """Without timeout= no rank writes where it is: the error must not claim the dead rank was in no call ("rank 1's
    last call: none") when it trained step 1 (and may have died inside step 2)."""
    results, exit_codes = distributed.run_tolerant(_one_rank_dies, 2, 3, None)
    assert exit_codes == [0, 3], exit_codes   # gloo reports the closed peer at once
    kind, message, _ = results[0]
    assert kind == "RankFailureError", (kind, message)
    assert "rank 0 of 2: a collective of step 2 did not complete (" in message
    assert "another rank probably died" in message and "where:" not in message, message


def _ctrl_c_saves(rank, world_size, folder):
    """Ctrl-C under torchrun: the terminal's SIGINT ends the loop, torchrun forwards a second one to every worker,
    which lands in the save the loop makes in ``except KeyboardInterrupt:`` (here on rank 1, in DCP's file write)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    model, _, loss_fn = build("mlp")
    step = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn, timeout=TIMEOUT)
    step(*batches("mlp", 1, 4, seed=rank)[0])
    write = dcp.FileSystemWriter.write_data

    def interrupted_write(writer, plan, planner):
        os.kill(os.getpid(), signal.SIGINT)
        return write(writer, plan, planner)
    if rank == 1:
        dcp.FileSystemWriter.write_data = interrupted_write
    raised = "no interrupt"
    try:
        zerocc.save_checkpoint(step, os.path.join(folder, "ckpt"))
    except KeyboardInterrupt:
        raised = "KeyboardInterrupt after the save"
    finally:
        dcp.FileSystemWriter.write_data = write
    return raised, step.full_state_dict()


def test_a_held_ctrl_c_pressed_again_and_again_is_raised_at_once():
    """A save that hangs can still be stopped: the third Ctrl-C (a second press under torchrun) is not held."""
    from zerocc.runtime.release import HeldInterrupt
    held = HeldInterrupt(let_through=2)
    held.hold()
    try:
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # the user's handler is back
    finally:
        held.release(deliver=False)


@pytest.mark.multirank
def test_ctrl_c_during_a_save_is_raised_once_every_rank_saved(tmp_path):
    """The second SIGINT torchrun forwards interrupted the save on one rank: the others waited in its collectives
    until the timeout and no checkpoint was written. The save now ends on every rank, then the interrupt is raised."""
    (_, state), (raised, _) = distributed.run(_ctrl_c_saves, 2, str(tmp_path))
    assert raised == "KeyboardInterrupt after the save"
    model, _, loss_fn = build("mlp")
    step = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn)
    zerocc.load_checkpoint(step, str(tmp_path / "ckpt"))
    assert step.steps == 1
    loaded = step.full_state_dict()
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key


def _different_batch_shapes(rank, world_size):
    model, _, loss_fn = build("mlp")
    step = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn, timeout=TIMEOUT)
    batch = batches("mlp", 1, 6 if rank == 1 else 4)[0]
    try:
        step(*batch)
    except zerocc.RankMismatchError as error:
        return str(error)
    return "no error"


@pytest.mark.multirank
def test_different_shapes_on_one_rank_fail_at_compile_naming_the_rank():
    for message in distributed.run(_different_batch_shapes, 2):
        # found by the check every call makes (failures.check_calls_agree), before compiling
        assert "ranks [1] were called with a batch of other shapes than rank 0's in this call" in message
        assert "rank 1: input 0: float32[6, 12]" in message
        assert "rank 0: input 0: float32[4, 12]" in message


def _one_rank_evaluates_or_saves(rank, world_size, call, folder):
    """Rank 0 evaluates (or saves, or reads the full state) under `if rank == 0:` while rank 1 trains on: at stage 3
    each of those gathers, and its collectives would pair with the step's. No timeout: nothing may hang."""
    model, _, loss_fn = build("mlp")
    step = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn)
    data = batches("mlp", 2, 4, seed=rank)
    step(*data[0])
    try:
        if rank == 0:
            {"eval": lambda: step.eval_forward(data[1][0]), "save": lambda: zerocc.save_checkpoint(step, folder),
             "full": step.full_state_dict}[call]()
        step(*data[1])
    except zerocc.RankMismatchError as error:
        return str(error)
    return "no error"


@pytest.mark.multirank
@pytest.mark.parametrize("call,name", [("eval", "step.eval_forward"), ("save", "zerocc.save_checkpoint"),
                                       ("full", "step.full_state_dict")])
def test_a_collective_called_on_one_rank_only_fails_on_every_rank_naming_the_calls(call, name, tmp_path):
    for message in distributed.run(_one_rank_evaluates_or_saves, 2, call, str(tmp_path / "ckpt"), timeout=120):
        assert "the ranks met in different calls" in message
        assert f"  - rank 0: {name}\n  - rank 1: the training step\n" in message
        assert f"fix: {name} runs collectives here: call it on every rank at the same point" in message
        assert "not under `if rank == 0:`" in message


def _different_code(rank, world_size):
    model, _, loss_fn = build("mlp")
    if rank == 2:   # this rank's forward skips a layer: its parameters get no gradient, the plan changes
        layers = model.net
        model.forward = lambda x: layers[6](layers[5](layers[4](layers[1](layers[0](x)))))
    step = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn, timeout=TIMEOUT)
    try:
        step(*batches("mlp", 1, 4)[0])
    except zerocc.RankMismatchError as error:
        return str(error)
    return "no error"


@pytest.mark.multirank
def test_different_code_on_one_rank_fails_at_compile():
    for message in distributed.run(_different_code, 4):
        assert "ranks [2] compiled a different step than rank 0" in message
        assert "rank 2 differs from rank 0 first at\n      rank 2: bucket 0:" in message
        assert "the same model code, optimizer and compile options" in message and "ZEROCC_DUMP_DIR" in message


def test_timeout_must_be_positive():
    model, _, loss_fn = build("mlp")
    with pytest.raises(zerocc.ConfigError, match="timeout must be a positive number of seconds, got -1"):
        zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn, timeout=-1)


def test_agreement_ignores_what_differs_per_rank():
    """Stages 1-2 slice different offsets on each rank; the lines compared must not include them."""
    from zerocc.runtime.failures import agreement_lines
    lines = []
    for rank in range(2):
        model, _, loss_fn = build("mlp")
        step = zerocc.compile(model, adamw(model), stage=2, loss_fn=loss_fn)
        # plan for rank ``rank`` of 2 on fake ranks: compile with a ctx that says so
        step.ranks = type(step.ranks)(2, rank, None, "fake")
        compiled = step._compile(batches("mlp", 1, 4)[0])
        program, ctx = compiled.program, compiled.ctx
        lines.append(agreement_lines(program.gm, ctx.shard_plan))
    assert lines[0] == lines[1]
    assert any(line.startswith("collective") for line in lines[0])


def _one_rank_refuses_a_keyword(rank, world_size, folder):
    """Rank 1 alone is given a bad stage (a value read from a per-rank config), then every rank compiles correctly.
    No timeout: nothing may hang."""
    model, _, loss_fn = build("mlp")
    optimizer = adamw(model)
    try:
        zerocc.compile(model, optimizer, stage=4 if rank == 1 else 3, loss_fn=loss_fn)
        refused = "no error"
    except zerocc.ConfigError as error:
        refused = str(error)
    step = zerocc.compile(model, optimizer, stage=3, loss_fn=loss_fn)   # the refusal changed nothing
    losses = [step(*batch) for batch in batches("mlp", 2, 4, seed=rank)]
    return refused, losses, step.full_state_dict()


@pytest.mark.multirank
def test_a_keyword_one_rank_alone_refuses_is_refused_on_every_rank(tmp_path):
    """Rank 0 waited in zerocc.compile's broadcast of its parameters for rank 1, which had raised: until rank 1's
    process ended (then a bare gloo 'Connection closed by peer'), or 30 minutes where the script caught the error."""
    (refused_0, losses_0, state_0), (refused_1, losses_1, state_1) = distributed.run(
        _one_rank_refuses_a_keyword, 2, str(tmp_path), timeout=120)
    assert refused_1.startswith("stage=4 is not a ZeRO stage")
    assert refused_0 == ("zerocc.compile was refused on another rank, so no rank compiles (every rank must compile "
                         f"the same step):\n  rank 1: {refused_1}")
    assert all(torch.equal(state_0[name], state_1[name]) for name in state_0)   # then trained together


def _one_rank_fails_to_trace(rank, world_size):
    """Rank 1 alone builds its optimizer listing a parameter twice, refused while tracing its first call; then every
    rank compiles again with a correct optimizer. No timeout: nothing may hang."""
    model, _, loss_fn = build("mlp")
    params = list(model.parameters())
    step = zerocc.compile(model, torch.optim.AdamW(params + params[:1] if rank == 1 else params), stage=3,
                          loss_fn=loss_fn)
    data = batches("mlp", 2, 4, seed=rank)
    try:
        step(*data[0])
        refused = "no error"
    except (zerocc.ConfigError, zerocc.RankMismatchError) as error:
        refused = f"{type(error).__name__}: {error}"
    step = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn)
    losses = [step(*batch) for batch in data]
    return refused, losses, step.full_state_dict()


@pytest.mark.multirank
def test_a_trace_one_rank_alone_fails_is_an_error_on_every_rank():
    """Rank 1's capture raised; rank 0 went on into the passes and the agreement's all_gather_object, waiting
    there for rank 1 (which, catching its error, was by then in another call's collectives): a hang."""
    (refused_0, _, state_0), (refused_1, _, state_1) = distributed.run(_one_rank_fails_to_trace, 2, timeout=120)
    assert refused_1.startswith("ConfigError: the optimizer lists a tensor more than once")
    assert refused_0.startswith("RankMismatchError: rank 0 of 2: tracing the step on its batch failed on rank(s) "
                                f"[1], so no rank compiles this program:\n  rank 1: {refused_1}")
    assert all(torch.equal(state_0[name], state_1[name]) for name in state_0)   # then trained together


class _EvalFailsOnRankOne(torch.nn.Module):
    """Rank 1's forward cannot be traced in eval mode (a Python branch on a tensor's value); training traces."""

    def __init__(self):
        super().__init__()
        self.net, _, _ = build("mlp")

    def forward(self, x):
        out = self.net(x)
        if not self.training and torch.distributed.get_rank() == 1 and out.sum() > -1e9:
            out = out + 1
        return out


def _one_rank_fails_to_trace_eval(rank, world_size):
    """Rank 1's eval_forward trace raises; the ranks then train on together. No timeout: nothing may hang."""
    torch.manual_seed(0)
    model = _EvalFailsOnRankOne()
    _, _, loss_fn = build("mlp")
    step = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn)
    data = batches("mlp", 3, 4, seed=rank)
    step(*data[0])
    try:
        step.eval_forward(data[1][0])
        refused = "no error"
    except (zerocc.ZeroccError, zerocc.RankMismatchError) as error:
        refused = f"{type(error).__name__}: {error}"
    losses = [step(*batch) for batch in data[1:]]
    return refused, losses, step.full_state_dict()


@pytest.mark.multirank
def test_an_eval_trace_one_rank_alone_fails_is_an_error_on_every_rank():
    """Rank 1's eval_forward trace raised; rank 0 went on into the program's gathers and waited there for rank 1
    (gloo's 30 minutes, or until rank 1's process ended)."""
    (refused_0, _, state_0), (refused_1, _, state_1) = distributed.run(_one_rank_fails_to_trace_eval, 2, timeout=120)
    assert refused_1.startswith("CaptureError: tracing eval_forward failed at"), refused_1
    assert refused_0.startswith("RankMismatchError: rank 0 of 2: tracing eval_forward on its batch failed on "
                                f"rank(s) [1], so no rank compiles this program:\n  rank 1: {refused_1}"), refused_0
    assert all(torch.equal(state_0[name], state_1[name]) for name in state_0)   # then trained together


def _one_rank_never_compiles(rank, world_size):
    if rank == 1:
        time.sleep(TIMEOUT + 5)   # stuck elsewhere (its loader), alive past the timeout
        return "slept"
    model, _, loss_fn = build("mlp")
    started = time.monotonic()
    try:
        zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn, timeout=TIMEOUT)
    except zerocc.RankFailureError as error:
        return str(error), time.monotonic() - started
    return "no error", time.monotonic() - started


@pytest.mark.multirank
def test_a_rank_that_never_reaches_compile_is_a_rank_failure_within_the_timeout():
    """With timeout=, rank 0 waited in the timeout group's creation and raised a bare DistStoreError (torchrun's TCP
    store) or RuntimeError: Wait timeout (a file store)."""
    results, exit_codes = distributed.run_tolerant(_one_rank_never_compiles, 2)
    message, seconds = results[0]
    assert message.startswith(f"rank 0 of 2: the other ranks did not reach zerocc.compile within {TIMEOUT} s "), \
        message
    assert seconds < TIMEOUT + 20, seconds


def _one_rank_ends_its_loop_first(rank, world_size):
    """Rank 1's loader (a dataset sharded by hand) has one batch fewer: it goes on to the barrier after the loop."""
    model, _, loss_fn = build("mlp")
    step = zerocc.compile(model, adamw(model), stage=1, loss_fn=loss_fn, timeout=4)
    try:
        for x, y in batches("mlp", 2 if rank == 1 else 3, 4, seed=rank):
            step(x, y)
        dist.barrier()
    except zerocc.RankFailureError as error:
        return str(error)
    except RuntimeError:   # rank 1's barrier, once the others gave up
        return "barrier failed"
    return "no error"


@pytest.mark.multirank
def test_a_rank_whose_loop_ended_first_is_named_by_the_ranks_left_waiting():
    """Ranks 0 and 2 said only that "another rank probably died, hung, or is running a different step": gloo's
    timeout names no rank. The ranks that fail write so in the store; those that never do are named."""
    results, exit_codes = distributed.run_tolerant(_one_rank_ends_its_loop_first, 3, limit=150)
    assert exit_codes == [0, 0, 0], (exit_codes, results)   # nobody hung
    assert results[1] == "barrier failed"
    for rank in (0, 2):
        assert f"rank {rank} of 3: a collective of step 3 did not complete within 4 s" in results[rank]
        assert "  where: rank 1 was not in step 3 (rank 1's last call: step 2): in other code (a loop that ended " \
               "first" in results[rank], results[rank]
        assert "give every rank the same number of batches" in results[rank]
