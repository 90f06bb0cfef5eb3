"""Tiny Hugging Face models, tokenizers and data files, made in a temporary directory (nothing
is downloaded): what a user's ``save_pretrained`` directory looks like, at hidden size 32."""

from __future__ import annotations

import random
from pathlib import Path

import torch

WORDS = ("the a one some this that movie film story plot actor scene music ending good bad "
         "great awful fine dull bright dark not very quite really so and but it was is seemed "
         "felt looked").split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tokenizer(path: Path, kind: str = "bert"):
    """A word-level fast tokenizer over WORDS, saved with save_pretrained."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + list(WORDS) + ["\n"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if kind == "bert":
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                                       pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                                       mask_token="[MASK]")
    else:
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                                       pad_token="[PAD]", eos_token="[SEP]", bos_token="[CLS]")
    fast.save_pretrained(str(path))
    return fast


LLAMA4 = dict(intermediate_size=32, intermediate_size_mlp=64, num_local_experts=4,
              num_experts_per_tok=2, moe_layers=[0], no_rope_layers=[1, 0],
              attention_chunk_size=4, floor_scale=4, attn_scale=0.5, pad_token_id=0,
              eos_token_id=3)

GEMMA4 = dict(head_dim=8, global_head_dim=16, hidden_size_per_layer_input=0, sliding_window=4,
              layer_types=["sliding_attention", "full_attention"], enable_moe_block=True,
              num_experts=4, top_k_experts=2, moe_intermediate_size=16, attention_k_eq_v=True,
              num_global_key_value_heads=1, final_logit_softcapping=30.0, pad_token_id=0,
              eos_token_id=3)

# decoders: (config class, model class, what each sets apart from the common tiny shape)
DECODERS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4)),
    # q/k norms; the upper layer slides (max_window_layers)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        head_dim=8, use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    # fused qkv and gate/up projections, partial rotary, residual dropout, every layer slides
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        resid_pdrop=0.1, partial_rotary_factor=0.5, sliding_window=4, pad_token_id=0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(pad_token_id=0)),  # norms after, q/k norms
    # the first layer slides, the last has no rotary: three kinds of block
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(
        num_hidden_layers=3, no_rope_layers=[1, 1, 0], use_sliding_window=True,
        sliding_window=4, layer_types=["sliding_attention", "full_attention", "full_attention"],
        pad_token_id=0)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=8)),  # scaled embeddings, tied
    # soft-capped attention and logits (caps low enough to bite), alternate layers slide
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=8, sliding_window=4, attn_logit_softcapping=1.0, final_logit_softcapping=2.0)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
        logits_scaling=4.0, tie_word_embeddings=False)),
    # mixtures of experts (the library stacks each layer's experts; checkpoints keep them one
    # by one): Mixtral with a window and router noise its only randomness, Qwen2-MoE with a
    # shared expert and a dense layer, Qwen3-MoE whose first layer is dense
    # (decoder_sparse_step), OLMoE
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=4, router_jitter_noise=0.1,
        attention_dropout=0.0)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        decoder_sparse_step=2, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, pad_token_id=0, eos_token_id=2)),
    # DeepSeek-V3: latent attention (MLA), its first layer dense, shared and routed experts
    # chosen within groups, a routing bias in the checkpoint (e_score_correction_bias)
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        num_key_value_heads=4,  # as its checkpoints have (the library pads GQA wrongly for MLA)
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
        topk_group=1, moe_intermediate_size=24, first_k_dense_replace=1, pad_token_id=0,
        bos_token_id=2, eos_token_id=3)),
    # GLM-4.5: partial rotary, q/k norms, attention biases, DeepSeek-V3's routing
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        head_dim=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
        topk_group=1, moe_intermediate_size=24, first_k_dense_replace=1,
        partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True, pad_token_id=0,
        eos_token_id=3)),
    # LayerNorm heads: Cohere (parallel attention and MLP, q/k norms, scaled logits, tied),
    # Cohere 2 (its sliding layers rotate, the others do not), StarCoder2 (biases, a window,
    # embedding and residual dropout)
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(
        use_qk_norm=True, logit_scale=0.5, pad_token_id=0, bos_token_id=2, eos_token_id=3)),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(
        head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        logit_scale=0.5, pad_token_id=0, bos_token_id=2, eos_token_id=3)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(
        sliding_window=4, embedding_dropout=0.1, residual_dropout=0.1, bos_token_id=2,
        eos_token_id=3)),
    # GLM-4 (dense): norms after attention and MLP too, a fused gate/up projection. Its rotary
    # is whole here: partial, the key bias's unrotated half has no gradient (softmax ignores a
    # shift every key shares), and AdamW turns float noise there into 1e-5 moves.
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(head_dim=8, partial_rotary_factor=1.0,
                                                  pad_token_id=0, eos_token_id=3)),
    "mistral4": ("Mistral4Config", "Mistral4ForCausalLM", dict(
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=24, first_k_dense_replace=1, pad_token_id=0, bos_token_id=2,
        eos_token_id=3)),
    # ERNIE 4.5 MoE: a dense first layer, a routing bias, shared experts; GraniteMoE: Granite's
    # multipliers, its experts stacked under names of its own
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", dict(
        head_dim=8, moe_num_experts=4, moe_k=2, moe_intermediate_size=24,
        moe_num_shared_experts=1, moe_layer_start_index=1, use_bias=True, pad_token_id=0,
        eos_token_id=3)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=3.0,
        residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0,
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=3)),
    # Llama 4: a chunked-attention layer (rotary, L2 q/k norm) of experts with a shared one,
    # and a dense NoPE full-attention layer whose queries are temperature-tuned by position
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM", dict(LLAMA4)),
    # Gemma 4: a sliding layer and a full one with wider heads, keys as values and one KV
    # head; both a dense MLP beside experts; soft-capped logits
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(GEMMA4)),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(
        head_dim=8, use_bias=True, tie_word_embeddings=False, pad_token_id=0, eos_token_id=3)),
    "glm": ("GlmConfig", "GlmForCausalLM", dict(head_dim=8, pad_token_id=0, eos_token_id=3)),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", dict(
        head_dim=8, num_experts=4, moe_topk=2, pad_token_id=0, eos_token_id=3)),
    "solar_open": ("SolarOpenConfig", "SolarOpenForCausalLM", dict(
        head_dim=8, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, pad_token_id=0, eos_token_id=3)),
    # K-EXAONE: a dense sliding layer, then a full-attention MoE one with a routing bias
    "exaone_moe": ("ExaoneMoeConfig", "ExaoneMoeForCausalLM", dict(
        moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
        n_group=1, topk_group=1, num_shared_experts=1, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=3)),
    "hy_v3": ("HYV3Config", "HYV3ForCausalLM", dict(
        head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        num_shared_experts=1, pad_token_id=0, eos_token_id=3)),
    # AFMoE: muP-scaled embedding, a dense sliding layer, a full-attention MoE one
    "afmoe": ("AfmoeConfig", "AfmoeForCausalLM", dict(
        head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        num_shared_experts=1, sliding_window=4, global_attn_every_n_layers=2, mup_enabled=True,
        pad_token_id=0, eos_token_id=3)),
    # DeepSeek-V3.2: its indexer keeps 4 keys a query (of up to 16), after a dense layer
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        num_key_value_heads=4, index_n_heads=2, index_head_dim=8, index_topk=4,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
        topk_group=1, moe_intermediate_size=16, first_k_dense_replace=1, pad_token_id=0,
        eos_token_id=3)),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, moe_intermediate_size=16, pad_token_id=0, eos_token_id=3)),
    # Cohere 2 MoE: its final norm an RMSNorm, as rms_norm_eps makes it
    "cohere2_moe": ("Cohere2MoeConfig", "Cohere2MoeForCausalLM", dict(
        head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        rms_norm_eps=1e-6,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"], pad_token_id=0,
        eos_token_id=3)),
    "granite_swa": ("GraniteSWAConfig", "GraniteSWAForCausalLM", dict(
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
        logits_scaling=4.0, sliding_window=4, layer_types=["sliding_attention",
                                                           "full_attention"],
        pad_token_id=0, eos_token_id=3)),
    # MiniMax: a lightning-attention layer (linear, in blocks of 4 tokens) and a softmax one
    # that slides (sliding_window set), experts under Mixtral's names, scaled residuals
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", dict(
        head_dim=8, num_local_experts=4, num_experts_per_tok=2, block_size=4, sliding_window=4,
        layer_types=["linear_attention", "full_attention"], full_attn_alpha_factor=0.5,
        linear_attn_alpha_factor=1.5, mlp_alpha_factor=0.8, pad_token_id=0, eos_token_id=3)),
    "flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, pad_token_id=0, eos_token_id=3)),
    "mimo_v2_flash": ("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", dict(
        head_dim=8, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, sliding_window=4, pad_token_id=0, eos_token_id=3)),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=4, router_jitter_noise=0.1,
        pad_token_id=0, eos_token_id=3)),
    # VaultGemma: Gemma 2's shape (soft-capped attention and logits, sliding layers)
    "vaultgemma": ("VaultGemmaConfig", "VaultGemmaForCausalLM", dict(
        head_dim=8, sliding_window=4, pad_token_id=0, eos_token_id=3)),
    # Granite 4.0-H: a Mamba-2 layer (chunks of 4 tokens) and an attention one, no rotary
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32,
        mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
        mamba_chunk_size=4, layer_types=["linear_attention", "full_attention"],
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
        logits_scaling=4.0, tie_word_embeddings=False, pad_token_id=0, eos_token_id=3)),
    # Kimi Linear: a Kimi delta attention layer (short convolutions, a per-channel forget
    # gate) with a dense MLP, then a latent-attention layer (no rotary) with experts
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", dict(
        layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
        linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=4, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        num_shared_experts=1, pad_token_id=0, eos_token_id=3)),
    # LayerNorm final norms: OLMo (no parameters, clipped q/k/v), Nemotron (weight + 1, partial
    # rotary, relu2), StableLM (parallel residual, q/k norms, biases), Jais 2
    "olmo": ("OlmoConfig", "OlmoForCausalLM", dict(clip_qkv=0.5, pad_token_id=0,
                                                   eos_token_id=3)),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", dict(
        head_dim=8, partial_rotary_factor=0.5, pad_token_id=0, eos_token_id=3)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(
        use_parallel_residual=True, qk_layernorm=True, use_qkv_bias=True, pad_token_id=0,
        eos_token_id=3)),
    "jais2": ("Jais2Config", "Jais2ForCausalLM", dict(head_dim=8, pad_token_id=0,
                                                     eos_token_id=3)),
    # parallel attention and MLP from one norm, partial rotary, dropout after the embedding
    # and on the residuals, a final norm under its own name, an LM head with a bias (no q/k
    # norms, as Phi-2: their bias on the keys' unrotated half gets a gradient of float noise
    # alone, which AdamW makes 1e-5 steps of, either way)
    # GPT-NeoX (Pythia): parallel residual, partial rotary, fused q/k/v, dropout after the
    # embedding and on the residuals, an embedding without a padding index, a head saved as
    # embed_out
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        hidden_dropout=0.1, rotary_pct=0.25, pad_token_id=0, eos_token_id=3)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(
        partial_rotary_factor=0.5, embd_pdrop=0.1, resid_pdrop=0.1, pad_token_id=0,
        eos_token_id=3)),
    # Qwen3-Next: a linear-attention layer (gated delta rule, a causal conv, masked by padding
    # alone) and a full-attention one (gated, partial rotary), experts and a gated shared one
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=24, mlp_only_layers=[],
        layer_types=["linear_attention", "full_attention"], pad_token_id=0, eos_token_id=3)),
    # Qwen3.5's language models: Qwen3-Next's layers, rotary sections of one position (text)
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]},
        pad_token_id=0, eos_token_id=3)),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"],
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=24,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]},
        pad_token_id=0, eos_token_id=3)),
    # gpt-oss: attention sinks, alternate layers slide, YaRN rotary, experts stacked in the
    # checkpoint too (transposed, gate and up interleaved, with biases), a router with a bias
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        head_dim=8, num_local_experts=4, num_experts_per_tok=2, intermediate_size=24,
        sliding_window=4, pad_token_id=0, eos_token_id=3,
        rope_parameters={"rope_type": "yarn", "factor": 2.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 32,
                         "truncate": False, "rope_theta": 150000.0})),
    # MiniMax-M2: Mixtral's checkpoint names, a routing bias beside them
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(
        head_dim=8, num_local_experts=4, num_experts_per_tok=2)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=24, first_k_dense_replace=1)),
    "dots1": ("Dots1Config", "Dots1ForCausalLM", dict(
        head_dim=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=24, first_k_dense_replace=1)),
    # a rotary per layer type: OLMo 3 (the sliding layers' own), Gemma 3 (local and global)
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(sliding_window=4, pad_token_id=0)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM", dict(head_dim=8)),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(head_dim=8, sliding_window=4)),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", dict(head_dim=8)),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", dict(head_dim=8)),
    "helium": ("HeliumConfig", "HeliumForCausalLM", dict(head_dim=8)),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", dict(head_dim=8)),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", dict(head_dim=8)),
}
ENCODERS = ("bert", "bert-base", "bert-mlm", "roberta", "roberta-mlm", "xlm-roberta")
# multimodal models whose language model trains (a tiny vision tower beside it)
MULTIMODAL = {
    "gemma3-vlm": ("Gemma3Config", "Gemma3ForConditionalGeneration", dict(
        model_type="gemma3_text", head_dim=8, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"]), dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14), dict(mm_tokens_per_image=4)),
    "mistral3-vlm": ("Mistral3Config", "Mistral3ForConditionalGeneration", dict(
        model_type="mistral", head_dim=8, tie_word_embeddings=False), dict(
        model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, image_size=28, patch_size=14, head_dim=8),
        dict(tie_word_embeddings=False)),
    "mistral4-vlm": ("Mistral3Config", "Mistral3ForConditionalGeneration", dict(
        model_type="mistral4", q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, num_key_value_heads=4, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=24,
        first_k_dense_replace=1, tie_word_embeddings=False), dict(
        model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, image_size=28, patch_size=14, head_dim=8),
        dict(tie_word_embeddings=False)),
    "llama4-vlm": ("Llama4Config", "Llama4ForConditionalGeneration", dict(LLAMA4), dict(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
        projector_output_dim=32), {}),
    "gemma4-vlm": ("Gemma4Config", "Gemma4ForConditionalGeneration", dict(GEMMA4), dict(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32),
        dict(audio_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               output_proj_dims=16, subsampling_conv_channels=[4, 4]))),
    "qwen3_5-vlm": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", dict(
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]},
        pad_token_id=0, eos_token_id=3), dict(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
        patch_size=4, spatial_merge_size=2, temporal_patch_size=2), {}),
}


def bpe_tokenizer(path: Path, specials: list[str], eos: str):
    """A byte-level BPE tokenizer (as GPT-2's and Llama 3's: a word carries the space before
    it, offsets untrimmed) trained on WORDS, saved with save_pretrained over ``path``'s."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    corpus = [" ".join(sentences(20, seed=s)) + " system user assistant" for s in range(20)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["[PAD]", "[UNK]", *specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   eos_token=eos)
    fast.save_pretrained(str(path))
    return fast


