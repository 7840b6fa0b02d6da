"""Draft heads: SGLang's on-disk layouts (EAGLE-3, EAGLE-1) round-tripped and loaded into
engines, and the shipped head's acceptance on held-out chat prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sglang_like.speculative.eagle_head import Eagle3Config, Eagle3Head, load_eagle3_head

from .spec_fakes import SPEC_QUANT, random_head

# ---- the head's files -------------------------------------------------------------------------


def _tiny_head_config(vocab: int = 96, hidden: int = 32) -> Eagle3Config:
    return Eagle3Config(hidden_size=hidden, intermediate_size=64, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=vocab, draft_vocab_size=vocab // 2,
                        target_hidden_size=hidden, aux_layer_ids=[0, 1, 1])


def test_head_round_trips_in_sglang_layout(tmp_path) -> None:
    torch.manual_seed(0)
    head = Eagle3Head(_tiny_head_config())
    head.d2t.copy_(torch.arange(48))  # draft id d -> target id 2d
    head.t2d[::2] = True
    head.save(str(tmp_path))
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight",
            "lm_head.weight", "d2t", "t2d", "norm.weight"} <= names
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 1]
    back = load_eagle3_head(str(tmp_path))
    assert torch.equal(back.to_target_ids(torch.tensor([0, 5])), torch.tensor([0, 10]))
    for (n, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items(), strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-3, rtol=1e-3, msg=n)
    (tmp_path / "config.json").write_text(json.dumps(config | {"architectures": ["Other"]}))
    with pytest.raises(ValueError, match="EAGLE-3"):
        load_eagle3_head(str(tmp_path))


def test_aux_layer_ids_are_read_in_both_conventions_heads_ship(make_engine, tmp_path) -> None:
    """`eagle_aux_hidden_state_layer_ids` as SGLang reads it: ids starting at 1 are layer
    outputs (SpecForge-style [1, 14, 26] is the input of layers 2, 15, 27), others layer
    inputs (ours, [2, 15, 27]). The shipped head with its ids written the other way reads the
    same three layers; ids that are not three layers of the target are refused."""
    import shutil

    from sglang_like.speculative import DEFAULT_HEAD
    from sglang_like.speculative.eagle_head import capture_layer_ids

    assert capture_layer_ids([1, 14, 26]) == [2, 15, 27]
    assert capture_layer_ids([2, 15, 27]) == [2, 15, 27]
    assert capture_layer_ids([0, 1, 1]) == [0, 1, 1]
    assert capture_layer_ids([]) == []
    config = _tiny_head_config()
    config.aux_layer_ids = [1, 2, 3]  # layer 1's input: no way to write it that reads back
    with pytest.raises(ValueError, match="layer 1"):
        config.to_json()
    shipped = json.loads((Path(DEFAULT_HEAD) / "config.json").read_text())
    assert shipped["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]

    def head_with(ids: list[int], name: str) -> str:
        folder = tmp_path / name
        shutil.copytree(DEFAULT_HEAD, folder)
        cfg = dict(shipped, eagle_config={"eagle_aux_hidden_state_layer_ids": ids})
        (folder / "config.json").write_text(json.dumps(cfg))
        return str(folder)

    prompts = HELD_OUT[:4]
    runs = {}
    for name, path in (("shipped", DEFAULT_HEAD), ("output-ids", head_with([1, 14, 26], "o"))):
        engine = make_engine(speculative_algorithm="EAGLE3", speculative_auto_disable=False,
                             speculative_draft_model_path=path, quantization=SPEC_QUANT)
        assert engine._client.core.runner.aux_layers == (2, 15, 27), name
        chat = [engine.apply_chat_template([{"role": "user", "content": q}]) for q in prompts]
        outs = engine.generate(chat, {"max_new_tokens": 32, "temperature": 0})
        runs[name] = [o["output_ids"] for o in outs]
        # the head drafts from these features: it commits more than a token per verify
        # (how many nodes a verify keeps depends on measured step times, so not exact)
        tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
        assert tokens > 1.2 * sum(o["meta_info"]["spec_verify_ct"] for o in outs), name
        engine.shutdown()
    assert runs["output-ids"] == runs["shipped"]
    with pytest.raises(ValueError, match="not three layers"):
        make_engine(speculative_algorithm="EAGLE3", speculative_draft_model_path=head_with(
            [2, 15, 30], "past-the-end"))


def test_head_rope_settings_and_unsupported_variants(make_engine, tmp_path) -> None:
    """A head's RoPE as its config.json gives it, in either spelling transformers writes
    (Llama 3.1's "llama3" scaling under rope_parameters here), reaches the drafter's tables;
    the switches of SGLang's head variants this runtime does not run are refused by name."""
    from sglang_like.layers.rotary import RotaryEmbedding

    folder = random_head(str(tmp_path / "head"), 49152, 576, 30)
    config = json.loads((Path(folder) / "config.json").read_text())
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config.pop("rope_theta")
    (Path(folder) / "config.json").write_text(json.dumps(
        config | {"rope_parameters": {"rope_theta": 500000.0, **scaling}}))
    head = load_eagle3_head(folder)
    assert head.config.rope_theta == 500000.0 and head.config.rope_scaling == scaling
    engine = make_engine(speculative_algorithm="EAGLE3", speculative_draft_model_path=folder,
                         quantization=SPEC_QUANT)
    drafter = engine._client.core.scheduler.drafter
    rows = drafter.rope.cos_table.shape[0]
    d = head.config.head_dim
    want = RotaryEmbedding(d, rows, 500000.0, scaling, "cpu").cos_table
    plain = RotaryEmbedding(d, rows, 500000.0, None, "cpu").cos_table
    assert torch.equal(drafter.rope.cos_table, want) and not torch.equal(want, plain)
    assert len(engine.generate("Hi", {"max_new_tokens": 4, "temperature": 0})["output_ids"]) == 4
    engine.shutdown()
    for key, where in (("bias", "top"), ("norm_before_fc", "eagle_config"),
                       ("norm_before_fc", "top"), ("fc_norm", "top"), ("use_aux_norm", "top"),
                       ("norm_output", "top")):
        variant = dict(config)
        if where == "top":
            variant[key] = True
        else:
            variant["eagle_config"] = {**config["eagle_config"], key: True}
        (Path(folder) / "config.json").write_text(json.dumps(variant))
        with pytest.raises(ValueError, match=key):
            load_eagle3_head(folder)
    (Path(folder) / "config.json").write_text(json.dumps(config | {"num_aux_hidden_states": 4}))
    with pytest.raises(ValueError, match="4 target features"):
        load_eagle3_head(folder)


def test_eagle1_head_round_trips_in_sglang_layout(tmp_path) -> None:
    """SGLang's `LlamaForCausalLMEagle` checkpoint names (the EAGLE repository's: no `model.`
    prefix, fc with a bias, no input norm on the layer); a `model.` prefix and the extra
    tensors such files carry (the target's embedding, an input norm SGLang deletes) load too;
    `load_draft_head` dispatches on the architecture."""
    from safetensors.torch import load_file, save_file

    from sglang_like.speculative.eagle1_head import Eagle1Config, Eagle1Head
    from sglang_like.speculative.head_loader import draft_head_footprint, load_draft_head

    torch.manual_seed(0)
    head = Eagle1Head(Eagle1Config(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=96))
    head.save(str(tmp_path))
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight",
            "layers.0.mlp.down_proj.weight", "layers.0.post_attention_layernorm.weight"} == (
        names - {"layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
                 "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate_proj.weight",
                 "layers.0.mlp.up_proj.weight"})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle"]
    back = load_draft_head(str(tmp_path))
    assert isinstance(back, Eagle1Head)
    # what CUDA pool sizing reserves for it, read from the folder alone: the bytes it holds
    # loaded, and its drafter's one-layer float32 pool (K and V of 2 kv heads of 8 values)
    assert draft_head_footprint(str(tmp_path)) == (
        sum(t.numel() * t.element_size() for t in (*back.parameters(), *back.buffers())),
        2 * 2 * 8 * 4)
    for (n, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3, msg=n)
    tensors = {f"model.{k}": v for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    tensors |= {"model.embed_tokens.weight": torch.zeros(96, 32),
                "model.layers.0.input_layernorm.weight": torch.ones(32)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert isinstance(load_draft_head(str(tmp_path)), Eagle1Head)
    del tensors["model.fc.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.bias"):
        load_draft_head(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(config | {"hot_vocab_size": 32}))
    with pytest.raises(ValueError, match="hot_vocab_size"):
        load_draft_head(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(config | {"architectures": ["Other"]}))
    with pytest.raises(ValueError, match="EAGLE-1/2"):
        load_draft_head(str(tmp_path))



# ---- the shipped head ---------------------------------------------------------------------------

HELD_OUT = [  # written for this test; the head trained on conversations the model wrote itself
    "What is the tallest mountain in the world?",
    "How do I make a cup of green tea?",
    "Give me three tips for learning to play the guitar.",
    "What does a firefighter do?",
    "Explain what a rainbow is.",
    "Write a short poem about autumn leaves.",
    "Why do cats purr?",
    "What is the boiling point of water in Fahrenheit?",
    "Suggest a name for a small bakery.",
    "How many days are there in a leap year?",
    "What are the colors of the French flag?",
    "Describe a sunset over the ocean.",
    "What is photosynthesis in simple words?",
    "List four animals that live in the Arctic.",
    "How can I improve my sleep?",
    "What is the difference between a lake and a sea?",
]
# Measured with the committed head (greedy, 64 new tokens, every step drafting a 3-token
# chain): 1.61 tokens per verify on a 2-core AMD EPYC, where the heads it was continued from
# measured 1.59, 1.50 and 1.45 (on an Intel Xeon the last two 1.48 and 1.42, the one
# before those, trained on 1/17 of the data, 1.31); a random head gives 1.00. The floor is
# that less a margin for another CPU's rounding in a different batch (or torch's head path
# where the native kernels are not built): it catches a broken, untrained or much weaker
# head, not a run's small gain. These prompts are written by people (none of them is in the
# head's data, whose everyday questions come from question frames, `chat_task`); the head's
# self-prompted conversations were written by the 135M model itself.
SHIPPED_HEAD_ACCEPT_FLOOR = 1.50


@pytest.mark.slow
def test_shipped_head_accepts_on_held_out_chat(make_engine) -> None:
    # the head's own drafts: without NGRAM's branch (tests/sglang_like/test_spec_copy_branch.py)
    engine = make_engine(speculative_algorithm="EAGLE3", speculative_auto_disable=False,
                         speculative_eagle_ngram_branch=False)
    prompts = [engine.apply_chat_template([{"role": "user", "content": q}]) for q in HELD_OUT]
    outs = engine.generate(prompts, {"max_new_tokens": 64, "temperature": 0})
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    verifies = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    accept = tokens / verifies
    print(f"\nshipped EAGLE-3 head: acceptance length {accept:.2f} on {len(prompts)} held-out "
          f"chat prompts ({tokens} tokens, {verifies} verify passes)")
    assert accept > SHIPPED_HEAD_ACCEPT_FLOOR
