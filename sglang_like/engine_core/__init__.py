"""The engine core: the scheduler and model runner, in their own process by default.

    user's process (or the HTTP server)          engine-core process
    Engine: tokenize, validate, handles   --->   EngineLoop: grammars, Scheduler, ModelRunner
            logprob text, streams         <---   output dicts (ids, text deltas, meta), batched
                         ZeroMQ over ipc://, msgspec-encoded messages (messages.py)

`Engine` talks to its core through a client with one interface and two forms:
`ProcessCoreClient` (client.py: spawns `python -m sglang_like.engine_core`, the default) and
`ThreadCoreClient` (local.py: the same loop on a thread of this process, `engine_in_process=True`;
tests use it to look inside the scheduler). `EngineCore` (core.py) is what runs on the other side
in both cases.
"""
