"""Every model family from a GGUF file as llama.cpp's own converter writes it, against our load of
the Hugging Face folder it was converted from.

Per family: the tiny seeded folder test_model_families builds (briefly trained, so top-1 means
something), converted by llama.cpp's convert_hf_to_gguf.py to F32 and to Q8_0. The F32 file
gives the folder's prefill logits (within 1e-4) and the same ModelConfig (the family fields and
the RoPE tables built from them); the Q8_0 file, dequantized (`quantization="none"`) and on the
native GGUF kernels (`auto`), keeps top-1 agreement >= 95% with the folder's fp32 and a small
relative logit error over the prompts and their greedy continuations.

Where the converter cannot say what the folder says, the folder is made the way the released
models are (each case says why): llama.cpp fixes Gemma 2/3's score scale to head_dim ** -0.5
(their released query_pre_attn_scalar), Gemma 3's global layer to one in six and SmolLM3's
RoPE-less layer to one in four. Mistral's and Qwen2's windows are not written by the converter
(llama.cpp runs them unwindowed): the file is compared with the folder without its window, and
a file that does say it (metadata added with gguf-py's copy_with_new_metadata) with the folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, NamedTuple

import pytest
import torch

from benchmarks.tiny_families import CONVERTER_CASES as CASES
from benchmarks.tiny_families import ConverterCase as Case
from benchmarks.tiny_families import prepare_for_converter, tokenizer_model
from sglang_like.model_loader import load_model
from sglang_like.models.registry import family_for

from ..llama_cpp_source import llama_cpp_converter_env, llama_cpp_tree
from .test_hf_archs import _our_prefill_logits, tokenizer_json  # noqa: F401
from .test_model_families import NEW_TOKENS, PROMPTS, _engine
from .test_model_families import build_folder as build_hf_folder

pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")

LOGITS_ATOL = 1e-4
TOP1_MIN = 0.95
# Relative L2 error of all-position logits, Q8_0 file against the folder's fp32, largest
# allowed: measured 0.002-0.007 over these families (none and auto); a layout bug (rows
# swapped, a norm or scale lost) gives errors of order 1.
Q8_REL = 0.02
# cos/sin tables: the file keeps RoPE factors (Llama 3's, longrope's) in float32, which moves
# an angle by up to position * 2**-24 (1.5e-5 at the 256 positions built here)
ROPE_ATOL = 3e-5
# The ModelConfig fields in which models differ (hf_loader / gguf_loader must agree on each).
FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
          "max_position_embeddings", "tie_word_embeddings", "attention_bias", "qk_norm",
          "hidden_act", "layer_types", "sliding_window", "rope_local_theta", "rope_layers",
          "rotary_dim", "attention_scale", "attn_logit_softcap", "final_logit_softcap",
          "embedding_scale", "residual_scale", "logit_scale", "num_experts",
          "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
          "shared_expert_intermediate_size", "moe_layers")
ROPE_KEYS = ("rope_type", "factor", "original_max_position_embeddings", "short_factor",
             "long_factor", "attention_factor", "beta_fast", "beta_slow")


# Runs llama.cpp's convert_hf_to_gguf.main() once per job in one process (its imports of torch
# and transformers then cost once, not per file), and gguf-py's copy_with_new_metadata for the
# files that say a window. Jobs come one JSON line each on stdin, as the test makes the folders,
# so that converting one overlaps building the next.
_DRIVER = r"""
import json, sys
tree = sys.argv[1]
sys.path.insert(0, tree)
import gguf
import convert_hf_to_gguf
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata
for line in sys.stdin:
    job = json.loads(line)
    if job["kind"] == "convert":
        sys.argv = ["convert_hf_to_gguf.py", job["folder"], "--outtype", job["outtype"],
                    "--outfile", job["out"]]
        convert_hf_to_gguf.main()
    else:
        reader = gguf.GGUFReader(job["src"])
        arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
        writer = gguf.GGUFWriter(job["out"], arch=arch, endianess=reader.endianess)
        new = {k: MetadataDetails(gguf.GGUFValueType[t], v) for k, (t, v) in job["meta"].items()}
        copy_with_new_metadata(reader, writer, new, [])
