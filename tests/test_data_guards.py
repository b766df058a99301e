"""Branches on batch values are decided on the real batch and guarded every step (zerocc/data_guards.py)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerocc
from tests import distributed
from tests.helpers import assert_rank_matches_reference
from tests.reference import eager


class CheckedLabels(nn.Module):
    """Validates its labels as wav2vec2's CTC head does, with a Python branch on their values."""

    def __init__(self, vocab=7):
        super().__init__()
        self.vocab = vocab
        self.linear = nn.Linear(12, vocab)

    def forward(self, x, labels):
        if labels.max() >= self.vocab:
            raise ValueError(f"Label values must be < vocab_size: {self.vocab}")
        return F.cross_entropy(self.linear(x), labels)


class ScaledWhenFlagged(nn.Module):
    """A branch on batch values that changes the computation (no side raises): each side is a program."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(12, 5)

    def forward(self, x, flags):
        y = self.linear(x)
        if flags.any():
            y = y * 2
        return y.square().mean()


def good_batch(generator):
    return torch.randn(4, 12, generator=generator), torch.randint(0, 7, (4,), generator=generator)


@pytest.mark.parametrize("stage", [0, 3])
def test_validation_on_labels_trains_like_eager_and_a_bad_batch_raises_the_models_error(stage):
    torch.manual_seed(0)
    model = CheckedLabels()
    reference = copy.deepcopy(model)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=0.1), stage=stage)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for index in range(4):
        batch = good_batch(generator)
        assert torch.equal(step(*batch), eager(reference, reference_optimizer, *batch))
        if index == 1:   # labels out of range: the model's own error, and nothing changed
            with pytest.raises(ValueError, match=r"Label values must be < vocab_size: 7") as info:
                step(batch[0], torch.tensor([0, 9, 1, 2]))
            assert any("test_data_guards.py" in note and "labels.max() >= self.vocab" in note for note in info.value.__notes__)


def test_a_bad_first_batch_raises_the_models_error():
    model = CheckedLabels()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3)
    with pytest.raises(ValueError, match=r"Label values must be < vocab_size: 7"):
        step(torch.randn(4, 12), torch.tensor([0, 9, 1, 2]))


def test_a_branch_on_batch_values_that_changes_the_computation_compiles_each_side():
    torch.manual_seed(0)
    model = ScaledWhenFlagged()
    reference = copy.deepcopy(model)
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for flags in ([0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]):
        batch = (torch.randn(4, 12, generator=generator), torch.tensor(flags))
        assert torch.equal(step(*batch), eager(reference, reference_optimizer, *batch))
    for parameter, expected in zip(step.full_state_dict().values(), reference.state_dict().values()):
        assert torch.equal(parameter, expected)


def test_batches_alternating_between_the_sides_of_a_branch_compile_each_side_once():
    """Each side's program is kept beside the other's for the same batch shapes: the sides alternate, no recompile."""
    torch.manual_seed(0)
    model = ScaledWhenFlagged()
    reference = copy.deepcopy(model)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=0.1), stage=3)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for index in range(6):
        batch = (torch.randn(4, 12, generator=generator), torch.tensor([0, index % 2, 0, 0]))
        assert torch.equal(step(*batch), eager(reference, reference_optimizer, *batch))
        if index == 1:
            compile_seconds = step.compile_seconds
    assert len(step.compile_stats) == 2   # one compile per side
    assert step.compile_seconds == compile_seconds
    assert len(step.cache.programs()) == 2
    for parameter, expected in zip(step.full_state_dict().values(), reference.state_dict().values()):
        assert torch.equal(parameter, expected)


@pytest.mark.parametrize("stage", [0, 3])
def test_eval_forward_decides_the_branch_on_each_batch_as_the_training_step_does(stage):
    """Evaluation takes eager's side of a branch on batch values (it failed to trace before), one program per side."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(12, 5)

        def forward(self, x, flags):
            y = self.linear(x)
            return y * 2 if flags.any() else y

    torch.manual_seed(0)
    model = Scaled()
    reference = copy.deepcopy(model)
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=stage,
                          loss_fn=lambda y: y.square().mean())
    generator = torch.Generator().manual_seed(1)
    step(torch.randn(4, 12, generator=generator), torch.tensor([0, 1, 0, 0]))
    reference.load_state_dict(step.full_state_dict())
    for flags in ([0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]):
        batch = (torch.randn(4, 12, generator=generator), torch.tensor(flags))
        with torch.no_grad():
            assert torch.equal(step.eval_forward(*batch), reference(*batch)), flags
    assert [len(kept) for kept in step.eval_programs.values()] == [2]   # one per side, each compiled once


