"""Resume with something changed, the way users do: a checkpoint saved by one run, loaded in a NEW process
(``tests/distributed.py``: state passes only through files) into a step built with another learning rate,
scheduler, optimizer class, model, option or world size, then trained on.

The reference is eager PyTorch doing the same: ``model.load_state_dict`` / ``optimizer.load_state_dict`` of the
same state, the same change, the same steps (bit for bit at world size 1). Changes eager cannot take either (a
model of other shapes) must be refused naming the tensors and the way out (docs/guide/checkpoints.md, "Resuming
with changes").
"""
from __future__ import annotations

import os
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerocc
from tests import distributed

K = 2   # steps before and after the save
V, D = 48, 16

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class LM(nn.Module):
    """A tiny language model with tied embeddings, optionally another layer or a classification head."""

    def __init__(self, vocab=V, layers=2, head=None):
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, 32), nn.GELU(), nn.Linear(32, D)) for _ in range(layers))
        self.norm = nn.LayerNorm(D)
        self.out = nn.Linear(D, vocab, bias=False)
        self.out.weight = self.emb.weight
        self.cls = nn.Linear(D, head) if head else None

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        h = self.norm(h)
        return self.cls(h.mean(1)) if self.cls is not None else self.out(h)


def lm_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def data(steps, rows=8):
    generator = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, V, (rows, 9), generator=generator) for _ in range(steps)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-1, momentum=0.9),
    "sgd_nesterov": lambda params: torch.optim.SGD(params, lr=1e-1, momentum=0.9, nesterov=True),
}


def eager_train(model, optimizer, batches, scheduler=None):
    losses = []
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        if scheduler is not None:
            scheduler.step()
    return losses


def _save(rank, world_size, kind, stage, folder, options=None):
    """The first run: K steps with zerocc, saved; and the same K steps eagerly, saved with torch.save."""
    torch.manual_seed(0)
    model = LM()
    step = zerocc.compile(model, OPTIMIZERS[kind](model.parameters()), stage=stage, loss_fn=lm_loss, **(options or {}))
    for batch in data(K):
        step(*batch)
    zerocc.save_checkpoint(step, f"{folder}/ckpt")
    torch.manual_seed(0)
    model = LM()
    optimizer = OPTIMIZERS[kind](model.parameters())
    eager_train(model, optimizer, data(K))
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, f"{folder}/eager.pt")


def _change(change, optimizer):
    """What the user does after loading; returns the scheduler it makes, if any."""
    group = optimizer.param_groups[0]
    if change == "lr and weight decay":
        group["lr"], group["weight_decay"] = 3e-3, 0.01
    elif change == "betas and eps":
        group["betas"], group["eps"] = (0.8, 0.95), 1e-6
    elif change == "weight decay":
        group["weight_decay"] = 0.1
    elif change == "nesterov":
        group["nesterov"] = True
    elif change == "cosine from the resumed step":   # the first run had no scheduler: no initial_lr to resume from
        group.setdefault("initial_lr", group["lr"])
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10, last_epoch=K - 1)
    elif change == "warm restarts":
        return torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=2)
    return None


def _resume(rank, world_size, change, kind, stage, folder):
    """A new process: zerocc's resume and eager's, with the same change; both losses and weights."""
    batches = data(2 * K)[K:]
    torch.manual_seed(5)   # other weights: everything must come from the files
    model = LM()
    optimizer = OPTIMIZERS[kind](model.parameters())
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=lm_loss)
    zerocc.load_checkpoint(step, f"{folder}/ckpt")
    scheduler = _change(change, optimizer)
    losses = []
    for batch in batches:
        losses.append(step(*batch))
        if scheduler is not None:
            scheduler.step()

    saved = torch.load(f"{folder}/eager.pt")
    eager_model = LM()
    eager_optimizer = OPTIMIZERS[kind](eager_model.parameters())
    eager_model.load_state_dict(saved["model"])
    eager_optimizer.load_state_dict(saved["optim"])
    eager_losses = eager_train(eager_model, eager_optimizer, batches, _change(change, eager_optimizer))
    return losses, eager_losses, step.full_state_dict(), eager_model.state_dict()


def assert_equal_to_eager(result):
    losses, eager_losses, weights, eager_weights = result
    assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses)), (losses, eager_losses)
    assert all(torch.equal(v, eager_weights[k]) for k, v in weights.items())


@pytest.mark.multirank   # a new process per phase (tests/distributed.py)
@pytest.mark.parametrize("change,saved_with,resumed_with,stage", [
    ("lr and weight decay", "adamw", "adamw", 3),
    ("betas and eps", "adamw", "adamw", 1),
    ("cosine from the resumed step", "adamw", "adamw", 2),
    ("warm restarts", "adamw", "adamw", 0),
    # eager's AdamW.__setstate__ sets decoupled_weight_decay back to True over Adam's saved False: the restored
    # groups kept Adam's, and the step trained Adam's coupled weight decay
    ("weight decay", "adam", "adamw", 1),
    ("none", "adamw", "adam", 3),
    ("nesterov", "sgd", "sgd_nesterov", 2),
])
def test_a_resume_with_new_settings_or_another_optimizer_class_equals_eager(tmp_path, change, saved_with, resumed_with, stage):
    distributed.run(_save, 1, saved_with, stage, str(tmp_path))
    assert_equal_to_eager(distributed.run(_resume, 1, change, resumed_with, stage, str(tmp_path))[0])


