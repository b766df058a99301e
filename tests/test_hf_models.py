"""Hugging Face ``transformers`` models, tiny and randomly initialized (no download), train at stages 1-3.

Each compiled step equals eager PyTorch bit for bit for two steps (losses and
every parameter), dropout included: both runs seed the global generator the
same way before each step, and the compiled step draws its random numbers in
eager's order. Skipped when transformers is not installed (it is in the
``test`` extra).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import zerocc
from tests import distributed
from tests.helpers import assert_rank_matches_reference
from tests.reference import mixed_eager_step, train_eagerly

transformers = pytest.importorskip("transformers")

VOCAB = 128


def causal_lm_loss(output, labels):
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def token_loss(output, labels):
    return F.cross_entropy(output.logits.reshape(-1, output.logits.shape[-1]), labels.reshape(-1))


def gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def llama():
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def bert():
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                     vocab_size=VOCAB, max_position_embeddings=64)
    return transformers.BertForMaskedLM(config)


def t5():
    config = transformers.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, d_kv=16, num_heads=2,
                                   vocab_size=VOCAB, decoder_start_token_id=0)
    return transformers.T5ForConditionalGeneration(config)


def causal_batch(generator):
    ids = torch.randint(0, VOCAB, (4, 16), generator=generator)
    return ids, ids


def masked_batch(generator):
    return torch.randint(0, VOCAB, (4, 16), generator=generator), torch.randint(0, VOCAB, (4, 16), generator=generator)


def seq2seq_batch(generator):
    # positional: T5's forward is (input_ids, attention_mask, decoder_input_ids, ...)
    ids = torch.randint(0, VOCAB, (4, 16), generator=generator)
    decoder_ids = torch.randint(0, VOCAB, (4, 8), generator=generator)
    return ids, torch.ones_like(ids), decoder_ids, torch.roll(decoder_ids, -1, dims=1)


# name -> (model factory, batch maker, loss_fn(output, labels))
MODELS = {
    "gpt2": (gpt2, causal_batch, causal_lm_loss),
    "llama": (llama, causal_batch, causal_lm_loss),
    "bert": (bert, masked_batch, token_loss),
    "t5": (t5, seq2seq_batch, token_loss),
}


def build(name):
    torch.manual_seed(0)
    return MODELS[name][0]()


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_tiny_transformers_train_bit_for_bit(name, stage):
    _, batch_maker, loss_fn = MODELS[name]
    reference = build(name)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    model = build(name)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=stage, loss_fn=loss_fn)
    generator = torch.Generator().manual_seed(1)
    for number in range(2):
        batch = batch_maker(generator)
        torch.manual_seed(100 + number)
        reference_optimizer.zero_grad(set_to_none=True)
        expected = loss_fn(reference(*batch[:-1]), batch[-1])
        expected.backward()
        reference_optimizer.step()
        torch.manual_seed(100 + number)
        assert torch.equal(step(*batch), expected), number
    full = step.full_state_dict()
    assert full.keys() == reference.state_dict().keys()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key


def keyword_batches(name, generator):
    """Batches as Hugging Face users write them: keyword arguments, the labels among them, the loss in the output."""
    ids = torch.randint(0, VOCAB, (4, 16), generator=generator)
    if name == "t5":
        decoder_ids = torch.randint(0, VOCAB, (4, 8), generator=generator)
        return dict(input_ids=ids, decoder_input_ids=decoder_ids, labels=torch.roll(decoder_ids, -1, dims=1),
                    use_cache=False)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, use_cache=False)


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
def test_a_keyword_batch_trains_bit_for_bit_and_evaluates(name):
    reference = build(name)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    model = build(name)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=3)   # no loss_fn: output.loss
    generator = torch.Generator().manual_seed(1)
    for number in range(3):
        batch = keyword_batches(name, generator)
        expected = train_eagerly(reference, reference_optimizer, batch, seed=100 + number)
        torch.manual_seed(100 + number)
        shuffled = dict(reversed(list(batch.items())))   # the keywords' order does not make a new program
        assert torch.equal(step(**shuffled), expected), number
    assert len(step.cache.programs()) == 1   # the first step runs the steady state's program too (optimizer_init.py)
    for key, value in reference.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key
    reference.eval()
    batch.pop("labels")
    with torch.no_grad():
        expected_logits = reference(**batch).logits
    assert torch.equal(step.eval_forward(**batch).logits, expected_logits)
    # with the generation cache a causal LM makes in eval mode by default (it was refused, asking for
    # use_cache=False): the same logits, the cache left out, and a warning that says so
    with pytest.warns(UserWarning, match=r"eval_forward returns the model's generation cache .* as None"):
        output = step.eval_forward(**{**batch, "use_cache": True})
    assert torch.equal(output.logits, expected_logits)
    assert getattr(output, "past_key_values", None) is None


def test_use_cache_true_trains_bit_for_bit_on_the_loss_alone():
    """getting-started.md: the training step keeps only the loss of an output holding a DynamicCache
    (``use_cache=True``), as eager's ``output.loss.backward()`` does; eval_forward, which returns the output,
    returns it without the cache (above)."""
    reference, model = build("llama"), build("llama")
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=3)
    generator = torch.Generator().manual_seed(1)
    for number in range(2):
        batch = {**keyword_batches("llama", generator), "use_cache": True}
        expected = train_eagerly(reference, reference_optimizer, batch, seed=100 + number)
        torch.manual_seed(100 + number)
        assert torch.equal(step(**batch), expected), number
    for key, value in reference.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key


def test_targets_are_the_last_positional_arguments_and_keywords_go_to_the_model():
    reference, model = build("gpt2"), build("gpt2")
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=1, loss_fn=causal_lm_loss)
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    with pytest.raises(zerocc.ConfigError, match=r"got 0 positional argument\(s\) but 1 target\(s\) were declared "
                                                 r"\(targets are the last positional arguments; keyword arguments go "
                                                 r"to the model\)"):
        step(input_ids=ids, labels=ids)
    torch.manual_seed(0)
    expected = causal_lm_loss(reference(ids, attention_mask=mask, use_cache=False), ids)
    torch.manual_seed(0)
    assert torch.equal(step(ids, ids, attention_mask=mask, use_cache=False), expected.detach())


def test_plan_takes_a_keyword_batch_and_plans_what_the_compiled_step_runs():
    batches = [keyword_batches("gpt2", torch.Generator().manual_seed(seed)) for seed in (1, 2)]
    model = build("gpt2")
    planned = zerocc.plan(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=3,
                          example_keyword_inputs=batches[0])
    model = build("gpt2")
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=3)
    for batch in batches:   # the second call compiles the steady state, which the planner plans
        step(**batch)
    assert planned.memory_plan.live_peak_bytes == step.report()["live_peak_bytes"]


def mask_batches(masks, generator, steps=4):
    """(ids, attention_mask, labels) per step: an all-ones mask (a tokenizer's unpadded batch), one padded row, or
    the two by turns."""
    batches = []
    for number in range(steps):
        ids = torch.randint(0, VOCAB, (4, 16), generator=generator)
        mask = torch.ones_like(ids)
        if masks == "padded" or masks == "alternating" and number % 2:
            mask[1, 12:] = 0
        batches.append((ids, mask, ids))
    return batches


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name, masks", [("llama", "all ones"), ("llama", "padded"), ("llama", "alternating"),
                                         ("bert", "alternating")])
def test_an_attention_mask_trains_bit_for_bit_whether_eager_drops_it_or_not(name, masks, param_dtype):
    """Eager's mask helpers (transformers/masking_utils.py) drop an all-ones mask (SDPA's is_causal instead), which
    rounds otherwise than the masked kernel (bf16); the branch is decided on the batch (zerocc/data_guards.py):
    the compiled step takes eager's side, and a padded batch compiles the other side once."""
    _, _, loss_fn = MODELS[name]
    reference = build(name)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    model = build(name)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=3, loss_fn=loss_fn,
                          param_dtype=param_dtype)
    for number, batch in enumerate(mask_batches(masks, torch.Generator().manual_seed(1))):
        torch.manual_seed(100 + number)
        expected = mixed_eager_step(reference, reference_optimizer, loss_fn, batch, param_dtype)
        torch.manual_seed(100 + number)
        assert torch.equal(step(*batch), expected), number
    for key, value in reference.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key
    assert len(step.compile_stats) == (2 if masks == "alternating" else 1)   # each side compiled once


