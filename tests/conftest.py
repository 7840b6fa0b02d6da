"""Suite-wide settings for a parallel run (`pytest -n 2 --dist loadfile`: 23 minutes on 2
cores against about 40 serially; CI runs serially while one test, the fused EAGLE head's K/V
bits against its single ops, fails in some parallel runs): the OpenMP wait policy of each
worker and of the servers it starts, and the order in which files are handed out."""

from __future__ import annotations

import os

# Two workers on two cores run twice as many OpenMP threads as there are cores. libgomp's
# default barrier spins for milliseconds before it sleeps, so a thread waiting for a partner
# that another process has taken the core from burns the core that partner needs: a decode
# step then crawls (3-60x slower, measured; docs/benchmarks.md#bench_contention). Threads that
# sleep at once share the cores as the scheduler sees fit. Set here, before any test module
# imports torch (libgomp reads it when it loads); the servers the tests start inherit it.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

# Files that take a minute or more, longest first: started first, so that the two workers do
# not end with one of them running a long file alone.
_LONG_FIRST = (
    "tests/kernels/test_triton_kernels.py",
    "tests/benchmarks/test_soak.py",
    "tests/sglang_like/test_gguf_types.py",
    "tests/sglang_like/test_native_decode.py",
    "tests/server/test_fuzz_schemathesis.py",
    "tests/sglang_like/test_speculative.py",
    "tests/sglang_like/test_family_gguf.py",
    "tests/sglang_like/test_kv_cache_dtype.py",
    "tests/sglang_like/test_lora_peft.py",
    "tests/sglang_like/test_model_families.py",
    "tests/sglang_like/test_tp_engine.py",
    "tests/server/test_real_storm.py",
    "tests/server/test_cli.py",
)


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {path: i for i, path in enumerate(_LONG_FIRST)}
    root = str(config.rootpath)

    def key(item) -> int:
        rel = os.path.relpath(str(item.path), root)
        return rank.get(rel, len(_LONG_FIRST))

    items.sort(key=key)  # stable: the rest keep their order
