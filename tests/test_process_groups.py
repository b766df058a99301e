"""The process groups users hand zerocc.compile: subgroups, DeviceMesh dimensions, backend strings, destroyed groups.

Data parallelism over a subgroup (``group=dist.new_group([0, 1])`` of 4 ranks,
or one dimension of a 2-D ``DeviceMesh``) trains each replica as one process
trains its replica's global batch; ``docs/launch.md`` says what is supported.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerocc
from tests import distributed
from tests.models import batches, build, eager_step
from tests.reference import adamw

STEPS = 3
ROWS = 4   # per rank


def _replica_group(rank, kind):
    """This rank's data-parallel group and its replica's number: 2 replicas of 2 ranks each."""
    if kind == "new_group":   # replicas {0, 1} and {2, 3}; every rank makes both groups, in the same order
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        return groups[rank // 2], rank // 2
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "x"))   # the "dp" groups are {0, 2} and {1, 3}
    return mesh.get_group("dp"), rank % 2


def _train_replica(rank, world_size, kind, stage, timeout):
    group, replica = _replica_group(rank, kind)
    model, _, loss_fn = build("mlp", seed=rank)   # differs per rank: the step starts from its group's first rank's
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn, group=group, timeout=timeout)
    me = dist.get_rank(group)
    for batch in batches("mlp", STEPS, 2 * ROWS, seed=10 + replica):
        step(*(t[me * ROWS:(me + 1) * ROWS] for t in batch))
    return replica, dist.get_global_rank(group, 0), step.full_state_dict()


@pytest.mark.multirank
@pytest.mark.parametrize("kind,stage,timeout", [("new_group", 3, 60), ("mesh", 1, None)])
def test_data_parallel_over_a_subgroup_trains_each_replica_like_one_process(kind, stage, timeout):
    """Every rank failed in zerocc.compile: the initial broadcast named global rank 0 (``src=0``), not in the
    second replica's group, and with ``timeout=`` each replica's ranks made the timeout group with
    ``dist.new_group(members)``, a collective of every rank of the default group (each replica's differs)."""
    results = distributed.run(_train_replica, 4, kind, stage, timeout, timeout=120)
    for replica, first, state in results:
        model, _, loss_fn = build("mlp", seed=first)
        optimizer = adamw(model)
        for batch in batches("mlp", STEPS, 2 * ROWS, seed=10 + replica):
            eager_step(model, optimizer, loss_fn, batch)
        for name, value in model.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=f"replica {replica}: {name}")


def _backend_string(rank, world_size):
    group = dist.new_group(backend="cpu:gloo")   # the device-to-backend form init_process_group takes too
    model, _, loss_fn = build("mlp")
    step = zerocc.compile(model, adamw(model), stage=2, loss_fn=loss_fn, group=group, timeout=60)
    for batch in batches("mlp", STEPS, 2 * ROWS):
        step(*(t[rank * ROWS:(rank + 1) * ROWS] for t in batch))
    return step.full_state_dict()


@pytest.mark.multirank
def test_a_group_with_a_backend_string_trains_like_one_process():
    """``dist.init_process_group("cpu:gloo")``: zerocc's control all-reduces ran on CUDA ("Torch not compiled with
    CUDA enabled"), as anything but a backend named exactly "gloo" was taken for NCCL."""
    states = distributed.run(_backend_string, 2)
    model, _, loss_fn = build("mlp")
    optimizer = adamw(model)
    for batch in batches("mlp", STEPS, 2 * ROWS):
        eager_step(model, optimizer, loss_fn, batch)
    for state in states:
        for name, value in model.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _destroyed_before_close(rank, world_size):
    group = dist.new_group([0, 1])
    model, _, loss_fn = build("mlp")
    step = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn, group=group)
    batch = batches("mlp", 1, ROWS, seed=rank)[0]
    step(*batch)
    dist.destroy_process_group(group)
    errors = []
    again = lambda: zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn)   # noqa: E731 - a notebook cell
    for call in (step.close, lambda: step(*batch), again):
        try:
            call()
        except zerocc.ConfigError as error:
            errors.append(str(error))
    return errors


