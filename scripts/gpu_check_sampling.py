"""The device check's "sampling" section (scripts/gpu_check.py): the device sampler
(sglang_like.layers.device_sampler) on the GPU against the host sampler.

Checks, each a row of the table:
- greedy: a batch of greedy rows under penalties, logit bias, a grammar bitmask and
  min_new_tokens gives the host sampler's tokens (on a host copy of the same logits);
- syncs: one `sample` of a batch of every kind of row makes exactly one device-to-host sync,
  counted by torch's CUDA sync debug mode (in --cpu-smoke there is no device: "-");
- draws: 4,000 seeded draws over 8 tokens (top-k 2, top-p, min-p) fall only in the kept set
  and pass a chi-square test against the distribution;
- time: a sampled batch at the Llama-3-8B vocabulary, device sampler against the logits'
  copy to the host plus the host sampler (the path before);
- steps: the scheduler over the runtime's ModelRunner (random weights, a stub tokenizer)
  with device sampling off and on: greedy requests generate the same tokens, and with it on
  a decode step makes one sync (CUDA; where the others come from is listed if not);
- ahead: a draft tree's rows drawn at once (`sample_ahead`) get the tokens, logprobs and top
  logprobs `sample` gives each row once its path is output, in one sync;
- verify: the same scheduler speculating, its drafts each request's own output from a run
  without speculation: seeded sampled requests output the same tokens (so deep drafts are
  accepted), and a verify step makes one sync.
- eagle: EAGLE-3 with a random head (drafting on the device on CUDA: the beams stay there
  between depths), eager and with every graph captured (the draft depths, the target's
  decode and verify): greedy output is the plain run's, a step syncs at most 3 times, and
  the ms a step both ways.

Imported lazily by gpu_check.section_sampling (it needs the runtime on sys.path).
"""

from __future__ import annotations

import warnings
from typing import Any

EOS = 2
EAGLE_DEPTHS = 3  # the eagle check's draft steps a tree (EAGLE's --speculative-num-steps - 1)
CHI2_LIMIT = 24.3  # p < 0.001 at 7 degrees of freedom


def _req(seed: int, output: tuple[int, ...] = (), grammar: bool = False, **params: Any) -> Any:
    import torch

    from sglang_like.req import Req
    from sglang_like.sampling_params import SamplingParams

    sp = SamplingParams(**params)
    req = Req(f"r{seed}", [5, 6, 7, 5], sp)
    req.output_ids = list(output)
    if not sp.is_greedy:
        req.generator = torch.Generator().manual_seed(seed)
    if grammar:
        req.grammar = object()  # only its presence is read while sampling
    return req


def _greedy_batch(batch: int) -> list[Any]:
    kinds = [dict(), dict(repetition_penalty=1.6), dict(frequency_penalty=1.0,
                                                        presence_penalty=0.5),
             dict(logit_bias={"9": 20.0}), dict(min_new_tokens=9, stop_token_ids=[3])]
    return [_req(i, output=(9, 9, 4, EOS), grammar=i % 3 == 0, temperature=0.0,
                 **kinds[i % len(kinds)]) for i in range(batch)]


def _mixed_batch(batch: int) -> list[Any]:
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_k=40),
             dict(top_p=0.9, repetition_penalty=1.2), dict(min_p=0.05, frequency_penalty=0.3),
             dict(temperature=1.1, top_k=20, top_p=0.95, logit_bias={"7": -4.0})]
    return [_req(i, output=tuple(range(100 + i, 140 + i)), **kinds[i % len(kinds)])
            for i in range(batch)]


def _bitmask(batch: int, vocab: int) -> Any:
    """A random packed mask on the host, where a grammar fills it."""
    import torch

    gen = torch.Generator().manual_seed(1)
    words = (vocab + 31) // 32
    return torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32, generator=gen)


