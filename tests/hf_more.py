"""More Hugging Face ``transformers`` architectures, tiny and randomly initialized (no download), beyond tests/zoo.py.

Task heads and model families the zoo leaves out (logit softcapping,
shared ALBERT layers, XLNet's two-stream attention, Funnel's pooling, RWKV,
sequence classification that pools the last non-pad token, DeBERTa's relative
attention, ...), found to train under zerocc at stage 3 bit for bit as in eager
PyTorch. Each entry is ``name -> (build, batch)``: ``build()`` makes a fresh
model after seeding the global generator, ``batch(generator)`` a keyword batch
as users write it, the labels among them, so the loss is the model's own
``output.loss`` (``tests.reference.train_eagerly`` is the eager reference).
Importing this module needs transformers: test modules import it after
``pytest.importorskip("transformers")``.
"""
from __future__ import annotations

import copy

import torch

import transformers as T

VOCAB = 128
ROWS, TOKENS = 4, 16
_ENCODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64)
_DECODER = dict(_ENCODER, num_key_value_heads=2)
_SEQ2SEQ = dict(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)


def _ids(generator, rows, vocab=VOCAB, tokens=TOKENS):
    return torch.randint(0, vocab, (rows, tokens), generator=generator)


def causal(generator, rows=ROWS):
    ids = _ids(generator, rows)
    return dict(input_ids=ids, labels=ids)


def masked(generator, rows=ROWS):
    return dict(input_ids=_ids(generator, rows), labels=_ids(generator, rows))


def sequence_classes(generator, rows=ROWS):
    return dict(input_ids=_ids(generator, rows), labels=torch.randint(0, 3, (rows,), generator=generator))


def token_classes(generator, rows=ROWS):
    return dict(input_ids=_ids(generator, rows), labels=torch.randint(0, 5, (rows, TOKENS), generator=generator))


def multiple_choice(generator, rows=ROWS):
    return dict(input_ids=torch.randint(0, VOCAB, (rows, 3, 12), generator=generator),
                labels=torch.randint(0, 3, (rows,), generator=generator))


def spans(generator, rows=ROWS):
    return dict(input_ids=_ids(generator, rows), start_positions=torch.randint(0, TOKENS, (rows,), generator=generator),
                end_positions=torch.randint(0, TOKENS, (rows,), generator=generator))


def seq2seq(generator, rows=ROWS, vocab=VOCAB):
    return dict(input_ids=_ids(generator, rows, vocab), labels=torch.randint(1, vocab, (rows, 6), generator=generator),
                use_cache=False)


RESIZED_VOCAB = 150


def resized_seq2seq(generator, rows=ROWS):
    """Token ids up to the resized vocabulary: the new embedding rows are trained too."""
    return seq2seq(generator, rows, RESIZED_VOCAB)


def bart_resized():
    """BART after resize_token_embeddings: set_input_embeddings puts one embedding module at three places (shared,
    encoder.embed_tokens, decoder.embed_tokens), and the step used to train it to inf/nan."""
    model = T.BartForConditionalGeneration(T.BartConfig(**_SEQ2SEQ))
    model.resize_token_embeddings(RESIZED_VOCAB)
    return model


def images(generator, rows=ROWS):
    return dict(pixel_values=torch.randn(rows, 3, 32, 32, generator=generator),
                labels=torch.randint(0, 5, (rows,), generator=generator))


def captions(generator, rows=ROWS):
    ids = torch.randint(3, VOCAB, (rows, 8), generator=generator)
    return dict(pixel_values=torch.randn(rows, 3, 32, 32, generator=generator), input_ids=ids, labels=ids)


IMAGE_TOKEN = 120
IMAGE_PATCHES = 16   # (32 / 8) ** 2: one token per patch of the vision tower


def image_and_text(generator, rows=ROWS):
    """A LLaVA batch: the image's placeholder tokens, replaced by the projected patches, left out of the loss."""
    ids = torch.randint(3, 100, (rows, 24), generator=generator)
    ids[:, 2:2 + IMAGE_PATCHES] = IMAGE_TOKEN
    labels = ids.clone()
    labels[:, 2:2 + IMAGE_PATCHES] = -100
    return dict(pixel_values=torch.randn(rows, 3, 32, 32, generator=generator), input_ids=ids, labels=labels)


