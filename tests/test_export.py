"""``export_full_state_dict``: 0-dim tensors round-trip, a failed export leaves no file and raises a zerocc error."""
from __future__ import annotations

import os

import pytest
import torch

import zerocc
from zerocc import state_dict
from tests.models import batches, build, eager_step

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def trained_cnn(stage):
    model, _, loss_fn = build("cnn")
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=stage, loss_fn=loss_fn)
    for batch in batches("cnn", 2, 8):
        step(*batch)
    return step


def test_export_round_trips_batch_norm_counters(tmp_path):
    step = trained_cnn(3)
    zerocc.save_checkpoint(step, tmp_path / "ckpt")
    zerocc.export_full_state_dict(str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors"))
    exported = state_dict.read_safetensors(str(tmp_path / "model.safetensors"))
    full = step.full_state_dict()
    assert exported.keys() == full.keys()
    for key, value in full.items():
        assert exported[key].shape == value.shape and torch.equal(exported[key], value), key
    assert exported["bn1.num_batches_tracked"].dim() == 0 and int(exported["bn1.num_batches_tracked"]) == 2

    plain, _, loss_fn = build("cnn", 5)
    plain.load_state_dict(exported)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    eager_step(plain, optimizer, loss_fn, batches("cnn", 1, 8, seed=3)[0])   # an exported model trains eagerly


def test_failed_export_leaves_no_partial_file_and_is_an_exception(tmp_path):
    step = trained_cnn(0)
    zerocc.save_checkpoint(step, tmp_path / "ckpt")
    folder = os.path.realpath(tmp_path / "ckpt")
    for name in os.listdir(folder):
        if name.endswith(".distcp"):
            os.truncate(os.path.join(folder, name), 16)   # corrupt the data
    out = str(tmp_path / "model.safetensors")
    with pytest.raises(zerocc.CheckpointError, match=r"exporting .*ckpt: reading (conv|bn|fc)"):
        zerocc.export_full_state_dict(str(tmp_path / "ckpt"), out)
    assert issubclass(zerocc.CheckpointError, Exception)   # DCP's CheckpointException is a BaseException
    assert not os.path.exists(out) and not os.path.exists(out + ".partial")
    with pytest.raises(zerocc.CheckpointError, match="not a complete zerocc checkpoint"):
        zerocc.export_full_state_dict(str(tmp_path / "nowhere"), out)