"""


def _without_window(folder: Any, target: Any) -> None:
    """`folder`'s model with no sliding window (what the converted file describes): its
    files linked, config.json rewritten."""
    target.mkdir()
    for name in os.listdir(folder):
        if name != "config.json":
            os.symlink(folder / name, target / name)
    cfg = json.loads((folder / "config.json").read_text())
    cfg |= {"sliding_window": None, "layer_types": None, "use_sliding_window": False}
    (target / "config.json").write_text(json.dumps(cfg))


class Files(NamedTuple):
    case: Case
    folder: str  # the Hugging Face folder
    reference: str  # the folder whose model the converted files describe
    f32: str
    q8_0: str
    windowed: str | None  # the F32 file with the window metadata added


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tokenizer_json: tuple[str, int]  # noqa: F811
              ) -> dict[str, Files]:
    """Every case's folder and its conversions, made once for the module."""
    root = tmp_path_factory.mktemp("family-gguf")
    spm_model = tokenizer_model()
    log = open(root / "convert.log", "w+")  # noqa: SIM115  (read back on failure)
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER, str(llama_cpp_tree())],
                              stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                              env=llama_cpp_converter_env(), text=True)
    files = {}

    def send(**job: Any) -> None:
        try:
            driver.stdin.write(json.dumps(job) + "\n")
            driver.stdin.flush()
        except BrokenPipeError:  # the driver failed: its exit status and log say why
            pass

    try:
        for case in CASES:
            name = case.family.name
            folder = root / name
            folder.mkdir()
            build_hf_folder(case.family, folder, tokenizer_json)
            prepare_for_converter(folder, case, spm_model)
            out = {t: root / f"{name}.{t}.gguf" for t in ("f32", "q8_0")}
            for outtype, path in out.items():
                send(kind="convert", folder=str(folder), outtype=outtype, out=str(path))
            reference, windowed = folder, None
            if case.window_metadata is not None:
                reference, windowed = root / f"{name}-no-window", root / f"{name}.window.gguf"
                _without_window(folder, reference)
                send(kind="metadata", src=str(out["f32"]), out=str(windowed),
                     meta=case.window_metadata)
            files[name] = Files(case, str(folder), str(reference), str(out["f32"]),
                                str(out["q8_0"]), None if windowed is None else str(windowed))
        try:
            driver.stdin.close()
        except BrokenPipeError:
            pass
        rc = driver.wait(timeout=600)
    finally:
        driver.kill()
    log.seek(0)
    assert rc == 0, log.read()[-4000:]
    log.close()
    return files


class Loaded(NamedTuple):
    files: Files
    reference: Any  # engine on the folder the files describe (fp32)
    f32: Any  # engine on the F32 file
    # the prompts with the reference's greedy continuations, and its logits over them
    sequences: list[tuple[list[int], torch.Tensor]]


