"""The pass manager: listing, reading, disabling and adding passes; verification; dumps; explain()."""
from __future__ import annotations

import hashlib
import os
import re
import sys

import pytest
import torch
import torch.nn.functional as F

import zerocc
from zerocc import graph as g
from tests import distributed
from tests.models import MLP, batches, build
from zerocc.pipeline import build_pipeline

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from custom_pass import keep_last_bucket_gathered  # noqa: E402


@pytest.fixture(autouse=True)
def no_registered_passes():
    yield
    zerocc.registry.clear()


def compiled_mlp(**settings):
    model = MLP()
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=3, loss_fn=F.mse_loss, **settings)
    step(*batches("mlp", 1, 4)[0])
    return step


def planned_gpt(world_size=4, **settings):
    model, _, _ = build("gpt")
    batch = batches("gpt", 1, 2)[0]
    return zerocc.plan(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=3, world_size=world_size,
                       example_inputs=batch, bucket_bytes=16 * 1024, **settings)


def test_passes_are_listed_and_every_graph_is_readable_python():
    step = compiled_mlp()
    assert step.passes == ["capture", "shard", "place_remat", "insert_collectives", "schedule", "overlap_updates",
                           "scatter_by_all_to_all", "gather_by_send_recv",
                           "gradients_into_buckets", "release_slots", "plan_memory", "place_buffers"]   # pools: default
    shard = str(step.graph("shard"))
    assert shard.startswith("# after pass 01 'shard': ")
    assert "reduce_gradient" in shard.splitlines()[0]
    assert "def forward(self" in shard
    assert "# after pass 00 'capture': the whole step, traced" in str(step.graph("capture"))


@pytest.mark.parametrize("stage", [0, 3])
def test_the_program_holds_only_the_constants_it_reads(stage, monkeypatch):
    """``shard`` re-traces the optimizer that capture spliced in; the replaced trace's constants must go with it."""
    monkeypatch.setenv("ZEROCC_TRACE_FIRST_STEP", "1")   # the first step's own program: Adam's state constants
    model = MLP()
    step = zerocc.compile(model, torch.optim.Adam(model.parameters(), lr=1e-2), stage=stage, loss_fn=F.mse_loss)
    step(*batches("mlp", 1, 4)[0])
    for program in [entry.program for entry in step.cache.programs()]:
        read = {node.target for node in program.gm.graph.nodes if node.op == "get_attr"}
        held = {name for name, _ in program.gm.named_buffers()}
        assert read and held == read


def test_disable_refuses_unknown_and_essential_passes_with_the_reason():
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(zerocc.ConfigError, match=r"cannot disable 'scheduel': no such pass; the passes are: shard, place_remat, insert_collectives, schedule, overlap_updates, scatter_by_all_to_all, gather_by_send_recv, gradients_into_buckets, release_slots, plan_memory"):
        zerocc.compile(model, optimizer, disable=["scheduel"])
    with pytest.raises(zerocc.ConfigError, match=r"(?s)'shard' cannot be disabled: the runtime lays out its tensors by "
                       r"the shard plan.*'shard' is required by 'insert_collectives'"):
        zerocc.compile(model, optimizer, disable=["shard"])


def test_a_registered_pass_sees_the_plans_and_can_be_disabled():
    seen = []

    def count_buckets(gm, ctx):
        seen.append(len(ctx.shard_plan.buckets))
        ctx.notes["count_buckets"] = f"{len(ctx.shard_plan.buckets)} buckets seen"
        return gm

    zerocc.register_pass(count_buckets, after="shard")
    step = compiled_mlp()
    assert step.passes == ["capture", "shard", "count_buckets", "place_remat", "insert_collectives", "schedule",
                           "overlap_updates", "scatter_by_all_to_all", "gather_by_send_recv",
                           "gradients_into_buckets", "release_slots", "plan_memory", "place_buffers"]
    assert seen == [1]
    assert "# 1 buckets seen" in str(step.graph("count_buckets"))
    assert compiled_mlp(disable=["count_buckets"]).passes == ["capture", "shard", "place_remat",
                                                               "insert_collectives", "schedule", "overlap_updates",
                                                               "scatter_by_all_to_all", "gather_by_send_recv",
                                                               "gradients_into_buckets", "release_slots",
                                                               "plan_memory", "place_buffers"]
    assert seen == [1]