# -- options changed on resume: the reference is the eager state loaded before compile, with the same options ---------
def _resume_with_options(rank, world_size, stage, options, folder):
    batches = data(2 * K)[K:]
    torch.manual_seed(5)
    model = LM()
    step = zerocc.compile(model, OPTIMIZERS["adamw"](model.parameters()), stage=stage, loss_fn=lm_loss, **options)
    zerocc.load_checkpoint(step, f"{folder}/ckpt")
    losses = [step(*batch) for batch in batches]
    saved = torch.load(f"{folder}/eager.pt")
    model = LM()
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optim"])
    reference = zerocc.compile(model, optimizer, stage=stage, loss_fn=lm_loss, **options)
    return losses, [reference(*batch) for batch in batches], step.full_state_dict(), reference.full_state_dict()


@pytest.mark.multirank   # a new process per phase (tests/distributed.py)
@pytest.mark.parametrize("saved_options,stage,options", [
    ({}, 2, {"param_dtype": torch.bfloat16, "grad_accumulation": 2, "clip_grad_norm": 0.5}),
    ({"param_dtype": torch.bfloat16}, 3, {"memory_budget": 10 ** 6, "memory_pools": False}),
])
def test_a_resume_with_other_options_equals_loading_the_eager_state_before_compile(tmp_path, saved_options, stage, options):
    distributed.run(_save, 1, "adamw", 1, str(tmp_path), saved_options)
    if saved_options:   # the eager state of a bf16 run is what step.close() hands back, not an fp32 eager run's
        distributed.run(_closed_state, 1, str(tmp_path), saved_options)
    assert_equal_to_eager(distributed.run(_resume_with_options, 1, stage, options, str(tmp_path))[0])


def _closed_state(rank, world_size, folder, options):
    torch.manual_seed(0)
    model = LM()
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    step = zerocc.compile(model, optimizer, stage=1, loss_fn=lm_loss, **options)
    for batch in data(K):
        step(*batch)
    step.close()
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, f"{folder}/eager.pt")


# -- fine-tuning: another model, or an optimizer over fewer parameters ----------------------------------------------
def _frozen_backbone():
    model = LM()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("norm"))
    return model


@pytest.mark.multirank   # a new process per phase (tests/distributed.py)
@pytest.mark.parametrize("changed,names", [
    (lambda: LM(head=3), ["model/cls.bias", "model/cls.weight"]),
    (lambda: LM(layers=3), ["model/blocks.2.0.bias"]),
    (lambda: LM(vocab=V + 8), ["emb.weight: (48, 16) in the checkpoint, (56, 16) here"]),
    (_frozen_backbone, ["the checkpoint's 'emb.weight' (11 in all), this one's 'norm.weight' (2 in all)"]),
], ids=["new head", "one more layer", "resized tied vocabulary", "optimizer over fewer parameters"])
def test_a_checkpoint_into_a_changed_model_is_refused_naming_the_tensors_and_the_way_out(tmp_path, changed, names):
    distributed.run(_save, 1, "adamw", 3, str(tmp_path))
    model = changed()
    step = zerocc.compile(model, OPTIMIZERS["adamw"](p for p in model.parameters() if p.requires_grad), stage=3,
                          loss_fn=lm_loss)
    with pytest.raises(zerocc.ConfigError) as error:
        zerocc.load_checkpoint(step, tmp_path / "ckpt")
    message = str(error.value)
    assert all(name in message for name in names), message
    assert "zerocc.export_full_state_dict" in message and "strict=False" in message, message


def _fine_tune(rank, world_size, folder):
    """The documented route: the checkpoint's weights into a model with a new head, before compile."""
    zerocc.export_full_state_dict(f"{folder}/ckpt", f"{folder}/model.safetensors")
    weights = zerocc.state_dict.read_safetensors(f"{folder}/model.safetensors")
    loss_fn = lambda out, y: F.cross_entropy(out, y[:, 0] % 3)   # noqa: E731
    results = []
    for state in (weights, torch.load(f"{folder}/eager.pt")["model"]):
        torch.manual_seed(5)
        model = LM(head=3)
        missing = model.load_state_dict(state, strict=False).missing_keys
        assert sorted(missing) == ["cls.bias", "cls.weight"], missing
        optimizer = OPTIMIZERS["adamw"](model.parameters())
        if not results:
            step = zerocc.compile(model, optimizer, stage=2, loss_fn=loss_fn)
            results += [[step(*batch) for batch in data(2 * K)[K:]], step.full_state_dict()]
            continue
        losses = []
        for x, y in data(2 * K)[K:]:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        return results[0], losses, results[1], model.state_dict()


