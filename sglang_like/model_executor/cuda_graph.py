"""CUDA graphs of the decode and verify forwards, one per batch-size bucket
(`--enable-cuda-graph`).

A small decode batch on a GPU waits on kernel launches, not on the GPU: each layer is a dozen
launches of a few microseconds of work, and Python issues them one by one. A graph records a
forward's launches once and replays them in one call. What a replay cannot change is what the
capture saw on the host: tensor addresses, shapes and the kernels' launch parameters. So each
bucket's forward reads fixed input buffers, which `run` fills with the batch's rows and pads
to the bucket with rows that write their K/V to the pool's padding slot 0 and read a few
keys; the Triton decode and tree kernels' grids and split counts depend only on the bucket,
the tree size and the table's width (triton_ops.decode_meta, tree_verify_meta), never on the
requests' lengths.

Decode batches replay, and under speculation the target's verify of the configured tree
size (`--speculative-num-draft-tokens` nodes a request, each under its own tree mask, which
is a buffer too); a padding request's rows all write slot 0 under a causal mask. A prefill,
a verify of other tree sizes (a tree cut short near max_new_tokens, NGRAM's ragged ones),
LoRA rows, images, a per-layer hook (prefill/decode disaggregation) or a tensor-parallel
group run eagerly, as does a batch past the largest bucket. EAGLE's draft depths are graphs
of their own (`speculative.eagle.EagleDraftGraphs`, sharing the backend). A MoE model is
refused (its routing reads the expert counts on the host, which
a capture cannot do).

The switch is off by default until `scripts/gpu_check.py`'s `graphs` section has passed on a
real GPU. `EagerGraphs` stands in for the CUDA graph API on any device (tests, the device
check's --cpu-smoke): it runs the recorded function again at each replay, over the same
buffers, and copies its results into the captured outputs, so every buffer and padding rule
above is exercised where no GPU is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

from sglang_like.forward_batch import ForwardBatch
from sglang_like.layers.moe import SparseMoE

logger = logging.getLogger(__name__)

Outputs = tuple[torch.Tensor, torch.Tensor | None]  # logits, EAGLE-3 features


def graph_buckets(max_batch_size: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every multiple of 8 up to `max_batch_size`
    (itself included), as SGLang's and vLLM's lists grow. A batch runs in the smallest bucket
    that holds it; the padding is at most 7 rows past 8."""
    if max_batch_size < 1:
        raise ValueError(f"cuda_graph_max_bs must be at least 1; got {max_batch_size}")
    sizes = [b for b in (1, 2, 4) if b < max_batch_size]
    sizes += list(range(8, max_batch_size, 8))
    return sizes + [max_batch_size]


class GraphBackend(Protocol):
    def capture(self, fn: Callable[[], Outputs]) -> tuple[Callable[[], None], Outputs]:
        """Record `fn` (it reads only fixed buffers); (replay, the outputs replay writes)."""


class CudaGraphs:
    """torch.cuda.CUDAGraph: the buckets share one memory pool (captured largest first, so
    the smaller ones fit in what the largest left)."""

    def __init__(self) -> None:
        self.pool: object | None = None

    def capture(self, fn: Callable[[], Outputs]) -> tuple[Callable[[], None], Outputs]:
        # run twice outside the capture on a side stream: Triton compiles and autotunes, and
        # the caching allocator settles, before anything is recorded
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay, out


class EagerGraphs:
    """Stands for CUDA graphs where there are none: replay runs the recorded function again
    over the same buffers and copies its results into the outputs the capture returned."""

    def capture(self, fn: Callable[[], Outputs]) -> tuple[Callable[[], None], Outputs]:
        out = fn()

        @torch.inference_mode()  # the outputs are the model's inference tensors
        def replay() -> None:
            logits, features = fn()
            out[0].copy_(logits)
            if features is not None:
                out[1].copy_(features)

        return replay, out


