"""Fake kernels for aten ops that torch traces only with real values, registered when zerocc is imported.

Capture traces on fake tensors (``zerocc/tracing.py``); an op whose output
shape depends on its input values has no fake kernel and stops the trace.
Those whose output shape is a size bounded by the data get one here that
returns that size as an unbacked symbol, as ``nonzero`` does in torch: the
graph then holds one program for every batch.
"""
from __future__ import annotations

import torch


@torch.library.register_fake("aten::_ctc_loss.Tensor")
def _ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    """CTC loss (``F.ctc_loss``): per-sequence losses and log alpha of (batch, time, 2 x longest target + 1)."""
    time, batch = log_probs.shape[0], log_probs.shape[1]   # ctc_loss unsqueezes unbatched input before this op
    states = torch.library.get_ctx().new_dynamic_size()   # 2 * max(target_lengths) + 1: read from the data
    return log_probs.new_empty((batch,)), log_probs.new_empty((batch, time, states))


@torch.library.register_fake("aten::_ctc_loss_backward.Tensor")
def _ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha, blank,
                       zero_infinity=False):
    """The gradient of CTC loss with respect to ``log_probs``: its shape."""
    return torch.empty_like(log_probs)
