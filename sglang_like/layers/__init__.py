"""The layers models are built from, one concept a module.

`norm` (RMSNorm), `rotary` (RoPE and its scalings), `activation` (gated MLP activations),
`attention` (store K/V and attend over the slot pool; Triton / torch reference backends),
`quantization/` (the linear methods behind `--quantization`: dense, int8, int4, GGUF blocks,
fp16), `logits` (final norm + LM head), `sampler` (logits -> tokens on the host),
`device_sampler` (logits -> tokens on their device, one copy back), `decoder` (a decoder
layer described as data) and `native_decode` (the native CPU decode step that reads those
descriptions).
"""