QWEN_GRIDS = ([(1, 4, 8), (1, 8, 4)], [(1, 4, 4), (1, 4, 12)])   # (frames, rows, columns) of patches per image;
# both 64 patches, 16 image tokens: the same batch shapes, another split of the patches and of the image tokens


def images_in_text(generator, rows=2):
    """A Qwen2-VL batch, one image per row: its merged patches (2 x 2 -> 1 token) at the image tokens, left out of
    the loss; the grid drawn from two (the second compiles a program of its own, the first again reuses it)."""
    ids = torch.randint(3, 100, (rows, 24), generator=generator)
    grids = QWEN_GRIDS[int(ids.sum()) % 2][:rows]
    types = torch.zeros(rows, 24, dtype=torch.int32)
    for row, (frames, height, width) in enumerate(grids):
        types[row, 2:2 + frames * height * width // 4] = 1
    ids[types == 1] = IMAGE_TOKEN
    labels = ids.masked_fill(types == 1, -100)
    patches = sum(frames * height * width for frames, height, width in grids)
    return dict(input_ids=ids, labels=labels, mm_token_type_ids=types, image_grid_thw=torch.tensor(grids),
                pixel_values=torch.randn(patches, 3 * 2 * 2 * 2, generator=generator))


def qwen2_vl():
    text = dict(_DECODER, rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[1, 1, 2]))
    vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=2,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    return T.Qwen2VLForConditionalGeneration(T.Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN, video_token_id=121,
        vision_start_token_id=122, vision_end_token_id=123))


_VISION = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
_MAMBA2 = dict(mamba_d_state=8, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, mamba_chunk_size=4, mamba_expand=2)


def llava():
    return T.LlavaForConditionalGeneration(T.LlavaConfig(
        vision_config=T.CLIPVisionConfig(**_VISION, intermediate_size=64), text_config=T.LlamaConfig(**_DECODER),
        image_token_index=IMAGE_TOKEN, vision_feature_layer=-1, projector_hidden_act="gelu"))


def pixels(generator, rows=ROWS):
    return dict(pixel_values=torch.randn(rows, 3, 32, 32, generator=generator))


def _keep(generator, rows, patches, hidden):
    """A boolean mask hiding ``hidden`` of ``patches`` per row, drawn per row (as MAE-style collators do)."""
    order = torch.rand(rows, patches, generator=generator).argsort(1)
    return torch.zeros(rows, patches, dtype=torch.bool).scatter(1, order[:, :hidden], True)


def video_patches(generator, rows=2):
    """VideoMAE: its batch's ``bool_masked_pos`` hides half the tubelets; the encoder keeps the others
    (``embeddings[~bool_masked_pos]``), whose number transformers' SDPA attention branches on."""
    return dict(pixel_values=torch.randn(rows, 4, 3, 16, 16, generator=generator),
                bool_masked_pos=_keep(generator, rows, 8, 4))


def masked_image_tokens(generator, rows=ROWS):
    """BEiT masked image modeling: a visual token per hidden patch, six per image."""
    return dict(pixel_values=torch.randn(rows, 3, 32, 32, generator=generator), bool_masked_pos=_keep(generator, rows, 16, 6),
                labels=torch.randint(0, 64, (rows * 6,), generator=generator))


def text_to_spectrogram(generator, rows=ROWS):
    """SpeechT5 text to speech: its loss selects spectrogram and labels by the labels' padding mask (masked_select)."""
    return dict(input_ids=_ids(generator, rows, tokens=8), attention_mask=torch.ones(rows, 8, dtype=torch.long),
                labels=torch.randn(rows, 6, 8, generator=generator))


def segment_by_text(generator, rows=ROWS):
    return dict(input_ids=_ids(generator, rows, tokens=8), pixel_values=torch.randn(rows, 3, 32, 32, generator=generator),
                labels=torch.rand(rows, 32, 32, generator=generator))


def perceiver_masked(generator, rows=ROWS):
    return dict(inputs=_ids(generator, rows), labels=_ids(generator, rows))