def test_register_pass_names_the_valid_anchors():
    with pytest.raises(zerocc.ConfigError, match=r"no pass named 'insert_collective'; the passes are: shard, mixed_precision, clip_gradients, place_remat, insert_collectives, schedule, overlap_updates, scatter_by_all_to_all, gather_by_send_recv, gradients_into_buckets, release_slots, plan_memory"):
        zerocc.register_pass(lambda gm, ctx: gm, after="insert_collective")
    with pytest.raises(zerocc.ConfigError, match="exactly one of after=... or before=..."):
        zerocc.register_pass(lambda gm, ctx: gm)


def test_the_old_name_of_place_remat_says_the_new_one():
    # recomputation was "checkpoints" until "checkpoint" came to mean saved state only
    with pytest.raises(zerocc.ConfigError, match=r"cannot disable 'place_checkpoints': the pass was renamed "
                                                 r"'place_remat'; write disable=\('place_remat', 'schedule'\)"):
        build_pipeline(3, ("place_checkpoints", "schedule"), user_passes=())
    with pytest.raises(zerocc.ConfigError, match=r"register_pass\('mine'\): the pass 'place_checkpoints' was "
                                                 r"renamed 'place_remat'; name it 'place_remat'"):
        zerocc.register_pass(lambda gm, ctx: gm, after="place_checkpoints", name="mine")
    with pytest.raises(zerocc.ConfigError, match=r"the pass 'place_checkpoints' was renamed 'place_remat'"):
        zerocc.register_pass(lambda gm, ctx: gm, after="shard", requires=("place_checkpoints",))
    model = MLP()
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=F.mse_loss)
    with pytest.raises(AttributeError, match=r"checkpoint_plan was renamed remat_plan .*read step.remat_plan"):
        _ = step.checkpoint_plan


def test_a_snapshot_keeps_the_program_as_its_pass_left_it():
    """Snapshots record nodes and build their graph only when read: a later pass's in-place rewrite (new
    arguments, meta written, a node erased, a node renamed) must not reach an earlier snapshot."""
    seen = {}

    def vandal(gm, ctx):
        adds = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.add.Tensor
                and n.meta["val"].dim() > 0]   # not the step count: doubling it from 0 would divide by 0
        seen["node"] = adds[0].name
        adds[0].meta["vandal"] = True
        adds[0].args = (adds[0].args[0], adds[0].args[0])
        adds[0]._rename("renamed_by_vandal")
        for node in reversed(gm.graph.nodes):   # the last dead call
            if node.op == "call_function" and not node.users and node.target is torch.ops.aten.detach.default:
                gm.graph.erase_node(node)
                break
        gm.recompile()
        return gm

    zerocc.register_pass(vandal, after="shard")
    step = compiled_mlp()
    before, after = step.graph("shard"), step.graph("vandal")
    node = {n.name: n for n in before.graph.nodes}[seen["node"]]
    assert "vandal" not in node.meta and node.args[0] is not node.args[1]
    assert "renamed_by_vandal" not in before.code and "renamed_by_vandal" in after.code
    assert before.code == step.graph("shard").code   # read twice: the same


@pytest.mark.parametrize("fails", [False, True])
def test_compiling_leaves_the_collectors_thresholds_as_they_were(fails):
    """The cycle collector runs rarely while compiling (zerocc/driver.py fewer_collections); the user's
    thresholds come back after the compile, and after a compile that fails."""
    import gc
    saved = gc.get_threshold()
    gc.set_threshold(1234, 5, 6)
    try:
        if fails:
            zerocc.register_pass(lambda gm, ctx: None, after="shard", name="forgetful")
            with pytest.raises(zerocc.PassError):
                compiled_mlp()
        else:
            compiled_mlp()
        assert gc.get_threshold() == (1234, 5, 6)
    finally:
        gc.set_threshold(*saved)


