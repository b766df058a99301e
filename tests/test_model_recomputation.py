"""A model's own activation checkpointing (``torch.utils.checkpoint``, Hugging Face's ``gradient_checkpointing_enable``).

Backward calls the checkpointed modules again, so the traced program must read
the traced parameters there, not the module's real ones; and the recomputation
rewinds the random generator to draw the forward's dropout masks again, which
the program replays (``zerocc/model_recomputation.py``). Both runs seed the
global generator the same way before each step; the compiled step equals eager
bit for bit, dropout on. Reentrant checkpointing is refused at its call.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import zerocc
from torch.nn.parallel import DistributedDataParallel

from tests import distributed
from tests.reference import adamw, assert_ranks_match_ddp, eager, eager_accumulated_step, mixed_eager_step


class Checkpointed(nn.Module):
    """Two blocks with dropout, each recomputed in backward."""

    def __init__(self, use_reentrant: bool = False):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 16), nn.Dropout(0.1))
            for _ in range(2))
        self.head = nn.Linear(16, 1)

    def forward(self, x, y=None):
        h = self.embed(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=self.use_reentrant)
        prediction = self.head(F.dropout(h, 0.1, self.training))
        return prediction if y is None else F.mse_loss(prediction, y)


class SelectivelyCheckpointed(Checkpointed):
    """The same blocks under selective checkpointing: the matmuls' outputs saved, the rest recomputed."""

    def forward(self, x, y=None):
        import functools
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        def policy(ctx, op, *args, **kwargs):
            return (CheckpointPolicy.MUST_SAVE if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
                    else CheckpointPolicy.PREFER_RECOMPUTE)
        h = self.embed(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=False,
                               context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
        return F.mse_loss(self.head(h), y)


def batches(steps=3):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=generator), torch.randn(6, 1, generator=generator)) for _ in range(steps)]


def assert_trains_like_eager(build, stage, batches, call=lambda step, batch: step(*batch),
                             eager_call=lambda model, optimizer, batch: eager(model, optimizer, *batch), **options):
    torch.manual_seed(0)
    reference = build()
    torch.manual_seed(0)
    model = build()
    reference_optimizer = adamw(reference)
    step = zerocc.compile(model, adamw(model), stage=stage, **options)
    for number, batch in enumerate(batches):
        torch.manual_seed(100 + number)
        expected = eager_call(reference, reference_optimizer, batch)
        torch.manual_seed(100 + number)
        assert torch.equal(call(step, batch), expected), number
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key
    return step


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_checkpointed_blocks_with_dropout_train_bit_for_bit(stage):
    assert_trains_like_eager(Checkpointed, stage, batches())


def test_checkpointed_blocks_with_dropout_accumulate_micro_batches_bit_for_bit():
    """Each micro-batch's recomputation replays its own forward's masks."""
    assert_trains_like_eager(Checkpointed, 2, batches(), grad_accumulation=2,
                             eager_call=lambda model, optimizer, batch: eager_accumulated_step(model, optimizer, None,
                                                                                               batch, 2)[0])


def test_checkpointed_blocks_with_dropout_in_bfloat16_train_like_hand_written_mixed_precision():
    """Recomputed in bfloat16 from the parameters' bfloat16 copies, as the forward computed."""
    assert_trains_like_eager(Checkpointed, 3, batches(), param_dtype=torch.bfloat16, loss_fn=F.mse_loss,
                             eager_call=lambda model, optimizer, batch: mixed_eager_step(model, optimizer, F.mse_loss,
                                                                                         batch, torch.bfloat16))


def _checkpointed_per_rank(rank, world_size):
    """Per rank, for stages 2 and 3: DDP's and the step's losses and final states, each step seeded alike."""
    local = [tuple(t[rank * 3:(rank + 1) * 3] for t in batch) for batch in batches()]
    results = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        reference = Checkpointed()
        ddp, reference_optimizer = DistributedDataParallel(reference), adamw(reference)
        torch.manual_seed(0)
        model = Checkpointed()
        step = zerocc.compile(model, adamw(model), stage=stage)
        expected, got = [], []
        for number, batch in enumerate(local):
            torch.manual_seed(100 + number)
            expected.append(eager(ddp, reference_optimizer, *batch))
            torch.manual_seed(100 + number)
            got.append(step(*batch))
        results[f"stage {stage}"] = (expected, got, reference.state_dict(), step.full_state_dict())
    return results


@pytest.mark.multirank
def test_checkpointed_blocks_with_dropout_sharded_across_ranks_match_ddp():
    """At stage 3 the recomputation reads parameters gathered again in backward."""
    assert_ranks_match_ddp(distributed.run(_checkpointed_per_rank, 2))