def eager_keyword_step(master, optimizer, batch, dtype):
    """One eager step of a model that computes its loss from a keyword batch, on a copy of its parameters cast
    to ``dtype`` (buffers as they are), fp32 gradients to the masters."""
    low = copy.deepcopy(master)
    for param in low.parameters():
        param.data = param.data.to(dtype)
    loss = low(**batch).loss
    loss.backward()
    for param, computed in zip(master.parameters(), low.parameters()):
        param.grad = computed.grad.to(param.dtype)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_llama_without_a_mask_and_with_gradient_checkpointing_trains_bit_for_bit(param_dtype):
    """use_cache=False and no attention_mask (what activation_checkpointing_enable sets): eager's mask helpers skip
    the causal mask there too; deciding whether the positions are packed sequences needs no guard (the positions
    are the model's own arange, the same every step)."""
    reference, model = build("llama"), build("llama")
    for each in (reference, model):
        each.activation_checkpointing_enable()   # gradient_checkpointing_enable, renamed
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=3, param_dtype=param_dtype)
    generator = torch.Generator().manual_seed(1)
    for number in range(3):
        ids = torch.randint(0, VOCAB, (4, 16), generator=generator)
        batch = dict(input_ids=ids, labels=ids, use_cache=False)
        assert torch.equal(step(**batch), eager_keyword_step(reference, reference_optimizer, batch, param_dtype)), number
    for key, value in reference.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key
    assert step.cache.last.program.guards == ()


