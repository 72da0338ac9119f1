"""The tiny Llama the Hugging Face integration tests train: built from a config, no download."""

from __future__ import annotations

import torch


def tiny_llama(dtype: torch.dtype = torch.bfloat16):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=128,
                                      max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).to(dtype)