def _stage_3_beside_ddp(model, data):
    """``model`` compiled at stage 3 and a DDP copy of it, each trained with AdamW on this rank's ``data``: the step's
    losses, DDP's, both states and how many programs the step compiled."""
    from torch.nn.parallel import DistributedDataParallel
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(reference)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1)
    expected = [eager(ddp, reference_optimizer, *batch) for batch in data]
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=0.1), stage=3, timeout=60)
    losses = [step(*batch) for batch in data]
    return losses, expected, step.full_state_dict(), reference.state_dict(), len(step.compile_stats)


def _one_rank_takes_the_other_side(rank, world_size):
    generator = torch.Generator().manual_seed(1)
    flagged = {2: 1, 4: 0}   # step -> the one rank whose batch takes the other side there
    data = []
    for index in range(6):
        x = torch.randn(4 * world_size, 12, generator=generator).chunk(world_size)[rank]
        data.append((x, torch.tensor([0, int(flagged.get(index) == rank), 0, 0])))
    torch.manual_seed(0)
    model = ScaledWhenFlagged()
    return _stage_3_beside_ddp(model, data)


@pytest.mark.multirank
def test_a_branch_taking_another_side_on_one_rank_compiles_on_every_rank_and_trains_as_ddp():
    """A rank that misses its cache alone would compile while the others run their program: the compile's
    collectives would wait for them until the timeout. Every rank learns of the miss in the call's batch check."""
    for rank, (losses, expected, state, expected_state, compiles) in enumerate(
            distributed.run(_one_rank_takes_the_other_side, 2, timeout=300)):
        assert_rank_matches_reference(rank, losses, expected, state, expected_state, state_rtol=1e-5, state_atol=1e-6)
        assert compiles == 3   # the first batch, and the two steps one rank's batch took the other side (both ranks)


def tiny_wav2vec2_for_ctc():
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(
        vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(4, 4), conv_kernel=(8, 8), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.Wav2Vec2ForCTC(config)


@pytest.mark.slow   # about 30 s: three traces of the whole step
def test_wav2vec2_ctc_trains_like_eager_and_rejects_labels_beyond_its_vocabulary():
    """Its CTC head validates labels with a branch on their values, and ctc_loss's shapes depend on them."""
    model = tiny_wav2vec2_for_ctc()
    reference = copy.deepcopy(model)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=3)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)

    def eager_ctc(audio, labels):
        reference_optimizer.zero_grad(set_to_none=True)
        loss = reference(input_values=audio, labels=labels).loss
        loss.backward()
        reference_optimizer.step()
        return loss.detach()

    for index in range(3):
        audio, labels = torch.randn(2, 400, generator=generator), torch.randint(1, 12, (2, 5), generator=generator)
        if index == 2:
            labels[0, 3:] = -100   # a shorter target: another longest-target length, the same program
        assert torch.equal(step(input_values=audio, labels=labels), eager_ctc(audio, labels))
        if index == 0:
            with pytest.raises(ValueError, match=r"Label values must be <= vocab_size: 12"):
                step(input_values=audio, labels=torch.tensor([[1, 2, 30, 4, 5], [1, 2, 3, 4, 5]]))