def query_tokens_then_text(generator, rows=ROWS, image_tokens=4):
    """BLIP-2, PaliGemma, Idefics3: image placeholder tokens first, then text; the loss on every token."""
    ids = torch.cat([torch.full((rows, image_tokens), IMAGE_TOKEN), torch.randint(3, 100, (rows, 8), generator=generator)], 1)
    return dict(pixel_values=torch.randn(rows, 3, 32, 32, generator=generator), input_ids=ids, labels=ids)


def prefix_image_then_text(generator, rows=ROWS):
    batch = query_tokens_then_text(generator, rows, IMAGE_PATCHES)
    return dict(batch, token_type_ids=(torch.arange(batch["input_ids"].shape[1]) >= IMAGE_PATCHES).long().expand(rows, -1))


def time_series(generator, rows=ROWS):
    return dict(past_values=torch.randn(rows, 10, generator=generator), past_time_features=torch.randn(rows, 10, 1, generator=generator),
                past_observed_mask=torch.ones(rows, 10), future_values=torch.randn(rows, 4, generator=generator),
                future_time_features=torch.randn(rows, 4, 1, generator=generator))


def patched_series(generator, rows=ROWS):
    return dict(past_values=torch.randn(rows, 32, 3, generator=generator), future_values=torch.randn(rows, 8, 3, generator=generator))


def speech_to_text(generator, rows=ROWS):
    return dict(input_values=torch.randn(rows, 400, generator=generator), labels=torch.randint(3, VOCAB, (rows, 6), generator=generator))


def image_to_text(generator, rows=ROWS):
    return dict(pixel_values=torch.randn(rows, 3, 32, 32, generator=generator),
                labels=torch.randint(3, VOCAB, (rows, 6), generator=generator))


def trocr():
    """A ViT encoder and a TrOCR decoder joined by VisionEncoderDecoderModel, which shifts the labels itself."""
    model = T.VisionEncoderDecoderModel(encoder=T.ViTModel(T.ViTConfig(**_VISION, intermediate_size=64)),
                                        decoder=T.TrOCRForCausalLM(T.TrOCRConfig(
                                            vocab_size=VOCAB, d_model=32, decoder_layers=2, decoder_attention_heads=4,
                                            decoder_ffn_dim=64, cross_attention_hidden_size=32)))
    model.config.decoder_start_token_id, model.config.pad_token_id = 2, 1
    return model


_SPEECHT5 = dict(vocab_size=VOCAB, hidden_size=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, conv_dim=(16, 16), conv_stride=(5, 4),
                 conv_kernel=(10, 8), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, mask_time_prob=0.0,
                 speech_decoder_prenet_units=32, encoder_layerdrop=0.0, decoder_layerdrop=0.0)
_SERIES = dict(prediction_length=4, context_length=8, lags_sequence=[1, 2], d_model=16, encoder_layers=1, decoder_layers=1,
               encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
               num_time_features=1, encoder_layerdrop=0.0, decoder_layerdrop=0.0)


def _seeded(make_model):
    def build():
        torch.manual_seed(0)
        return make_model()
    return build


