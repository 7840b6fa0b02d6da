"""`python -m sglang_like.launch_server`: parse the CLI, build the Engine, serve it over HTTP.

SIGTERM / SIGINT: stop accepting connections, let in-flight requests finish for up to
--shutdown-timeout seconds (then abort them), shut the engine down, exit 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from sglang_like.config import (
    DISAGGREGATION_MODES,
    EMBEDDING_POOLINGS,
    KV_CACHE_DTYPES,
    QUANTIZATION_CHOICES,
    REASONING_PARSERS,
    SPECULATIVE_ALGORITHMS,
    ServerArgs,
)
from sglang_like.function_call.parsers import TOOL_CALL_PARSERS

logger = logging.getLogger("sglang_like.launch_server")

_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _decode_threads(value: str) -> str:
    """`--decode-threads`: auto or a positive integer (argparse's usage error otherwise)."""
    from sglang_like.utils.decode_threads import parse_decode_threads

    try:
        parse_decode_threads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def build_parser() -> argparse.ArgumentParser:
    d = ServerArgs()
    p = argparse.ArgumentParser(
        prog="python -m sglang_like.launch_server",
        description="Serve a model with SGLang-native and OpenAI-compatible HTTP APIs.",
    )
    p.add_argument("--model-path", default=d.model_path,
                   help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tokenizer-path", default=d.tokenizer_path)
    p.add_argument("--served-model-name", default=d.served_model_name,
                   help="model id in /v1/models (default: from the model path)")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--api-key", default=d.api_key,
                   help="require 'Authorization: Bearer <key>' on every route but /health "
                        "(better: --api-key-file or $SGLANG_LIKE_API_KEY, which other users "
                        "of the machine cannot read in the process list)")
    p.add_argument("--api-key-file", default=None,
                   help="plain keys, one a line ('#' comments): each key is a tenant")
    p.add_argument("--admin-api-key", default=d.admin_api_key,
                   help="the operator's key: cache flush, aborting others' or all requests, "
                        "the PD role switch, the dashboard and cache routes, /metrics (also "
                        "--admin-api-key-file or $SGLANG_LIKE_ADMIN_API_KEY)")
    p.add_argument("--admin-api-key-file", default=None)
    p.add_argument("--allowed-hosts", default=None,
                   type=lambda v: tuple(h.strip() for h in v.split(",") if h.strip()),
                   help="comma-separated Host names the server answers to ('*': any); "
                        "default: loopback names on a loopback --host, any otherwise")
    p.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes)
    p.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars,
                   help="longer text prompts get 400 before they are tokenized (default: "
                        "32 x the context length)")
    p.add_argument("--ssl-keyfile", default=d.ssl_keyfile, help="with --ssl-certfile: HTTPS")
    p.add_argument("--ssl-certfile", default=d.ssl_certfile)
    p.add_argument("--enable-cross-tenant-cache", action="store_true",
                   default=d.enable_cross_tenant_cache,
                   help="let requests of different keys / cache_salt values share cached "
                        "prefixes (faster; a tenant can then time or count another's prefixes)")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default=d.device)
    p.add_argument("--quantization", default=d.quantization, choices=list(QUANTIZATION_CHOICES),
                   help="weights: auto (CPU: int4 for a Q4 GGUF, else int8; CUDA: none), none "
                        "(dense, exact), int8, int4")
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                   choices=[*KV_CACHE_DTYPES, "fp8"],
                   help="the KV pool's dtype; int8 / fp8_e4m3 (fp8) / fp8_e5m2 keep 8-bit codes "
                        "and a scale per token and KV head (1.9x the tokens per GiB of bf16)")
    p.add_argument("--context-length", type=int, default=d.context_length)
    p.add_argument("--max-total-tokens", type=int, default=d.max_total_tokens,
                   help="KV pool size in tokens (default: from --mem-fraction-static)")
    p.add_argument("--mem-fraction-static", type=float, default=d.mem_fraction_static,
                   help="CUDA: the share of the GPU's memory weights and KV pool take together "
                        "(default 0.85); CPU: the share of available memory the KV pool takes "
                        "(default 0.25)")
    p.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size)
    p.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens)
    p.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    p.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                   help="beyond this many waiting requests, new ones get 429")
    p.add_argument("--schedule-policy", default=d.schedule_policy, choices=["lpm", "fcfs"])
    add_priority_arguments(p, d)
    p.add_argument("--disable-radix-cache", action="store_true", default=d.disable_radix_cache)
    p.add_argument("--grammar-backend", default=d.grammar_backend,
                   choices=["xgrammar", "outlines"])
    p.add_argument("--grammar-compile-memory-mb", type=int,
                   default=d.grammar_compile_memory_mb,
                   help="a new grammar is first compiled in a worker process capped at this "
                        "much memory and killed at the timeout (0: in the engine only)")
    p.add_argument("--random-seed", type=int, default=d.random_seed)
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   default=d.enable_deterministic_inference,
                   help="outputs that do not depend on the batch: int4 linears and the LM head "
                        "run one kernel at every row count (slower in large batches on AMX "
                        "CPUs)")
    p.add_argument("--tool-call-parser", default=d.tool_call_parser,
                   choices=list(TOOL_CALL_PARSERS),
                   help="the model's tool-call format; auto: by its chat template (Hermes "
                        "<tool_call> tags when the template has no tool syntax)")
    p.add_argument("--reasoning-parser", default=d.reasoning_parser,
                   choices=list(REASONING_PARSERS),
                   help="split a reasoning model's think block from its answer in chat "
                        "completions: message.reasoning_content (delta.reasoning_content "
                        "when streamed) beside content")
    p.add_argument("--reasoning-budget", type=int, default=d.reasoning_budget,
                   help="default thinking_budget of a chat request: after this many answer "
                        "tokens the server closes the think block (-1: unlimited)")
    p.add_argument("--watchdog-timeout", type=float, default=d.watchdog_timeout,
                   help="/health answers 503 while one scheduler step has run this many "
                        "seconds (a stuck forward)")
    p.add_argument("--stream-interval", type=int, default=d.stream_interval,
                   help="a stream gets a chunk once this many tokens are new (its first "
                        "token and its end at once); above 1 the serving side does less work "
                        "per token, which on a machine of few cores the decode step gets back")
    add_speculative_arguments(p, d)
    add_lora_arguments(p, d)
    add_scale_out_arguments(p, d)
    p.add_argument("--skip-server-warmup", action="store_true", default=d.skip_server_warmup,
                   help="start without the warmup requests CUDA servers run first (so the "
                        "first user request compiles nothing); CPU servers skip it anyway")
    p.add_argument("--enable-cuda-graph", action="store_true", default=d.enable_cuda_graph,
                   help="CUDA only: replay decode steps (and speculative verifies of "
                        "--speculative-num-draft-tokens nodes) as CUDA graphs, one per "
                        "batch-size bucket (1, 2, 4, 8, 16, ... up to --cuda-graph-max-bs); "
                        "off until the device check has passed it on a GPU")
    p.add_argument("--cuda-graph-max-bs", type=int, default=d.cuda_graph_max_bs,
                   help="largest decode batch captured (default: --max-running-requests, "
                        "at most 64); larger batches run eagerly")
    p.add_argument("--engine-in-process", action="store_true", default=d.engine_in_process,
                   help="run the scheduler and model on a thread of the HTTP process instead "
                        "of an engine process of their own (the shape before; for debugging)")
    p.add_argument("--cpu-pinning", default=d.cpu_pinning, choices=["auto", "on", "off"],
                   help="auto (= on for the server): on CPU the engine loop's thread gets a "
                        "core of its own, which the OpenMP workers and this HTTP process keep "
                        "off (a pipe write would otherwise run the HTTP side on the loop's "
                        "core); off: the OS decides")
    p.add_argument("--decode-threads", default=d.decode_threads, type=_decode_threads,
                   help="auto: a CPU decode step runs on the cores other processes leave "
                        "free (1 up to the prefill's thread count), looked at twice a second; "
                        "N: always N threads (llama.cpp's -t; prefill keeps all of them)")
    p.add_argument("--device-sampling", default=d.device_sampling,
                   choices=["auto", "on", "off"],
                   help="auto (= on on CUDA): sample on the model's device, with one "
                        "device-to-host copy of the chosen tokens a step; off: copy the "
                        "logits to the host and sample there (the CPU default)")
    p.add_argument("--log-level", default=d.log_level, choices=_LOG_LEVELS)
    p.add_argument("--log-requests", action="store_true", default=d.log_requests,
                   help="log one INFO line per generate request (whatever --log-level): rid, "
                        "route, model, token counts, finish reason, latency, client, status")
    p.add_argument("--log-requests-level", default=d.log_requests_level,
                   choices=["metadata", "full"],
                   help="with --log-requests: full adds the prompt and the output text")
    p.add_argument("--otlp-traces-endpoint", default=d.otlp_traces_endpoint, metavar="URL",
                   help="send an OpenTelemetry trace of each request (queue, prefill, decode "
                        "spans) to this OTLP/HTTP collector, e.g. http://localhost:4318")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may run after SIGTERM before being aborted")
    return p


