"""logit_bias (OpenAI's; a sampling parameter here as in SGLang): validation, and on the real
default model that -100 bans a token, +100 forces one, greedy included, while the logprobs
reported stay the model's own."""

from __future__ import annotations

import pytest

from sglang_like.sampling_params import SamplingParams

PROMPT = "The capital of France is"
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def test_validation() -> None:
    sp = SamplingParams.from_dict({"logit_bias": {"5": 10, 7: -100.0}})
    assert sp.logit_bias == {"5": 10.0, "7": -100.0} and sp.token_bias == {5: 10.0, 7: -100.0}
    assert SamplingParams.from_dict({"logit_bias": {}}).token_bias == {}
    assert SamplingParams().token_bias == {}
    for bad in ({"x": 1}, {"-1": 1}, {True: 1}, {"3": 100.5}, {"3": "high"}, {"3": None},
                [1, 2], {str(i): 1 for i in range(1025)}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams.from_dict({"logit_bias": bad})
    with pytest.raises(ValueError, match=r"token ids in \[0, 9\]"):
        SamplingParams.from_dict({"logit_bias": {"10": 1}}).validate(vocab_size=10)


@pytest.mark.slow
def test_ban_and_force_on_the_default_model(make_engine) -> None:
    engine = make_engine(quantization="none")
    base = engine.generate(PROMPT, GREEDY)["output_ids"]
    banned = base[0]
    out = engine.generate(PROMPT, {**GREEDY, "logit_bias": {str(banned): -100}})["output_ids"]
    assert out[0] != banned and banned not in out
    forced = engine.tokenizer.encode(" banana")[-1]
    got = engine.generate(PROMPT, {**GREEDY, "logit_bias": {str(forced): 100}},
                          return_logprob=True)
    assert got["output_ids"] == [forced] * GREEDY["max_new_tokens"]
    # the reported logprob is the model's, not the biased distribution's (which would be ~0)
    first_lp = got["meta_info"]["output_token_logprobs"][0][0]
    assert first_lp < -5.0, first_lp
    # sampled rows take the bias too, and a batch mixes biased and plain requests
    outs = engine.generate([PROMPT, PROMPT], [
        {**GREEDY, "temperature": 1.0, "seed": 1, "logit_bias": {str(forced): 100}}, GREEDY])
    assert outs[0]["output_ids"] == [forced] * GREEDY["max_new_tokens"]
    assert outs[1]["output_ids"] == base
