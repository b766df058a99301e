"""Hugging Face ``transformers`` architectures, tiny and randomly initialized (no download), for the model zoo.

Each entry builds a model from a small config (hidden size 32-64, one or two
layers, vocabulary 128, short inputs) and makes keyword batches as users
write them, the labels among them, so the loss is the model's own
``output.loss``. ``tests.reference.train_eagerly`` is the reference a compiled step must
reproduce: the global generator is seeded the same way before each step on
both sides, so dropout draws the same masks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import transformers

VOCAB = 128
TOKENS = (2, 16)   # batch, sequence


@dataclass(frozen=True)
class Architecture:
    family: str
    build: Callable[[], torch.nn.Module]   # a fresh model, seeded
    batch: Callable[[torch.Generator, int], dict]   # (generator, batch size) -> keyword batch, labels included


def _seeded(make_model):
    def build():
        torch.manual_seed(0)
        return make_model()
    return build


def _tokens(generator, rows):
    # no use_cache=False: without a cache and a mask, transformers looks for packed sequences in position_ids and,
    # in eager only (a data-dependent shortcut it skips under tracing), drops the causal mask for SDPA's is_causal;
    # the traced step then runs the masked kernel, equal in the forward but off by ulps in the backward
    ids = torch.randint(0, VOCAB, (rows, TOKENS[1]), generator=generator)
    return dict(input_ids=ids, labels=ids)


def _masked_tokens(generator, rows):
    ids = torch.randint(0, VOCAB, (rows, TOKENS[1]), generator=generator)
    return dict(input_ids=ids, labels=torch.randint(0, VOCAB, (rows, TOKENS[1]), generator=generator))


def _seq2seq(generator, rows):
    ids = torch.randint(0, VOCAB, (rows, TOKENS[1]), generator=generator)
    return dict(input_ids=ids, labels=torch.randint(1, VOCAB, (rows, 6), generator=generator), use_cache=False)


def _images(classes):
    def batch(generator, rows):
        return dict(pixel_values=torch.randn(rows, 3, 32, 32, generator=generator),
                    labels=torch.randint(0, classes, (rows,), generator=generator))
    return batch


def _segmentation(generator, rows):
    return dict(pixel_values=torch.randn(rows, 3, 32, 32, generator=generator),
                labels=torch.randint(0, 4, (rows, 32, 32), generator=generator))


def _speech_ctc(generator, rows):
    return dict(input_values=torch.randn(rows, 400, generator=generator),
                labels=torch.randint(1, 16, (rows, 4), generator=generator))


def _speech_seq2seq(generator, rows):
    return dict(input_features=torch.randn(rows, 16, 32, generator=generator),
                labels=torch.randint(1, VOCAB, (rows, 6), generator=generator), use_cache=False)


def _image_text(generator, rows):
    return dict(input_ids=torch.randint(0, VOCAB, (rows, 8), generator=generator),
                pixel_values=torch.randn(rows, 3, 32, 32, generator=generator), return_loss=True)


# Sizes most configs share: two layers of width 32 with 4 heads (2 key-value heads), vocabulary 128.
_DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)
_ENCODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64)
# Four experts, two per token (transformers' default experts implementation: grouped_mm).
_MOE = dict(_DECODER, num_hidden_layers=1, num_experts_per_tok=2)
_VISION = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=32, intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=4)


def _causal(config_class, model_class, family="decoder LM", **sizes):
    return Architecture(family, _seeded(lambda: model_class(config_class(**sizes))), _tokens)


def _t(name):
    return getattr(transformers, name)


def mixtral(**options):
    return _t("MixtralForCausalLM")(_t("MixtralConfig")(**_MOE, num_local_experts=4, **options))


def qwen2_moe(**options):
    return _t("Qwen2MoeForCausalLM")(_t("Qwen2MoeConfig")(**_MOE, num_experts=4, moe_intermediate_size=32,
                                                            shared_expert_intermediate_size=32, **options))


def qwen3_moe(**options):
    return _t("Qwen3MoeForCausalLM")(_t("Qwen3MoeConfig")(**_MOE, num_experts=4, moe_intermediate_size=32, head_dim=8,
                                                            **options))


def olmoe(**options):
    return _t("OlmoeForCausalLM")(_t("OlmoeConfig")(**_MOE, num_experts=4, **options))


def deepseek_v3(**options):
    config = _t("DeepseekV3Config")(**dict(_MOE, num_hidden_layers=2, num_key_value_heads=4), n_routed_experts=4, n_shared_experts=1,
                                     moe_intermediate_size=32, first_k_dense_replace=1, n_group=2, topk_group=1,
                                     kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                     v_head_dim=8, **options)
    return _t("DeepseekV3ForCausalLM")(config)


def jamba(**options):
    config = _t("JambaConfig")(**dict(_MOE, num_hidden_layers=2), num_experts=4, expert_layer_period=2,
                               expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8,
                               mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False, **options)
    return _t("JambaForCausalLM")(config)


# name -> builder(**config options): the mixture-of-experts models, also trained with each experts implementation
MIXTURES_OF_EXPERTS = {
    "mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe, "olmoe": olmoe,
    "deepseek_v3": deepseek_v3, "jamba": jamba,
}


def _moe(config, model, **sizes):
    """A causal-LM MoE of transformers beyond the zoo's six: two layers, four experts, two per token."""
    common = dict(_MOE, num_hidden_layers=2, head_dim=8, moe_intermediate_size=32, num_local_experts=4, num_experts=4,
                  n_routed_experts=4)

    def build(**options):
        return _t(model)(_t(config)(**{**common, **sizes, **options}))
    return build