@pytest.mark.multirank
def test_a_step_whose_group_was_destroyed_says_so():
    """step.close() after dist.destroy_process_group() raised TypeError: Invariant encountered: value was None.
    Compiling the model again (a notebook that destroyed and re-created its group) said "step.close after ...",
    a call the user never made: compiling closes the step holding the model first, and now says so."""
    for errors in distributed.run(_destroyed_before_close, 2):
        assert [e.split(":")[0] for e in errors] == ["step.close after dist.destroy_process_group()",
                                                      "the training step after dist.destroy_process_group()",
                                                      "zerocc.compile"], errors
        assert "this model is held by a step compiled earlier (after 1 steps), which compiling it again first " \
               "closes, handing it back whole; that failed:\nstep.close after dist.destroy_process_group()" in errors[2]
        assert all("fix: call dist.destroy_process_group() last, after step.close()" in e for e in errors), errors


def _two_steps_over_two_groups(rank, world_size):
    groups = {"a": ([0, 1], dist.new_group([0, 1])), "b": ([1, 2], dist.new_group([1, 2]))}
    steps = {}
    for name, (members, group) in groups.items():   # rank 1 holds both steps, ranks 0 and 2 one each
        if rank in members:
            model, _, loss_fn = build("mlp")
            steps[name] = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn, group=group, timeout=60)
    for i in range(STEPS):
        for name, step in steps.items():
            me = dist.get_rank(groups[name][1])
            batch = batches("mlp", STEPS, 2 * ROWS, seed=ord(name))[i]
            step(*(t[me * ROWS:(me + 1) * ROWS] for t in batch))
    return {name: step.full_state_dict() for name, step in steps.items()}


@pytest.mark.multirank
def test_two_steps_over_two_subgroups_in_one_process_with_a_timeout():
    """Rank 1 (in both groups) and rank 2 named the second step's timeout group differently (torch hashes the
    number of groups a process holds into a locally made group's name): both waited for the other, and failed
    with "the other ranks did not reach zerocc.compile" after the timeout."""
    results = distributed.run(_two_steps_over_two_groups, 3, timeout=120)
    assert [sorted(r) for r in results] == [["a"], ["a", "b"], ["b"]]
    for name in "ab":
        model, _, loss_fn = build("mlp")
        optimizer = adamw(model)
        for batch in batches("mlp", STEPS, 2 * ROWS, seed=ord(name)):
            eager_step(model, optimizer, loss_fn, batch)
        for states in results:
            for key, value in model.state_dict().items():
                if name in states:
                    torch.testing.assert_close(states[name][key], value, rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")


def _groups_differ(rank, world_size, scenario):
    first = dist.new_group([0, 1])
    other = dist.new_group([0, 1])
    group = {"on rank 0 only": first if rank == 0 else None,     # rank 1 takes the default group (the same ranks)
             "another object per rank": first if rank == 0 else other,
             "other ranks": first if rank == 0 else None}[scenario]   # at 4 ranks: [0, 1] against [0, 1, 2, 3]
    model, _, loss_fn = build("mlp")
    try:
        zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn, group=group)
    except zerocc.ConfigError as error:
        return str(error)
    return "compiled"


@pytest.mark.multirank
@pytest.mark.parametrize("scenario,world_size", [("on rank 0 only", 2), ("another object per rank", 2),
                                                 ("other ranks", 4)])
def test_different_groups_on_different_ranks_are_refused_on_every_rank(scenario, world_size):
    """Each rank waited forever in zerocc.compile's first collective, over its own group, for ranks that passed
    another."""
    messages = distributed.run(_groups_differ, world_size, scenario, timeout=60)
    assert all(m.startswith("zerocc.compile") and "different process groups" in m or "refused it" in m
               for m in messages), messages
    assert sum("fix: pass the same group= on every rank" in m for m in messages) >= 2, messages


