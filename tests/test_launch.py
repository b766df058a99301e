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