_BUILDERS = {
    "gemma3": (lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(
        **_DECODER, head_dim=8, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0)), causal),
    "gemma2_softcap": (lambda: T.Gemma2ForCausalLM(T.Gemma2Config(
        **_DECODER, head_dim=8, sliding_window=8, final_logit_softcapping=30.0, attn_logit_softcapping=50.0)), causal),
    "codegen": (lambda: T.CodeGenForCausalLM(T.CodeGenConfig(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4, n_ctx=64)), causal),
    "distilbert": (lambda: T.DistilBertForMaskedLM(T.DistilBertConfig(
        vocab_size=VOCAB, dim=32, hidden_dim=64, n_layers=2, n_heads=4, max_position_embeddings=64)), masked),
    "distilbert_seq": (lambda: T.DistilBertForSequenceClassification(T.DistilBertConfig(
        vocab_size=VOCAB, dim=32, hidden_dim=64, n_layers=2, n_heads=4, max_position_embeddings=64, num_labels=3)),
        sequence_classes),
    # one layer's parameters shared by all three layers
    "albert": (lambda: T.AlbertForMaskedLM(T.AlbertConfig(**dict(_ENCODER, num_hidden_layers=3), embedding_size=16)),
               masked),
    "modernbert": (lambda: T.ModernBertForMaskedLM(T.ModernBertConfig(
        **dict(_ENCODER, num_hidden_layers=3), global_attn_every_n_layers=2, local_attention=8, pad_token_id=0,
        eos_token_id=1, bos_token_id=2, cls_token_id=2, sep_token_id=1)), masked),
    "xlnet": (lambda: T.XLNetLMHeadModel(T.XLNetConfig(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4, d_inner=64)),
              masked),
    "electra": (lambda: T.ElectraForMaskedLM(T.ElectraConfig(**_ENCODER, embedding_size=16)), masked),
    "roberta_tok": (lambda: T.RobertaForTokenClassification(T.RobertaConfig(
        **dict(_ENCODER, max_position_embeddings=80), num_labels=5)), token_classes),
    "roberta_mc": (lambda: T.RobertaForMultipleChoice(T.RobertaConfig(**dict(_ENCODER, max_position_embeddings=80))),
                   multiple_choice),
    "roberta_qa": (lambda: T.RobertaForQuestionAnswering(T.RobertaConfig(**dict(_ENCODER, max_position_embeddings=80))),
                   spans),
    "marian": (lambda: T.MarianMTModel(T.MarianConfig(**_SEQ2SEQ, pad_token_id=0, decoder_start_token_id=0)), seq2seq),
    "pegasus": (lambda: T.PegasusForConditionalGeneration(T.PegasusConfig(
        **_SEQ2SEQ, pad_token_id=0, decoder_start_token_id=0)), seq2seq),
    "mbart": (lambda: T.MBartForConditionalGeneration(T.MBartConfig(**_SEQ2SEQ)), seq2seq),
    "bart_resized": (bart_resized, resized_seq2seq),
    "rwkv": (lambda: T.RwkvForCausalLM(T.RwkvConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64,
        context_length=64)), causal),
    "stablelm": (lambda: T.StableLmForCausalLM(T.StableLmConfig(**_DECODER)), causal),
    "mpt": (lambda: T.MptForCausalLM(T.MptConfig(
        vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=64)), causal),
    "gpt_bigcode": (lambda: T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, multi_query=True)), causal),
    # pools the last token that is not pad_token_id (a data-dependent index)
    "bloom_seq": (lambda: T.BloomForSequenceClassification(T.BloomConfig(
        vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, num_labels=3, pad_token_id=0)), sequence_classes),
    "llama_seq": (lambda: T.LlamaForSequenceClassification(T.LlamaConfig(**_DECODER, num_labels=3, pad_token_id=0)),
                  sequence_classes),
    "deberta_tok": (lambda: T.DebertaV2ForTokenClassification(T.DebertaV2Config(
        **_ENCODER, position_buckets=16, max_relative_positions=32, num_labels=5, relative_attention=True,
        pos_att_type=["p2c", "c2p"])), token_classes),
    "deberta_v1": (lambda: T.DebertaForMaskedLM(T.DebertaConfig(
        **_ENCODER, relative_attention=True, max_relative_positions=32, pos_att_type=["p2c", "c2p"])), masked),
    "funnel": (lambda: T.FunnelForMaskedLM(T.FunnelConfig(
        vocab_size=VOCAB, block_sizes=[1, 1], d_model=32, n_head=4, d_head=8, d_inner=64)), masked),
    "mobilebert": (lambda: T.MobileBertForMaskedLM(T.MobileBertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        embedding_size=16, intra_bottleneck_size=16, true_hidden_size=16)), masked),
    "olmo2": (lambda: T.Olmo2ForCausalLM(T.Olmo2Config(**_DECODER)), causal),
    "cohere2": (lambda: T.Cohere2ForCausalLM(T.Cohere2Config(
        **_DECODER, sliding_window=8, layer_types=["sliding_attention", "full_attention"])), causal),
    "nemotron": (lambda: T.NemotronForCausalLM(T.NemotronConfig(**_DECODER)), causal),
    "starcoder2": (lambda: T.Starcoder2ForCausalLM(T.Starcoder2Config(**_DECODER, sliding_window=8)), causal),
    # hybrid state space + attention
    "falcon_h1": (lambda: T.FalconH1ForCausalLM(T.FalconH1Config(
        **_DECODER, head_dim=8, mamba_d_ssm=64, **_MAMBA2)), causal),
    "bamba": (lambda: T.BambaForCausalLM(T.BambaConfig(**_DECODER, attn_layer_indices=[1], **_MAMBA2)), causal),
    # one shared attention block, with per-layer LoRA adapters, after the Mamba2 layer marked "hybrid"
    "zamba2": (lambda: T.Zamba2ForCausalLM(T.Zamba2Config(
        **_DECODER, mamba_d_state=8, mamba_headdim=8, n_mamba_heads=8, mamba_ngroups=1, chunk_size=4,
        num_mem_blocks=1, layers_block_type=["mamba", "hybrid"], use_mem_rope=True, adapter_rank=8)), causal),
    "dinov2": (lambda: T.Dinov2ForImageClassification(T.Dinov2Config(**_VISION, mlp_ratio=2, num_labels=5)), images),
    "blip_caption": (lambda: T.BlipForConditionalGeneration(T.BlipConfig(
        vision_config=dict(_VISION, intermediate_size=64), projection_dim=32,
        text_config=dict(_ENCODER, encoder_hidden_size=32))), captions),
    # the projected image patches written into the text's embeddings at the image tokens (masked_scatter)
    "llava": (llava, image_and_text),
    # patches split per image by sizes read from the batch's image_grid_thw (zerocc/data_guards.py)
    "qwen2_vl": (qwen2_vl, images_in_text),
    # MAE: random masking by torch.rand noise and argsort in forward
    "vitmae": (lambda: T.ViTMAEForPreTraining(T.ViTMAEConfig(
        **_VISION, intermediate_size=64, decoder_hidden_size=32, decoder_num_hidden_layers=1, decoder_num_attention_heads=4,
        decoder_intermediate_size=64)), pixels),
    "videomae": (lambda: T.VideoMAEForPreTraining(T.VideoMAEConfig(
        **dict(_VISION, image_size=16), intermediate_size=64, num_frames=4, tubelet_size=2, decoder_hidden_size=32,
        decoder_num_hidden_layers=1, decoder_num_attention_heads=4, decoder_intermediate_size=64)), video_patches),
    "beit_mim": (lambda: T.BeitForMaskedImageModeling(T.BeitConfig(
        **_VISION, intermediate_size=64, vocab_size=64, use_mask_token=True)), masked_image_tokens),
    "hiera": (lambda: T.HieraForImageClassification(T.HieraConfig(
        image_size=[32, 32], embed_dim=16, num_heads=[1, 2], depths=[1, 1], num_query_pool=1, masked_unit_size=[4, 4],
        num_labels=5)), images),
    "levit": (lambda: T.LevitForImageClassification(T.LevitConfig(
        image_size=32, patch_size=16, hidden_sizes=[32, 48, 64], num_attention_heads=[1, 2, 2], depths=[1, 1, 1],
        key_dim=[8, 8, 8], num_labels=5)), images),
    "swinv2": (lambda: T.Swinv2ForImageClassification(T.Swinv2Config(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=5)), images),
    "clipseg": (lambda: T.CLIPSegForImageSegmentation(T.CLIPSegConfig(
        text_config=_ENCODER, vision_config=dict(_VISION, intermediate_size=64), projection_dim=32, extract_layers=[0, 1],
        reduce_dim=16, decoder_num_attention_heads=4, decoder_intermediate_size=32)), segment_by_text),
    "perceiver": (lambda: T.PerceiverForMaskedLM(T.PerceiverConfig(
        num_latents=8, d_latents=32, d_model=32, num_blocks=1, num_self_attends_per_block=2, num_self_attention_heads=4,
        num_cross_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=TOKENS)), perceiver_masked),
    # Fourier transforms in place of attention (torch.fft.fftn: complex tensors in the step)
    "fnet": (lambda: T.FNetForMaskedLM(T.FNetConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64)), masked),
    "esm": (lambda: T.EsmForMaskedLM(T.EsmConfig(
        **dict(_ENCODER, vocab_size=33), pad_token_id=1, mask_token_id=32, position_embedding_type="rotary")),
        lambda generator, rows=ROWS: dict(input_ids=torch.randint(4, 30, (rows, TOKENS), generator=generator),
                                          labels=torch.randint(4, 30, (rows, TOKENS), generator=generator))),
    "blip2": (lambda: T.Blip2ForConditionalGeneration(T.Blip2Config(
        vision_config=dict(_VISION, intermediate_size=64), qformer_config=dict(_ENCODER, encoder_hidden_size=32),
        text_config=dict(model_type="opt", vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                         num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=64),
        num_query_tokens=4, image_token_index=IMAGE_TOKEN)), query_tokens_then_text),
    "paligemma": (lambda: T.PaliGemmaForConditionalGeneration(T.PaliGemmaConfig(
        vision_config=dict(_VISION, intermediate_size=64, model_type="siglip_vision_model"),
        text_config=dict(model_type="gemma", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=8),
        image_token_index=IMAGE_TOKEN, projection_dim=32)), prefix_image_then_text),
    "trocr": (trocr, image_to_text),
    "speecht5_asr": (lambda: T.SpeechT5ForSpeechToText(T.SpeechT5Config(**_SPEECHT5)), speech_to_text),
    "speecht5_tts": (lambda: T.SpeechT5ForTextToSpeech(T.SpeechT5Config(
        **_SPEECHT5, num_mel_bins=8, reduction_factor=2, speech_decoder_postnet_units=16, speech_decoder_postnet_layers=2)),
        text_to_spectrogram),
    # distribution heads: the negative log-likelihood of a Student's t and of a normal
    "time_series": (lambda: T.TimeSeriesTransformerForPrediction(T.TimeSeriesTransformerConfig(
        **_SERIES, distribution_output="student_t")), time_series),
    "informer": (lambda: T.InformerForPrediction(T.InformerConfig(**_SERIES, distribution_output="normal")), time_series),
    "patchtst": (lambda: T.PatchTSTForPrediction(T.PatchTSTConfig(
        num_input_channels=3, context_length=32, patch_length=8, patch_stride=8, prediction_length=8, d_model=32,
        num_attention_heads=4, num_hidden_layers=2, ffn_dim=64)), patched_series),
}

