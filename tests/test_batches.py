"""Batches as data pipelines make them: numpy arrays, loaders that reuse their buffers, collators' dicts.

Each compiled step trains bit for bit like eager on the same stream of batches at world size 1, or is refused
with an error naming the batch's entry.
"""
from __future__ import annotations

import copy
import re
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


class OptionalTokenTypes(nn.Module):
    """Reads a collator's dict: its token-type layer only where the batch has ``token_type_ids``."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(50, 8)
        self.token_types = nn.Embedding(2, 8)
        self.head = nn.Linear(8, 50)

    def forward(self, batch):
        hidden = self.tokens(batch["input_ids"])
        if batch.get("token_type_ids") is not None:
            hidden = hidden + self.token_types(batch["token_type_ids"])
        return nn.functional.cross_entropy(self.head(hidden).flatten(0, 1), batch["labels"].flatten())


@pytest.mark.parametrize("left_out", ["missing", "None"])
def test_a_batch_without_an_optional_entry_names_it_and_training_goes_on(left_out):
    torch.manual_seed(0)
    model = OptionalTokenTypes()
    reference = copy.deepcopy(model)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=0.01), stage=3)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)

    def batch(token_types=True):
        ids = torch.randint(0, 50, (4, 6), generator=generator)
        made = {"input_ids": ids, "labels": ids.roll(1, 1), "token_type_ids": torch.randint(0, 2, (4, 6), generator=generator)}
        if not token_types:
            made = {k: v for k, v in made.items() if k != "token_type_ids"} if left_out == "missing" else made | {"token_type_ids": None}
        return made
    first = batch()
    assert torch.equal(step(first), eager(reference, reference_optimizer, first))
    named = "no argument 0['token_type_ids'] (the first batch had a tensor)" if left_out == "missing" else \
        "argument 0['token_type_ids'] is None (the first batch had a tensor)"
    with pytest.raises(zerocc.CaptureError, match=re.escape(f"no longer reaches 'token_types.weight' (changed since then: {named})")) \
            as info:
        step(batch(token_types=False))
    assert "give every batch the same entries" in str(info.value)
    second = batch()   # nothing changed: training goes on as eager's
    assert torch.equal(step(second), eager(reference, reference_optimizer, second))
    full = step.full_state_dict()
    for name, value in reference.state_dict().items():
        assert torch.equal(full[name], value), name
