"""Complex numbers in real models: Meta's Llama rotary embedding, a Fourier neural operator's complex weights.

Complex values in the forward (``torch.polar``, ``view_as_complex``, ``torch.fft``) trace like any other op; what
zerocc itself does to a complex *parameter* or *buffer* is what these pin: its bucket under ``param_dtype`` (a
real dtype: complex parameters keep their own, as ``model.bfloat16()`` keeps them) and the collectives that carry
it across ranks (gloo reduces no complex dtype: it travels as its real view).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import zerocc
from tests import distributed

STEPS = 3


def _rotate(x, freqs_cis):
    """Meta's ``apply_rotary_emb``: pairs of features as complex numbers, rotated by ``freqs_cis``."""
    rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * freqs_cis.view(1, x.shape[1], 1, -1)
    return torch.view_as_real(rotated).flatten(3).type_as(x)


class _RotaryAttention(torch.nn.Module):
    """One attention layer with Llama's reference rotary embedding, its ``freqs_cis`` (complex64, from
    ``torch.polar``) a buffer."""

    def __init__(self, dim=16, heads=2, positions=16):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(32, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.out = torch.nn.Linear(dim, 32, bias=False)
        half = dim // heads // 2
        freqs = torch.outer(torch.arange(positions).float(), 1.0 / 10000 ** (torch.arange(half).float() / half))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(freqs), freqs))

    def forward(self, tokens, targets):
        batch, length = tokens.shape
        q, k, v = self.qkv(self.embed(tokens)).view(batch, length, 3, self.heads, -1).unbind(2)
        freqs_cis = self.freqs_cis[:length]
        q, k = _rotate(q, freqs_cis), _rotate(k, freqs_cis)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        logits = self.out(attended.transpose(1, 2).reshape(batch, length, -1)).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class _SpectralOperator(torch.nn.Module):
    """A 1-d Fourier neural operator layer: complex ``torch.cfloat`` weights on the lowest modes (computed in fp32
    whatever the input's dtype), and a complex buffer the forward updates (a running spectrum)."""

    def __init__(self, width=8, modes=4):
        super().__init__()
        self.modes = modes
        self.lift = torch.nn.Linear(2, width)
        self.weights = torch.nn.Parameter(torch.rand(width, width, modes, dtype=torch.cfloat) / width ** 2)
        self.pointwise = torch.nn.Conv1d(width, width, 1)
        self.project = torch.nn.Linear(width, 1)
        self.register_buffer("spectrum", torch.zeros(modes, dtype=torch.cfloat))

    def forward(self, x, y):
        h = self.lift(x).permute(0, 2, 1)
        spectrum = torch.fft.rfft(h.float())[..., :self.modes]
        with torch.no_grad():
            self.spectrum.mul_(0.9).add_(spectrum.mean(dim=(0, 1)) * 0.1)
        mixed = torch.zeros(h.shape[0], h.shape[1], h.shape[-1] // 2 + 1, dtype=torch.cfloat)
        mixed[..., :self.modes] = (torch.einsum("bix,iox->box", spectrum, self.weights) + self.spectrum).to(mixed.dtype)
        h = F.gelu(torch.fft.irfft(mixed, n=h.shape[-1]).type_as(h) + self.pointwise(h))
        return F.mse_loss(self.project(h.permute(0, 2, 1)).squeeze(-1), y)


def _operator_batches(size, steps=STEPS):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 16, 2, generator=generator), torch.randn(size, 16, generator=generator))
            for _ in range(steps)]


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _eager_in(dtype, model, optimizer, batch):
    """One eager step computed in ``dtype`` from fp32 masters: the floating parameters and inputs cast to it (as
    ``model.to(dtype)`` would not: it casts complex ones too, dropping their imaginary part), complex ones kept."""
    low = copy.deepcopy(model)
    for param in low.parameters():
        if param.is_floating_point():
            param.data = param.data.to(dtype)
    loss = low(*(t.to(dtype) if t.is_floating_point() else t for t in batch)).float()
    loss.backward()
    for master, computed in zip(model.parameters(), low.parameters()):
        master.grad = computed.grad.to(master.dtype)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for name, buffer in low.named_buffers():
        model.get_buffer(name).copy_(buffer)
    return loss.detach()


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 3])
def test_llama_rotary_embedding_bit_for_bit(stage, param_dtype):
    """Meta's reference RoPE (``torch.polar`` buffer, ``view_as_complex`` / ``view_as_real``) trains as eager,
    under ``param_dtype=torch.bfloat16`` too (``x.float()`` before the rotation, ``type_as(x)`` after)."""
    torch.manual_seed(0)
    reference = _RotaryAttention()
    model = copy.deepcopy(reference)
    optimizer = _adamw(reference)
    step = zerocc.compile(model, _adamw(model), stage=stage, param_dtype=param_dtype)
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        batch = tuple(torch.randint(0, 32, (4, 12), generator=generator) for _ in range(2))
        if param_dtype is None:
            optimizer.zero_grad()
            expected = reference(*batch)
            expected.backward()
            optimizer.step()
        else:
            expected = _eager_in(param_dtype, reference, optimizer, batch)
        assert torch.equal(step(*batch), expected.detach())
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_complex_parameters_keep_their_dtype_under_param_dtype(stage):
    """``param_dtype=torch.bfloat16`` casts the floating parameters; a complex one computes, and its gradient is
    reduced, in complex64. Its gradient bucket was cast to bf16 before the reduction (the imaginary part dropped,
    a wrong update without an error), and at stages 1-2 it got a bf16 compute copy."""
    torch.manual_seed(0)
    reference = _SpectralOperator()
    model = copy.deepcopy(reference)
    optimizer = _adamw(reference)
    step = zerocc.compile(model, _adamw(model), stage=stage, param_dtype=torch.bfloat16)
    for batch in _operator_batches(4):
        assert torch.equal(step(*batch), _eager_in(torch.bfloat16, reference, optimizer, batch))
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key
    assert full["weights"].dtype == torch.cfloat


