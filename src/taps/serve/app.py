"""The FastAPI application of `taps serve`: OpenAI's chat and completion endpoints over one Engine.

One request decodes at a time per model (batch size 1, as the study measures): a request waits in
a queue of at most `Limits.max_queue` for the decoder; beyond it the answer is 429 with a
Retry-After estimated from recent request times, and 503 (also with Retry-After) once the server
is shutting down. Each decode runs in a worker thread and hands its tokens to the request's
coroutine as the verifier accepts them; a stream's client that goes away, a stop string, or
shutdown stops the decode at the next step and frees the decoder for the next request.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections import deque
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from taps.config import check_at_least, setting
from taps.serve.engine import Engine, Outcome, Sampling, VariantError
from taps.serve.metrics import CONTENT_TYPE, Metrics
from taps.serve.protocol import (DONE, GenerationRequest, RequestError, TextStream, chunk, new_id, parse_chat,
                                 parse_completion, parse_json, response, usage)

MAX_BODY_BYTES = 4 << 20
FINISH_LABEL = {"stop_token": "stop", "stop_string": "stop", "max_new_tokens": "length", "cancelled": "cancelled"}


@dataclass(frozen=True)
class Limits:
    max_queue: int = setting(16, "requests waiting for the decoder beyond the one decoding", at_least=0)
    max_tokens: int = setting(2048, "the most a request may ask for; also its default, within the context window",
                              at_least=1)
    max_prompt_tokens: int | None = setting(None, "None: the context window less one token", at_least=1)

    def __post_init__(self) -> None:
        check_at_least(self)


class Scheduler:
    """The decoder's lock and its bounded queue (all calls on the event loop's thread)."""

    def __init__(self, max_queue: int):
        self.max_queue, self.waiting, self.running, self.closing = max_queue, 0, 0, False
        self._lock: asyncio.Lock | None = None
        self._durations: deque[float] = deque(maxlen=20)
        self.cancels: set[threading.Event] = set()

    def retry_after(self) -> str:
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        return str(max(1, math.ceil(mean * (self.waiting + 1))))

    async def acquire(self) -> None:
        if self.closing:
            raise RequestError("the server is shutting down", status=503, kind="server_error", code="shutting_down",
                               headers={"Retry-After": self.retry_after()})
        if self.running + self.waiting > self.max_queue:
            raise RequestError(f"the server is busy: one request decodes at a time and {self.waiting} are waiting "
                               f"(the limit is {self.max_queue}); retry later", status=429, kind="rate_limit_error",
                               code="queue_full", headers={"Retry-After": self.retry_after()})
        self._lock = self._lock or asyncio.Lock()
        self.waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self.waiting -= 1
        self.running += 1

    def release(self, seconds: float) -> None:
        self._durations.append(seconds)
        self.running -= 1
        self._lock.release()


class Job:
    """One decode in a worker thread; `events()` yields its text deltas, then its outcome."""

    def __init__(self, server: "Server", request: GenerationRequest, prompt: list[int], variant, sampling: Sampling,
                 endpoint: str, arrived: float):
        self.server, self.request, self.variant, self.endpoint = server, request, variant, endpoint
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.text = TextStream(server.engine.detokenize, request.stop)
        self.arrived = arrived
        self.thread = threading.Thread(target=self._work, args=(prompt, sampling), daemon=True, name="taps-decode")

    def _call(self, function, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(function, *args)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass

    def _work(self, prompt: list[int], sampling: Sampling) -> None:
        start = time.perf_counter()
        try:
            outcome = self.server.engine.decode(prompt, self.variant, sampling,
                                                on_tokens=lambda tokens: self._call(self.queue.put_nowait,
                                                                                    ("tokens", tokens)),
                                                cancelled=self.cancel.is_set)
            if outcome.finish == "cancelled" and self.text.stopped:
                outcome.finish = "stop_string"
            self.server.metrics.finished(self.endpoint, self.variant, outcome, FINISH_LABEL[outcome.finish],
                                         time.perf_counter() - self.arrived)
            last = ("done", outcome)
        except BaseException as err:  # reported to the client; the server goes on
            self.server.metrics.failed(self.endpoint, self.variant.label, time.perf_counter() - self.arrived)
            last = ("error", err)
        # the decoder is free before the response is complete (callbacks run in this order)
        self._call(self._released, time.perf_counter() - start)
        self._call(self.queue.put_nowait, last)

    def _released(self, seconds: float) -> None:
        self.server.scheduler.cancels.discard(self.cancel)
        self.server.scheduler.release(seconds)

    def start(self) -> None:
        self.server.scheduler.cancels.add(self.cancel)
        self.thread.start()

    async def events(self, gone=None):
        """("delta", text) as tokens arrive, then ("done", Outcome); `gone`: an async check, polled
        every second, that the client is still there (non-streaming requests)."""
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(self.queue.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if gone is not None and await gone():
                        self.cancel.set()
                    continue
                if kind == "tokens":
                    delta = self.text.push(value)
                    if self.text.stopped:
                        self.cancel.set()  # the rest would be cut anyway
                elif kind == "done":
                    delta = self.text.push([], final=True)
                else:
                    raise value
                if delta:
                    yield "delta", delta
                if kind == "done":
                    yield "done", value
                    return
        finally:
            self.cancel.set()  # a client gone mid-stream: the decoder stops at its next step


class Server:
    def __init__(self, engine: Engine, limits: Limits = Limits()):
        self.engine, self.limits = engine, limits
        self.scheduler = Scheduler(limits.max_queue)
        self.metrics = Metrics()
        self.created = int(time.time())

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.engine.model_id, "object": "model", "created": self.created,
                                            "owned_by": "taps", "taps": self.engine.describe()}]}

    def _prompt(self, request: GenerationRequest) -> tuple[list[int], str]:
        engine, param = self.engine, "messages" if request.chat else "prompt"
        if request.chat:
            try:
                ids = engine.chat_prompt(request.prompt)
            except ValueError as err:  # no chat template
                raise RequestError(f"{err}; use /v1/completions", param="messages") from None
        elif isinstance(request.prompt, str):
            ids = engine.text_prompt(request.prompt)
        else:
            ids = list(request.prompt)
            bad = next((i for i, t in enumerate(ids) if not 0 <= t < engine.vocab_size), None)
            if bad is not None:
                raise RequestError(f"prompt[{bad}] = {ids[bad]} is outside the vocabulary of {engine.vocab_size} "
                                   "tokens", param=f"prompt[{bad}]")
        if not ids:
            raise RequestError("the prompt is empty: at least one token is needed", param=param)
        return ids, param

    def _sampling(self, request: GenerationRequest, prompt: list[int], param: str) -> Sampling:
        window = self.engine.context_window
        most = self.limits.max_prompt_tokens or window - 1
        if len(prompt) > most:
            raise RequestError(f"the prompt ({param}) has {len(prompt)} tokens; this server takes at most {most} "
                               f"(the target's context window is {window})", param=param, code="context_length_exceeded")
        room = window - len(prompt)
        asked = request.max_tokens
        if asked is not None and asked > self.limits.max_tokens:
            raise RequestError(f"max_tokens is {asked}; this server allows at most {self.limits.max_tokens}",
                               param="max_tokens")
        if asked is not None and asked > room:
            raise RequestError(f"the prompt has {len(prompt)} tokens and max_tokens is {asked}: {len(prompt) + asked} "
                               f"exceeds the target's context window of {window} tokens", param="max_tokens",
                               code="context_length_exceeded")
        return Sampling(max_tokens=asked or min(self.limits.max_tokens, room), temperature=request.temperature,
                        top_p=request.top_p, seed=request.seed)

    async def generate(self, http: Request, chat: bool):
        arrived = time.perf_counter()
        raw = await http.body()
        if len(raw) > MAX_BODY_BYTES:
            raise RequestError(f"the request body has {len(raw)} bytes; the limit is {MAX_BODY_BYTES}", param="body",
                               status=413)
        body = parse_json(raw)
        request = parse_chat(body) if chat else parse_completion(body)
        if request.model != self.engine.model_id:
            raise RequestError(f"model {request.model!r} is not served here; this server serves "
                               f"{self.engine.model_id!r} (GET /v1/models)", param="model", status=404,
                               code="model_not_found")
        try:
            variant = self.engine.resolve(request.variant)
        except VariantError as err:
            raise RequestError(str(err), param="taps.variant", code="unknown_variant") from None
        prompt, param = self._prompt(request)
        sampling = self._sampling(request, prompt, param)
        await self.scheduler.acquire()
        try:
            job = Job(self, request, prompt, variant, sampling, "chat" if chat else "completions", arrived)
            job.start()
        except BaseException:
            self.scheduler.release(0.0)
            raise
        rid = new_id(chat)
        if request.stream:
            return StreamingResponse(self._stream(job, rid), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        async for kind, value in job.events(gone=http.is_disconnected):
            if kind == "done":
                return JSONResponse(response(request, rid, self.engine.model_id, job.text.sent, value.finish,
                                             usage(value, variant)))

    async def _stream(self, job: Job, rid: str):
        request, model = job.request, self.engine.model_id
        if request.chat:
            yield chunk(request, rid, model, role=True)
        try:
            async for kind, value in job.events():
                if kind == "delta":
                    yield chunk(request, rid, model, text=value)
                    continue
                outcome: Outcome = value
                yield chunk(request, rid, model, finish=outcome.finish)
                if request.include_usage:
                    yield chunk(request, rid, model, use=usage(outcome, job.variant))
        except Exception as err:  # the status is sent already: the error goes into the stream
            yield f"data: {json.dumps(_internal(err).body())}\n\n"
        yield DONE

    async def shutdown(self) -> None:
        """Refuse new requests, stop running decodes at their next step, wait for them (a few seconds)."""
        self.scheduler.closing = True
        for cancel in list(self.scheduler.cancels):
            cancel.set()
        for _ in range(100):
            if not self.scheduler.running:
                break
            await asyncio.sleep(0.05)


def _internal(err: BaseException) -> RequestError:
    return RequestError(f"internal error: {type(err).__name__}: {err}", status=500, kind="server_error")


def create_app(engine: Engine, limits: Limits = Limits()) -> FastAPI:
    server = Server(engine, limits)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await server.shutdown()

    app = FastAPI(title="taps serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.taps = server

    def error(err: RequestError) -> JSONResponse:
        server.metrics.reject(err.status)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, err: RequestError):
        return error(err)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, err: HTTPException):
        message = {404: f"no such endpoint {request.url.path}", 405: f"{request.method} is not allowed on "
                                                                     f"{request.url.path}"}.get(err.status_code, err.detail)
        return error(RequestError(message, param=None, status=err.status_code,
                                  headers=dict(err.headers or {})))

    @app.exception_handler(Exception)
    async def _bug(request: Request, err: Exception):
        return error(_internal(err))

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/health")
    async def health():
        return {"status": "shutting_down" if server.scheduler.closing else "ok"}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.generate(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.generate(request, chat=False)

    @app.get("/metrics")
    async def metrics():
        s = server.scheduler
        page = server.metrics.render(s.waiting, s.running, s.max_queue, server.engine.learned())
        return PlainTextResponse(page, media_type=CONTENT_TYPE)

    return app


def run(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 30.0,
        log_level: str = "info") -> None:
    """Serve until SIGINT / SIGTERM: then stop accepting, let running requests finish for up to
    `shutdown_timeout` seconds, cancel the rest, and return."""
    import signal

    import uvicorn

    # uvicorn shuts down gracefully on the signal, then raises it again for the handler it found;
    # this one lets the command return (exit code 0) instead of dying of it after a clean shutdown
    done = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                      timeout_graceful_shutdown=shutdown_timeout)).run()
    finally:
        for sig, handler in done.items():
            signal.signal(sig, handler)


@contextmanager
def serving(app: FastAPI, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 5.0):
    """Serve `app` from a background thread (tests, benchmarks, notebooks) until the block ends;
    yields (the uvicorn server, its base URL). Port 0: a free port, chosen by the system."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=shutdown_timeout))
    thread = threading.Thread(target=server.run, daemon=True, name="taps-serve")
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield server, f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
