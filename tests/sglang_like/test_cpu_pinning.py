"""The engine loop's core (sglang_like.utils.cpu_runtime): claims spread engines over cores and are
released with their process; a process's threads move off a core and leave the caller alone.

Each case runs in a child process, so the test process's own threads keep their cores."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from sglang_like.utils.cpu_runtime import CLAIM_DIR_ENV

CPUS = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="pinning needs two allowed cores")

_CLAIMANT = textwrap.dedent("""
    import sys
    from sglang_like.utils.cpu_runtime import claim_loop_cpu
    print(claim_loop_cpu(), flush=True)
    sys.stdin.readline()  # hold the claim until told
""")


def _claimant(folder: str) -> tuple[subprocess.Popen, int | None]:
    proc = subprocess.Popen([sys.executable, "-c", _CLAIMANT], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, CLAIM_DIR_ENV: folder})
    line = proc.stdout.readline().strip()
    return proc, None if line == "None" else int(line)


def _release(proc: subprocess.Popen) -> None:
    proc.stdin.write("\n")
    proc.stdin.flush()
    proc.wait(timeout=30)


@needs_two
def test_a_link_planted_at_a_lock_path_is_not_followed(tmp_path) -> None:
    """The claim folder is shared by every user's engines: a symlink at cpuN.lock must not
    make an engine open (and lock) the file it points to; that core is skipped."""
    victim = tmp_path / "victim"
    victim.write_text("keep")
    folder = tmp_path / "claims"
    folder.mkdir()
    (folder / f"cpu{CPUS[0]}.lock").symlink_to(victim)
    proc, cpu = _claimant(str(folder))
    try:
        assert cpu == CPUS[1]
        assert victim.read_text() == "keep"
    finally:
        _release(proc)


@needs_two
def test_claims_take_the_lowest_free_core_and_end_with_their_process(tmp_path) -> None:
    folder = str(tmp_path)
    held = [_claimant(folder) for _ in range(len(CPUS))]
    try:
        assert [cpu for _, cpu in held] == CPUS  # one core each, lowest first
        extra, cpu = _claimant(folder)
        assert cpu is None  # every core is held: this engine pins nothing
        _release(extra)
        _release(held[0][0])  # its core is free again once the process is gone
        again, cpu = _claimant(folder)
        assert cpu == CPUS[0]
        _release(again)
    finally:
        for proc, _ in held:
            if proc.poll() is None:
                _release(proc)


_MOVER = textwrap.dedent("""
    import os, threading
    from sglang_like.utils.cpu_runtime import keep_threads_off
    cpu = min(os.sched_getaffinity(0))
    stop = threading.Event()
    ready = []
    def run():
        ready.append(threading.get_native_id())
        stop.wait()
    t = threading.Thread(target=run); t.start()
    while not ready: pass
    include_self = os.environ["INCLUDE_SELF"] == "1"
    moved = keep_threads_off(cpu, include_self=include_self)
    later = []
    t2 = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0))); t2.start()
    t2.join()
    print(moved, cpu in os.sched_getaffinity(ready[0]), cpu in os.sched_getaffinity(0),
          cpu in later[0])
    stop.set(); t.join()
""")


@needs_two
@pytest.mark.parametrize("include_self", [False, True])
def test_threads_move_off_a_core(include_self: bool) -> None:
    out = subprocess.run([sys.executable, "-c", _MOVER], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "INCLUDE_SELF": str(int(include_self))})
    assert out.returncode == 0, out.stderr[-2000:]
    moved, other_on, self_on, later_on = out.stdout.split()
    assert int(moved) == (2 if include_self else 1)  # the worker (and the caller)
    assert other_on == "False"
    # the caller keeps the core unless asked, and threads it starts inherit its cores
    assert self_on == later_on == str(not include_self)


_ENGINE = textwrap.dedent("""
    import sys
    from sglang_like import Engine
    e = Engine(cpu_pinning=sys.argv[1], max_total_tokens=256)
    out = e.generate("Hi", {"max_new_tokens": 2})
    print(e.loop_cpu, len(out["output_ids"]), flush=True)
    e.shutdown()
""")


@needs_two
def test_the_engine_api_pins_only_when_asked(tmp_path) -> None:
    """`auto` is the server's pinning (its HTTP process moves off the loop's core); an Engine
    in a caller's process leaves placement to the OS unless given `on`, whose core its caller
    can read (`Engine.loop_cpu`) and keep off."""
    got = {}
    for mode in ("auto", "on", "off"):
        out = subprocess.run([sys.executable, "-c", _ENGINE, mode], capture_output=True,
                             text=True, timeout=300,
                             env={**os.environ, CLAIM_DIR_ENV: str(tmp_path)})
        assert out.returncode == 0, out.stderr[-2000:]
        got[mode] = out.stdout.split()
    assert got["auto"] == ["None", "2"] and got["off"] == ["None", "2"]
    assert got["on"] == [str(CPUS[0]), "2"]