def model_dir(path: Path, family: str, seed: int = 0, biases: bool = False, **over) -> Path:
    """A save_pretrained directory of a tiny model of ``family``: bert (sequence classifier, 3
    labels), bert-base (BertModel alone), bert-mlm (a masked LM, without a pooler), roberta
    and xlm-roberta (sequence classifiers), roberta-mlm (a masked LM: the classifier is new,
    the LM head unused), gpt2 (tied), or one of DECODERS (llama: grouped-query attention,
    qwen2: tied embeddings and attention biases, mistral: sliding window, ...), or one of
    them with "-cls": its sequence classifier. ``biases``: biases drawn at random, as a
    trained model's are (the library starts them at zero)."""
    import transformers as tf

    path.mkdir(parents=True, exist_ok=True)
    vocab = len(SPECIAL) + len(WORDS) + 1
    torch.manual_seed(seed)
    if family in ENCODERS:
        common = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                      num_labels=3)
        if family.startswith("bert"):
            cfg = tf.BertConfig(**common, **over)
            model = {"bert": tf.BertForSequenceClassification, "bert-base": tf.BertModel,
                     "bert-mlm": tf.BertForMaskedLM}[family](cfg)  # the MLM has no pooler
        else:  # RoBERTa pads with the tokenizer's [PAD] (0); positions start after it
            kind = "XLMRoberta" if family == "xlm-roberta" else "Roberta"
            cfg = getattr(tf, f"{kind}Config")(**common, pad_token_id=0, bos_token_id=2,
                                               eos_token_id=3, type_vocab_size=1, **over)
            head = "ForMaskedLM" if family == "roberta-mlm" else "ForSequenceClassification"
            model = getattr(tf, f"{kind}{head}")(cfg)
        tokenizer(path, "bert")
    elif family == "gpt2":
        cfg = tf.GPT2Config(**{**dict(vocab_size=vocab, n_embd=32, n_layer=2, n_head=2,
                                      n_positions=64), **over})
        model = tf.GPT2LMHeadModel(cfg)
        tokenizer(path, "lm")
    elif family in MULTIMODAL:
        config_class, model_class, text, vision, own = MULTIMODAL[family]
        text = {**dict(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=64, attention_dropout=0.1), **text}
        cfg = getattr(tf, config_class)(text_config=text, vision_config=vision, **own, **over)
        model = getattr(tf, model_class)(cfg)
        tokenizer(path, "lm")
    else:  # "<decoder>-cls": its sequence classifier (3 labels, pooled at the last real token)
        classifier = family.endswith("-cls")
        config_class, model_class, own = DECODERS[family.removesuffix("-cls")]
        common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, attention_dropout=0.1)
        if classifier:
            common.update(num_labels=3, pad_token_id=0)
            model_class = model_class.replace("ForCausalLM", "ForSequenceClassification")
        cfg = getattr(tf, config_class)(**{**common, **own, **over})
        model = getattr(tf, model_class)(cfg)
        tokenizer(path, "lm")
    with torch.no_grad():
        if biases:
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():  # a routing bias (the library starts it at 0),
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # Gemma 4's layer
                b.normal_(0.0, 0.1)  # scalar (at 1)
            elif name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    model.save_pretrained(str(path))
    return path