def test_a_failing_pass_is_named_with_the_passes_before_it():
    def broken(gm, ctx):
        raise ValueError("nope")

    zerocc.register_pass(broken, before="insert_collectives")
    with pytest.raises(zerocc.PassError, match=r"pass 'broken' failed \(passes run before it: capture, shard, place_remat\): ValueError: nope"):
        compiled_mlp()


def test_a_pass_must_return_the_graph_module():
    zerocc.register_pass(lambda gm, ctx: None, after="shard", name="forgetful")
    with pytest.raises(zerocc.PassError, match=r"pass 'forgetful' failed .*returned NoneType, not the torch.fx.GraphModule"):
        compiled_mlp()


def test_a_pass_run_while_place_remat_measures_must_return_the_graph_module_too():
    """place_remat runs the passes after it on a candidate (``LaterPasses``): a registered one returning None there
    was named as the next pass's AttributeError on None, not as the pass that returned it."""
    zerocc.register_pass(lambda gm, ctx: None, after="place_remat", name="forgetful")
    with pytest.raises(zerocc.PassError, match=r"pass 'forgetful' failed \(passes run before it: capture, shard, "
                                               r"place_remat\): TypeError: the pass returned NoneType, not the "
                                               r"torch.fx.GraphModule"):
        compiled_mlp(memory_budget=10**9)


def test_verify_accepts_the_pipeline_and_catches_a_collective_used_before_its_wait():
    plan = planned_gpt(verify=True)
    assert plan.report()["collectives_per_step"]["all_gather"] > 0

    def skip_a_wait(gm, ctx):
        wait = next(n for n in gm.graph.nodes if g.is_wait(n) and g.is_all_gather(n.args[0]))
        wait.replace_all_uses_with(wait.args[0])
        gm.graph.erase_node(wait)
        return gm

    zerocc.register_pass(skip_a_wait, after="insert_collectives")
    with pytest.raises(zerocc.PassError, match=r"(?s)pass 'skip_a_wait' failed.*is never waited.*before it is waited"):
        planned_gpt(verify=True)


def _compile_verified(rank, world_size):
    """The fingerprint verify compared and the collectives the step issued; then a compile in which
    rank 1 alone retags one collective (a pass registered on every rank, acting on rank 1): verify's error."""
    from zerocc import verify
    model = MLP()
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters()), stage=3, loss_fn=F.mse_loss, verify=True)
    step(*batches("mlp", 1, 4)[0])
    fingerprint = verify.collective_fingerprint(step.cache.last.program.gm)
    issued = step.report()["collectives_per_step"]

    def retag_on_rank_1(gm, ctx):
        if ctx.rank == 1:
            next(n for n in gm.graph.nodes if g.is_collective(n)).meta[g.BUCKET] = -1
        return gm
    zerocc.register_pass(retag_on_rank_1, after="insert_collectives")
    model = MLP()
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters()), stage=3, loss_fn=F.mse_loss, verify=True)
    try:
        step(*batches("mlp", 1, 4)[0])
        error = None
    except zerocc.PassError as raised:
        error = str(raised)
    return fingerprint, issued, error


@pytest.mark.multirank
def test_verify_compares_collective_order_across_ranks():
    results = distributed.run(_compile_verified, 2)
    fingerprints = {fingerprint for fingerprint, _, _ in results}
    assert len(fingerprints) == 1 and hashlib.sha256().hexdigest() not in fingerprints   # not the hash of nothing
    assert all(issued.get("all_gather", 0) > 0 and issued.get("reduce_scatter", 0) > 0 for _, issued, _ in results)
    for _, _, error in results:   # every rank learns that rank 1 differs, after the pass that made it differ
        assert error is not None and re.search(r"(?s)pass 'retag_on_rank_1' failed.*ranks \[1\] issue different "
                                               r"collectives \(or in a different order\) than rank 0", error), error


