"""ModelRunner: owns the model and the KV pool; turns a batch into one forward."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from sglang_like.config import ModelConfig
from sglang_like.forward_batch import ForwardBatch
from sglang_like.layers.lora import LoraBatch
from sglang_like.layers.quantization import QuantConfig
from sglang_like.mem_pool import KVPool, ReqToTokenPool
from sglang_like.model_executor.cuda_graph import CudaGraphs, ForwardGraphs, GraphBackend
from sglang_like.models.registry import model_class, vision_class
from sglang_like.multimodal.encoder_cache import EncoderCache
from sglang_like.schedule_batch import ScheduleBatch
from sglang_like.tp.comm import TPRankLost
from sglang_like.tp.parallel import TPShard, shard_weights
from sglang_like.utils.decode_threads import DecodeThreads
from sglang_like.utils.upload import upload_ints

if TYPE_CHECKING:
    from sglang_like.tp.group import TPGroup

logger = logging.getLogger(__name__)

class ModelRunner:
    """Builds the model from Hugging Face-named weights and runs mixed extend/decode batches.

    Tensor parallelism: with `tp` the model is one rank's shard (its KV pool holds its KV
    heads only). Rank 0 also gets `tp_group`: `forward` then hands each batch to the other
    ranks, which run it through `run_shard`; the scheduler's side is unchanged.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype,
        device: torch.device,
        num_kv_slots: int | Callable[[int], int],
        context_len: int,
        max_running_requests: int,
        quant: QuantConfig | None = None,
        kv_dtype: torch.dtype | None = None,
        tp: TPShard | None = None,
        tp_group: TPGroup | None = None,
        encoder_cache_bytes: int = 256 << 20,
    ) -> None:
        """`dtype` is the dense dtype (residual stream, unquantized weights); `quant` picks each
        linear's method (default: dense in `dtype`); `kv_dtype` the KV pool's (default `dtype`).
        `num_kv_slots`: the KV pool's size in tokens, or a function of the pool's bytes per
        token (this rank's KV heads) that gives it once the weights are on the device: the
        CUDA sizing reads the memory they left (engine_core.setup.cuda_pool_slots).
        `tp`: this rank's shard; `tp_group` (rank 0): the started group, which this runner
        then owns (closed if the build fails); its other ranks take rank 0's pool size. A
        vision-language model's image side (its "vision." weights) is built beside the text
        model; `encoder_cache_bytes` bounds the encoder outputs kept by image hash."""
        try:
            self.vision = self._build_vision(model_config, weights, dtype, device, tp)
            if self.vision is not None:  # the text model's weights only (the dict is shared)
                weights = {n: w for n, w in weights.items() if not n.startswith("vision.")}
            self.encoder_cache = EncoderCache(encoder_cache_bytes)
            self._build(model_config, weights, dtype, device, context_len,
                        max_running_requests, quant, tp)
            # last: everything else this runner holds on the device is placed by now
            self._build_kv_pool(num_kv_slots, kv_dtype or dtype, tp, tp_group)
            if tp_group is not None:
                tp_group.wait_ready()
        except BaseException:
            if tp_group is not None:
                tp_group.close()
            raise
        self.tp_group = tp_group
        self.decode_threads: DecodeThreads | None = None
        self.graphs: list[ForwardGraphs] = []  # capture_graphs
        self.graph_backend: GraphBackend | None = None

    def _build(self, model_config: ModelConfig, weights: dict[str, torch.Tensor],
               dtype: torch.dtype, device: torch.device, context_len: int,
               max_running_requests: int, quant: QuantConfig | None,
               tp: TPShard | None) -> None:
        model_cls = model_class(model_config.architecture)  # ValueError if unsupported
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.quant = quant or QuantConfig("none", dtype)
        model = model_cls(model_config, self.quant, tp)
        model.set_rope(context_len, device)
        if tp is not None:
            weights = shard_weights(weights, model_config, tp.plan)
        model.load_weights(weights, device)
        self.model = model.eval()
        self.req_to_token_pool = ReqToTokenPool(max_running_requests + 1, context_len, device)
        self.aux_layers: tuple[int, ...] = ()  # set by an EAGLE-3 drafter
        self.last_features: torch.Tensor | None = None

    def _build_kv_pool(self, num_kv_slots: int | Callable[[int], int], kv_dtype: torch.dtype,
                       tp: TPShard | None, tp_group: TPGroup | None) -> None:
        """The KV pool, sized now if `num_kv_slots` is a function; the other tensor-parallel
        ranks wait for this size before they allocate theirs (equal pools: one scheduler
        hands out slots for all of them)."""
        config = self.model_config
        num_kv_heads = tp.plan.num_kv_heads if tp else config.num_key_value_heads
        if callable(num_kv_slots):
            num_kv_slots = num_kv_slots(KVPool.bytes_per_token(
                config.num_hidden_layers, num_kv_heads, config.head_dim, kv_dtype))
        if tp_group is not None:
            tp_group.share_num_kv_slots(num_kv_slots)
        self.kv_pool = KVPool(num_kv_slots, config.num_hidden_layers, num_kv_heads,
                              config.head_dim, kv_dtype, self.device)

    @staticmethod
    def _build_vision(config: ModelConfig, weights: dict[str, torch.Tensor],
                      dtype: torch.dtype, device: torch.device, tp: TPShard | None
                      ) -> torch.nn.Module | None:
        """The image side (encoder + projector, dense in `dtype`) from the "vision." weights;
        None for a text model."""
        state = {n[len("vision."):]: w for n, w in weights.items() if n.startswith("vision.")}
        if config.vision is None:
            return None
        if tp is not None:
            raise ValueError("tensor parallelism does not take a vision-language model yet")
        module = vision_class(config.vision.family)(config.vision, config.hidden_size)
        missing = sorted(set(module.state_dict()) - set(state))
        if missing:
            raise ValueError(f"checkpoint {config.model_path!r} lacks vision weights "
                             f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
        module.load_state_dict(state, strict=False)  # unread parts (SigLIP's head) left out
        return module.to(device=device, dtype=dtype).eval()

    def _embedding_rows(self, item: Any, a: int, b: int) -> torch.Tensor:
        """Rows [a, b) of an image's embedding ([b - a, hidden]), encoding only the crops
        they come from (Idefics3 splits a picture into crops of equal token counts; the other
        families have one): a prefill chunk through a large image encodes its share of it, so
        a step's encoder work is bounded by its chunk. Crops are kept by (hash, crop)."""
        crops = item.shape[0]
        per = sum(n for _, n in item.runs) // crops
        wanted = range(a // per, (b + per - 1) // per)
        got = {c: self.encoder_cache.get((item.hash, c)) for c in wanted}
        missing = [c for c, rows in got.items() if rows is None]
        if missing:
            pixels = np.frombuffer(item.pixels, dtype=np.float32).reshape(item.shape)
            batch = torch.from_numpy(pixels[missing].copy()).to(self.device, self.dtype)
            for c, rows in zip(missing, self.vision.encode(batch).split(per), strict=True):
                got[c] = rows
                self.encoder_cache.put((item.hash, c), rows)
        rows = torch.cat([got[c] for c in wanted])
        return rows[a - wanted.start * per: b - wanted.start * per]

    def _image_inputs(self, batch: ScheduleBatch
                      ) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
        """(input ids the embedding can read, image rows, their embeddings): each image
        position of a request's new tokens gets its image's embedding row, and its pad id an
        id inside the vocabulary. Drafted or decoded tokens never are image positions."""
        if self.vision is None or not any(r.images for r in batch.reqs):
            return batch.input_ids, None, None
        vocab, image_token = self.model_config.vocab_size, self.model_config.vision.image_token_id
        ids = [t if t < vocab else image_token for t in batch.input_ids]
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        start = 0
        for req, pre, n, tree in zip(batch.reqs, batch.prefix_lens, batch.extend_lens,
                                     batch.trees, strict=True):
            if req.images and tree is None and pre < req.prompt_len:
                for item in req.images:
                    done = 0  # embedding rows of this image before the run
                    for s, length in item.runs:
                        lo, hi = max(s, pre), min(s + length, pre + n)
                        if lo < hi:
                            parts.append(self._embedding_rows(item, done + lo - s,
                                                              done + hi - s))
                            rows += range(start + lo - pre, start + hi - pre)
                        done += length
            start += n
        if not rows:
            return ids, None, None
        return (ids, torch.tensor(rows, dtype=torch.long, device=self.device),
                torch.cat(parts))

    def _two_way_blocks(self, batch: ScheduleBatch) -> list[list[tuple[int, int]]] | None:
        """Per request, the (start, end) rows of its new tokens holding an image whose rows
        attend to each other both ways (Gemma 3; the scheduler keeps such an image in one
        chunk); None when no request of the batch has one."""
        if not self.model_config.vision.bidirectional:
            return None
        out: list[list[tuple[int, int]]] = []
        for req, pre, n, tree in zip(batch.reqs, batch.prefix_lens, batch.extend_lens,
                                     batch.trees, strict=True):
            spans = []
            if req.images and tree is None:
                for item in req.images:
                    for s, length in item.runs:
                        lo, hi = max(s, pre), min(s + length, pre + n)
                        if lo < hi:
                            spans.append((lo - pre, hi - pre))
            out.append(spans)
        return out if any(out) else None

    def build_forward_batch(self, batch: ScheduleBatch) -> ForwardBatch:
        dev = self.device
        input_ids, image_rows, image_embeds = self._image_inputs(batch)
        custom_masks = tree_mask = None
        blocks = self._two_way_blocks(batch) if image_rows is not None else None
        if batch.has_trees or blocks is not None:
            positions = []
            custom_masks = []
            for i, (pre, n, tree) in enumerate(zip(batch.prefix_lens, batch.extend_lens,
                                                   batch.trees, strict=True)):
                if tree is None:
                    positions += range(pre, pre + n)
                    mask = torch.ones(n, n, dtype=torch.bool).tril_()
                    for lo, hi in blocks[i] if blocks is not None else ():
                        mask[lo:hi, lo:hi] = True  # an image's rows see each other
                    custom_masks.append(mask)
                else:
                    positions += [pre + d for d in tree.depth]
                    custom_masks.append(tree.mask())
            if dev.type == "cuda" and all(t is not None for t in batch.trees) and len(
                    set(batch.extend_lens)) == 1:
                # a uniform verify batch: the Triton tree kernel
                tree_mask, custom_masks = torch.stack(custom_masks).to(dev), None
        else:
            positions = [p for pre, n in zip(batch.prefix_lens, batch.extend_lens, strict=True)
                         for p in range(pre, pre + n)]
        (input_ids_t, positions_t, out_slots, pool_rows, prefix_lens, extend_lens,
         logits_rows) = upload_ints([input_ids, positions, batch.out_slots,
                                      [r.req_pool_idx for r in batch.reqs], batch.prefix_lens,
                                      batch.extend_lens, batch.logits_rows], dev)
        return ForwardBatch(
            input_ids=input_ids_t,
            positions=positions_t,
            out_slots=out_slots,
            req_pool_indices=pool_rows,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            logits_indices=logits_rows,
            req_to_token=self.req_to_token_pool.req_to_token,
            tree_mask=tree_mask,
            custom_masks=custom_masks,
            is_decode=batch.is_decode,
            on_layer=batch.on_layer,
            positional_masks=None if blocks is None else torch.tensor(
                [t is None for t in batch.trees], dtype=torch.bool),
            lora=LoraBatch.build([r.lora.adapter.weights if r.lora is not None else None
                                  for r in batch.reqs], batch.extend_lens, dev)
            if any(r.lora is not None for r in batch.reqs) else None,
            image_rows=image_rows,
            image_embeds=image_embeds,
            max_extend_len=max(batch.extend_lens, default=0),
        )

    def forward(self, batch: ScheduleBatch, *, to_host: bool = True) -> torch.Tensor:
        """Logits [len(batch.logits_rows), vocab] float32 on CPU, or with `to_host=False` on
        the model's device (for the device sampler: no full-vocabulary copy). With
        `aux_layers` set (an EAGLE-3 drafter is on), the target's features of every token row
        are kept in `last_features` [num_tokens, 3 * hidden] for the drafter."""
        fb = self.build_forward_batch(batch)
        self._set_threads(fb)
        pooled = batch if any(r.pooling for r in batch.reqs) else None
        graphs = next((g for g in self.graphs if g.takes(fb)), None)
        if (graphs is not None and pooled is None
                and batch.logits_rows == list(range(fb.num_tokens))):
            logits, features = graphs.run(fb)
            if self.aux_layers:
                self.last_features = features
            return logits.cpu() if to_host else logits
        if self.tp_group is None:
            return self._forward(fb, pooled, to_host)
        self.tp_group.broadcast(fb)
        try:
            return self._forward(fb, pooled, to_host)
        except Exception as exc:
            # the other ranks are inside this forward's collectives: they cannot be brought
            # back in step with the next batch, so the group (and the engine) ends
            raise TPRankLost(f"rank 0 failed inside a tensor-parallel forward: "
                             f"{type(exc).__name__}: {exc}") from exc

    def capture_graphs(self, max_batch_size: int, backend: GraphBackend | None = None,
                       verify_tokens: int | None = None) -> None:
        """Capture the decode forward, and with `verify_tokens` the verify of that many tree
        nodes a request, as CUDA graphs (sglang_like.model_executor.cuda_graph) for batches
        of up to `max_batch_size` requests, which `forward` then replays; after an EAGLE-3
        drafter has set `aux_layers` (the graphs keep its features too). `backend`: the
        graph API (default: CUDA's, its memory pool shared by every graph)."""
        if self.tp_group is not None:
            raise ValueError("--enable-cuda-graph does not take tensor parallelism yet (the "
                             "batch reaches the other ranks through the host)")
        backend = backend if backend is not None else CudaGraphs()
        self.graph_backend = backend  # the drafter's graphs share it (and its memory pool)
        sizes = [1] + ([verify_tokens] if verify_tokens and verify_tokens > 1 else [])
        self.graphs = [ForwardGraphs(self, max_batch_size, backend, n) for n in sizes]

    def _set_threads(self, fb: ForwardBatch) -> None:
        """The forward's thread count (`decode_threads`, set by the engine's build on CPU):
        the native step's decode and verify forwards may run on fewer threads than the rest;
        prefill chunks keep every thread, natively (cold prompts, cached prefixes, every
        chunk in deterministic mode) or not: their phases are long beside a barrier's cost."""
        if self.decode_threads is not None:
            runs_native = getattr(self.model, "runs_native", None)
            step = fb.is_decode or (fb.custom_masks is not None and fb.image_rows is None)
            self.decode_threads.for_forward(
                step and runs_native is not None and runs_native(fb, self.kv_pool))

    @property
    def has_greedy_forward(self) -> bool:
        """Whether `forward_greedy` has a path of its own (else it is not to be called)."""
        return self.tp_group is None and getattr(self.model, "has_head_argmax", False)

    def forward_greedy(self, batch: ScheduleBatch) -> list[int]:
        """The argmax token of each of `forward(batch)`'s rows, the same ids, the LM head computing
        only the logits that can be the maximum (`has_greedy_forward`); `last_features` kept
        as `forward` keeps them."""
        fb = self.build_forward_batch(batch)
        self._set_threads(fb)
        ids, features = self.model.forward_argmax(fb, self.kv_pool, self.aux_layers)
        if self.aux_layers:
            self.last_features = features
        return ids.tolist()

    def _forward(self, fb: ForwardBatch, pooled: ScheduleBatch | None = None,
                 to_host: bool = True) -> torch.Tensor:
        """Logits (float32; on the host if `to_host`); `pooled` (a batch with embedding
        requests): their final hidden states (after the model's norm) are also read out and
        pooled into each request."""
        final = self.model_config.num_hidden_layers
        aux = self.aux_layers + ((final,) if pooled is not None else ())
        if not aux:
            logits = self.model(fb, self.kv_pool).float()
            return logits.cpu() if to_host else logits
        logits, features = self.model.forward_features(fb, self.kv_pool, aux)
        if pooled is not None:
            hidden = self.model_config.hidden_size
            _pool_hidden(pooled, features[:, -hidden:])
            features = features[:, :-hidden] if self.aux_layers else None
        if self.aux_layers:
            self.last_features = features
        return logits.float().cpu() if to_host else logits.float()

    def run_shard(self, fb: ForwardBatch) -> None:
        """A tensor-parallel rank > 0's part of a forward: its layers, K/V stored, no logits."""
        self.model.forward_layers(fb, self.kv_pool)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do without them)."""
        if self.tp_group is not None:
            self.tp_group.close()


def _pool_hidden(batch: ScheduleBatch, hidden: torch.Tensor) -> None:
    """Each embedding request's pooled final hidden state, once its prompt is computed:
    "last" its last prompt row's, "mean" the mean over its prompt rows (summed chunk by
    chunk: such a request takes no cached prefix, see Scheduler._max_prefix_len), L2
    normalized in `req.embedding` (float32, CPU), as the peers' embedding servers do."""
    start = 0
    for req, pre, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, strict=True):
        if req.pooling and pre < req.prompt_len:
            end = min(pre + n, req.prompt_len)
            rows = hidden[start:start + end - pre].float()
            if req.pooling == "mean":
                total = rows.sum(0)
                req.embedding_sum = total if req.embedding_sum is None else (
                    req.embedding_sum + total)
            if end == req.prompt_len:
                vec = (rows[-1] if req.pooling == "last"
                       else req.embedding_sum / req.prompt_len)
                req.embedding = torch.nn.functional.normalize(vec, dim=0).cpu()
        start += n
