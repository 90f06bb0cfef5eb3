"""Hugging Face model directories built from a config (random init, ``save_pretrained``; no
tokenizer: token ids are the data) and their token files, for the benchmarks."""

from __future__ import annotations

import torch

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                rope_theta=500000.0, tie_word_embeddings=False)
TINYLLAMA = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048,
                 tie_word_embeddings=False)  # 22 layers: 1.1B parameters
LLAMA_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
                  tie_word_embeddings=False)
# OLMoE-1B-7B's shape: 64 experts of 1024, 8 per token (16 layers: 6.9B parameters, 1.3B
# active per token), trained with its routers' load-balancing loss (coefficient 0.01)
BALANCED = dict(output_router_logits=True, router_aux_loss_coef=0.01)
OLMOE = dict(hidden_size=2048, intermediate_size=1024, num_attention_heads=16,
             num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, vocab_size=50304,
             max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=1,
             eos_token_id=50279, **BALANCED)
OLMOE_TINY = dict(hidden_size=64, intermediate_size=32, num_attention_heads=4,
                  num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, vocab_size=256,
                  max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=1,
                  eos_token_id=2, **BALANCED)
SHAPES = {"llama": ("Llama", TINYLLAMA, LLAMA_TINY), "olmoe": ("Olmoe", OLMOE, OLMOE_TINY)}


def hf_dir(path: str, layers: int, shape: dict, device: str, arch: str = "Llama",
           dtype: torch.dtype = torch.bfloat16) -> int:
    """A save_pretrained directory of a randomly initialised ``{arch}ForCausalLM`` of
    ``shape`` and ``layers`` layers, built on ``device`` in ``dtype``; its parameters."""
    import transformers as tf

    cfg = getattr(tf, f"{arch}Config")(**shape, num_hidden_layers=layers)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = getattr(tf, f"{arch}ForCausalLM")(cfg)
    finally:
        torch.set_default_dtype(before)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path)
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return params


def active_params(shape: dict, layers: int, params: int) -> int:
    """The parameters a token computes with: a mixture of experts' chosen experts only."""
    experts = shape.get("num_experts")
    if not experts:
        return params
    h, i = shape["hidden_size"], shape["intermediate_size"]
    return params - layers * (experts - shape["num_experts_per_tok"]) * 3 * h * i


def token_file(path: str, vocab: int, tokens: int) -> None:
    """Random token ids (uint32), the data of a model built from a config."""
    torch.randint(0, vocab, (tokens,), dtype=torch.int32).numpy().astype("uint32").tofile(path)