@pytest.mark.multirank   # a new process per phase (tests/distributed.py)
def test_fine_tuning_a_new_head_from_the_exported_weights_equals_eager(tmp_path):
    distributed.run(_save, 1, "adamw", 3, str(tmp_path))
    assert_equal_to_eager(distributed.run(_fine_tune, 1, str(tmp_path))[0])


# -- world size, stage, options and batch size per rank changed together: 2 -> 1 -> 2 ranks ------------------------
def _phase(rank, world_size, stage, options, rows, first, folder):
    torch.manual_seed(0 if first == 0 else 5)
    model = LM()
    step = zerocc.compile(model, OPTIMIZERS["adamw"](model.parameters()), stage=stage, loss_fn=lm_loss, **options)
    if first:
        zerocc.load_checkpoint(step, f"{folder}/ckpt")
    per_rank = rows // world_size
    batches = [(x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank])
               for x, y in data(first + K, rows)[first:]]
    losses = [step(*batch) for batch in batches]
    zerocc.save_checkpoint(step, f"{folder}/ckpt")
    return losses, step.full_state_dict()


@pytest.mark.multirank
def test_resharding_with_other_options_and_batch_sizes_on_each_resume_matches_eager(tmp_path):
    phases = [(2, 3, {}, 8), (1, 2, {"grad_accumulation": 2}, 8), (2, 1, {"clip_grad_norm": 100.0}, 16)]
    torch.manual_seed(0)
    model = LM()
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    for number, (world_size, stage, options, rows) in enumerate(phases):
        got = distributed.run(_phase, world_size, stage, options, rows, number * K, str(tmp_path))
        expected = eager_train(model, optimizer, data((number + 1) * K, rows)[number * K:])
        global_losses = [torch.stack(losses).mean() for losses in zip(*(result[0] for result in got))]
        torch.testing.assert_close(global_losses, expected, rtol=1e-5, atol=1e-5)
        for name, tensor in model.state_dict().items():
            torch.testing.assert_close(got[0][1][name], tensor, rtol=1e-4, atol=1e-5)


# -- a Hugging Face model: zerocc -> export -> eager fine-tuning (from_pretrained, save_pretrained) -> zerocc ---------
def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                      tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config)


def _tokens():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (2, 16), generator=generator) for _ in range(3 * K)]


def _eager_hf(model, optimizer, batches):
    losses = []
    for ids in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def _hf_phase(rank, world_size, phase, folder):
    from transformers import LlamaForCausalLM
    tokens = _tokens()
    if phase == "zerocc":
        model = _llama()
        step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=3)
        for ids in tokens[:K]:
            step(input_ids=ids, labels=ids)
        zerocc.save_checkpoint(step, f"{folder}/ckpt")
        with pytest.raises(zerocc.ConfigError, match="does not exist; create it first"):   # a FileNotFoundError on .partial
            zerocc.export_full_state_dict(f"{folder}/ckpt", f"{folder}/hf/model.safetensors")
        os.makedirs(f"{folder}/hf")
        zerocc.export_full_state_dict(f"{folder}/ckpt", f"{folder}/hf/model.safetensors")
        model.config.save_pretrained(f"{folder}/hf")
        return None
    if phase == "eager":   # Trainer-style: from_pretrained, a fresh optimizer, save_pretrained
        model = LlamaForCausalLM.from_pretrained(f"{folder}/hf")
        model.train()
        losses = _eager_hf(model, torch.optim.AdamW(model.parameters(), lr=5e-4), tokens[K:2 * K])
        model.save_pretrained(f"{folder}/hf2")
        return losses
    model = LlamaForCausalLM.from_pretrained(f"{folder}/hf2")   # and back into zerocc
    model.train()
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=2)
    return [step(input_ids=ids, labels=ids) for ids in tokens[2 * K:]], step.full_state_dict()


@pytest.mark.multirank   # a new process per phase (tests/distributed.py)
@pytest.mark.slow   # three processes that each import transformers: about 90 s on a busy 2-core machine
def test_a_hf_model_from_zerocc_to_eager_fine_tuning_and_back_equals_eager_throughout(tmp_path):
    distributed.run(_hf_phase, 1, "zerocc", str(tmp_path))
    fine_tuned = distributed.run(_hf_phase, 1, "eager", str(tmp_path))[0]
    losses, weights = distributed.run(_hf_phase, 1, "back", str(tmp_path))[0]
    model = _llama()
    tokens = _tokens()
    _eager_hf(model, torch.optim.AdamW(model.parameters(), lr=1e-3), tokens[:K])
    assert all(torch.equal(a, b) for a, b in zip(fine_tuned, _eager_hf(model, torch.optim.AdamW(model.parameters(), lr=5e-4),
                                                                         tokens[K:2 * K])))
    expected = _eager_hf(model, torch.optim.AdamW(model.parameters(), lr=1e-3), tokens[2 * K:])
    assert all(torch.equal(a, b) for a, b in zip(losses, expected)), (losses, expected)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())