def lengthening_jsonl(path: Path, longest: int) -> Path:
    """Texts of 2, 3, ..., ``longest`` words (one token each): in file order, each sample
    longer than the last (padded boundaries that keep growing)."""
    import json

    path.write_text("".join(json.dumps({"text": " ".join(WORDS[:n])}) + "\n"
                            for n in range(2, longest + 1)))
    return path


def sentences(n: int, seed: int = 0, min_words: int = 2, max_words: int = 9) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
            for _ in range(n)]


def classification_tsv(path: Path, n: int = 48, seed: int = 0, pairs: bool = False) -> Path:
    """Sentences of varying length (so batches are padded), labels 0..2 from their words."""
    texts = sentences(n, seed)
    seconds = sentences(n, seed + 1)
    lines = ["sentence\tlabel" if not pairs else "sentence1\tsentence2\tlabel"]
    for t, u in zip(texts, seconds):
        label = (t.count("good") + t.count("great") - t.count("bad")) % 3
        lines.append(f"{t}\t{label}" if not pairs else f"{t}\t{u}\t{label}")
    path.write_text("\n".join(lines) + "\n")
    return path


def lm_jsonl(path: Path, n: int = 48, seed: int = 0) -> Path:
    import json

    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in sentences(n, seed)))
    return path