def test_dump_dir_setting_and_environment_variable(tmp_path, monkeypatch):
    compiled_mlp(dump_dir=str(tmp_path / "set"))
    assert sorted(os.listdir(tmp_path / "set")) == ["000_capture.py", "001_shard.py", "002_place_remat.py",
                                                    "003_insert_collectives.py", "004_schedule.py",
                                                    "005_overlap_updates.py", "006_scatter_by_all_to_all.py",
                                                    "007_gather_by_send_recv.py", "008_gradients_into_buckets.py",
                                                    "009_release_slots.py", "010_plan_memory.py", "011_place_buffers.py",
                                                    "memory_plan.json"]
    assert (tmp_path / "set" / "001_shard.py").read_text().startswith("# after pass 01 'shard'")
    monkeypatch.setenv("ZEROCC_DUMP_DIR", str(tmp_path / "env"))
    planned_gpt()
    assert len(os.listdir(tmp_path / "env")) == 13   # capture, eleven passes (place_buffers: pools are on by default) and the memory plan


def _compile_with_dumps(rank, world_size, folder):
    step = compiled_mlp(dump_dir=folder)
    return str(step.graph("place_buffers")) + "\n"


@pytest.mark.multirank
def test_every_rank_dumps_its_own_programs(tmp_path):
    """torchrun gives every rank the same dump_dir: the ranks wrote the same file names into it, overwriting each
    other's, and no file said which rank's program it held. Each rank writes into rank<r>/ under it."""
    programs = distributed.run(_compile_with_dumps, 2, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["rank0", "rank1"]
    for rank, program in enumerate(programs):
        assert len(os.listdir(tmp_path / f"rank{rank}")) == 13
        assert (tmp_path / f"rank{rank}" / "011_place_buffers.py").read_text() == program


def test_explain_says_what_the_passes_decided():
    text = planned_gpt().explain()
    assert "stage 3, world size 4, rank 0" in text
    assert "buckets: " in text
    assert "collectives per step: " in text and "all_gather" in text
    assert "model states per rank: params" in text
    assert "01 shard" in text and "02 place_remat" in text and "03 insert_collectives" in text
    # the decisions as sentences, not dataclass reprs
    assert "schedule: " in text and "all_gather (" in text and "issued early" in text and "in flight" in text
    assert "ScheduledCollective(" not in text
    assert "predicted peak memory: " in text and "at the live peak" in text and "activations" in text


def test_custom_pass_example_drops_one_gather():
    # without the schedule pass, which keeps forward copies within prefetch_bytes by itself
    before = planned_gpt(disable=["schedule"]).report()
    zerocc.register_pass(keep_last_bucket_gathered, after="insert_collectives")
    after_plan = planned_gpt(verify=True, disable=["schedule"])
    after = after_plan.report()
    assert after["collectives_per_step"]["all_gather"] == before["collectives_per_step"]["all_gather"] - 1
    last = after_plan.shard_plan.buckets[-1]
    assert before["comm_bytes_per_step"]["all_gather"] - after["comm_bytes_per_step"]["all_gather"] == last.nbytes


def _train_with_and_without_the_custom_pass(rank, world_size):
    results = []
    for register in (False, True):
        if register:
            zerocc.register_pass(keep_last_bucket_gathered, after="insert_collectives")
        model, _, loss_fn = build("gpt")
        step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=3, bucket_bytes=16 * 1024,
                              disable=["schedule"])   # which keeps forward copies within prefetch_bytes by itself
        data = batches("gpt", 2, 4 * world_size)
        results.append([step(*[t[rank * 4:(rank + 1) * 4] for t in batch]) for batch in data])
        results.append(step.report()["collectives_per_step"]["all_gather"])
    return results