def check_greedy(ctx: Any, report: Any, batch: int, vocab: int) -> None:
    import torch

    from sglang_like.layers.device_sampler import DeviceSampler
    from sglang_like.layers.sampler import Sampler

    reqs = _greedy_batch(batch)
    logits = torch.randn(batch, vocab, device=ctx.device) * 3
    logits[:, EOS] = 50.0
    bitmask = _bitmask(batch, vocab)
    want = Sampler({EOS}, vocab).sample(logits.cpu(), reqs, bitmask).next_token_ids
    got = DeviceSampler({EOS}, vocab).sample(logits.clone(), reqs, bitmask).next_token_ids
    same = sum(g == w for g, w in zip(got, want, strict=True))
    report.rows.append(["greedy = host sampler", f"B{batch} V{vocab}", f"{same}/{batch}", ""])
    report.figures["greedy_equal"] = same
    if same != batch:
        report.failures.append(f"greedy: {batch - same} of {batch} rows differ from the host")


def check_syncs(ctx: Any, report: Any, batch: int, vocab: int) -> None:
    import torch

    from sglang_like.layers.device_sampler import DeviceSampler

    if ctx.device.type != "cuda":
        report.rows.append(["device-to-host syncs / sample", f"B{batch} V{vocab}", "-", "no GPU"])
        return
    reqs = _mixed_batch(batch)
    reqs[0].return_logprob, reqs[0].top_logprobs_num = True, 5
    sampler = DeviceSampler({EOS}, vocab)
    logits = torch.randn(batch, vocab, device=ctx.device)
    bitmask = _bitmask(batch, vocab)
    sampler.sample(logits.clone(), reqs, bitmask)  # warm: first-call allocations
    fresh = logits.clone()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            sampler.sample(fresh, reqs, bitmask)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    report.rows.append(["device-to-host syncs / sample", f"B{batch} V{vocab}", str(len(syncs)),
                        "budget 1"])
    report.figures["syncs_per_sample"] = len(syncs)
    if len(syncs) != 1:
        report.failures.append(f"syncs: {len(syncs)} per sample, budget 1: {syncs[:4]}")


def check_draws(ctx: Any, report: Any, num_draws: int = 4000, vocab: int = 8) -> None:
    import torch

    from sglang_like.layers.device_sampler import DeviceSampler

    row = torch.linspace(2.0, -2.0, vocab, device=ctx.device)
    cases = {"top_k 2": (dict(top_k=2), 2), "top_p 0.75": (dict(top_p=0.75), 3),
             "min_p 0.3": (dict(min_p=0.3), 3)}
    for name, (params, keep) in cases.items():
        reqs = [_req(s, **params) for s in range(num_draws)]
        out = DeviceSampler({EOS}, vocab).sample(row.repeat(num_draws, 1), reqs)
        observed = torch.bincount(torch.tensor(out.next_token_ids), minlength=vocab).double()
        p = torch.softmax(row.cpu().double(), dim=-1)
        p[keep:] = 0
        expected = p / p.sum() * num_draws
        outside = int(observed[keep:].sum())
        chi2 = float(((observed[:keep] - expected[:keep]) ** 2 / expected[:keep]).sum())
        report.rows.append([f"draws {name}", f"{num_draws} x V{vocab}",
                            f"chi2 {chi2:.1f}", f"{outside} outside"])
        report.figures[f"chi2 {name}"] = chi2
        if outside or chi2 >= CHI2_LIMIT:
            report.failures.append(f"draws {name}: chi2 {chi2:.1f}, {outside} outside the set")


def check_time(ctx: Any, report: Any, batch: int, vocab: int) -> None:
    import torch

    from sglang_like.layers.device_sampler import DeviceSampler
    from sglang_like.layers.sampler import Sampler

    reqs = _mixed_batch(batch)
    logits = torch.randn(batch, vocab, device=ctx.device)
    device, host = DeviceSampler({EOS}, vocab), Sampler({EOS}, vocab)
    t_device = ctx.bench(lambda: device.sample(logits.clone(), reqs))
    t_host = ctx.bench(lambda: host.sample(logits.float().cpu(), reqs))
    report.rows.append(["time: device / copy + host", f"B{batch} V{vocab}",
                        f"{t_device:.3f} ms", f"{t_host:.3f} ms"])
    report.figures["device_ms"], report.figures["host_ms"] = t_device, t_host


