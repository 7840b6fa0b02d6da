"""sglang_like: a structured-generation LLM runtime in the spirit of SGLang."""
