"""The small Llama that the user scripts here fine-tune: transformers' own LlamaForCausalLM from a config (no
download), the same weights in every process."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config)