_LINEAR_ATTENTION = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                         shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"])
_GROUPED_ROUTING = dict(n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1)

# more mixture-of-experts architectures of transformers 5.23, each with its own router, experts or attention:
# trained at stage 3 by tests/test_moe.py (-m slow). Left out, refused: Switch Transformers, NLLB-MoE, DBRX and
# LongCat-Flash, whose only experts code is the loop over the experts hit (docs/models.md)
MORE_MIXTURES_OF_EXPERTS = {
    "granitemoe": _moe("GraniteMoeConfig", "GraniteMoeForCausalLM"),
    "granitemoeshared": _moe("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", shared_intermediate_size=32),
    "granitemoehybrid": _moe("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", shared_intermediate_size=32,
                             layer_types=["mamba", "attention"], mamba_d_state=8, mamba_n_heads=4, mamba_d_head=16,
                             mamba_n_groups=1, mamba_chunk_size=4, mamba_expand=2),
    "phimoe": _moe("PhimoeConfig", "PhimoeForCausalLM"),   # sparsemixer routing
    "gpt_oss": _moe("GptOssConfig", "GptOssForCausalLM", layer_types=["sliding_attention", "full_attention"],
                    sliding_window=8),   # attention sinks, clamped SwiGLU experts with biases
    "qwen3_next": _moe("Qwen3NextConfig", "Qwen3NextForCausalLM", **_LINEAR_ATTENTION),   # gated delta rule
    "qwen3_5_moe": _moe("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", **_LINEAR_ATTENTION),
    "ernie4_5_moe": _moe("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", moe_num_experts=4, moe_k=2,
                         moe_num_shared_experts=1),
    "minimax": _moe("MiniMaxConfig", "MiniMaxForCausalLM", layer_types=["linear_attention", "full_attention"],
                    block_size=8),   # lightning attention
    "jetmoe": _moe("JetMoeConfig", "JetMoeForCausalLM", kv_channels=8, num_key_value_heads=4),   # mixture of attention heads
    "deepseek_v2": _moe("DeepseekV2Config", "DeepseekV2ForCausalLM", **_GROUPED_ROUTING, num_key_value_heads=4,
                        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
    "glm4_moe": _moe("Glm4MoeConfig", "Glm4MoeForCausalLM", **_GROUPED_ROUTING),
    "dots1": _moe("Dots1Config", "Dots1ForCausalLM", **_GROUPED_ROUTING),
    "hunyuan_v1_moe": _moe("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", moe_topk=2),
    "llama4": _moe("Llama4TextConfig", "Llama4ForCausalLM", intermediate_size_mlp=64, num_experts_per_tok=1,
                   interleave_moe_layer_step=1),
    "exaone_moe": _moe("ExaoneMoeConfig", "ExaoneMoeForCausalLM"),
    "flex_olmo": _moe("FlexOlmoConfig", "FlexOlmoForCausalLM", pad_token_id=1, eos_token_id=2, bos_token_id=None),
    "lfm2_moe": _moe("Lfm2MoeConfig", "Lfm2MoeForCausalLM", num_dense_layers=1, layer_types=["conv", "full_attention"]),
    "afmoe": _moe("AfmoeConfig", "AfmoeForCausalLM"),
    "cohere2_moe": _moe("Cohere2MoeConfig", "Cohere2MoeForCausalLM"),
    # Kimi Delta Attention (gated delta rule per channel) beside MLA attention, a dense layer then a MoE one
    "kimi_linear": _moe("KimiLinearConfig", "KimiLinearForCausalLM", num_key_value_heads=4, pad_token_id=0,
                        layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
                        num_experts_per_token=2, linear_head_dim=8, linear_num_heads=4, kv_lora_rank=16,
                        q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
}


def _zoo() -> dict[str, Architecture]:
    decoder = dict(_DECODER)
    zoo = {
        "gpt2": _causal(_t("GPT2Config"), _t("GPT2LMHeadModel"), vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                        n_positions=64),
        "gpt_neox": _causal(_t("GPTNeoXConfig"), _t("GPTNeoXForCausalLM"), **_ENCODER),
        "gptj": _causal(_t("GPTJConfig"), _t("GPTJForCausalLM"), vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                        n_positions=64, rotary_dim=4),
        "llama": _causal(_t("LlamaConfig"), _t("LlamaForCausalLM"), **decoder),
        "mistral": _causal(_t("MistralConfig"), _t("MistralForCausalLM"), **decoder, sliding_window=8),
        "qwen2": _causal(_t("Qwen2Config"), _t("Qwen2ForCausalLM"), **decoder),
        "qwen3": _causal(_t("Qwen3Config"), _t("Qwen3ForCausalLM"), **decoder, head_dim=8),
        "gemma": _causal(_t("GemmaConfig"), _t("GemmaForCausalLM"), **decoder, head_dim=8),
        "gemma2": _causal(_t("Gemma2Config"), _t("Gemma2ForCausalLM"), **decoder, head_dim=8, sliding_window=8),
        "phi": _causal(_t("PhiConfig"), _t("PhiForCausalLM"), **decoder),
        "phi3": _causal(_t("Phi3Config"), _t("Phi3ForCausalLM"), **decoder, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "falcon": _causal(_t("FalconConfig"), _t("FalconForCausalLM"), vocab_size=VOCAB, hidden_size=32,
                          num_hidden_layers=2, num_attention_heads=4),
        "opt": _causal(_t("OPTConfig"), _t("OPTForCausalLM"), vocab_size=VOCAB, hidden_size=32, ffn_dim=64,
                       num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32),
        "bloom": _causal(_t("BloomConfig"), _t("BloomForCausalLM"), vocab_size=VOCAB, hidden_size=32, n_layer=2,
                         n_head=4),
        "mamba": _causal(_t("MambaConfig"), _t("MambaForCausalLM"), "state space", vocab_size=VOCAB, hidden_size=32,
                         num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4, use_mambapy=False),
        "mamba2": _causal(_t("Mamba2Config"), _t("Mamba2ForCausalLM"), "state space", vocab_size=VOCAB, hidden_size=32,
                          num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4, num_heads=8, head_dim=8,
                          n_groups=1, chunk_size=4),
        "t5": Architecture("encoder-decoder", _seeded(lambda: _t("T5ForConditionalGeneration")(_t("T5Config")(
            vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_decoder_layers=2, num_heads=4,
            decoder_start_token_id=0))), _seq2seq),
        "bart": Architecture("encoder-decoder", _seeded(lambda: _t("BartForConditionalGeneration")(_t("BartConfig")(
            vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64))), _seq2seq),
        "bert": Architecture("masked LM", _seeded(lambda: _t("BertForMaskedLM")(_t("BertConfig")(**_ENCODER))),
                             _masked_tokens),
        "roberta": Architecture("masked LM", _seeded(lambda: _t("RobertaForMaskedLM")(_t("RobertaConfig")(
            **dict(_ENCODER, max_position_embeddings=80)))), _masked_tokens),
        # Longformer's sliding-window attention takes overlapping chunks with as_strided (zerocc/tracing.py)
        "longformer": Architecture("masked LM", _seeded(lambda: _t("LongformerForMaskedLM")(_t("LongformerConfig")(
            **dict(_ENCODER, max_position_embeddings=80), attention_window=4))), _masked_tokens),
        # reversible layers: backward recomputes each layer and calls backward() on it, writing .grad (capture.py);
        # dropout 0: its layers reseed the generator (torch.seed()) in every training forward, refused before a draw
        "reformer": _causal(_t("ReformerConfig"), _t("ReformerModelWithLMHead"), vocab_size=VOCAB, hidden_size=32,
                            num_attention_heads=2, attention_head_size=8, feed_forward_size=64,
                            attn_layers=["local", "local"], axial_pos_shape=[4, 4], axial_pos_embds_dim=[16, 16],
                            max_position_embeddings=TOKENS[1], is_decoder=True, local_attn_chunk_length=4,
                            hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0),
        "deberta_v2": Architecture("masked LM", _seeded(lambda: _t("DebertaV2ForMaskedLM")(_t("DebertaV2Config")(
            **_ENCODER, position_buckets=16, max_relative_positions=32))), _masked_tokens),
        "resnet": Architecture("vision CNN", _seeded(lambda: _t("ResNetForImageClassification")(_t("ResNetConfig")(
            embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10))), _images(10)),
        "convnext": Architecture("vision CNN", _seeded(lambda: _t("ConvNextForImageClassification")(
            _t("ConvNextConfig")(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10))), _images(10)),
        "vit": Architecture("vision transformer", _seeded(lambda: _t("ViTForImageClassification")(_t("ViTConfig")(
            **_VISION, num_labels=10))), _images(10)),
        "swin": Architecture("vision transformer", _seeded(lambda: _t("SwinForImageClassification")(_t("SwinConfig")(
            image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
            num_labels=10))), _images(10)),
        "segformer": Architecture("segmentation", _seeded(lambda: _t("SegformerForSemanticSegmentation")(
            _t("SegformerConfig")(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                                  num_attention_heads=[1, 2], decoder_hidden_size=32, num_labels=4, drop_path_rate=0.0,
                                  classifier_dropout_prob=0.0))),   # with classifier dropout the first loss differs (docs/models.md)
            _segmentation),
        "wav2vec2": Architecture("audio", _seeded(lambda: _t("Wav2Vec2ForCTC")(_t("Wav2Vec2Config")(
            vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4), num_conv_pos_embeddings=8,
            num_conv_pos_embedding_groups=2, mask_time_prob=0.0, layerdrop=0.0))), _speech_ctc),
        "whisper": Architecture("audio", _seeded(lambda: _t("WhisperForConditionalGeneration")(_t("WhisperConfig")(
            vocab_size=VOCAB, num_mel_bins=16, d_model=32, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
            max_source_positions=16, max_target_positions=32, decoder_start_token_id=1, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, suppress_tokens=None, begin_suppress_tokens=None))), _speech_seq2seq),
        "clip": Architecture("contrastive multimodal", _seeded(lambda: _t("CLIPModel")(_t("CLIPConfig")(
            text_config=dict(_ENCODER, max_position_embeddings=16), vision_config=_VISION, projection_dim=16))),
            _image_text),
        "siglip": Architecture("contrastive multimodal", _seeded(lambda: _t("SiglipModel")(_t("SiglipConfig")(
            text_config=dict(_ENCODER, max_position_embeddings=16), vision_config=_VISION))), _image_text),
    }
    for name, builder in MIXTURES_OF_EXPERTS.items():
        family = "hybrid state space + MoE" if name == "jamba" else "mixture of experts"
        zoo[name] = Architecture(family, _seeded(builder), _tokens)
    return dict(sorted(zoo.items()))


ZOO = _zoo()


def batches(name: str, steps: int, rows: int = TOKENS[0], seed: int = 1) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [ZOO[name].batch(generator, rows) for _ in range(steps)]