def add_priority_arguments(p: argparse.ArgumentParser, d: ServerArgs) -> None:
    """SGLang's priority-scheduling switches, and the per-key limit on requests in flight."""
    p.add_argument("--enable-priority-scheduling", action="store_true",
                   default=d.enable_priority_scheduling,
                   help="order the waiting queue by each request's `priority` (a higher value "
                        "first), preempt a running request outranked by more than "
                        "--priority-scheduling-preemption-threshold, and let a full queue "
                        "drop its lowest priority; without it a priority other than 0 is 400")
    p.add_argument("--schedule-low-priority-values-first", action="store_true",
                   default=d.schedule_low_priority_values_first,
                   help="a lower priority value runs first (vLLM's direction)")
    p.add_argument("--priority-scheduling-preemption-threshold", type=int,
                   default=d.priority_scheduling_preemption_threshold,
                   help="a waiting request preempts a running one only when its priority is "
                        "more than this much more urgent")
    p.add_argument("--max-concurrent-requests-per-key", type=int,
                   default=d.max_concurrent_requests_per_key,
                   help="generating requests one API key may have in flight; one more gets "
                        "429 with Retry-After (the admin key is not limited)")


def add_speculative_arguments(p: argparse.ArgumentParser, d: ServerArgs) -> None:
    """SGLang's speculative-decoding switches (shared by the server and the CLI)."""
    p.add_argument("--speculative-algorithm", default=d.speculative_algorithm,
                   type=lambda s: s.upper(), choices=list(SPECULATIVE_ALGORITHMS),
                   help="EAGLE/EAGLE3 (a draft head; the default model ships one) or NGRAM")
    p.add_argument("--speculative-draft-model-path", default=d.speculative_draft_model_path,
                   help="folder of an EAGLE/EAGLE3 head in SGLang's layout")
    p.add_argument("--speculative-num-steps", type=int, default=d.speculative_num_steps)
    p.add_argument("--speculative-eagle-topk", type=int, default=d.speculative_eagle_topk)
    p.add_argument("--speculative-num-draft-tokens", type=int,
                   default=d.speculative_num_draft_tokens)
    p.add_argument("--speculative-ngram-min-match-window-size", type=int,
                   default=d.speculative_ngram_min_match_window_size)
    p.add_argument("--speculative-ngram-max-match-window-size", type=int,
                   default=d.speculative_ngram_max_match_window_size)
    p.add_argument("--speculative-ngram-max-bfs-breadth", type=int,
                   default=d.speculative_ngram_max_bfs_breadth)
    p.add_argument("--speculative-ngram-capacity", type=int,
                   default=d.speculative_ngram_capacity,
                   help="tokens of finished requests' text NGRAM also drafts from (0: off)")
    p.add_argument("--disable-speculative-auto-disable", dest="speculative_auto_disable",
                   action="store_false", default=d.speculative_auto_disable,
                   help="speculate on every step, even where it measured as not paying")
    p.add_argument("--disable-speculative-eagle-ngram-branch",
                   dest="speculative_eagle_ngram_branch", action="store_false",
                   default=d.speculative_eagle_ngram_branch,
                   help="EAGLE/EAGLE3: draft from the head alone (by default NGRAM's "
                        "continuation of the request's text is a branch of the head's tree)")