class _StubTokenizer:
    """Enough of a tokenizer for the scheduler's output path (no model files here)."""

    eos_token_ids: tuple[int, ...] = ()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(65 + i % 26) for i in ids)


def _scheduler(ctx: Any, config: Any, weights: Any, device_sampling: bool,
               drafter: Any = None) -> Any:
    import torch

    from sglang_like.model_runner import ModelRunner
    from sglang_like.scheduler import Scheduler, SchedulerConfig

    runner = ModelRunner(config, weights, dtype=torch.float32, device=ctx.device,
                         num_kv_slots=1024, context_len=128, max_running_requests=8)
    sched_config = SchedulerConfig(pool_size=1024, context_len=128,
                                   vocab_size=config.vocab_size, max_running_requests=8,
                                   device_sampling=device_sampling,
                                   speculative_auto_disable=False)
    return Scheduler(sched_config, runner, _StubTokenizer(), frozenset({EOS}), drafter)


def _weights(config: Any) -> dict[str, Any]:
    import torch

    from sglang_like.model_loader.loaded import expected_weight_shapes

    gen = torch.Generator().manual_seed(0)
    return {n: (torch.randn(s, generator=gen) * 0.2 + (1.0 if "norm" in n else 0.0))
            for n, s in expected_weight_shapes(config).items()}


def _step_syncs(ctx: Any, sched: Any) -> list[str]:
    """Run one step; on CUDA, where each sync it made came from (file:line)."""
    import torch

    if ctx.device.type != "cuda":
        sched.step()
        return []
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            sched.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename.rsplit('/', 2)[-1]}:{w.lineno}" for w in caught
            if "synchroniz" in str(w.message)]


def _report_syncs(report: Any, ctx: Any, label: str, figure: str, config: Any,
                  worst: list[str]) -> bool:
    """The row (and figure) of the most syncs a step took; False without a GPU to count
    them on (torch's sync debug mode counts CUDA syncs only)."""
    counted = ctx.device.type == "cuda"
    report.rows.append([label, f"V{config.vocab_size}", str(len(worst)) if counted else "-",
                        ", ".join(worst[:4]) if counted else "no GPU"])
    if counted:
        report.figures[figure] = len(worst)
    return counted


def check_steps(ctx: Any, report: Any, config: Any, num_steps: int) -> None:
    from sglang_like.req import Req
    from sglang_like.sampling_params import SamplingParams

    weights = _weights(config)
    kinds = [dict(temperature=0.0), dict(temperature=0.0, repetition_penalty=1.3,
                                         logit_bias={"9": 2.0}),
             dict(temperature=0.8, top_k=20, seed=1), dict(top_p=0.9, min_p=0.05, seed=2)]
    outputs, worst = {}, []
    for on in (False, True):
        sched = _scheduler(ctx, config, weights, on)
        reqs = [Req(f"r{i}", [5 + i, 17, 3, 90, 41, 7], SamplingParams(
            max_new_tokens=num_steps + 2, ignore_eos=True, **kw)) for i, kw in enumerate(kinds)]
        for r in reqs:
            sched.add_request(r)
        sched.step()  # the prefill
        for _ in range(num_steps):
            syncs = _step_syncs(ctx, sched)
            if on and len(syncs) > len(worst):
                worst = syncs
        outputs[on] = [r.output_ids for r in reqs[:2]]
    same = outputs[False] == outputs[True]
    report.rows.append(["steps: greedy off = on", f"{num_steps} decode steps", str(same), ""])
    counted = _report_syncs(report, ctx, "steps: syncs / decode step (most)", "steps_max_syncs",
                            config, worst)
    report.figures["steps_greedy_equal"] = same
    if not same:
        report.failures.append("steps: greedy tokens differ with device sampling on")
    if counted and len(worst) > 1:
        report.failures.append(f"steps: {len(worst)} syncs in a decode step: {worst[:6]}")