def test_reentrant_checkpointing_is_refused_at_its_call_with_the_fix_and_the_module_keeps_working():
    model = Checkpointed(use_reentrant=True)
    step = zerocc.compile(model, adamw(model), stage=3)
    with pytest.raises(zerocc.CaptureError, match=r"use_reentrant=True \(PyTorch's default where use_reentrant is "
                                                  r"not passed\) at .*test_model_recomputation\.py:\d+: "
                                                  r"h = h \+ checkpoint\(block.*Pass use_reentrant=False"):
        step(*batches(1)[0])
    assert "apply" not in torch.utils.checkpoint.CheckpointFunction.__dict__   # PyTorch's own, restored
    model(*batches(1)[0]).backward()   # eager still checkpoints reentrantly


class DrawsSomethingElse(nn.Module):
    """Its checkpointed function draws a dropout mask in forward and uniform noise when recomputed."""

    def __init__(self):
        super().__init__()
        self.inner, self.linear = nn.Linear(8, 8), nn.Linear(8, 1)
        self.calls = 0

    def noisy(self, x):
        self.calls += 1
        h = self.inner(x)
        return F.dropout(h, 0.5) if self.calls % 2 else h * torch.rand_like(h)

    def forward(self, x, y):
        return F.mse_loss(self.linear(checkpoint(self.noisy, x, use_reentrant=False)), y)


def test_a_recomputation_that_draws_other_random_numbers_is_refused_naming_both_lines():
    model = DrawsSomethingElse()
    step = zerocc.compile(model, adamw(model), stage=0)
    with pytest.raises(zerocc.CaptureError, match=r"(?s)rewound the random generator.*drew with aten\.rand_like.*"
                                                  r"test_model_recomputation\.py:\d+.*forward drew with "
                                                  r"aten\.bernoulli.*preserve_rng_state=False"):
        step(*batches(1)[0])


class Reseeds(nn.Module):
    """Reformer's pattern: a seed drawn in forward (``torch.seed()``), set again to recompute with the same masks."""

    def __init__(self, p):
        super().__init__()
        self.inner, self.linear, self.p = nn.Linear(8, 8), nn.Linear(8, 1), p

    def forward(self, x, y):
        seed = torch.seed()
        h = F.dropout(self.inner(x), self.p)
        torch.manual_seed(seed)
        again = F.dropout(self.inner(x), self.p)   # eager: the same mask as h
        return F.mse_loss(self.linear(h * again), y)


def test_a_step_that_reseeds_the_generator_and_then_draws_is_refused_naming_both_lines():
    """The program draws from the generator as it runs; before this refusal the two masks differed, silently."""
    model = Reseeds(0.5)
    step = zerocc.compile(model, adamw(model), stage=0)
    with pytest.raises(zerocc.CaptureError, match=r"(?s)reseeds the random generator at .*test_model_recomputation\.py:"
                                                  r"\d+: seed = torch\.seed\(\) and then draws with aten\.bernoulli.*"
                                                  r"h = F\.dropout.*dropout probability 0"):
        step(*batches(1)[0])
    for function in (torch.manual_seed, torch.seed, torch.random.manual_seed, torch.random.seed):   # torch's own again
        assert "traced_recomputation" not in function.__qualname__


def test_a_step_that_reseeds_the_generator_but_draws_nothing_trains_bit_for_bit():
    """Reformer with dropout 0 calls torch.seed() and torch.manual_seed() in every training forward."""
    assert_trains_like_eager(lambda: Reseeds(0.0), 3, batches())


def gpt2(transformers):   # dropout 0.1 in embeddings, attention and residuals (GPT2Config's defaults)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                                                n_positions=32))


def llama(transformers):   # the dropout inside the attention kernel (scaled_dot_product_attention's dropout_p)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=64, attention_dropout=0.1))


@pytest.mark.parametrize("stage,architecture", [(0, gpt2), (3, gpt2), (3, llama)],
                         ids=["gpt2-stage0", "gpt2-stage3", "llama-stage3"])
def test_hugging_face_activation_checkpointing_trains_bit_for_bit(stage, architecture):
    transformers = pytest.importorskip("transformers")

    def build():
        model = architecture(transformers)
        # transformers 5's name for it (gradient_checkpointing_enable before); non-reentrant by default
        enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
        enable()
        return model.train()

    generator = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 64, (2, 16), generator=generator) for _ in range(3)]

    def eager_call(model, optimizer, batch):
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        return loss.detach()

    assert_trains_like_eager(build, stage, ids, call=lambda step, batch: step(input_ids=batch, labels=batch),
                             eager_call=eager_call)


@pytest.mark.parametrize("stage", [0, 3])
def test_selective_checkpointing_saves_what_its_policy_says_and_trains_bit_for_bit(stage):
    """Selective checkpointing (``context_fn=create_selective_checkpoint_contexts``) saw the trace's proxy mode as
    torch.compile's and cached every op's output for the recomputation: a dropout in the block failed to compile
    ("Tensor cached during selective activation checkpoint has been mutated"), and without dropout nothing was
    recomputed. The step is traced as eager runs it: the GELUs are recomputed, the matmuls are not."""
    step = assert_trains_like_eager(SelectivelyCheckpointed, stage, batches())
    program = str(step.graph("capture"))
    assert program.count("aten.gelu.default") == 4   # two blocks' forward and recomputation
    assert program.count("aten.addmm.default") == 6   # embed, two per block, head: none recomputed