class LayerDrop(nn.Module):
    """Skips its layer when a random draw says so, as transformers' LayerDrop does in training."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x, labels):
        if torch.rand([]) < 0.5:   # a random branch: it changes the computation, no check on the batch
            x = self.layer(x)
        return F.cross_entropy(x, labels)


def test_a_branch_on_a_random_draw_is_refused_naming_its_line():
    """A guard would re-draw the number (taking the step's random numbers) and the branch changes the computation.
    The error says it is a random draw and how transformers' LayerDrop is turned off (HuBERT, Data2VecAudio,
    SpeechT5, the time-series transformers have it on by default), where it only said to use tensor ops."""
    model = LayerDrop()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=0)
    with pytest.raises(zerocc.CaptureError, match=r"(?s)the step cannot be traced at .*test_data_guards.py.*torch.rand"
                                                  r".*note: the branch is on a random draw .*layerdrop=0.0"):
        step(torch.randn(3, 4), torch.tensor([0, 1, 2]))


class CodebookCollisions(nn.Module):
    """wav2vec2 pretraining's contrastive loss: Gumbel-softmax codes (a random draw), then ``if neg_is_pos.any():
    logits[neg_is_pos] = -inf``, a branch on activations."""

    def __init__(self):
        super().__init__()
        self.codes = nn.Linear(4, 3)

    def forward(self, x):
        chosen = F.gumbel_softmax(self.codes(x), tau=1.0, hard=True)
        logits = x[:, :3] * 1.0
        same = chosen == 1
        if same.any():
            logits[same] = float("-inf")
        return logits.clamp(min=-1.0).square().mean()


def test_a_branch_on_activations_after_a_random_draw_is_refused_with_what_to_do_not_as_a_layerdrop():
    """The condition reads parameters: no option turns it off, where the note said it was LayerDrop (layerdrop=0.0);
    it now says that a body writing only where the mask is True can run without the ``if``."""
    model = CodebookCollisions()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=0)
    with pytest.raises(zerocc.CaptureError, match=r"(?s)the step cannot be traced at .*test_data_guards.py.*same.any"
                                                  r".*note: the branch asks whether a mask computed from activations "
                                                  r".*masked_fill") as caught:
        step(torch.randn(3, 4))
    assert "LayerDrop" not in str(caught.value)


class PerImage(nn.Module):
    """Splits its patches per image by sizes read from the batch's grid, as Qwen2-VL's vision tower does:
    ``repeat_interleave`` and ``F.pad`` of the lengths, ``split(lengths.tolist())``, a view per image."""

    SCALE = {2: 1.0, 3: 2.0, 4: 0.5}   # keyed: a weight per image looked up by its rows (values as dict keys)

    def __init__(self, keyed=False):
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.keyed = keyed

    def forward(self, patches, grid):   # grid: one (frames, rows, columns) row per image
        lengths = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
        bounds = F.pad(lengths.cumsum(0), (1, 0))
        pieces = self.linear(patches).split((bounds[1:] - bounds[:-1]).tolist())
        return torch.stack([piece.view(rows, columns, 6).mean(1).square().sum() * (self.SCALE[rows] if self.keyed else 1)
                            for piece, (_, rows, columns) in zip(pieces, grid.tolist())]).sum()


GRIDS = ([[1, 2, 4], [1, 4, 2]], [[1, 2, 2], [1, 3, 4]])   # 16 patches each: the same batch shapes


def _trained_on_grids(keyed: bool):
    """``PerImage`` at stage 3 trained on grids A, B, A, B, each loss and finally every parameter equal to eager's:
    the step, and its compile seconds after the second grid."""
    torch.manual_seed(0)
    model = PerImage(keyed=keyed)
    reference = copy.deepcopy(model)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=0.1), stage=3)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for index, grid in enumerate((GRIDS[0], GRIDS[1], GRIDS[0], GRIDS[1])):
        batch = (torch.randn(16, 6, generator=generator), torch.tensor(grid))
        assert torch.equal(step(*batch), eager(reference, reference_optimizer, *batch)), index
        if index == 1:
            compile_seconds = step.compile_seconds
    for parameter, expected in zip(step.full_state_dict().values(), reference.state_dict().values()):
        assert torch.equal(parameter, expected)
    return step, compile_seconds


def test_sizes_read_from_the_batch_train_as_eager_one_program_for_every_grid_of_the_batchs_size():
    """A size an op computes from the batch's values (repeat_interleave) that a shape needs as a number (F.pad) is
    decided on the real batch and guarded (it failed to trace before, at F.pad); split sizes read with .tolist()
    stay symbols, so one program serves every grid of 16 patches (a trace that needs the values themselves reads
    them: Qwen2-VL, test_hf_more.py)."""
    step, _ = _trained_on_grids(keyed=False)
    assert len(step.compile_stats) == 1
    guards = step.cache.programs()[0].program.guards
    assert any("F.pad(lengths.cumsum(0), (1, 0))" in guard.where for guard in guards)


def test_values_read_from_the_batch_that_must_be_numbers_are_read_one_program_per_grid():
    """Values read with .tolist() used as dict keys cannot stay symbols: the trace fails on them, and the step is
    traced again with the values read on the real batch and guarded; another grid compiles a program of its own,
    the first grid again reuses the first (Qwen2-VL's itertools.groupby over its token types)."""
    step, compile_seconds = _trained_on_grids(keyed=True)
    assert len(step.compile_stats) == 2 and step.compile_seconds == compile_seconds
    guards = step.cache.programs()[0].program.guards
    assert any("split((bounds[1:] - bounds[:-1]).tolist())" in guard.where for guard in guards)


def test_planning_sizes_read_from_a_meta_batch_is_refused_naming_the_line():
    # a model on the meta device (a model on the CPU given a meta batch is refused before tracing: test_planning.py)
    with torch.device("meta"):
        model = PerImage()
    with pytest.raises(zerocc.CaptureError, match=r"(?s)cannot be traced at .*test_data_guards.py.*F.pad.*sizes"):
        zerocc.plan(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3,
                    example_inputs=(torch.randn(16, 6, device="meta"), torch.tensor(GRIDS[0], device="meta")))


def _ranks_with_other_grids(rank, world_size):
    generator = torch.Generator().manual_seed(1)
    data = []
    for index in range(4):   # rank 1's grid changes at the second step, rank 0's at the third
        patches = torch.randn(16 * world_size, 6, generator=generator).chunk(world_size)[rank]
        data.append((patches, torch.tensor(GRIDS[int(index >= 1 + (rank == 0))])))
    torch.manual_seed(0)
    model = PerImage(keyed=True)
    return _stage_3_beside_ddp(model, data)


@pytest.mark.multirank
def test_ranks_whose_batches_have_other_grids_compile_together_and_train_as_ddp():
    for rank, (losses, expected, state, expected_state, compiles) in enumerate(
            distributed.run(_ranks_with_other_grids, 2, timeout=300)):
        assert_rank_matches_reference(rank, losses, expected, state, expected_state, state_rtol=1e-5, state_atol=1e-6)
        assert compiles == 3   # the first batch, then each step a rank's grid changed, on both ranks


class VariationalPolicy(nn.Module):
    """torch.distributions in forward with their default argument checks (``validate_args``): a VAE's
    ``Normal.rsample`` and KL to the prior, a policy's ``Categorical.log_prob``. Each check is a Python branch on
    activations (``if not torch._is_all_true(valid): raise ValueError``)."""

    def __init__(self):
        super().__init__()
        self.encode, self.decode, self.policy = nn.Linear(6, 8), nn.Linear(4, 6), nn.Linear(6, 5)

    def forward(self, x, actions):
        mu, log_var = self.encode(x).chunk(2, -1)
        posterior = torch.distributions.Normal(mu, (0.5 * log_var).exp())
        prior = torch.distributions.Normal(torch.zeros_like(mu), torch.ones_like(mu))
        kl = torch.distributions.kl_divergence(posterior, prior).sum(-1).mean()
        reconstruction = F.mse_loss(self.decode(posterior.rsample()), x)
        policy = torch.distributions.Categorical(logits=self.policy(x))
        return reconstruction + kl - policy.log_prob(actions).mean() - 0.01 * policy.entropy().mean()


@pytest.mark.parametrize("stage", [0, 3])
def test_distributions_checking_their_arguments_train_like_eager(stage):
    """The checks on activations were refused as data-dependent control flow; the program now checks them as an op
    (the random draw of ``rsample`` is the program's, seeded alike)."""
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 6, generator=generator), torch.randint(0, 5, (4,), generator=generator)) for _ in range(3)]
    torch.manual_seed(0)
    model = VariationalPolicy()
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=stage)
    for number, batch in enumerate(data):
        torch.manual_seed(100 + number)
        expected = eager(reference, reference_optimizer, *batch)
        torch.manual_seed(100 + number)
        assert torch.equal(step(*batch), expected), number
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key