def tokens_bin(path: Path, n: int = 4000, vocab: int | None = None, seed: int = 0,
               dtype: str = "uint16", sample_seed: int | None = None) -> Path:
    """Token ids (nanoGPT's .bin): a repeated phrase (fixed by ``seed``) with 20% of the
    tokens replaced at random (drawn by ``sample_seed``): a stream a small LM can learn, and
    held-out streams of the same language."""
    import numpy as np

    vocab = vocab or len(SPECIAL) + len(WORDS) + 1
    phrase = np.random.default_rng(seed).integers(len(SPECIAL), vocab, size=7)
    rng = np.random.default_rng([seed, seed if sample_seed is None else sample_seed, 1])
    ids = np.where(rng.random(n) < 0.8, np.resize(phrase, n), rng.integers(0, vocab, size=n))
    ids.astype(dtype).tofile(path)
    return path


def phrase_text(path: Path, lines: int = 300, seed: int = 0, sample_seed: int | None = None
                ) -> Path:
    """Plain text: a fixed phrase of WORDS (by ``seed``) repeated, one word in five replaced
    at random (drawn by ``sample_seed``): a language a small LM learns."""
    phrase = random.Random(seed).sample(WORDS, 6)
    rng = random.Random(f"{seed}-{sample_seed}")
    out = []
    for _ in range(lines):
        out.append(" ".join(w if rng.random() < 0.8 else rng.choice(WORDS) for w in phrase))
    path.write_text("\n".join(out) + "\n")
    return path