class ForwardGraphs:
    """The runner's forward over batches of `draft_tokens` rows a request captured per bucket
    of `graph_buckets(max_batch_size)` requests, over input buffers of the largest bucket's
    size: decode batches (`draft_tokens` 1), or speculative verifies of one tree size (every
    request `draft_tokens` nodes under its own tree mask: the Triton tree kernel's uniform
    batch). `run(fb)` replays the smallest bucket that holds `fb` (`takes(fb)` first)."""

    def __init__(self, runner: Any, max_batch_size: int, backend: GraphBackend,
                 draft_tokens: int = 1) -> None:
        """`runner`: the ModelRunner whose model, pool, table and `aux_layers` the forward
        reads (a layer below it: typed loosely); `backend`: the graph API (CudaGraphs, whose
        memory pool every graph of a runner shares)."""
        if any(isinstance(layer.mlp, SparseMoE) for layer in runner.model.model.layers):
            raise ValueError("--enable-cuda-graph does not take a MoE model: its routing "
                             "reads each expert's row count on the host, which a graph "
                             "cannot replay; run without it")
        if draft_tokens < 1:
            raise ValueError(f"draft_tokens must be at least 1; got {draft_tokens}")
        self.runner = runner
        self.backend = backend
        self.buckets = graph_buckets(max_batch_size)
        self.draft_tokens = n = draft_tokens
        self.features = bool(runner.aux_layers)  # an EAGLE-3 drafter's capture, if any
        reqs, dev = self.buckets[-1], runner.device
        rows = reqs * n
        # a padding request: rows at positions 0.. of row 0's table under a causal mask, all
        # writing their K/V into the pool's padding slot 0
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self.pad_positions = torch.arange(n, device=dev).repeat(reqs)
        self.positions = self.pad_positions.clone()
        self.out_slots = torch.zeros(rows, dtype=torch.long, device=dev)
        self.logits_rows = torch.arange(rows, dtype=torch.long, device=dev)
        self.req_pool_indices = torch.zeros(reqs, dtype=torch.long, device=dev)
        self.prefix_lens = torch.zeros(reqs, dtype=torch.long, device=dev)
        self.extend_lens = torch.full((reqs,), n, dtype=torch.long, device=dev)
        self.seq_lens = torch.full((reqs,), n, dtype=torch.long, device=dev)
        self.causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril_()
        self.tree_mask = (self.causal.repeat(reqs, 1, 1) if n > 1 else None)
        self._replay: dict[int, Callable[[], None]] = {}
        self._outputs: dict[int, Outputs] = {}
        self.num_replays = 0
        for bs in reversed(self.buckets):
            fb = self._static_batch(bs)
            self._replay[bs], self._outputs[bs] = self.backend.capture(
                lambda fb=fb: self._forward(fb))
        logger.info("CUDA graphs captured for %s of %s requests",
                    "decode batches" if n == 1 else f"verifies of {n} tokens a request",
                    ", ".join(map(str, self.buckets)))

    def _static_batch(self, bs: int) -> ForwardBatch:
        t = bs * self.draft_tokens
        fb = ForwardBatch(
            input_ids=self.input_ids[:t], positions=self.positions[:t],
            out_slots=self.out_slots[:t], req_pool_indices=self.req_pool_indices[:bs],
            prefix_lens=self.prefix_lens[:bs], extend_lens=self.extend_lens[:bs],
            logits_indices=self.logits_rows[:t],
            req_to_token=self.runner.req_to_token_pool.req_to_token,
            tree_mask=None if self.tree_mask is None else self.tree_mask[:bs],
            is_decode=self.draft_tokens == 1, max_extend_len=self.draft_tokens)
        fb.seq_lens = self.seq_lens[:bs]  # a buffer, where __post_init__ made a new tensor
        return fb

    def _forward(self, fb: ForwardBatch) -> Outputs:
        model, pool = self.runner.model, self.runner.kv_pool
        if self.features:
            logits, features = model.forward_features(fb, pool, self.runner.aux_layers)
            return logits.float(), features
        return model(fb, pool).float(), None

    def takes(self, fb: ForwardBatch) -> bool:
        """Whether `fb` can replay: at most the largest bucket's requests, each with this
        graph's rows (a plain decode, or a uniform verify of that tree size), the logits of
        every row asked for (the caller checks), nothing the forward would branch on the host
        for (LoRA rows, images, per-request masks, a per-layer hook)."""
        n = self.draft_tokens
        shape_fits = (fb.is_decode and fb.tree_mask is None if n == 1 else
                      fb.tree_mask is not None and fb.tree_mask.shape[1] == n)
        return (shape_fits and fb.batch_size <= self.buckets[-1]
                and fb.num_tokens == fb.batch_size * n and fb.lora is None
                and fb.image_rows is None and fb.custom_masks is None and fb.on_layer is None
                and self.features == bool(self.runner.aux_layers))

    def run(self, fb: ForwardBatch) -> Outputs:
        """`fb`'s (logits [rows, vocab] float32, features or None), by the replay of the
        smallest bucket of at least its requests; copies, not the graph's own outputs (the
        next replay overwrites those)."""
        n, per = fb.batch_size, self.draft_tokens
        bs = next(b for b in self.buckets if b >= n)
        t, t_bs = n * per, bs * per
        for buf, src in ((self.input_ids, fb.input_ids), (self.positions, fb.positions),
                         (self.out_slots, fb.out_slots)):
            buf[:t].copy_(src)
        for buf, src in ((self.req_pool_indices, fb.req_pool_indices),
                         (self.prefix_lens, fb.prefix_lens), (self.seq_lens, fb.seq_lens)):
            buf[:n].copy_(src)
        if self.tree_mask is not None:
            self.tree_mask[:n].copy_(fb.tree_mask)
        if bs > n:  # the padding requests (a request of the last replay may be there)
            for buf in (self.input_ids, self.out_slots):
                buf[t:t_bs].zero_()
            self.positions[t:t_bs].copy_(self.pad_positions[t:t_bs])
            self.req_pool_indices[n:bs].zero_()
            self.prefix_lens[n:bs].zero_()
            self.seq_lens[n:bs].fill_(per)
            if self.tree_mask is not None:
                self.tree_mask[n:bs].copy_(self.causal.expand(bs - n, per, per))
        # the table's pending writes are in (a replay reads the tensor, not the property)
        assert fb.req_to_token is self.runner.req_to_token_pool.req_to_token
        self._replay[bs]()
        self.num_replays += 1
        logits, features = self._outputs[bs]
        return logits[:t].clone(), None if features is None else features[:t].clone()