def _beside_ddp(rank, world_size, memory_pools):
    """Each stage's losses and full state beside DDP's (the spectrum buffer: each rank's own, as DDP's)."""
    results = {}
    global_batches = _operator_batches(4 * world_size)
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        reference = _SpectralOperator()
        model = copy.deepcopy(reference)
        ddp = DistributedDataParallel(reference)
        optimizer = _adamw(reference)
        step = zerocc.compile(model, _adamw(model), stage=stage, memory_pools=memory_pools, clip_grad_norm=0.5)
        expected, got = [], []
        for batch in global_batches:
            local = tuple(t.chunk(world_size)[rank] for t in batch)
            optimizer.zero_grad()
            loss = ddp(*local)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
            optimizer.step()
            expected.append(loss.detach())
            got.append(step(*local))
        results[stage] = (expected, got, dict(reference.state_dict()), step.full_state_dict())
    return results


@pytest.mark.multirank
@pytest.mark.parametrize("memory_pools", [False, True], ids=["plain", "pools"])
def test_complex_parameters_and_buffers_across_two_ranks(memory_pools):
    """A complex parameter's bucket and a complex buffer on 2 gloo ranks, every stage, clipped: the program's
    gathers, reductions and buffer broadcast failed inside gloo ('Invalid scalar type'); they now send the real
    view and train as DDP does."""
    for rank, results in enumerate(distributed.run(_beside_ddp, 2, memory_pools)):
        for stage, (expected, got, expected_state, state) in results.items():
            torch.testing.assert_close(torch.stack(got), torch.stack(expected), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"stage {stage} rank {rank} losses: {m}")
            for key, value in expected_state.items():
                assert state[key].dtype == value.dtype, key
                torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"stage {stage} rank {rank} {key}: {m}")


def test_complex_checkpoint_exports_to_safetensors(tmp_path):
    """A checkpoint with complex64 entries (a parameter, a buffer) exports as safetensors' C64 and loads into a new
    model; the export raised KeyError 'complex64'. complex128, which safetensors has no dtype for, is refused naming
    the entry, before a file is written."""
    from zerocc.state_dict import read_safetensors
    torch.manual_seed(0)
    model = _SpectralOperator()
    step = zerocc.compile(model, _adamw(model), stage=3)
    for batch in _operator_batches(4):
        step(*batch)
    zerocc.save_checkpoint(step, str(tmp_path / "ckpt"))
    zerocc.export_full_state_dict(str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors"))
    fresh = _SpectralOperator()
    fresh.load_state_dict(read_safetensors(str(tmp_path / "model.safetensors")))
    for key, value in step.full_state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key

    wide = _SpectralOperator()
    wide.weights = torch.nn.Parameter(wide.weights.detach().to(torch.complex128))
    wide.spectrum = wide.spectrum.to(torch.complex128)
    step = zerocc.compile(wide, _adamw(wide), stage=0)
    zerocc.save_checkpoint(step, str(tmp_path / "wide"))
    with pytest.raises(zerocc.CheckpointError, match=r"no dtype for spectrum \(complex128\), weights \(complex128\)"):
        zerocc.export_full_state_dict(str(tmp_path / "wide"), str(tmp_path / "wide.safetensors"))
    assert not list(tmp_path.glob("wide.safetensors*"))
