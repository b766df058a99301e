"""0-dim parameters (CLIP's ``logit_scale = nn.Parameter(torch.tensor(2.66))``) train like eager.

A 0-dim parameter is one element of a bucket; the shard pass gives the
optimizer that element as a 0-dim tensor, as eager does, so its state is 0-dim
as in eager (it used to be a 1-element piece meeting 0-dim state, and AdamW's
trace failed at every stage). World size 1: every stage bit for bit against
eager; 2 ranks: stages 1 and 3 against DDP, with the 0-dim parameter in rank
1's shard.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import zerocc
from tests import distributed
from tests.models import eager_step
from tests.reference import adamw, eager_accumulated_step

STAGES = (0, 1, 2, 3)


class ScaledLinear(nn.Module):
    """A linear layer whose logits are multiplied by ``exp(logit_scale)``, as CLIP's are; the scale is used last."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(12, 5)
        self.logit_scale = nn.Parameter(torch.tensor(2.66))

    def forward(self, x):
        return self.linear(x) * self.logit_scale.exp()


def build():
    torch.manual_seed(0)
    return ScaledLinear()


def loss_fn(output, target):
    return nn.functional.cross_entropy(output, target)


def batches(count, rows):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 12, generator=generator), torch.randint(0, 5, (rows,), generator=generator))
            for _ in range(count)]


@pytest.mark.parametrize("stage", STAGES)
def test_zero_dim_parameter_bit_for_bit(stage):
    reference = build()
    reference_optimizer = adamw(reference)
    model = build()
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn)
    for batch in batches(3, 8):
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, loss_fn, batch))
    full = step.full_state_dict()
    assert full["logit_scale"].shape == ()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key


def test_zero_dim_optimizer_state_from_eager_steps_is_picked_up():
    """The optimizer's 0-dim ``exp_avg`` of a 0-dim parameter becomes the program's state, not a step count."""
    reference = build()
    reference_optimizer = adamw(reference)
    model = build()
    optimizer = adamw(model)
    data = batches(4, 8)
    for batch in data[:2]:
        eager_step(reference, reference_optimizer, loss_fn, batch)
        eager_step(model, optimizer, loss_fn, batch)
    step = zerocc.compile(model, optimizer, stage=3, loss_fn=loss_fn)
    for batch in data[2:]:
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, loss_fn, batch))
    for key, value in reference.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key


class ScaledInput(nn.Module):
    """The 0-dim parameter used first: its gradient piece comes before the linear layer's in the bucket."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.5))
        self.linear = nn.Linear(12, 5)

    def forward(self, x):
        return self.linear(x * self.scale)


@pytest.mark.parametrize("stage", STAGES)
def test_zero_dim_parameter_with_clipping_and_accumulation_bit_for_bit(stage):
    """Clipping used to fail to compile (a node used before its definition) when a 0-dim parameter was not
    the last piece of its bucket: the clipped gradient was placed after shard's 0-dim view that reads it."""
    torch.manual_seed(0)
    reference = ScaledInput()
    reference_optimizer = adamw(reference)
    torch.manual_seed(0)
    model = ScaledInput()
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn, grad_accumulation=2, clip_grad_norm=0.5)
    for batch in batches(3, 8):
        expected, norm = eager_accumulated_step(reference, reference_optimizer, loss_fn, batch, 2, clip=0.5)
        assert torch.equal(step(*batch), expected)
        assert torch.equal(step.last_grad_norm, norm)
    for key, value in reference.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key


def scaled_input_step(stage, seed):
    torch.manual_seed(seed)
    model = ScaledInput()
    return zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("stage", [0, 3])
