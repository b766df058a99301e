"""More Hugging Face architectures (tests/hf_more.py) train under zerocc as in eager PyTorch.

- Every one at stage 3, world size 1, three AdamW steps: bit for bit eager
  (every loss, every parameter), dropout included (both sides seed the global
  generator before each step). The default suite trains three: BART after
  ``resize_token_embeddings`` (one embedding module at three places, which
  trained to nan), ALBERT (one layer's parameters shared by every layer) and
  Marian (encoder-decoder), Qwen2-VL and VideoMAE (activations selected by
  the batch's boolean mask, whose number SDPA attention branches on); the
  rest under ``-m slow``.
- Five of them with options combined at stage 1: bf16 compute, gradient
  accumulation over two micro-batches and gradient clipping, bit for bit the
  hand-written reference (``hf_more.mixed_accumulated_keyword_step``).
- Five of them across two ranks against DDP on the same per-rank batches,
  within tests/test_numerics.py's tolerances; three more with masks drawn
  or selected per rank (ViTMAE, VideoMAE, SpeechT5 text to speech).
"""
from __future__ import annotations

import pytest
import torch

import zerocc
from tests import distributed
from tests.helpers import beside_ddp, beside_eager
from tests.reference import assert_ranks_match_ddp

pytest.importorskip("transformers")
from tests.hf_more import MODELS, batches, mixed_accumulated_keyword_step  # noqa: E402  (needs transformers)

DEFAULT_SLICE = {"bart_resized", "albert", "marian", "qwen2_vl", "videomae"}

# Architectures that fail today, each with the error a user sees; strict, so a fix shows up as a failure here.
KNOWN_FAILURES: dict[str, str] = {}


def _params(names):
    for name in names:
        marks = [] if name in DEFAULT_SLICE else [pytest.mark.slow]
        if name in KNOWN_FAILURES:
            marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[name]))
        yield pytest.param(name, marks=marks)


@pytest.mark.parametrize("name", list(_params(MODELS)))
def test_stage_3_equals_eager_bit_for_bit(name, deterministic):
    build, _ = MODELS[name]
    step, reference = beside_eager(build, batches(name, 3))
    assert step.full_state_dict().keys() == reference.state_dict().keys()


COMBINED = ["albert", "marian", "distilbert_seq", "deberta_v1", "gemma3"]


@pytest.mark.slow
@pytest.mark.parametrize("name", COMBINED)
def test_bf16_with_accumulation_and_clipping_at_stage_1_bit_for_bit(name, deterministic):
    build, _ = MODELS[name]
    reference = build()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    model = build()
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=1,
                          param_dtype=torch.bfloat16, reduce_dtype=torch.float32, grad_accumulation=2,
                          clip_grad_norm=0.25)
    norms = []
    for number, batch in enumerate(batches(name, 3)):
        expected, norm = mixed_accumulated_keyword_step(reference, reference_optimizer, batch, 100 + number,
                                                        dtype=torch.bfloat16, k=2, clip=0.25)
        torch.manual_seed(100 + number)
        assert torch.equal(step(**batch), expected), number
        assert torch.equal(step.last_grad_norm, norm), number
        norms.append(norm)
    assert max(norms) > 0.25   # the clip acts
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert full[key].dtype == value.dtype and torch.equal(full[key], value), key


ACROSS_RANKS = ["bart_resized", "albert", "xlnet", "llama_seq", "deberta_tok"]


def _against_ddp(rank, world_size, names):
    torch.use_deterministic_algorithms(True)
    # XLNet's mask_emb and segment parameters get no gradient without perm_mask and token_type_ids
    return {name: beside_ddp(MODELS[name][0], batches(name, 2, rows=2 * world_size), rank, world_size,
                             find_unused_parameters=True, timeout=120) for name in names}


@pytest.mark.slow
@pytest.mark.multirank
def test_five_architectures_across_two_ranks_match_ddp():
    assert_ranks_match_ddp(distributed.run(_against_ddp, 2, ACROSS_RANKS, timeout=600))


MASKED_ACROSS_RANKS = ["vitmae", "videomae", "speecht5_tts"]   # each rank draws and selects by its own masks


@pytest.mark.slow
@pytest.mark.multirank
def test_masked_pretraining_and_masked_losses_across_two_ranks_match_ddp():
    assert_ranks_match_ddp(distributed.run(_against_ddp, 2, MASKED_ACROSS_RANKS, timeout=600))