SAVED_STATE = torch.Generator().manual_seed(5).get_state()


class SetsAGenerator(nn.Module):
    """Forward seeds or sets a generator with the generator's own methods (which zerocc cannot patch), then or
    before drawing from it."""

    def __init__(self, how):
        super().__init__()
        self.linear, self.how, self.generator = nn.Linear(8, 1), how, torch.Generator()

    def forward(self, x, y):
        if self.how == "own generator seeded":
            self.generator.manual_seed(0)
            noise = torch.randn(x.shape, generator=self.generator)
        elif self.how == "default generator seeded":
            torch.default_generator.manual_seed(100)   # the state the loop seeds before the first call
            noise = torch.randn_like(x)
        elif self.how == "state set back":
            state = torch.default_generator.get_state()
            noise = torch.randn_like(x)
            torch.default_generator.set_state(state)
            noise = noise + torch.randn_like(x)
        elif self.how == "state of its own":
            torch.set_rng_state(SAVED_STATE)
            noise = torch.randn_like(x)
        else:   # "seeded after drawing"
            noise = torch.randn(x.shape, generator=self.generator)
            self.generator.manual_seed(3)
        return F.mse_loss(self.linear(x + noise), y)


@pytest.mark.parametrize("how", ["own generator seeded", "default generator seeded", "state set back",
                                 "state of its own", "seeded after drawing"])
def test_a_generator_seeded_or_set_inside_the_step_is_refused_naming_the_draw(how):
    """A trace runs Generator.manual_seed / set_state once; the program draws on from the generator's state without
    them: each of these trained with other random numbers than eager's, silently, from the second step on (the
    first, too, for a seed after the draw)."""
    model = SetsAGenerator(how)
    step = zerocc.compile(model, adamw(model), stage=0)
    torch.manual_seed(100)
    with pytest.raises(zerocc.CaptureError, match=r"seeds or sets the state of a random generator between .* and "
                                                  r"(.*test_model_recomputation\.py:\d+: .*randn|the step's end).*"
                                                  r"Seed or set the generator before calling the step"):
        step(*batches(1)[0])


class ForksTheGenerator(nn.Module):
    """Noise drawn inside torch.random.fork_rng (the global generator set back after it), then drawn again."""

    def __init__(self, again):
        super().__init__()
        self.linear, self.again = nn.Linear(8, 1), again

    def forward(self, x, y):
        with torch.random.fork_rng():
            noise = torch.randn(x.shape)
        noise = noise + torch.randn(x.shape if self.again == "alike" else (x.shape[0], 1))
        return F.mse_loss(F.dropout(self.linear(x + noise), 0.5), y)


def test_fork_rng_in_forward_replays_its_draws_as_eager_draws_them_again():
    assert_trains_like_eager(lambda: ForksTheGenerator("alike"), 0, batches())


def test_fork_rng_then_a_draw_of_another_size_is_refused_naming_the_fork():
    """After the rewind eager draws 6 numbers, the first one the forked draw's; the replay handed back the forked
    draw's (6, 1) tensor instead, silently (broadcast into the sum)."""
    model = ForksTheGenerator("other size")
    step = zerocc.compile(model, adamw(model), stage=0)
    with pytest.raises(zerocc.CaptureError, match=r"(?s)rewound the random generator at .*test_model_recomputation\.py:"
                                                  r"\d+: with torch\.random\.fork_rng\(\):.*drew with aten\.randn\.default"
                                                  r" at .*on other sizes or arguments"):
        step(*batches(1)[0])


class CheckpointedNoise(nn.Module):
    """A checkpointed block that draws its noise from a generator of its own, which checkpointing does not rewind."""

    def __init__(self):
        super().__init__()
        self.inner, self.linear, self.generator = nn.Linear(8, 8), nn.Linear(8, 1), torch.Generator().manual_seed(1)

    def block(self, x):
        return torch.tanh(self.inner(x) + torch.randn(x.shape, generator=self.generator))

    def forward(self, x, y):
        return F.mse_loss(self.linear(F.dropout(checkpoint(self.block, x, use_reentrant=False), 0.2)), y)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_checkpointed_block_drawing_from_a_generator_of_its_own_draws_anew_in_the_recomputation(stage):
    """torch.utils.checkpoint rewinds torch's generators only: eager's recomputation draws new noise from the
    block's own generator (which advances twice a step). The program replayed the forward's noise instead, as for
    a draw from torch's generator: other gradients and another generator state than eager's, silently."""
    assert_trains_like_eager(CheckpointedNoise, stage, batches())