MODELS = {name: (_seeded(make_model), batch) for name, (make_model, batch) in _BUILDERS.items()}


def batches(name: str, steps: int, rows: int = ROWS, seed: int = 1) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [MODELS[name][1](generator, rows) for _ in range(steps)]


def _split(batch: dict, k: int) -> list[dict]:
    """K micro-batches along dim 0 of every tensor; other values (use_cache=False) go to each."""
    parts = {key: value.chunk(k) if isinstance(value, torch.Tensor) else [value] * k for key, value in batch.items()}
    return [{key: chunks[index] for key, chunks in parts.items()} for index in range(k)]


def mixed_accumulated_keyword_step(model, optimizer, batch: dict, seed: int, *, dtype, k: int = 1, clip=None):
    """One eager step of a model that computes its loss from a keyword batch, with low-precision compute and
    gradient accumulation and clipping: ``tests.reference.mixed_eager_step`` (the masters cast to ``dtype``, fp32
    gradients) generalized to K micro-batches as ``tests/fuzz_reference.reference_step`` does it: each micro-batch's
    ``(loss.float() / K)`` gradients cast to fp32 and summed, then ``clip_grad_norm_``, then the update. The global
    generator is seeded with ``seed`` first (dropout). Returns (the summed loss, the norm before clipping)."""
    torch.manual_seed(seed)
    optimizer.zero_grad(set_to_none=True)
    low = copy.deepcopy(model)   # keeps tied weights tied
    for param in low.parameters():
        param.data = param.data.to(dtype)
    grads: dict[str, torch.Tensor | None] = {}
    total = None
    for micro in _split(batch, k):
        loss = low(**micro).loss.float()
        if k > 1:
            loss = loss / k
        names = [name for name, param in low.named_parameters() if param.requires_grad]
        params = dict(low.named_parameters())
        computed = torch.autograd.grad(loss, [params[name] for name in names], allow_unused=True)
        for name, grad in zip(names, computed):   # AccumulateGrad's order: the running sum, then the new one
            grad = None if grad is None else grad.float()
            old = grads.get(name)
            grads[name] = grad if old is None else old if grad is None else old + grad
        total = loss.detach() if total is None else total + loss.detach()
    for name, param in model.named_parameters():
        param.grad = grads.get(name)
    norm = None
    if clip is not None:
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip)
    optimizer.step()
    return total, norm