@pytest.mark.multirank
def test_custom_pass_example_trains_exactly_as_without_it():
    for losses, gathers, losses_with, gathers_with in distributed.run(_train_with_and_without_the_custom_pass, 2):
        assert gathers_with == gathers - 1
        assert all(torch.equal(a, b) for a, b in zip(losses, losses_with))


def test_a_compile_says_each_phase_once_it_runs_long_and_as_asked(monkeypatch, capsys):
    """A 705M GPT compiled for about 40 s without a word (a hang, to its user): by default a compile that has
    run ``QUIET_SECONDS`` says each phase it ends on stderr; ``progress=`` says every phase, to a function or
    to stderr, or nothing; the program is the same."""
    from zerocc import progress

    model, _, loss_fn = build("mlp", 0)
    x, y = batches("mlp", 1, 4)[0]
    lines = []
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn,
                          progress=lines.append)
    step(x, y)
    names = [name for name in step.passes if name != "capture"]
    assert lines[0].startswith("traced the step: ") and lines[-1].startswith("compiled the step's program for ")
    assert [line.split(":")[0] for line in lines[1:-1]] == [f"pass {name}" for name in names]
    assert all(line.endswith(" s into the compile)") for line in lines)
    capsys.readouterr()

    def compiled_with(**settings):
        model, _, loss_fn = build("mlp", 0)
        zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn, **settings)(x, y)
        return capsys.readouterr().err

    assert compiled_with() == ""   # a short compile says nothing
    assert compiled_with(progress=False) == ""
    assert compiled_with(progress=True).count("[zerocc] ") == len(lines)
    monkeypatch.setattr(progress, "QUIET_SECONDS", 0.0)   # as a compile past 10 s
    assert compiled_with().count("[zerocc] ") == len(lines)
    assert compiled_with(progress=False) == ""
    with pytest.raises(zerocc.ConfigError, match="progress must be None"):
        zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), progress="yes")


@pytest.mark.parametrize("anchor", [dict(after="mixed_precision"), dict(before="clip_gradients"),
                                    dict(after="place_buffers")])
def test_a_pass_registered_at_an_optional_pass_runs_where_that_pass_would(anchor):
    """register_pass(after="mixed_precision") or before="clip_gradients" was refused ("no pass named ..."), though
    step.passes lists them; after="place_buffers" was taken, and then every compile with memory_pools=False failed."""
    seen = []
    zerocc.register_pass(lambda gm, ctx: seen.append(ctx.stage) or gm, name="mine", **anchor)
    with_option = compiled_mlp(param_dtype=torch.bfloat16, clip_grad_norm=1.0)
    names = with_option.passes
    assert names.index("mine") == names.index(next(iter(anchor.values()))) + (1 if "after" in anchor else -1)
    without = compiled_mlp(memory_pools=False).passes   # none of the three optional passes runs
    assert len(seen) == 2
    if "place_buffers" in anchor.values():
        assert without[-1] == "mine"
    else:   # where mixed_precision and clip_gradients run: right after shard
        assert without[:3] == ["capture", "shard", "mine"]


def test_a_graph_a_registered_pass_broke_is_named_without_the_graph_printed():
    """A pass that leaves the graph out of order: without verify the next pass that lints failed with FX's whole
    graph in the message and no word of the registered pass; with verify=True the error is the pass's own."""
    def out_of_order(gm, ctx):
        nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
        nodes[0].prepend(nodes[-1])   # the last op moved first: its arguments come after it
        return gm

    zerocc.register_pass(out_of_order, after="insert_collectives")
    with pytest.raises(zerocc.PassError) as failed:
        compiled_mlp(verify=True)
    message = str(failed.value)
    assert message.startswith("pass 'out_of_order' failed") and "used before it has been defined" in message
    assert "graph():" not in message and "placeholder[target=" not in message
    with pytest.raises(zerocc.PassError) as failed:
        compiled_mlp()
    message = str(failed.value)
    assert "graph():" not in message and "placeholder[target=" not in message
    assert "registered pass(es) 'out_of_order' ran before it: compile with verify=True" in message