class LearnedScale(nn.Module):
    """A Normal whose scale is a linear layer's output, unconstrained: a batch can make it negative."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 2)
        with torch.no_grad():
            self.linear.bias.copy_(torch.tensor([0.0, 10.0]))

    def forward(self, x):
        loc, scale = self.linear(x).unbind(-1)
        return -torch.distributions.Normal(loc, scale).log_prob(torch.zeros_like(loc)).mean()


@pytest.mark.parametrize("stage", [0, 3])
def test_a_distribution_argument_breaking_its_constraint_raises_in_the_step_and_changes_nothing(stage):
    torch.manual_seed(0)
    model = LearnedScale()
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.01)
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.01), stage=stage)
    good = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(step(good), eager(reference, reference_optimizer, good))
    bad = -1000.0 * reference.linear.weight[1].detach().sign().expand(4, 3).clone()   # a negative scale
    with pytest.raises(ValueError, match="Expected parameter scale"):
        reference(bad)
    before = {key: value.clone() for key, value in step.full_state_dict().items()}
    with pytest.raises(RuntimeError, match=r"torch.distributions argument or sample broke its constraint "
                                           r"\(validate_args\) at .*test_data_guards.py:\d+: .*Normal\(loc, scale\)"):
        step(bad)
    assert all(torch.equal(value, before[key]) for key, value in step.full_state_dict().items())
    assert torch.equal(step(good), eager(reference, reference_optimizer, good))


class ClampedWhenNotFinite(nn.Module):
    """transformers' DETR-family encoder layers in training (and BART's under float16): ``if not
    torch.isfinite(hidden_states).all(): hidden_states = torch.clamp(...)``, a Python branch on activations."""

    def __init__(self):
        super().__init__()
        self.encode, self.head = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x, labels):
        hidden = self.encode(x)
        if self.training:
            if not torch.isfinite(hidden).all():
                clamp = torch.finfo(hidden.dtype).max - 1000
                hidden = torch.clamp(hidden, min=-clamp, max=clamp)
        return F.cross_entropy(self.head(hidden), labels)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_branch_on_finite_activations_trains_like_eager_and_checks_them_in_the_program(stage):
    """The branch was refused as data-dependent control flow (DETR, Mask2Former, RT-DETR, ... and BART-family
    models with param_dtype=torch.float16 could not be compiled); the program now takes the finite side and checks it
    as an op, which raises, naming the line, on a batch that makes the activations infinite (eager clamps them) and
    changes nothing."""
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 4, generator=generator), torch.randint(0, 3, (4,), generator=generator)) for _ in range(3)]
    torch.manual_seed(0)
    model = ClampedWhenNotFinite()
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=stage)
    for number, batch in enumerate(data[:2]):
        assert torch.equal(step(*batch), eager(reference, reference_optimizer, *batch)), number
    before = {key: value.clone() for key, value in step.full_state_dict().items()}
    with pytest.raises(RuntimeError, match=r"non-finite values \(inf or nan\) in the branch at "
                                           r".*test_data_guards.py:\d+: if not torch.isfinite\(hidden\).all\(\)"):
        step(torch.full((4, 4), float("inf")), data[0][1])
    assert all(torch.equal(value, before[key]) for key, value in step.full_state_dict().items())
    assert torch.equal(step(*data[2]), eager(reference, reference_optimizer, *data[2]))
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key


class VisiblePatches(nn.Module):
    """VideoMAE's and SpeechT5's pattern: activations selected by a boolean mask of the batch (``h[~mask]``,
    ``h.masked_select(mask)``), then a branch on how many were kept (transformers' SDPA attention's
    ``q_length > 1``) or the selection met with the labels selected by the same mask (an L1 loss's broadcast)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x, hidden, targets):
        h = self.linear(x)[~hidden].reshape(x.shape[0], -1, 8)
        if h.shape[1] > 1:   # the number kept: the batch's mask alone decides it
            h = h * 2
        padding = targets != -100.0
        selected = self.linear(x).masked_select(padding)
        return h.square().mean() + F.l1_loss(selected, targets.masked_select(padding))


@pytest.mark.parametrize("stage", [0, 3])
def test_sizes_of_activations_selected_by_a_mask_of_the_batch_are_decided_on_the_batch(stage):
    torch.manual_seed(0)
    model = VisiblePatches()
    reference = copy.deepcopy(model)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=0.1), stage=stage)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for kept in (3, 1, 4):   # one patch kept per row takes the branch's other side
        order = torch.rand(2, 6, generator=generator).argsort(1)
        hidden = torch.ones(2, 6, dtype=torch.bool).scatter(1, order[:, :kept], False)
        targets = torch.randn(2, 6, 8, generator=generator)
        targets[:, kept:] = -100.0
        batch = (torch.randn(2, 6, 8, generator=generator), hidden, targets)
        assert torch.equal(step(*batch), eager(reference, reference_optimizer, *batch)), kept
    for parameter, expected in zip(step.full_state_dict().values(), reference.state_dict().values()):
        assert torch.equal(parameter, expected)