def add_lora_arguments(p: argparse.ArgumentParser, d: ServerArgs) -> None:
    """SGLang's multi-LoRA switches: PEFT adapters served over the one base model, picked per
    request (`lora_path`, or an OpenAI `model` naming the adapter)."""
    p.add_argument("--enable-lora", action="store_true", default=d.enable_lora,
                   help="serve LoRA adapters (on by itself with --lora-paths); load more at "
                        "run time with POST /load_lora_adapter (admin key)")
    p.add_argument("--lora-paths", nargs="+", default=list(d.lora_paths), metavar="ADAPTER",
                   help="adapters loaded at start, each NAME=PATH, a bare PATH (named by "
                        "itself), or SGLang's JSON '{\"lora_name\": ..., \"lora_path\": ..., "
                        "\"pinned\": true}' (a pinned adapter is never evicted)")
    p.add_argument("--max-loras-per-batch", type=int, default=d.max_loras_per_batch,
                   help="distinct adapters running at once; requests on more wait their turn")
    p.add_argument("--max-loaded-loras", type=int, default=d.max_loaded_loras,
                   help="adapters held in memory; loading one more unloads the least recently "
                        "used idle, unpinned one (default: no limit)")
    p.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                   help="adapters of a higher rank are refused at load (default: any)")
    p.add_argument("--lora-target-modules", nargs="+", default=d.lora_target_modules,
                   metavar="MODULE",
                   help="modules adapters may adapt: q_proj k_proj v_proj o_proj gate_proj "
                        "up_proj down_proj (qkv_proj, gate_up_proj for fused checkpoints), or "
                        "all (the default); an adapter touching another is refused at load")
    p.add_argument("--allowed-local-media-path", default=d.allowed_local_media_path,
                   help="a vision-language model takes local image paths (file://, /path) "
                        "under this folder only; default: none")
    p.add_argument("--is-embedding", action="store_true", default=d.is_embedding,
                   help="serve embeddings only (/v1/embeddings, /encode); generating routes "
                        "answer 400")
    p.add_argument("--embedding-pooling", default=d.embedding_pooling,
                   choices=list(EMBEDDING_POOLINGS),
                   help="pool the final hidden states of the last prompt token (default) or "
                        "their mean")
    p.add_argument("--allowed-media-domains", nargs="+", default=d.allowed_media_domains,
                   metavar="HOST",
                   help="hosts whose http(s) image URLs the server fetches (redirects "
                        "included); default: any")
    p.add_argument("--limit-mm-per-prompt", type=int, default=d.limit_mm_per_prompt,
                   help="images one prompt may carry")
    p.add_argument("--mm-encoder-cache-mb", type=int, default=d.mm_encoder_cache_mb,
                   help="encoder outputs kept by image content hash (MB, least recently used "
                        "out)")


