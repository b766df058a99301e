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


def _start(arguments, out, log):
    return subprocess.Popen([*TORCHRUN, *arguments, SCRIPT, str(out)], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


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
    try:
        codes = [launch.wait(timeout=540) for launch in launches]
    finally:
        for launch in launches:
            if launch.poll() is None:
                launch.kill()
        for log in logs:
            log.close()
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
