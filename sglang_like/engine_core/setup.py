"""Engine set-up: resolve the "auto" knobs, load the weights, build the runner and scheduler."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
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
from sglang_like.model_executor.cuda_graph import graph_buckets
from sglang_like.model_loader import load_model
from sglang_like.model_runner import ModelRunner
from sglang_like.scheduler import Scheduler, SchedulerConfig
from sglang_like.scheduler.config import priority_config
from sglang_like.speculative import SpecConfig, resolve_spec_config
from sglang_like.tokenizer import Tokenizer
from sglang_like.utils.decode_threads import DecodeThreads, parse_decode_threads

logger = logging.getLogger(__name__)

_CPU_MAX_AUTO_SLOTS = 1 << 16
_CPU_MEM_FRACTION = 0.25  # of the host's available memory, for the KV pool
_CUDA_MEM_FRACTION = 0.85  # of the GPU's memory, for weights and KV pool
_GIB = 1 << 30


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
    parse_decode_threads(server_args.decode_threads)  # a bad value fails before the load
    device = _resolve_device(server_args.device)
    device_sampling = resolve_device_sampling(server_args.device_sampling, device)
    graph_max_bs = (cuda_graph_max_bs(server_args, device) if server_args.enable_cuda_graph
                    else None)  # before the load: a CPU engine refuses the flag at once
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
    sa = server_args.replace(
        context_length=context_len, device=str(device),
        dtype=str(dtype).removeprefix("torch."), quantization=quantization,
        kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
        mem_fraction_static=resolve_mem_fraction(server_args.mem_fraction_static, device),
        skip_server_warmup=resolve_skip_server_warmup(server_args.skip_server_warmup, device),
        **_lora_args(server_args),
    )
    runner = _build_runner(sa, loaded.config, loaded.weights, device, dtype, quant, kv_dtype,
                           pool_slots(sa, loaded.config, kv_dtype, device, spec, dtype))
    if device.type == "cpu" and sa.tp_size == 1:  # TP ranks split the cores among them
        runner.decode_threads = DecodeThreads.build(sa.decode_threads, torch.get_num_threads())
    num_slots = runner.kv_pool.num_slots
    sa = sa.replace(max_total_tokens=num_slots)
    eos = frozenset(loaded.config.eos_token_ids) | frozenset(tokenizer.eos_token_ids)
    drafter = build_drafter(spec, runner) if spec is not None else None
    if graph_max_bs is not None:  # after the drafter: its features are part of the forward
        runner.capture_graphs(graph_max_bs,
                              verify_tokens=spec.num_draft_tokens if spec is not None else None)
        if spec is not None and spec.algorithm != "NGRAM" and spec.num_steps > 1:
            drafter.capture_graphs(graph_max_bs, runner.graph_backend)  # its draft depths
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


def cuda_graph_max_bs(sa: ServerArgs, device: torch.device) -> int:
    """The largest decode batch `--enable-cuda-graph` captures (ValueError off CUDA)."""
    if device.type != "cuda":
        raise ValueError(f"--enable-cuda-graph needs a CUDA device; this engine runs on "
                         f"{device.type}")
    if sa.cuda_graph_max_bs is None:
        return min(sa.max_running_requests, 64)
    graph_buckets(sa.cuda_graph_max_bs)  # ValueError for a bad one
    return sa.cuda_graph_max_bs


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
                  kv_dtype: torch.dtype, num_kv_slots: int | Callable[[int], int]
                  ) -> ModelRunner:
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
        config, weights, dtype=dtype, device=device, num_kv_slots=num_kv_slots,
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


def resolve_skip_server_warmup(value: bool | None, device: torch.device) -> bool:
    """None: skip the start-up warmup off CUDA, where nothing compiles (engine_core.warmup)."""
    return device.type != "cuda" if value is None else bool(value)


def resolve_mem_fraction(fraction: float | None, device: torch.device) -> float:
    """`mem_fraction_static` checked, None resolved: on CUDA the share of the GPU's memory
    that weights and KV pool take together (SGLang's meaning and usual value); elsewhere the
    share of the host's available memory the KV pool takes."""
    if fraction is None:
        return _CUDA_MEM_FRACTION if device.type == "cuda" else _CPU_MEM_FRACTION
    if not 0 < fraction <= 1:
        raise ValueError(f"mem_fraction_static must be in (0, 1]; got {fraction}")
    return fraction


def pool_slots(sa: ServerArgs, config: ModelConfig, kv_dtype: torch.dtype,
               device: torch.device, spec: SpecConfig | None = None,
               dtype: torch.dtype = torch.float32) -> int | Callable[[int], int]:
    """The KV pool's size: `max_total_tokens` when given; on CUDA a function of the pool's
    bytes per token, which ModelRunner calls once the weights are on the GPU
    (`cuda_pool_slots`, less what an EAGLE drafter will add: its head and its own pool);
    elsewhere sized now from the host's available memory."""
    if sa.max_total_tokens:
        return sa.max_total_tokens
    if device.type == "cuda":
        reserve = (0, 0)
        if spec is not None and spec.algorithm in ("EAGLE", "EAGLE3"):
            from sglang_like.speculative.eagle import head_dtype
            from sglang_like.speculative.head_loader import draft_head_footprint

            # the head in the model's dtype (`dtype`), as the drafter will place it
            reserve = draft_head_footprint(spec.draft_model_path, head_dtype(dtype, device))
        return functools.partial(cuda_pool_slots, device=device,
                                 fraction=sa.mem_fraction_static, context_len=sa.context_length,
                                 reserve=reserve)
    return _auto_pool_size(config, kv_dtype, sa.mem_fraction_static)


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device, as the driver counts them (tests replace this).
    Blocks the caching allocator keeps but no tensor holds (the loader's temporaries) are
    given back first, or they would count as used."""
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)


def cuda_pool_slots(bytes_per_token: int, *, device: torch.device, fraction: float,
                    context_len: int, reserve: tuple[int, int] = (0, 0)) -> int:
    """SGLang's sizing: weights and KV pool together take `fraction` of the GPU's memory.
    Read once the weights are placed, what is in use then (weights, the CUDA context, other
    processes) comes off total x fraction and the pool gets the rest; the other 1 - fraction
    is left for activations and the allocator. `reserve`: (bytes, bytes per slot) placed after
    the pool and within the fraction (an EAGLE head and its pool, `draft_head_footprint`).
    ValueError when that is not one context."""
    free, total = device_memory(device)
    used = total - free
    fixed, per_slot = reserve
    budget = int(total * fraction) - used - fixed
    num_slots = max(budget, 0) // (bytes_per_token + per_slot)
    if num_slots < context_len:
        draft = (f" (the draft head takes {fixed / _GIB:.2f} GiB and {per_slot} bytes a "
                 f"token of it)" if fixed or per_slot else "")
        raise ValueError(
            f"no room for a KV pool of one context ({context_len} tokens) on {device}: "
            f"--mem-fraction-static {fraction:g} of its {total / _GIB:.2f} GiB is "
            f"{total * fraction / _GIB:.2f} GiB, and {used / _GIB:.2f} GiB are in use once the "
            f"weights are placed, leaving {budget / _GIB:.2f} GiB{draft} for {num_slots} tokens "
            f"of {bytes_per_token + per_slot} bytes; raise --mem-fraction-static, lower "
            f"--context-length, or set --max-total-tokens")
    logger.info("KV pool: %d tokens (%.2f GiB) = %g of %.2f GiB on %s less %.2f GiB in use "
                "once the weights are placed%s", num_slots, num_slots * bytes_per_token / _GIB,
                fraction, total / _GIB, device, used / _GIB,
                f" and {(fixed + num_slots * per_slot) / _GIB:.2f} GiB for the draft head"
                if fixed or per_slot else "")
    return num_slots


def _auto_pool_size(config: Any, dtype: torch.dtype, fraction: float) -> int:
    """From the host's available memory (a KV pool off CUDA lives there)."""
    per_token = KVPool.bytes_per_token(config.num_hidden_layers, config.num_key_value_heads,
                                       config.head_dim, dtype)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 8 << 30
    return max(min(int(avail * fraction) // per_token, _CPU_MAX_AUTO_SLOTS), 1024)