def _llama_with_masks_on_ranks(rank, world_size):
    """Each rank's batches, all-ones masks but a padded row on rank 1 at step 1 and on rank 0 at step 3; the
    hand-written bf16 reference (fp32 gradients summed across ranks) and the compiled step."""
    generator = torch.Generator().manual_seed(1)
    data = []
    for number in range(4):
        ids = torch.randint(0, VOCAB, (4 * world_size, 16), generator=generator).chunk(world_size)[rank]
        mask = torch.ones_like(ids)
        if (number, rank) in ((1, 1), (3, 0)):
            mask[1, 12:] = 0
        data.append((ids, mask, ids))
    reference = build("llama")
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    expected = [mixed_eager_step(reference, reference_optimizer, causal_lm_loss, batch, torch.bfloat16,
                                 world_size=world_size) for batch in data]
    model = build("llama")
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=3, loss_fn=causal_lm_loss,
                          param_dtype=torch.bfloat16, reduce_dtype=torch.float32, timeout=60)
    losses = [step(*batch) for batch in data]
    return expected, losses, reference.state_dict(), step.full_state_dict(), len(step.compile_stats)


@pytest.mark.multirank
def test_llama_with_a_padded_batch_on_one_rank_trains_as_the_reference_on_two_ranks():
    """The mask shortcut is decided per rank's batch: a rank whose batch is padded takes the masked side while the
    other takes eager's shortcut, and every rank compiles when one's side has no program yet."""
    for rank, (expected, losses, expected_state, state, compiles) in enumerate(
            distributed.run(_llama_with_masks_on_ranks, 2, timeout=300)):
        assert_rank_matches_reference(rank, losses, expected, state, expected_state, state_rtol=1e-4, state_atol=1e-5)
        assert compiles == 3   # the first batch, and each step one rank's batch took the other side (both ranks)


def _trainer_optimizer(model):
    """What the Trainer's create_optimizer builds with optim="adamw_torch": weight decay off for biases and norms."""
    decay = transformers.trainer_pt_utils.get_parameter_names(model, [torch.nn.LayerNorm], ["bias"])
    groups = [{"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": 0.1},
              {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-2)
    return optimizer, transformers.get_cosine_schedule_with_warmup(optimizer, 2, 6)


@pytest.mark.parametrize("stage", [0, 3])
def test_what_a_trainer_subclass_runs_around_the_step_trains_as_the_trainers_own_step(stage):
    """docs/guide/training-loops.md's Trainer recipe without the Trainer (it needs accelerate): gradient
    checkpointing without reentrancy enabled before compiling, the Trainer's LabelSmoother normalized by the step's
    token count (a tensor, counted over the unshifted labels as the Trainer counts), its weight-decay groups and a
    cosine schedule with warm-up stepped after each step: bit for bit the Trainer's eager training_step."""
    smoother = transformers.trainer_pt_utils.LabelSmoother(epsilon=0.1)

    def loss_fn(output, labels, num_items_in_batch):
        return smoother(output, labels, shift_labels=True, num_items_in_batch=num_items_in_batch)

    generator = torch.Generator().manual_seed(1)
    data = []
    for _ in range(4):
        ids = torch.randint(0, VOCAB, (4, 16), generator=generator)
        labels = ids.masked_fill(torch.rand(ids.shape, generator=generator) < 0.2, -100)
        data.append((ids, labels, labels.ne(-100).sum()))
    torch.manual_seed(0)
    reference = gpt2()
    model = copy.deepcopy(reference)
    for m in (reference, model):
        m.config.use_cache = False
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer, schedule = _trainer_optimizer(model)
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=loss_fn, clip_grad_norm=1.0)
    eager, eager_schedule = _trainer_optimizer(reference)
    for seed, (ids, labels, count) in enumerate(data):
        torch.manual_seed(seed)    # GPT-2's dropout draws the same masks in both
        loss = loss_fn(reference(ids), labels, count)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        eager.step()
        eager.zero_grad()
        eager_schedule.step()
        torch.manual_seed(seed)
        assert torch.equal(step(ids, labels, count), loss.detach())
        assert torch.equal(step.last_grad_norm, norm)
        schedule.step()
        assert optimizer.param_groups[0]["lr"] == eager.param_groups[0]["lr"]
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in step.full_state_dict().items())