def add_scale_out_arguments(p: argparse.ArgumentParser, d: ServerArgs) -> None:
    """Tensor parallelism and SGLang's prefill/decode disaggregation switches."""
    p.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int,
                   default=d.tp_size,
                   help="engine-core ranks the model is split across (one process each)")
    p.add_argument("--disaggregation-mode", default=d.disaggregation_mode,
                   choices=list(DISAGGREGATION_MODES),
                   help="prefill or decode: a worker of a PD pair behind sglang-router "
                        "--pd-disaggregation; null: a regular worker")
    p.add_argument("--disaggregation-bootstrap-port", type=int,
                   default=d.disaggregation_bootstrap_port,
                   help="where a prefill worker waits for its decode workers")
    p.add_argument("--disaggregation-transfer-backend", default=d.disaggregation_transfer_backend,
                   choices=["mooncake"])
    p.add_argument("--disaggregation-transfer-timeout", type=float,
                   default=d.disaggregation_transfer_timeout,
                   help="seconds a decode worker waits for a request's KV before failing it")
    p.add_argument("--disaggregation-secret-file", default=None,
                   help="the secret the prefill and decode workers of a cluster share (or "
                        "$SGLANG_LIKE_DISAGGREGATION_SECRET); peers without it are not heard")
    p.add_argument("--enable-disaggregation-mode-switch", action="store_true",
                   default=d.enable_disaggregation_mode_switch,
                   help="allow POST /switch_disaggregation_mode (admin key) on this worker")
    p.add_argument("--disaggregation-allowed-peers", default=",".join(
                       d.disaggregation_allowed_peers),
                   type=lambda v: tuple(h.strip() for h in v.split(",") if h.strip()),
                   help="comma-separated prefill hosts a request's bootstrap_host may name "
                        "(default: loopback hosts only)")


