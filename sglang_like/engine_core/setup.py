"""Engine set-up: resolve the "auto" knobs, load the weights, build the runner and scheduler."""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch

from sglang_like.config import ModelConfig, ServerArgs
from sglang_like.layers.quantization import (
    QuantConfig,
    all_int4_blocks,
    any_gguf_blocks,
    resolve_quantization,
)
from sglang_like.mem_pool import KVPool, resolve_kv_cache_dtype
from sglang_like.model_loader import load_model
from sglang_like.model_runner import ModelRunner
from sglang_like.scheduler import Scheduler, SchedulerConfig
from sglang_like.scheduler.config import priority_config
from sglang_like.speculative import SpecConfig, resolve_spec_config
from sglang_like.tokenizer import Tokenizer

_CPU_MAX_AUTO_SLOTS = 1 << 16


class EngineParts(NamedTuple):
    """What an Engine runs on; `server_args` has every "auto" resolved."""

    server_args: ServerArgs
    device: torch.device
    dtype: torch.dtype
    model_config: ModelConfig
    tokenizer: Tokenizer
    runner: ModelRunner
    scheduler: Scheduler
    eos_token_ids: frozenset[int]
    loras: Any = None  # a lora.LoraRegistry when LoRA is on


def build_engine_parts(server_args: ServerArgs) -> EngineParts:
    """Load the model named by `server_args` and build its runner and scheduler (call it on
    the thread that will run them: see Engine)."""
    if server_args.cpu_pinning not in ("auto", "on", "off"):
        raise ValueError(f"cpu_pinning must be auto, on or off; got "
                         f"{server_args.cpu_pinning!r}")
    device = _resolve_device(server_args.device)
    device_sampling = resolve_device_sampling(server_args.device_sampling, device)
    dtype = _resolve_dtype(server_args.dtype, device)
    spec = resolve_spec_config(server_args, default_model=server_args.model_path is None)
    # One read of the checkpoint: GGUF blocks stay packed unless dense was asked for, and
    # `auto` is decided from what was read (a dense method dequantizes blocks it is handed).
    keep_packed = device.type == "cpu" and server_args.quantization != "none"
    loaded = load_model(server_args.model_path, dtype, keep_packed=keep_packed)
    quantization = resolve_quantization(
        server_args.quantization, device=device, dtype_is_explicit=server_args.dtype != "auto",
        source_has_int4_blocks=all_int4_blocks(loaded.weights),
        source_has_gguf_blocks=any_gguf_blocks(loaded.weights),
    )
    quant = QuantConfig(quantization, dtype,
                        deterministic=server_args.enable_deterministic_inference)
    # a quantized pool (int8 / fp8) resolves to its torch dtype's name ("int8",
    # "float8_e4m3fn", "float8_e5m2"), which TP ranks read back with getattr(torch, ...)
    kv_dtype = resolve_kv_cache_dtype(server_args.kv_cache_dtype, quant.kv_dtype)
    tokenizer = loaded.tokenizer
    if server_args.tokenizer_path is not None:
        from sglang_like.model_loader import load_tokenizer

        tokenizer = load_tokenizer(server_args.tokenizer_path)
    context_len = server_args.context_length or loaded.config.max_position_embeddings
    num_slots = server_args.max_total_tokens or _auto_pool_size(
        loaded.config, kv_dtype, device, server_args.mem_fraction_static
    )
    sa = server_args.replace(
        context_length=context_len, max_total_tokens=num_slots, device=str(device),
        dtype=str(dtype).removeprefix("torch."), quantization=quantization,
        kv_cache_dtype=str(kv_dtype).removeprefix("torch."), **_lora_args(server_args),
    )
    runner = _build_runner(sa, loaded.config, loaded.weights, device, dtype, quant, kv_dtype)
    eos = frozenset(loaded.config.eos_token_ids) | frozenset(tokenizer.eos_token_ids)
    drafter = build_drafter(spec, runner) if spec is not None else None
    scheduler = Scheduler(
        SchedulerConfig(
            pool_size=num_slots, context_len=context_len, vocab_size=loaded.config.vocab_size,
            max_running_requests=sa.max_running_requests,
            max_prefill_tokens=sa.max_prefill_tokens,
            chunked_prefill_size=sa.chunked_prefill_size, schedule_policy=sa.schedule_policy,
            disable_radix_cache=sa.disable_radix_cache, eviction_policy=sa.eviction_policy,
            enable_jump_forward=sa.enable_jump_forward, random_seed=sa.random_seed,
            speculative_auto_disable=sa.speculative_auto_disable,
            max_loras_per_batch=sa.max_loras_per_batch, device_sampling=device_sampling,
            **priority_config(sa),
        ),
        runner, tokenizer, eos, drafter,
    )
    loras = _load_loras(sa, loaded.config, device, runner.tp_group) if sa.enable_lora else None
    scheduler.loras = loras
    return EngineParts(sa, device, dtype, loaded.config, tokenizer, runner, scheduler, eos,
                       loras)


