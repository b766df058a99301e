"""Batches as data pipelines make them: numpy arrays, loaders that reuse their buffers, collators' dicts.

Each compiled step trains bit for bit like eager on the same stream of batches at world size 1, or is refused
with an error naming the batch's entry.
"""
from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

import zerocc
from tests.reference import eager


class ReadsArrays(nn.Module):
    """A model whose batch is numpy arrays, made tensors in forward (a Python value to the step: a constant)."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(50, 4)
        self.linear = nn.Linear(4, 1)

    def forward(self, ids, features):
        return self.embedding(torch.as_tensor(ids)).sum() * self.linear(torch.from_numpy(features)).mean()


def _train_beside_eager(stage, batches):
    torch.manual_seed(0)
    model = ReadsArrays()
    reference = copy.deepcopy(model)
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.01), stage=stage)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zerocc.RecompileWarning)   # every new array compiles: they are constants
        for number, batch in enumerate(batches):
            expected = eager(reference, reference_optimizer, *batch)   # before the step: batches() may reuse buffers
            assert torch.equal(step(*batch), expected), number
    full = step.full_state_dict()
    for name, value in reference.state_dict().items():
        assert torch.equal(full[name], value), name


@pytest.mark.parametrize("stage", [0, 3])
def test_numpy_arrays_whose_repr_is_the_same_train_like_eager(stage):
    """numpy's repr elides all but the corners of an array of more than 1,000 elements (a padded batch of token
    ids: a start token first, padding last): keyed by it, the second batch reused the first's program."""
    def batches():
        rng = np.random.default_rng(0)
        for _ in range(3):
            ids = rng.integers(2, 50, (40, 32))
            ids[:, :3], ids[:, -3:] = 1, 0
            yield ids, np.ones((2, 4), dtype=np.float32)
    _train_beside_eager(stage, batches())


@pytest.mark.parametrize("stage", [0, 3])
def test_a_loader_reusing_its_numpy_buffer_does_not_change_a_compiled_program(stage):
    """The trace's torch.from_numpy shared the batch's buffer: overwritten by the loader, the program compiled for
    the first values ran on the new ones when a batch with the first values came again."""
    ids = np.full((4, 8), 3)
    buffer = np.ones((2, 4), dtype=np.float32)
    first = buffer.copy()

    def batches():
        for value in (1.0, 5.0):
            buffer[:] = value
            yield ids, buffer
        yield ids, first
    _train_beside_eager(stage, batches())