ENV_API_KEY = "SGLANG_LIKE_API_KEY"
ENV_ADMIN_API_KEY = "SGLANG_LIKE_ADMIN_API_KEY"
ENV_DISAGGREGATION_SECRET = "SGLANG_LIKE_DISAGGREGATION_SECRET"


def read_secret_lines(path: str) -> list[str]:
    """The non-empty, non-comment lines of a key file (SystemExit naming a bad file)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise SystemExit(f"cannot read {path}: {exc}") from None
    if mode & 0o077:
        logger.warning("%s is readable by other users (chmod 600 it)", path)
    keys = [line for line in lines if line and not line.startswith("#")]
    if not keys:
        raise SystemExit(f"{path} holds no key")
    return keys


def server_args_from(ns: argparse.Namespace,
                     environ: dict[str, str] | None = None) -> ServerArgs:
    """Map parsed options onto ServerArgs (options that are not ServerArgs fields are left out).

    Keys and the PD secret come from the command line, else their file, else the environment
    (so none has to be on a command line, which any user of the machine can read)."""
    env = os.environ if environ is None else environ
    values = dict(vars(ns))
    # $SGLANG_LIKE_API_KEY stands for --api-key; a key file adds its keys (tenants)
    first = values.get("api_key") or env.get(ENV_API_KEY)
    keys: list[str] = [first] if first else []
    if values.get("api_key_file"):
        keys += [k for k in read_secret_lines(values["api_key_file"]) if k not in keys]
    values["api_key"], values["extra_api_keys"] = (keys[0], tuple(keys[1:])) if keys else (
        None, ())
    if not values.get("admin_api_key"):
        if values.get("admin_api_key_file"):
            values["admin_api_key"] = read_secret_lines(values["admin_api_key_file"])[0]
        else:
            values["admin_api_key"] = env.get(ENV_ADMIN_API_KEY) or None
    if values.get("disaggregation_secret_file"):
        values["disaggregation_secret"] = read_secret_lines(
            values["disaggregation_secret_file"])[0]
    else:
        values["disaggregation_secret"] = env.get(ENV_DISAGGREGATION_SECRET) or None
    if values.get("allowed_hosts") is None:
        values["allowed_hosts"] = ()
    for name in ("lora_paths", "lora_target_modules", "allowed_media_domains"):  # lists -> tuples
        if isinstance(values.get(name), list):
            values[name] = tuple(values[name])
    if values["admin_api_key"] and values["admin_api_key"] in keys:
        raise SystemExit("the admin API key must differ from every plain key")
    if values.get("reasoning_budget") is not None and values["reasoning_budget"] < 0:
        values["reasoning_budget"] = None  # llama.cpp's -1: unlimited
    fields = set(ServerArgs.__dataclass_fields__)
    return ServerArgs(**{k: v for k, v in values.items() if k in fields})


def _check(args: ServerArgs) -> None:
    for name in ("port",):
        if not 0 < getattr(args, name) < 65536:
            raise SystemExit(f"--{name} must be in 1..65535")
    for name in ("max_running_requests", "max_queued_requests", "max_request_body_bytes"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise SystemExit("--ssl-keyfile and --ssl-certfile go together")
    if args.reasoning_budget is not None and args.reasoning_parser is None:
        raise SystemExit("--reasoning-budget needs --reasoning-parser")
    if args.max_concurrent_requests_per_key is not None:
        if args.max_concurrent_requests_per_key < 1:
            raise SystemExit("--max-concurrent-requests-per-key must be at least 1")
        if not args.api_key:
            raise SystemExit("--max-concurrent-requests-per-key limits each API key: give "
                             "keys (--api-key, --api-key-file)")
    if args.otlp_traces_endpoint is not None:
        from sglang_like.server.tracing import traces_url

        try:
            traces_url(args.otlp_traces_endpoint)
        except ValueError as e:
            raise SystemExit(f"--otlp-traces-endpoint: {e}") from None
    _check_lora(args)


def _check_lora(args: ServerArgs) -> None:
    """The LoRA flags' forms, before the model loads (the adapters themselves are read and
    checked by the engine)."""
    for name in ("max_loras_per_batch", "max_loaded_loras", "max_lora_rank"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    if not (args.lora_paths or args.lora_target_modules):
        return
    from sglang_like.lora import LORA_TARGETS, LoraAdapterError, parse_lora_paths

    try:
        parse_lora_paths(args.lora_paths)
    except LoraAdapterError as e:
        raise SystemExit(str(e)) from None
    unknown = [m for m in args.lora_target_modules or () if m not in (*LORA_TARGETS, "all")]
    if unknown:
        raise SystemExit(f"--lora-target-modules: unknown {unknown}; choose from "
                         f"{' '.join(LORA_TARGETS)} or all")


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    args = server_args_from(ns)
    _check(args)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    import uvicorn

    from sglang_like import Engine
    from sglang_like.server import create_app

    t0 = time.perf_counter()
    if args.cpu_pinning == "auto":  # the server keeps its HTTP process off the loop's core
        args = dataclasses.replace(args, cpu_pinning="on")
    engine = Engine(server_args=args)
    if engine.loop_cpu is not None:  # the HTTP side (this process) keeps off the loop's core
        from sglang_like.utils.cpu_runtime import keep_threads_off

        keep_threads_off(engine.loop_cpu, include_self=True)
    app = create_app(engine)
    state = app.state.server
    if state.served_model_name in state.lora_names:  # `model` of that name means the base
        engine.shutdown()
        raise SystemExit(f"a LoRA adapter is named {state.served_model_name!r}, the served "
                         "model's own name; give it another name in --lora-paths")
    info = engine.get_server_info()
    print(
        f"sglang_like: loaded {state.model_path} as '{state.served_model_name}' in "
        f"{time.perf_counter() - t0:.1f}s (device {info.get('device')}, dtype "
        f"{info.get('dtype')}, KV pool {info['kv_pool'].get('total_slots')} tokens, context "
        f"{state.context_length}); listening on "
        f"{'https' if args.ssl_certfile else 'http'}://{args.host}:{args.port}"
        + (" (API key required)" if args.api_key else "")
        + (" (admin key set)" if args.admin_api_key else ""),
        flush=True,
    )
    server = uvicorn.Server(uvicorn_config(app, args, ns.shutdown_timeout))
    # uvicorn re-raises a caught SIGTERM/SIGINT after its graceful shutdown, which would end the
    # process with the signal's default action; these handlers make that a no-op so we exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _noop)
    try:
        server.run()
    finally:
        logger.info("shutting down the engine")
        engine.shutdown()
        _exit_watchdog()
    return 0 if server.started else 1


def uvicorn_config(app: Any, args: ServerArgs, shutdown_timeout: float) -> Any:
    """uvicorn's settings for serving `app`: HTTPS when the key and certificate are given."""
    import uvicorn

    return uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=max(1, int(shutdown_timeout)), access_log=False,
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
    )


def _noop(signum: int, frame: Any) -> None:
    logger.debug("signal %d after shutdown ignored", signum)


def _exit_watchdog(grace_s: float = 10.0) -> None:
    """If a stray non-daemon thread would keep the process alive, exit anyway after a grace."""
    def stragglers() -> list[threading.Thread]:
        return [t for t in threading.enumerate()
                if t is not threading.current_thread() and not t.daemon and t.is_alive()]

    deadline = time.monotonic() + grace_s
    while stragglers() and time.monotonic() < deadline:
        time.sleep(0.1)
    if stragglers():
        logger.warning("threads still alive after shutdown: %s; exiting anyway",
                       [t.name for t in stragglers()])
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