def test_checkpoints_of_a_zero_dim_parameter_load_before_and_after_the_first_call_and_export(tmp_path, stage):
    """A 0-dim parameter used to be saved 0-dim before the first call and as 1 element after it: a
    checkpoint then failed to load into a fresh step (CheckpointException: size mismatch), and to export."""
    data = batches(3, 8)
    original = scaled_input_step(stage, 0)
    zerocc.save_checkpoint(original, tmp_path / "initial")
    original(*data[0])
    zerocc.save_checkpoint(original, tmp_path / "trained")
    expected = [original(*batch) for batch in data[1:]]

    fresh = scaled_input_step(stage, 7)   # loaded before its first call
    zerocc.load_checkpoint(fresh, tmp_path / "trained")
    assert all(torch.equal(fresh(*batch), loss) for batch, loss in zip(data[1:], expected))

    ran = scaled_input_step(stage, 7)     # a checkpoint saved before the first call, loaded after it
    ran(*data[2])
    zerocc.load_checkpoint(ran, tmp_path / "initial")
    for batch in data[:2]:
        ran(*batch)
    assert torch.equal(ran(*data[2]), expected[-1])

    zerocc.export_full_state_dict(str(tmp_path / "trained"), str(tmp_path / "model.safetensors"))
    exported = zerocc.state_dict.read_safetensors(str(tmp_path / "model.safetensors"))
    plain = ScaledInput()
    plain.load_state_dict(exported)
    assert exported["scale"].shape == ()


def _save_on_two_ranks(rank, world_size, folder):
    step = scaled_input_step(3, 0)
    for batch in batches(2, 8):
        step(*(t[rank * 4:(rank + 1) * 4] for t in batch))
    zerocc.save_checkpoint(step, folder)
    return step.full_state_dict()


@pytest.mark.multirank
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_zero_dim_parameter_sharded_on_two_ranks_resumes_on_one(tmp_path):
    saved = distributed.run(_save_on_two_ranks, 2, str(tmp_path / "ckpt"))[0]
    resumed = scaled_input_step(1, 7)
    zerocc.load_checkpoint(resumed, tmp_path / "ckpt")   # before the first call
    for key, value in resumed.model.state_dict().items():
        assert torch.equal(value, saved[key]), key
    resumed(*batches(1, 8)[0])


def tiny_clip():
    transformers = pytest.importorskip("transformers")
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=16, patch_size=8)
    torch.manual_seed(0)
    return transformers.CLIPModel(transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))


@pytest.mark.slow   # the tiny ScaledLinear pins the fix in the default suite; the model zoo trains CLIP too
@pytest.mark.parametrize("stage", [0, 3])
def test_tiny_clip_bit_for_bit(stage):
    """Hugging Face's CLIPModel, random init from a tiny config (no download): its contrastive loss, as eager."""
    reference = tiny_clip()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    model = tiny_clip()
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=stage)
    generator = torch.Generator().manual_seed(1)
    for number in range(2):
        batch = dict(input_ids=torch.randint(0, 64, (4, 8), generator=generator),
                     pixel_values=torch.randn(4, 3, 16, 16, generator=generator), return_loss=True)
        reference_optimizer.zero_grad(set_to_none=True)
        expected = reference(**batch).loss
        expected.backward()
        reference_optimizer.step()
        assert torch.equal(step(**batch), expected.detach()), number
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key


def _train_all_stages(rank, world_size):
    data = batches(3, 4 * world_size)
    local = [tuple(t[rank * 4:(rank + 1) * 4] for t in batch) for batch in data]
    reference = build()
    optimizer = adamw(reference)
    ddp = DistributedDataParallel(reference)
    results = {"ddp": ([eager_step(ddp, optimizer, loss_fn, batch) for batch in local],
                       {k: v.clone() for k, v in reference.state_dict().items()})}
    for stage in (1, 3):
        model = build()
        step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn)
        losses = [step(*batch) for batch in local]
        owners = {piece.param for _, _, piece in step.state.plan.owned_pieces()}
        results[stage] = (losses, step.full_state_dict(), owners)
    return results


@pytest.mark.multirank
def test_zero_dim_parameter_two_ranks_match_ddp():
    per_rank = distributed.run(_train_all_stages, 2)
    scale_index = 2   # linear.weight, linear.bias, logit_scale: the last element of the one bucket
    for stage in (1, 3):
        assert [scale_index in results[stage][2] for results in per_rank] == [False, True], stage
    for rank, results in enumerate(per_rank):
        expected_losses, expected_state = results["ddp"]
        for stage in (1, 3):
            losses, state, _ = results[stage]
            torch.testing.assert_close(torch.stack(losses), torch.stack(expected_losses), rtol=1e-5, atol=1e-6)
            for key, value in expected_state.items():
                torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"stage {stage} rank {rank} {key}: {m}")