class GaussianHead(nn.Module):
    """A regression head predicting a mean and a variance, trained with ``nn.GaussianNLLLoss``, which asks
    ``torch.any(var < 0)`` (a Python branch on activations) before computing. The variance is the head's raw output:
    a batch can make it negative."""

    def __init__(self):
        super().__init__()
        self.body, self.head, self.variance = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(4, 1)
        self.loss = nn.GaussianNLLLoss(full=True)
        with torch.no_grad():
            self.variance.bias.fill_(5.0)

    def forward(self, x, target):
        mean, var = self.head(torch.tanh(self.body(x))), self.variance(x)
        return self.loss(mean, target, var)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gaussian_nll_loss_trains_like_eager_and_checks_its_variance_in_the_program(stage):
    """nn.GaussianNLLLoss was refused as data-dependent control flow; the program now takes the side with no negative
    variance and checks it as an op, which raises, naming the user's line, where eager raises its ValueError, and
    changes nothing."""
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(6, 4, generator=generator), torch.randn(6, 1, generator=generator)) for _ in range(3)]
    torch.manual_seed(0)
    model = GaussianHead()
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=stage)
    for number, batch in enumerate(data[:2]):
        assert torch.equal(step(*batch), eager(reference, reference_optimizer, *batch)), number
    bad = -1000.0 * reference.variance.weight.detach().sign().expand(6, 4).clone()   # a negative variance
    with pytest.raises(ValueError, match="var has negative entry"):
        reference(bad, data[0][1])
    before = {key: value.clone() for key, value in step.full_state_dict().items()}
    with pytest.raises(RuntimeError, match=r"nn.GaussianNLLLoss's var has negative entries at "
                                           r".*test_data_guards.py:\d+: return self.loss\(mean, target, var\)"):
        step(bad, data[0][1])
    assert all(torch.equal(value, before[key]) for key, value in step.full_state_dict().items())
    assert torch.equal(step(*data[2]), eager(reference, reference_optimizer, *data[2]))
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key