def test_world_size_set_without_a_rendezvous_says_how_to_launch(monkeypatch):
    """WORLD_SIZE=2 set by hand (no torchrun): torch's ValueError about MASTER_ADDR, not saying why zerocc.compile
    tried to make a process group at all."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    model, _, loss_fn = build("mlp")
    with pytest.raises(zerocc.ConfigError, match=r"WORLD_SIZE=2 is set, so it initialized the default process group "
                                                 r"from the environment \(env://\), which failed: .*MASTER_ADDR"
                                                 r"(.|\n)*fix: launch with torchrun"):
        zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn)
    assert not dist.is_initialized()


def test_a_restarted_job_whose_group_fails_on_torchruns_shared_store_says_how_to_launch(monkeypatch):
    """``torchrun --max-restarts``: the restarted ranks read the addresses the dead ones left in the c10d rendezvous's
    shared store, and gloo's 'connectFullMesh failed ... Connection refused' did not say why nor what to do (the real
    launch: test_launch.py's restart test, run with the fix)."""
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                        "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(name, value)

    def stale_address(backend):
        raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:152] timed out connecting: SO_ERROR: "
                           "Connection refused, remote=[127.0.0.1]:8102$1")
    monkeypatch.setattr(dist, "init_process_group", stale_address)
    model, _, loss_fn = build("mlp")
    with pytest.raises(zerocc.ConfigError, match=r"torchrun restarted this job \(TORCHELASTIC_RESTART_COUNT=1\) and "
                                                 r"creating the default process group failed: Gloo connectFullMesh"
                                                 r"(.|\n)*fix: start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")   # the first attempt: torch's error as it is
    with pytest.raises(RuntimeError, match="connectFullMesh") as raised:
        zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn)
    assert not isinstance(raised.value, zerocc.ConfigError)


def _not_a_member(rank, world_size):
    group = dist.new_group([0, 1])   # rank 2 gets GroupMember.NON_GROUP_MEMBER
    model, _, loss_fn = build("mlp")
    try:
        step = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn, group=group)
    except zerocc.ConfigError as error:
        return str(error)
    step(*batches("mlp", 1, ROWS, seed=rank)[0])
    return "trained"


@pytest.mark.multirank
def test_a_rank_outside_the_group_it_passes_is_refused_and_the_group_trains():
    """Rank 2 took the int NON_GROUP_MEMBER for a bad group, and waited over the default group for ranks 0 and 1 to
    join its refusal, forever (they trained over their own group)."""
    messages = distributed.run(_not_a_member, 3, timeout=60)
    assert messages[:2] == ["trained", "trained"], messages
    assert messages[2].startswith("group= is a group rank 2 is not in"), messages[2]


def _save_per_replica_then_resume_on_all(rank, world_size, folder):
    group, replica = _replica_group(rank, "new_group")
    model, _, loss_fn = build("mlp")
    step = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn, group=group)
    me = dist.get_rank(group)
    data = batches("mlp", STEPS, 2 * ROWS, seed=10 + replica)
    for batch in data[:-1]:
        step(*(t[me * ROWS:(me + 1) * ROWS] for t in batch))
    zerocc.save_checkpoint(step, f"{folder}/replica{replica}")   # each replica's ranks save their shards
    step.close()
    model, _, loss_fn = build("mlp", seed=5)
    step = zerocc.compile(model, adamw(model), stage=1, loss_fn=loss_fn)   # all 4 ranks go on from replica 1
    zerocc.load_checkpoint(step, f"{folder}/replica1")
    batch = batches("mlp", STEPS, 2 * ROWS, seed=11)[-1]
    step(*(t[rank * 2:(rank + 1) * 2] for t in batch))
    return step.full_state_dict()


@pytest.mark.multirank
def test_a_checkpoint_saved_over_a_subgroup_resumes_on_another_number_of_ranks(tmp_path):
    states = distributed.run(_save_per_replica_then_resume_on_all, 4, str(tmp_path), timeout=120)
    model, _, loss_fn = build("mlp")
    optimizer = adamw(model)
    for batch in batches("mlp", STEPS, 2 * ROWS, seed=11):
        eager_step(model, optimizer, loss_fn, batch)
    for state in states:
        for name, value in model.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