AHEAD_PATHS = [[], [9], [9, 4], [4], [4, 9, 9], [30]]  # a tree's nodes below the root


def check_ahead(ctx: Any, report: Any, vocab: int) -> None:
    import torch

    from sglang_like.layers.device_sampler import DeviceSampler

    kinds = [dict(temperature=0.9, top_k=8, repetition_penalty=1.6),
             dict(top_p=0.9, frequency_penalty=1.5, presence_penalty=1.0,
                  logit_bias={"9": 2.0}),
             dict(min_p=0.05, min_new_tokens=4, stop_token_ids=[3]),
             dict(temperature=0.0, repetition_penalty=2.0, presence_penalty=3.0)]
    outputs = [(9, 4), (4,), (9, 9), (7,)]
    reqs = [_req(i + 1, output=outputs[i], **kw) for i, kw in enumerate(kinds)]
    for r in reqs[1::2]:
        r.return_logprob, r.top_logprobs_num = True, 2
    owners = [k for k in range(len(reqs)) for _ in AHEAD_PATHS]
    paths = AHEAD_PATHS * len(reqs)
    logits = torch.randn(len(owners), vocab, device=ctx.device) * 3
    logits[:, EOS] = logits[:, 3] = 9.0  # min_new_tokens must hold them back
    logits[:, 9] = logits[:, 4] = 8.0  # penalties over the path must move the choice
    sampler = DeviceSampler({EOS}, vocab)
    sampler.sample_ahead(logits.clone(), reqs, owners, paths)  # warm
    fresh = logits.clone()
    syncs: list[str] = []
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                ahead = sampler.sample_ahead(fresh, reqs, owners, paths)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    else:
        ahead = sampler.sample_ahead(fresh, reqs, owners, paths)
    same = 0
    for i, k in enumerate(owners):
        later = _req(k + 1, output=outputs[k] + tuple(paths[i]), **kinds[k])
        later.return_logprob = reqs[k].return_logprob
        later.top_logprobs_num = reqs[k].top_logprobs_num
        want = sampler.sample(logits[i : i + 1].clone(), [later])
        got_lp, want_lp = ahead.logprobs[i], want.logprobs[0]
        if (ahead.next_token_ids[i] == want.next_token_ids[0]
                and (got_lp is None) == (want_lp is None)
                and (want_lp is None or abs(got_lp - want_lp) < 1e-5)
                and [t for _, t in ahead.top_logprobs[i] or []]
                == [t for _, t in want.top_logprobs[0] or []]):
            same += 1
    counted = ctx.device.type == "cuda"
    report.rows.append(["ahead: rows = drawn later", f"{len(owners)} rows V{vocab}",
                        f"{same}/{len(owners)}", f"{len(syncs)} sync(s)" if counted else "no GPU"])
    report.figures["ahead_equal"] = same
    if same != len(owners):
        report.failures.append(f"ahead: {len(owners) - same} rows differ from sample()")
    if counted and len(syncs) != 1:
        report.failures.append(f"ahead: {len(syncs)} syncs, budget 1: {syncs[:4]}")


class _OwnOutputDrafter:
    """Drafts each request's output from `script` (rid -> its tokens without speculation) as
    a chain past what it has output: deep drafts are accepted only where a verify draws what
    plain decoding drew."""

    def __init__(self, script: dict[str, list[int]], depth: int) -> None:
        self.script, self.num_draft_tokens = script, depth + 1

    def propose(self, reqs: list[Any], max_depths: list[int], ctx: Any) -> list[Any]:
        from sglang_like.speculative.tree import DraftTree

        trees = []
        for req, cap in zip(reqs, max_depths, strict=True):
            ahead = self.script[req.rid][len(req.output_ids):]
            trees.append(DraftTree.chain(req.fill_ids[-1],
                                         ahead[:min(self.num_draft_tokens - 1, cap)]))
        return trees


