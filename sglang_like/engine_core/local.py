"""ThreadCoreClient: the engine core on a thread of this process (`engine_in_process=True`).

The shape before the engine had its own process, kept for tests that look inside the scheduler
and for debugging: no second process, but tokenizing and HTTP share the GIL with the loop.
"""

from __future__ import annotations

import functools
import queue
import threading
from typing import Any

from sglang_like.config import ServerArgs
from sglang_like.engine_core.core import CoreInfo, EngineCore, make_req
from sglang_like.engine_core.io import RequestHandle
from sglang_like.engine_core.messages import GenerateReqInput
from sglang_like.utils.cpu_runtime import release_openmp_threads, trim_heap


class ThreadCoreClient:
    def __init__(self, server_args: ServerArgs) -> None:
        # Every torch op of the engine (load, forward, sampling) runs on the loop thread: a
        # second thread with its own OpenMP team oversubscribes the cores, and GNU OpenMP
        # then stops spinning between parallel regions (each matmul pays a wake-up; measured
        # 2x slower decode on 2 cores). The caller's own team, if it made one, is let go.
        release_openmp_threads()
        ready: queue.Queue[BaseException | None] = queue.Queue(maxsize=1)
        self.core: EngineCore | None = None
        self._thread = threading.Thread(target=self._main, args=(server_args, ready),
                                        name="sglang-like-scheduler", daemon=True)
        self._thread.start()
        error = ready.get()
        if error is not None:
            self._thread.join()
            raise error
        assert self.core is not None
        self.info: CoreInfo = self.core.info
        self.tokenizer = self.core.tokenizer

    def _main(self, server_args: ServerArgs, ready: queue.Queue) -> None:
        try:
            self.core = EngineCore(server_args)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            ready.put(exc)
            return
        trim_heap()  # the loader's temporaries
        ready.put(None)
        self.core.loop.run()

    @property
    def grammar_backend(self) -> Any:
        return self.core.grammar_backend

    def submit(self, msgs: list[GenerateReqInput], handles: list[RequestHandle]) -> None:
        reqs = [make_req(msg) for msg in msgs]
        self.core.loop.submit_all(list(zip(reqs, handles, strict=True)))

    def abort(self, rid: str | None) -> None:
        if rid is None:
            self.core.loop.put_command("abort_all")
        else:
            self.core.loop.put_command("abort", rid)

    def call(self, method: str, **kwargs: Any) -> Any:
        assert method in EngineCore.RPC_METHODS, method
        done: queue.Queue = queue.Queue(maxsize=1)
        fn = functools.partial(getattr(self.core, method), **kwargs)
        self.core.loop.put_command("call", (fn, done))
        ok, value = done.get()
        if not ok:
            raise value
        return value

    def check_health(self) -> str | None:
        return self.core.loop.check_health()

    @property
    def num_queued(self) -> int:
        return len(self.core.scheduler.waiting) + self.core.loop.num_pending_commands

    def shutdown(self) -> None:
        self.core.loop.put_command("stop")
        self._thread.join(timeout=30)
        self.core.runner.close()  # tensor-parallel ranks stop now, not at interpreter exit
        self.core.shutdown_grammars()
        self.core.shutdown_disaggregation()