def resolve_device_sampling(value: str, device: torch.device) -> bool:
    """`device_sampling` as a switch: "auto" is on for CUDA only (ValueError for a bad one)."""
    if value not in ("auto", "on", "off"):
        raise ValueError(f"device_sampling must be auto, on or off; got {value!r}")
    return value == "on" or (value == "auto" and device.type == "cuda")


def _lora_args(sa: ServerArgs) -> dict[str, Any]:
    """The LoRA knobs checked and resolved: adapters given turn LoRA on; "all" targets are
    every target (None)."""
    from sglang_like.lora import LORA_TARGETS

    enable = sa.enable_lora or bool(sa.lora_paths)
    targets = sa.lora_target_modules
    if targets is not None:
        targets = tuple(targets)
        if "all" in targets:
            targets = None
        else:
            unknown = [t for t in targets if t not in LORA_TARGETS]
            if unknown:
                raise ValueError(f"lora_target_modules: unknown {unknown}; choose from "
                                 f"{', '.join(LORA_TARGETS)} or all")
    if enable:
        if sa.max_loras_per_batch < 1:
            raise ValueError(f"max_loras_per_batch must be >= 1; got {sa.max_loras_per_batch}")
        if sa.max_loaded_loras is not None and sa.max_loaded_loras < 1:
            raise ValueError(f"max_loaded_loras must be >= 1; got {sa.max_loaded_loras}")
        if sa.max_lora_rank is not None and sa.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1; got {sa.max_lora_rank}")
    return {"enable_lora": enable, "lora_target_modules": targets}


def _load_loras(sa: ServerArgs, config: ModelConfig, device: torch.device,
                tp_group: Any = None) -> Any:
    """The registry, with `--lora-paths` loaded (read here: nothing is served yet); with a
    tensor-parallel group, adapters reach every rank through it."""
    from sglang_like.lora import LoraRegistry, parse_lora_paths, read_adapter

    entries = parse_lora_paths(sa.lora_paths)
    if sa.max_loaded_loras is not None and len(entries) > sa.max_loaded_loras:
        raise ValueError(f"{len(entries)} --lora-paths but --max-loaded-loras "
                         f"{sa.max_loaded_loras}")
    registry = LoraRegistry(sa.max_loaded_loras, tp_group)
    for name, path, pinned in entries:
        adapter = read_adapter(name, path, config, max_rank=sa.max_lora_rank,
                               target_modules=sa.lora_target_modules)
        registry.install(adapter.to(device), pinned)
    return registry


def _build_runner(sa: ServerArgs, config: ModelConfig, weights: dict[str, Any],
                  device: torch.device, dtype: torch.dtype, quant: QuantConfig,
                  kv_dtype: torch.dtype) -> ModelRunner:
    """The model runner; with `tp_size` > 1 it is rank 0 of a tensor-parallel group whose
    other ranks start here (they load while this rank builds its own shard)."""
    tp_group = tp = None
    if sa.tp_size > 1:
        from sglang_like.tp.group import TPGroup

        tp_group = TPGroup(sa, config, device)
        tp = tp_group.shard
    elif sa.tp_size < 1:
        raise ValueError(f"tp_size must be >= 1; got {sa.tp_size}")
    return ModelRunner(
        config, weights, dtype=dtype, device=device, num_kv_slots=sa.max_total_tokens,
        context_len=sa.context_length, max_running_requests=sa.max_running_requests,
        quant=quant, kv_dtype=kv_dtype, tp=tp, tp_group=tp_group,
        encoder_cache_bytes=sa.mm_encoder_cache_mb << 20,
    )


def build_drafter(spec: SpecConfig, runner: ModelRunner) -> Any:
    """The drafter `spec` names, attached to the target's runner."""
    if spec.algorithm == "NGRAM":
        from sglang_like.speculative.ngram import NgramDrafter

        return NgramDrafter(spec.num_draft_tokens, spec.ngram_min_window, spec.ngram_max_window,
                            spec.ngram_breadth, spec.ngram_capacity)
    from sglang_like.speculative.eagle import EagleDrafter

    return EagleDrafter(spec, runner)


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _resolve_dtype(dtype: str, device: torch.device,
                   default: torch.dtype | None = None) -> torch.dtype:
    if dtype == "auto":
        if default is not None:
            return default
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "half": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype must be one of auto, {', '.join(table)}; got {dtype!r}")
    return table[dtype]


def _auto_pool_size(config: Any, dtype: torch.dtype, device: torch.device,
                    fraction: float) -> int:
    per_token = KVPool.bytes_per_token(config.num_hidden_layers, config.num_key_value_heads,
                                       config.head_dim, dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(int(free * fraction) // per_token, 1024)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 8 << 30
    return max(min(int(avail * fraction) // per_token, _CPU_MAX_AUTO_SLOTS), 1024)