def check_verify(ctx: Any, report: Any, config: Any, max_new: int) -> None:
    from sglang_like.req import Req
    from sglang_like.sampling_params import SamplingParams

    weights = _weights(config)
    kinds = [dict(temperature=0.8, top_k=20, repetition_penalty=1.3, seed=1),
             dict(top_p=0.9, min_p=0.05, frequency_penalty=0.4, logit_bias={"9": 2.0}, seed=2),
             dict(temperature=1.0, min_new_tokens=max_new - 2, seed=3),
             dict(temperature=1.0, seed=4)]
    outputs, worst, accepted = {}, [], 0
    for drafter in (None, "own"):
        script = outputs.get(None)
        sched = _scheduler(ctx, config, weights, True,
                           None if drafter is None else _OwnOutputDrafter(script, 3))
        reqs = [Req(f"r{i}", [5 + i, 17, 3, 90, 41, 7], SamplingParams(
            max_new_tokens=max_new, ignore_eos=True, **kw)) for i, kw in enumerate(kinds)]
        for r in reqs:
            sched.add_request(r)
        sched.step()  # the prefill
        while sched.has_work:
            syncs = _step_syncs(ctx, sched)
            if drafter is not None and len(syncs) > len(worst):
                worst = syncs
        outputs[drafter] = {r.rid: r.output_ids for r in reqs}
        if drafter is not None:
            accepted = sum(n for length, n in sched.spec_accept_lengths.items() if length > 1)
    same = outputs[None] == outputs["own"]
    report.rows.append(["verify: sampled spec = plain", f"{len(kinds)} x {max_new} tokens",
                        str(same), f"{accepted} verifies took drafts"])
    counted = _report_syncs(report, ctx, "verify: syncs / step (most)", "verify_max_syncs",
                            config, worst)
    report.figures["verify_sampled_equal"] = same
    if not same or not accepted:
        report.failures.append(f"verify: sampled outputs equal {same}, {accepted} verifies "
                               "took drafts")
    if counted and len(worst) > 1:
        report.failures.append(f"verify: {len(worst)} syncs in a step: {worst[:6]}")


