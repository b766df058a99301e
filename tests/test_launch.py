"""Launch with torchrun as users do: one node with 2 processes, and 2 nodes with 1 process each, train alike.

The multi-node launch (``--nnodes 2 --rdzv-backend c10d --rdzv-endpoint``) is
run as two torchrun agents on this machine, each a "node" of one process;
ranks are handed out by the c10d rendezvous, and each rank trains on the
slice of the global batch its RANK names. Every rank's losses and final
parameters must equal the single-node run's (``--standalone
--nproc_per_node 2``) bit for bit: the same ranks do the same arithmetic,
whichever agent started them. ``docs/launch.md`` documents both launches.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.distributed import free_port

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launched.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _waited(launches, logs, timeout: float) -> list[int]:
    """Each launch's exit code, waiting at most ``timeout`` seconds each; whatever still runs is killed, the logs closed."""
    try:
        return [launch.wait(timeout=timeout) for launch in launches]
    finally:
        for launch in launches:
            if launch.poll() is None:
                launch.kill()
        for log in logs:
            log.close()


def _start(arguments, out, log, *script_arguments, environment=()):
    return subprocess.Popen([*TORCHRUN, *arguments, SCRIPT, str(out), *script_arguments], stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1", **dict(environment)})


def _results(folder):
    return [torch.load(folder / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


@pytest.mark.multirank
def test_two_nodes_train_bit_for_bit_like_one_node(tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    single.mkdir()
    multi.mkdir()
    port = free_port()
    node = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"zerocc-test-{port}"]
    logs = [open(tmp_path / f"{name}.log", "w") for name in ("single", "node0", "node1")]
    launches = [_start(["--standalone", "--nproc-per-node", "2"], single, logs[0]),
                _start([*node, "--node-rank", "0"], multi, logs[1]),
                _start([*node, "--node-rank", "1"], multi, logs[2])]
    codes = _waited(launches, logs, timeout=540)
    output = "\n".join((tmp_path / f"{name}.log").read_text()[-3000:] for name in ("single", "node0", "node1"))
    assert codes == [0, 0, 0], output
    for rank, (one_node, two_nodes) in enumerate(zip(_results(single), _results(multi))):
        assert one_node["environment"]["LOCAL_WORLD_SIZE"] == "2" and two_nodes["environment"]["LOCAL_WORLD_SIZE"] == "1"
        assert two_nodes["environment"]["GROUP_RANK"] == str(rank)   # node of this rank (one process a node)
        assert all(torch.equal(a, b) for a, b in zip(one_node["losses"], two_nodes["losses"])), rank
        assert one_node["state"].keys() == two_nodes["state"].keys()
        for key, value in one_node["state"].items():
            assert torch.equal(two_nodes["state"][key], value), (rank, key)
    first, second = _results(multi)
    assert all(torch.equal(a, b) for a, b in zip(first["state"].values(), second["state"].values()))   # ranks agree
    # the script never destroys the group zerocc.compile made from torchrun's environment: zerocc does at exit
    # (left to the interpreter's teardown, gloo's threads could abort a rank that trained well: exit -6)
    for folder in (single, multi):
        assert [(folder / f"exit{rank}.txt").read_text() for rank in range(2)] == ["destroyed"] * 2


@pytest.mark.multirank
@pytest.mark.slow   # two torchrun jobs of 2 ranks, one of them started twice: about 40 s on 2 cores
def test_a_job_torchrun_restarts_resumes_from_its_checkpoint_bit_for_bit(tmp_path):
    """``torchrun --max-restarts 1``: rank 1 dies before step 2 (index 1) of the first attempt; torchrun stops rank 0
    and starts both again, which load the last checkpoint (after step 1) and train on. Losses of the steps after the
    restart and the final state equal, bit for bit, a job that never failed. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1:
    with torchrun's shared store the restarted ranks read the dead ones' addresses (zerocc.compile says so)."""
    plain, restarted = tmp_path / "plain", tmp_path / "restarted"
    plain.mkdir()
    restarted.mkdir()
    logs = [open(tmp_path / f"{name}.log", "w") for name in ("plain", "restarted")]
    standalone = ["--standalone", "--nproc-per-node", "2"]
    launches = [_start(standalone, plain, logs[0]),
                _start([*standalone, "--max-restarts", "1"], restarted, logs[1], "1",
                       environment={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})]
    codes = _waited(launches, logs, timeout=300)
    output = "\n".join((tmp_path / f"{name}.log").read_text()[-3000:] for name in ("plain", "restarted"))
    assert codes == [0, 0], output
    for rank, (once, again) in enumerate(zip(_results(plain), _results(restarted))):
        assert again["environment"]["TORCHELASTIC_RESTART_COUNT"] == "1", rank
        assert len(once["losses"]) == 3 and len(again["losses"]) == 2, rank   # steps 2 and 3 after the restart
        assert all(torch.equal(a, b) for a, b in zip(once["losses"][1:], again["losses"])), rank
        assert once["state"].keys() == again["state"].keys()
        for key, value in once["state"].items():
            assert torch.equal(again["state"][key], value), (rank, key)


def _own_disk(disk, mount_point) -> list[str]:
    """A command prefix running what follows with ``mount_point`` showing ``disk``: a node-local disk at a path
    every node has (``unshare --mount``, root only); [] where this machine cannot."""
    prefix = ["unshare", "--mount", "sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh",
              str(disk), str(mount_point)]
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return prefix if probe.returncode == 0 else []


@pytest.mark.multirank
def test_a_checkpoint_on_each_nodes_own_disk_is_refused_naming_the_rank(tmp_path):
    """Two nodes saving to the same path on their own disks: each rank wrote its shards on its own node, the save
    reported success and no node held a whole checkpoint (node 1 kept every version it wrote). The save is refused
    on every rank before anything is written, naming rank 1; a folder node 1 alone holds is refused naming the
    missing shard; a copy only node 0 holds is refused at load on every rank. A shared folder saves as before."""
    (tmp_path / "local").mkdir()
    (tmp_path / "disk1").mkdir()
    own_disk = _own_disk(tmp_path / "disk1", tmp_path / "local")
    if not own_disk:
        pytest.skip("needs `unshare --mount` and bind mounts (root) to give one node its own disk")
    port = free_port()
    node = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    script = os.path.join(os.path.dirname(SCRIPT), "launched_node_local.py")
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [open(tmp_path / f"node{n}.log", "w") for n in (0, 1)]
    launches = [subprocess.Popen([*prefix, *TORCHRUN, *node, "--node-rank", str(n), script, str(tmp_path)],
                                 stdout=logs[n], stderr=subprocess.STDOUT, env=environment)
                for n, prefix in enumerate(([], own_disk))]
    codes = _waited(launches, logs, timeout=240)
    output = "\n".join((tmp_path / f"node{n}.log").read_text()[-3000:] for n in (0, 1))
    assert codes == [0, 0], output
    first, second = _results(tmp_path)
    for result in (first, second):
        assert "rank(s) 1 (host" in result["node_local"] and "do not see the folder" in result["node_local"]
        assert "Nothing was written" in result["node_local"] and "NFS" in result["node_local"]
        assert "lacks __1_0.distcp" in result["stale"], result["stale"]
        assert result["shared"].endswith("ckpt.v1")
    assert "rank 1: ConfigError" in first["load"] and "rank 0 sees it" in first["load"], first["load"]
    assert "it does not exist" in second["load"]
    assert first["listing"] == ["copy"]                      # node 0: nothing of the refused saves
    assert second["listing"] == ["stale.v1"]                 # node 1: only the folder it held (and its shard)
    assert os.listdir(tmp_path / "disk1" / "stale.v1") == ["__1_0.distcp"]
    # the script never destroys the group zerocc.compile made from torchrun's environment: zerocc does at exit
    # (left to the interpreter's teardown, gloo's threads once aborted node 0's rank here after it saved: exit -6)
    assert [(tmp_path / f"exit{rank}.txt").read_text() for rank in range(2)] == ["destroyed"] * 2


def test_a_lost_store_host_is_named_where_no_rank_can_be(monkeypatch):
    """A whole node down (its torchrun agent with its ranks) takes the store it hosts: the ranks left waiting could
    not read where the others were, and the error named no rank and no node. It now names the store's address and
    says its node is probably down (a step's error read with no default store: as with a store that is gone)."""
    from zerocc.hardware import Ranks
    from zerocc.runtime import failures
    monkeypatch.setenv("MASTER_ADDR", "node0.example")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert not torch.distributed.is_initialized()
    line = failures._where_the_others_are(Ranks(2, 1, object(), "0"), "step 2", RuntimeError("Connection closed by peer"))
    assert "the ranks' store (node0.example:29500) does not answer" in line and "probably down" in line, line