@pytest.fixture(scope="module", params=CASES, ids=[c.family.name for c in CASES])
def loaded(request, converted: dict[str, Files]):
    files = converted[request.param.family.name]
    reference = _engine(files.reference, quantization="none")
    f32 = _engine(files.f32, quantization="none")
    prompts = _ids(reference)
    outs = reference.generate(input_ids=prompts, sampling_params={
        "max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True})
    seqs = [ids + out["output_ids"] for ids, out in zip(prompts, outs, strict=True)]
    yield Loaded(files, reference, f32, [(s, _our_prefill_logits(reference, s)) for s in seqs])
    reference.shutdown()
    f32.shutdown()


def _ids(engine: Any) -> list[list[int]]:
    return [engine.tokenizer.encode(p) for p in PROMPTS]


def _assert_same_config(got: Any, want: Any, name: str) -> None:
    diffs = {f: (getattr(got, f), getattr(want, f)) for f in FIELDS
             if getattr(got, f) != getattr(want, f)}
    assert not diffs, f"{name}: GGUF vs folder {diffs}"


def test_config_equals_the_folders(loaded: Loaded) -> None:
    """Every family field equal; the RoPE tables (of every kind the layers use) equal."""
    got, want = loaded.f32.model_config, loaded.reference.model_config
    _assert_same_config(got, want, loaded.files.case.family.name)
    assert family_for(got.architecture) == family_for(want.architecture)
    if loaded.files.case.family.name != "llama3":  # Llama 3's as per-frequency factors
        pick = lambda s: {k: s[k] for k in ROPE_KEYS if s and k in s}  # noqa: E731
        assert pick(got.rope_scaling) == pick(want.rope_scaling)
    assert (got.rope_scaling is None) == (want.rope_scaling is None)
    ropes, ref_ropes = loaded.f32.runner.model.ropes, loaded.reference.runner.model.ropes
    assert ropes.keys() == ref_ropes.keys()
    for kind, rope in ropes.items():
        torch.testing.assert_close(rope.cos_table, ref_ropes[kind].cos_table, rtol=0,
                                   atol=ROPE_ATOL)
        torch.testing.assert_close(rope.sin_table, ref_ropes[kind].sin_table, rtol=0,
                                   atol=ROPE_ATOL)


def test_f32_file_gives_the_folders_logits(loaded: Loaded) -> None:
    worst = 0.0
    for ids in _ids(loaded.reference):
        got = _our_prefill_logits(loaded.f32, ids)
        want = _our_prefill_logits(loaded.reference, ids)
        assert got.shape == want.shape
        assert want.std().item() > 0.1  # far from flat: the comparison means something
        worst = max(worst, (got - want).abs().max().item())
    print(f"{loaded.files.case.family.name}: F32 max logit diff {worst:.2e}")
    assert worst < LOGITS_ATOL


@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_q8_0_file_tracks_the_folder(loaded: Loaded, quantization: str) -> None:
    """Q8_0 dequantized (`none`) and on the GGUF kernels (`auto`): top-1 of every position of
    the prompts and their fp32 greedy continuations, and the logits' relative error."""
    engine = _engine(loaded.files.q8_0, quantization=quantization)
    try:
        mlp = engine.runner.model.model.layers[0].mlp
        down = mlp.experts[0].down_proj if hasattr(mlp, "experts") else mlp.down_proj
        method = type(down.method).__name__
        assert method == {"none": "DenseMethod", "auto": "GGUFMethod"}[quantization]
        _assert_same_config(engine.model_config, loaded.f32.model_config, "Q8_0 vs F32")
        agree = total = 0
        err = norm = 0.0
        for seq, want in loaded.sequences:
            got = _our_prefill_logits(engine, seq)
            agree += int((got.argmax(-1) == want.argmax(-1)).sum())
            total += len(seq)
            err += (got - want).norm().item() ** 2
            norm += want.norm().item() ** 2
        rel = (err / norm) ** 0.5
        print(f"{loaded.files.case.family.name} Q8_0 {quantization}: top-1 {agree}/{total}, "
              f"relative error {rel:.4f}")
        assert agree / total >= TOP1_MIN
        assert rel < Q8_REL
    finally:
        engine.shutdown()


WINDOWED = [c for c in CASES if c.window_metadata is not None]


@pytest.mark.parametrize("case", WINDOWED, ids=[c.family.name for c in WINDOWED])
def test_a_file_that_says_the_window_gets_it(converted: dict[str, Files], case: Case) -> None:
    """The converter writes no window for Mistral / Qwen2; a file whose metadata says it
    (sliding_window, and which layers slide) loads as the windowed folder does."""
    files = converted[case.family.name]
    folder = _engine(files.folder, quantization="none")
    windowed = _engine(files.windowed, quantization="none")
    unwindowed = _engine(files.f32, quantization="none")
    try:
        _assert_same_config(windowed.model_config, folder.model_config, case.family.name)
        assert folder.model_config.sliding_window is not None
        assert unwindowed.model_config.sliding_window is None
        apart = 0.0
        for ids in _ids(folder):
            want = _our_prefill_logits(folder, ids)
            assert (_our_prefill_logits(windowed, ids) - want).abs().max().item() < LOGITS_ATOL
            apart = max(apart, (_our_prefill_logits(unwindowed, ids) - want).abs().max().item())
        assert apart > 0.01  # the window matters on these prompts: the case could fail
    finally:
        for engine in (folder, windowed, unwindowed):
            engine.shutdown()


def test_unsupported_architecture_is_refused_by_name(tmp_path) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "bloom.gguf"
    writer = gguf.GGUFWriter(str(path), "bloom")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'bloom' unsupported; supported: llama, .*smollm3"):
        load_model(str(path))