def check_eagle(ctx: Any, report: Any, config: Any, max_new: int) -> None:
    """EAGLE-3 with a seeded random head (saved to a temporary folder and loaded as a user's
    would be), its draft depths eager and then replayed as graphs (`--enable-cuda-graph`:
    CUDA graphs, the target's decode and verify too; EagerGraphs in --cpu-smoke): greedy
    requests output what they output without speculation, a step that verifies and drafts
    EAGLE_DEPTHS depths syncs at most 3 times on CUDA (the verify's argmax, the head's
    candidates after it, every draft depth's at once), and the ms a step both ways."""
    import tempfile
    import time

    import torch

    from sglang_like.model_executor.cuda_graph import CudaGraphs, EagerGraphs
    from sglang_like.req import Req
    from sglang_like.sampling_params import SamplingParams
    from sglang_like.speculative import SpecConfig
    from sglang_like.speculative.eagle import EagleDrafter
    from sglang_like.speculative.eagle_head import Eagle3Config, Eagle3Head

    weights = _weights(config)
    outputs, worst, drafted, step_ms, replays = {}, [], 0, {}, 0
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        Eagle3Head(Eagle3Config(
            hidden_size=config.hidden_size, intermediate_size=2 * config.hidden_size,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=config.vocab_size,
            draft_vocab_size=config.vocab_size, target_hidden_size=config.hidden_size,
            aux_layer_ids=[0, config.num_hidden_layers // 2, config.num_hidden_layers - 1],
        )).save(folder)
        spec = SpecConfig("EAGLE3", num_steps=EAGLE_DEPTHS + 1, eagle_topk=2,
                          num_draft_tokens=6, draft_model_path=folder, ngram_min_window=1,
                          ngram_max_window=4, ngram_breadth=1, auto_disable=False)
        for mode in ("plain", "eagle", "eagle+graphs"):
            sched = _scheduler(ctx, config, weights, True)
            if mode != "plain":
                sched.drafter = EagleDrafter(spec, sched.runner)
                sched.drafter.on_device = True  # what CUDA runs (the CPU's own: the host walk)
            if mode == "eagle+graphs":
                backend = EagerGraphs() if ctx.smoke else CudaGraphs()
                sched.runner.capture_graphs(4, backend, verify_tokens=spec.num_draft_tokens)
                sched.drafter.capture_graphs(4, sched.runner.graph_backend)
            reqs = [Req(f"r{i}", [5 + i, 17, 3, 90, 41, 7], SamplingParams(
                max_new_tokens=max_new, ignore_eos=True, temperature=0.0)) for i in range(3)]
            for r in reqs:
                sched.add_request(r)
            sched.step()  # the prefill
            steps, t0 = 0, time.perf_counter()
            while sched.has_work:
                syncs = _step_syncs(ctx, sched)
                steps += 1
                if mode != "plain" and len(syncs) > len(worst):
                    worst = syncs
            step_ms[mode] = (time.perf_counter() - t0) * 1e3 / max(steps, 1)
            outputs[mode] = {r.rid: r.output_ids for r in reqs}
            if mode == "eagle":
                drafted = sched.drafter.num_forwards
            if mode == "eagle+graphs":
                replays = sched.drafter.graphs.num_replays
    same = outputs["plain"] == outputs["eagle"] == outputs["eagle+graphs"]
    report.rows.append(["eagle: greedy spec = plain", f"3 x {max_new} tokens", str(same),
                        f"{drafted} head forwards, {EAGLE_DEPTHS} draft depths"])
    report.rows.append(["eagle: ms / step eager, graphs (syncs counted)", f"V{config.vocab_size}",
                        f"{step_ms['eagle']:.2f}, {step_ms['eagle+graphs']:.2f}",
                        f"{replays} draft replays; plain {step_ms['plain']:.2f}"])
    counted = _report_syncs(report, ctx, "eagle: syncs / step (most)", "eagle_max_syncs",
                            config, worst)
    report.figures.update({"eagle_greedy_equal": same, "eagle_step_ms": step_ms,
                           "eagle_draft_replays": replays})
    if not same or not drafted or not replays:
        report.failures.append(f"eagle: greedy outputs equal {same}, {drafted} head forwards, "
                               f"{replays} draft replays")
    if counted and len(worst) > 3:
        report.failures.append(f"eagle: {len(worst)} syncs in a step: {worst[:6]}")


def run_sampling_checks(ctx: Any, report: Any) -> None:
    """Fill `report` (gpu_check.Report: columns check, shape, value, note)."""
    from sglang_like.config import ModelConfig

    if ctx.smoke:
        check_greedy(ctx, report, 10, 300)
        check_syncs(ctx, report, 5, 300)
        check_draws(ctx, report)
        check_time(ctx, report, 5, 300)
        check_steps(ctx, report, ModelConfig("llama", 97, 64, 192, 2, 4, 2, 16), 3)
        check_ahead(ctx, report, 300)
        check_verify(ctx, report, ModelConfig("llama", 97, 64, 192, 2, 4, 2, 16), 8)
        check_eagle(ctx, report, ModelConfig("llama", 97, 64, 192, 2, 4, 2, 16), 8)
    else:
        check_greedy(ctx, report, 64, 128256)
        check_syncs(ctx, report, 64, 128256)
        check_draws(ctx, report)
        check_time(ctx, report, 64, 128256)
        check_steps(ctx, report, ModelConfig("llama", 32000, 256, 512, 2, 4, 2, 64), 6)
        check_ahead(ctx, report, 128256)
        check_verify(ctx, report, ModelConfig("llama", 32000, 256, 512, 2, 4, 2, 64), 12)
        check_eagle(ctx, report, ModelConfig("llama", 32000, 256, 512, 2, 4, 2, 64), 12)
