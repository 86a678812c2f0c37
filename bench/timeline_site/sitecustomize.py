"""Stamps for bench/request_timeline.py: imported at start-up by every Python process that has
this directory on PYTHONPATH (the bench server and its front-end processes), it wraps the
functions of a request's path so that each call writes `perf_counter_ns label>` on entry and
`label<` on return to a file of its own process. perf_counter is CLOCK_MONOTONIC on Linux, the
same clock in every process, so the stamps line up with the client's.

Does nothing unless MOE_SERVE_TIMELINE_DIR is set. A point whose function is gone (renamed)
writes `missing:label`, which the timeline reports, rather than stopping the server.
"""

import functools
import importlib
import inspect
import os
import time

# (module, qualified name, label); the front-end process imports no torch: its own list
_HTTP = [
    ("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol.on_message_begin", "http_begin"),
    ("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol.on_message_complete",
     "http_body_done"),
    ("uvicorn.protocols.http.httptools_impl", "RequestResponseCycle.send", "http_send"),
]  # fmt: skip
# a front end runs as `python -m moe_serve.service.frontends.front_end`: its FrontEnd is
# __main__'s, patched when uvicorn starts (before that, __main__ is not loaded yet)
_FRONT_END_MAIN = [
    ("__main__", "FrontEnd._forward", "fe_forward"),
    ("__main__", "FrontEnd._read_body", "fe_read_body"),
    ("__main__", "FrontEnd._forward_json", "fe_forward_json"),
    ("__main__", "decode_forward_arrays", "fe_decode_json"),
    ("__main__", "_write_blob", "fe_write_blob"),
    ("__main__", "_json_reply", "fe_encode_json"),
]
_FRONT_END = [
    ("moe_serve.service.http.direct_body", "DirectBody.read", "body_read"),  # its body in place
    ("moe_serve.service.frontends.channel", "EngineClient.forward", "fe_engine"),
]
_ENGINE = [
    ("moe_serve.service.http.middleware", "RequestMiddleware.__call__", "middleware"),
    ("moe_serve.service.http.routes.forward", "ForwardEndpoint.__call__", "fast_path"),
    ("moe_serve.service.http.direct_body", "DirectBody.read", "body_read"),
    ("moe_serve.service.frontends.channel_server", "_FrontEndLink._forward", "channel_forward"),
    ("moe_serve.service.core.forward", "_decode_blob", "decode"),
    ("moe_serve.service.engine.batcher", "DynamicBatcher.submit", "submit"),
    ("moe_serve.service.engine.batcher", "DynamicBatcher._launch", "launch"),
    ("moe_serve.service.engine.engine", "Engine.start", "engine_start"),
    ("moe_serve.service.engine.pipeline", "_gather", "gather"),
    ("moe_serve.service.engine.pipeline", "DevicePipeline._enqueue", "enqueue"),
    ("moe_serve.kernels.layer_graphs", "LayerGraphs.replay", "replay"),
    ("moe_serve.service.engine.batcher", "DynamicBatcher._finish", "finish"),
    ("moe_serve.service.engine.pipeline", "_InFlight.result", "result"),
    ("moe_serve.service.core.forward", "_encode_blob", "encode"),
    ("moe_serve.service.core.forward", "_decode_json", "decode_json"),
    ("moe_serve.service.core.forward", "_encode_json", "encode_json"),
]


def _install(directory: str) -> None:
    fd = os.open(f"{directory}/stamps-{os.getpid()}.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    front_end = "MOE_SERVE_FRONT_END" in os.environ  # set by the engine for its front ends
    role = "fe" if front_end else "engine"

    def stamp(label: str) -> None:
        os.write(fd, f"{time.perf_counter_ns()} {role}:{label}\n".encode())

    def wrapped(fn, label):
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def timed(*args, **kwargs):
                stamp(label + ">")
                try:
                    return await fn(*args, **kwargs)
                finally:
                    stamp(label + "<")

            return timed

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            stamp(label + ">")
            try:
                return fn(*args, **kwargs)
            finally:
                stamp(label + "<")

        return timed

    def patch(points):
        for module, qualname, label in points:
            *path, name = qualname.split(".")
            try:
                owner = importlib.import_module(module)
                for part in path:
                    owner = getattr(owner, part)
                setattr(owner, name, wrapped(getattr(owner, name), label))
            except (ImportError, AttributeError):
                os.write(fd, f"0 missing:{role}:{label}\n".encode())

    patch(_HTTP + (_FRONT_END if front_end else _ENGINE))
    if front_end:
        import uvicorn

        run = uvicorn.Server.run

        def run_patched(self, *args, **kwargs):
            patch(_FRONT_END_MAIN)
            return run(self, *args, **kwargs)

        uvicorn.Server.run = run_patched


if os.environ.get("MOE_SERVE_TIMELINE_DIR"):
    _install(os.environ["MOE_SERVE_TIMELINE_DIR"])
