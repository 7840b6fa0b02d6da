"""Model implementations that run over a ForwardBatch and the token-granular KV pool."""

from sglang_like.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]

LlamaForCausalLM.__doc__ = LlamaForCausalLM.__doc__ or "Decoder-only Llama-family model."
