"""llama.cpp's source tree, as the llama-cpp-python sdist on PyPI carries it, for tests that use
llama.cpp as an oracle: its converter (convert_hf_to_gguf.py + gguf-py), its vocab-only GGUFs with
tokenizer test vectors (models/ggml-vocab-*.gguf{,.inp,.out}) and its real chat templates
(models/templates/*.jinja).

The tree is fetched once and cached where ../shared/peers/llama-cpp.sh keeps it
(${PEERS_HOME:-${XDG_CACHE_HOME:-~/.cache}/peers}/llama.cpp-<version>/dl/...), so a machine that
already built llama.cpp's tools reuses that extraction. Otherwise only the parts the tests need
are extracted from the sdist, into a temporary folder renamed into place at the end: parallel
test workers either see the whole tree or none of it.
"""

from __future__ import annotations

import functools
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile

VERSION = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")
_SDIST_ROOT = f"llama_cpp_python-{VERSION}"
_TREE_IN_SDIST = f"{_SDIST_ROOT}/vendor/llama.cpp"


def _home() -> pathlib.Path:
    base = os.environ.get("PEERS_HOME")
    if base is None:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(cache, "peers")
    return pathlib.Path(base) / f"llama.cpp-{VERSION}"


def _wanted(relative: str) -> bool:
    """Whether a path inside vendor/llama.cpp is one the tests use (keeps the extraction small)."""
    if relative in ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py"):
        return True
    if relative.startswith(("conversion/", "gguf-py/", "models/templates/")):
        return True
    return relative.startswith("models/ggml-vocab-")


def _is_complete(tree: pathlib.Path) -> bool:
    return (
        (tree / "convert_hf_to_gguf.py").is_file()
        and (tree / "gguf-py" / "gguf").is_dir()
        and any((tree / "models").glob("ggml-vocab-*.gguf"))
        and (tree / "models" / "templates").is_dir()
    )


def _download_sdist(dl: pathlib.Path) -> pathlib.Path:
    sdist = dl / f"{_SDIST_ROOT}.tar.gz"
    if sdist.is_file():
        return sdist
    dl.mkdir(parents=True, exist_ok=True)
    # Into a private folder first: a second worker downloading at the same time must not read a
    # half-written archive, and os.replace of a finished file is atomic.
    staging = pathlib.Path(tempfile.mkdtemp(prefix=".sdist-", dir=dl))
    try:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "-q", "-d", str(staging), f"llama-cpp-python=={VERSION}"],
            check=True,
        )
        os.replace(staging / sdist.name, sdist)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return sdist


def _extract(sdist: pathlib.Path, target: pathlib.Path) -> None:
    staging = pathlib.Path(tempfile.mkdtemp(prefix=".extract-", dir=target.parent))
    try:
        prefix = _TREE_IN_SDIST + "/"
        with tarfile.open(sdist, "r:gz") as tar:
            members = []
            for member in tar.getmembers():
                if not member.name.startswith(prefix) or not (member.isfile() or member.isdir()):
                    continue
                relative = member.name[len(prefix):]
                if _wanted(relative):
                    member.name = relative
                    members.append(member)
            # The "data" filter (refuses links out of the tree, odd modes) where Python has it.
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(staging, members=members, **safe)
        try:
            os.rename(staging, target)
        except OSError:
            # Another worker renamed its complete copy first; theirs is as good as ours.
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@functools.cache
def llama_cpp_tree() -> pathlib.Path:
    """The llama.cpp source folder (convert_hf_to_gguf.py, gguf-py/, models/), fetched once."""
    home = _home()
    shared = home / "dl" / _TREE_IN_SDIST
    if _is_complete(shared):
        return shared
    own = home / "tests-tree"
    if not _is_complete(own):
        home.mkdir(parents=True, exist_ok=True)
        _extract(_download_sdist(home / "dl"), own)
    return own


def llama_cpp_converter_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for `python <tree>/convert_hf_to_gguf.py ...` in a subprocess: the tree's
    gguf-py first on PYTHONPATH, so the converter uses the gguf package it was written with
    rather than whatever gguf version is installed."""
    env = dict(os.environ if base is None else base)
    paths = [str(llama_cpp_tree() / "gguf-py")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env
