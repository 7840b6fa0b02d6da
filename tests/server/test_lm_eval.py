"""lm-evaluation-harness (PyPI `lm-eval`), run for real as a subprocess with its
`local-completions` model against a real server on loopback: a 10-question multiple-choice
task (loglikelihoods from /v1/completions with echo and logprobs) and a 5-question
generate_until task, both from JSONL files in lm_eval_tasks/ (no hub: offline env). It counts
tokens with the server's own /tokenize (`tokenizer_backend=remote`). The loglikelihood of each
(context, continuation) it received must equal what /generate reports for the same strings."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

TASKS_DIR = os.path.join(os.path.dirname(__file__), "lm_eval_tasks")
TASKS = ("sglang_like_mc", "sglang_like_gen")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _run_lm_eval(server: Any, out_dir: str) -> subprocess.CompletedProcess:
    model_args = (f"model=sglang-like,base_url={server.url}/v1/completions,num_concurrent=1,"
                  "max_retries=1,tokenizer_backend=remote,max_length=2048")
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
           "--model_args", model_args, "--include_path", TASKS_DIR, "--tasks", ",".join(TASKS),
           "--log_samples", "--output_path", out_dir, "--seed", "1234"]
    env = {**os.environ, **OFFLINE, "HF_DATASETS_CACHE": os.path.join(out_dir, "hf_datasets")}
    # relative data_files in the task YAMLs resolve against the working directory
    return subprocess.run(cmd, cwd=TASKS_DIR, env=env, capture_output=True, text=True,
                          timeout=240)


def _samples(out_dir: str, task: str) -> list[dict[str, Any]]:
    (path,) = glob.glob(os.path.join(out_dir, "**", f"samples_{task}_*.jsonl"), recursive=True)
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _results(out_dir: str) -> dict[str, Any]:
    (path,) = glob.glob(os.path.join(out_dir, "**", "results_*.json"), recursive=True)
    with open(path) as f:
        return json.load(f)["results"]


def _native_loglikelihood(server: Any, context: str, continuation: str) -> tuple[float, bool]:
    """lm-eval's split of the pair (trailing spaces of the context go to the continuation,
    the whole string is tokenized once), scored by /generate: the summed logprob of the
    continuation tokens, and whether each was the most likely one."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    tokenize = server.url + "/tokenize"
    whole = httpx.post(tokenize, json={"prompt": context + continuation,
                                       "add_special_tokens": False}).json()["tokens"]
    ctx_len = httpx.post(tokenize, json={"prompt": context,
                                         "add_special_tokens": False}).json()["count"]
    r = httpx.post(server.url + "/generate", timeout=120, json={
        "input_ids": whole, "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 1})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    entries = meta["input_token_logprobs"][ctx_len:]
    tops = meta["input_top_logprobs"][ctx_len:]
    assert entries and [e[1] for e in entries] == whole[ctx_len:]
    is_greedy = all(top[0][1] == e[1] for e, top in zip(entries, tops, strict=True))
    return sum(e[0] for e in entries), is_greedy


def test_lm_eval_local_completions(real_server: Any, tmp_path: Any) -> None:
    from lm_eval.utils import check_remote_tokenizer_support

    # lm-eval's own probe, which picks tokenizer_backend=remote when it passes
    assert check_remote_tokenizer_support(real_server.url + "/v1/completions")
    t0 = time.monotonic()
    proc = _run_lm_eval(real_server, str(tmp_path))
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    results = _results(str(tmp_path))
    mc, gen = results["sglang_like_mc"], results["sglang_like_gen"]
    print(f"\nlm-eval ({elapsed:.1f} s): {TASKS[0]} acc={mc['acc,none']:.2f} "
          f"acc_norm={mc['acc_norm,none']:.2f}; {TASKS[1]} "
          f"exact_match={gen['exact_match,none']:.2f}")
    # a 135M model knows some of these; chance on 4 choices is 0.25
    assert 0.0 <= mc["acc,none"] <= 1.0 and 0.0 <= gen["exact_match,none"] <= 1.0

    mc_samples = _samples(str(tmp_path), TASKS[0])
    assert len(mc_samples) == 10
    max_diff, num_pairs = 0.0, 0
    for sample in mc_samples:
        assert len(sample["arguments"]) == 4 == len(sample["resps"])
        for args, resp in zip(sample["arguments"].values(), sample["resps"], strict=True):
            context, continuation = args["arg_0"], args["arg_1"]
            got_ll, got_greedy = float(resp[0][0]), resp[0][1] in (True, "True")
            ll, is_greedy = _native_loglikelihood(real_server, context, continuation)
            assert got_ll < 0 and got_ll == pytest.approx(ll, abs=1e-5), (context, continuation)
            assert got_greedy == is_greedy, (context, continuation)
            max_diff = max(max_diff, abs(got_ll - ll))
            num_pairs += 1
    print(f"loglikelihoods: {num_pairs} pairs equal to /generate's (max |diff| {max_diff:.2e})")

    gen_samples = _samples(str(tmp_path), TASKS[1])
    assert len(gen_samples) == 5
    for sample in gen_samples:
        text = sample["resps"][0][0]
        assert isinstance(text, str) and "\n" not in text  # `until` was applied
    print("generations:", [s["resps"][0][0] for s in gen_samples])


def test_tokenizer_routes(real_server: Any) -> None:
    """What lm-eval's RemoteTokenizer sends and reads, and the shapes beside it."""
    url = real_server.url
    info = httpx.get(url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    text = "Question: What is 2+2?\nAnswer: 4"
    one = httpx.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False,
                                              "return_token_strs": True}).json()
    assert one["count"] == len(one["tokens"]) == len(one["token_strs"]) > 5
    assert one["max_model_len"] == info["model_max_length"]
    back = httpx.post(url + "/detokenize", json={"tokens": one["tokens"]}).json()
    assert back["prompt"] == back["text"] == text
    eos = httpx.post(url + "/tokenize", json={"prompt": info["eos_token"],
                                              "add_special_tokens": False}).json()["tokens"]
    assert len(eos) == 1 and eos[0] in info["eos_token_ids"]  # lm-eval's eos_token_id
    batch = httpx.post(url + "/v1/tokenize", json={"prompt": [text, "hi"]}).json()
    assert batch["tokens"][0] == one["tokens"] and batch["count"] == [one["count"],
                                                                      len(batch["tokens"][1])]
    texts = httpx.post(url + "/v1/detokenize", json={"tokens": batch["tokens"]}).json()["text"]
    assert texts == [text, "hi"]
    bad = httpx.post(url + "/detokenize", json={"tokens": [info["vocab_size"]]})
    assert bad.status_code == 400 and "tokens" in bad.json()["error"]["message"]
