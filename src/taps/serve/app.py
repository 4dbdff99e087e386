"""The FastAPI application of `taps serve`: OpenAI's chat and completion endpoints over one Engine.

One request decodes at a time per model (batch size 1, as the study measures): a request waits in
a queue of at most `Limits.max_queue` for the decoder; beyond it the answer is 429 with a
Retry-After estimated from recent request times, and 503 (also with Retry-After) once the server
is shutting down. Admission is fair between clients (told apart by their address: serve/admission.py).
Each decode runs in a worker thread and hands its tokens to the request's coroutine as the
verifier accepts them; a stream's client that goes away, a stop string, or shutdown stops the
decode at the next step and frees the decoder for the next request.

Hostile requests cost little: the body is counted while it streams in (413 past the limit), a
prompt that cannot fit the token limit is refused before it is tokenised (Engine.max_token_chars
bounds the characters of a token), and parsing and tokenising run in one worker thread, off the
event loop. An unexpected error is answered 500 as a RequestError, so the connection stays open.

Shutdown drains (DrainingServer): new requests get 503, running and queued ones may finish within
the shutdown timeout, and what is still unfinished then is cut and reported as cut: a 503, or an
error event in a stream; never a normal finish_reason.

With an API key (`create_app(api_key=...)`), every endpoint but /health wants `Authorization:
Bearer KEY` (serve/auth.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from taps.core.config import check_at_least, setting
from taps.serve.admission import Scheduler
from taps.serve.auth import BearerKey
from taps.serve.engine import Engine, Outcome, Sampling, VariantError
from taps.serve.learn import Answer, Learner
from taps.serve.swap import HeadSwapper
from taps.serve.metrics import CONTENT_TYPE, Metrics
from taps.serve.protocol import (DONE, GenerationRequest, RequestError, TextStream, chunk, new_id, parse_chat,
                                 parse_completion, parse_json, response, usage)

MAX_BODY_BYTES = 4 << 20
FINISH_LABEL = {"stop_token": "stop", "stop_string": "stop", "max_new_tokens": "length", "cancelled": "cancelled"}
CUT_GRACE_S = 10.0  # after the drain's deadline: time for cut decodes to stop and their answers to go out
LOG = logging.getLogger("taps.serve")


@dataclass(frozen=True)
class Limits:
    max_queue: int = setting(16, "requests waiting for the decoder beyond the one decoding", at_least=0)
    max_tokens: int = setting(2048, "the most a request may ask for; also its default, within the context window",
                              at_least=1)
    max_prompt_tokens: int | None = setting(None, "None: the context window less one token", at_least=1)

    def __post_init__(self) -> None:
        check_at_least(self)


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
        self.cut = False  # set by the shutdown's deadline (Scheduler.cut): a cancelled decode is then cut
        self.thread = threading.Thread(target=self._work, args=(prompt, sampling), daemon=True, name="taps-decode")
        self.id = new_id(request.chat)

    def _call(self, function, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(function, *args)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass

    def _work(self, prompt: list[int], sampling: Sampling) -> None:
        start = time.perf_counter()
        swapper = self.server.swapper
        try:
            versions = swapper.apply() if swapper is not None else {}  # between requests: no decode runs now
            outcome = self.server.engine.decode(prompt, self.variant, sampling,
                                                on_tokens=lambda tokens: self._call(self.queue.put_nowait,
                                                                                    ("tokens", tokens)),
                                                cancelled=self.cancel.is_set, remember=self.request.learn)
            if outcome.finish == "cancelled" and self.text.stopped:
                outcome.finish = "stop_string"
            label = "cut" if outcome.finish == "cancelled" and self.cut else FINISH_LABEL[outcome.finish]
            self.server.metrics.finished(self.endpoint, self.variant, outcome, label,
                                         time.perf_counter() - self.arrived)
            self.server.keep(self, prompt, outcome)
            if swapper is not None:
                swapper.finished(versions, self.variant.members, len(outcome.tokens), outcome.verifier_calls,
                                 outcome.decode_s)
            last = ("done", outcome)
        except BaseException as err:  # reported to the client; the server goes on
            self.server.metrics.failed(self.endpoint, self.variant.label, time.perf_counter() - self.arrived)
            last = ("error", err)
        # the decoder is free before the response is complete (callbacks run in this order)
        self._call(self._released, time.perf_counter() - start)
        self._call(self.queue.put_nowait, last)

    def _released(self, seconds: float) -> None:
        self.server.scheduler.jobs.discard(self)
        self.server.scheduler.release(seconds)

    def start(self) -> None:
        self.server.scheduler.jobs.add(self)
        self.thread.start()

    def unfinished(self, outcome: Outcome) -> RequestError:
        """What a decode stopped before its end (and not by a stop string) is answered with: never a
        normal finish_reason. Cut by shutdown: 503 (retry elsewhere or later); otherwise its client
        went away and nobody reads it."""
        n = len(outcome.tokens)
        if self.cut:
            self.server.cut_answers += 1
            err = self.server.scheduler.shutting_down(f"the server shut down before this answer was complete: it "
                                                      f"was cut after {n} tokens; retry")
        else:
            err = RequestError(f"the request was cancelled after {n} tokens", status=499, kind="server_error",
                               code="cancelled")
        err.counted = True  # requests_total{finish="cut" | "cancelled"} counts it already
        return err

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
                    if value.finish == "cancelled":
                        raise self.unfinished(value)
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
    def __init__(self, engine: Engine, limits: Limits = Limits(), learner: Learner | None = None,
                 swapper: HeadSwapper | None = None):
        self.engine, self.limits, self.learner, self.swapper = engine, limits, learner, swapper
        self.scheduler = Scheduler(limits.max_queue)
        self.metrics = Metrics(keep={*engine.named, engine.default.label})
        self.created = int(time.time())
        self.cut_answers = 0  # answers cut by the shutdown (reported as cut)
        # parsing and tokenising, off the event loop; one at a time bounds their memory
        self.prepare_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="taps-prepare")

    def keep(self, job: Job, prompt: list[int], outcome: Outcome) -> None:
        """A finished decode, handed to `--learn`'s learner unless the request opted out."""
        if self.learner is None or not job.request.learn:
            return
        sampling = {"temperature": job.request.temperature, "top_p": job.request.top_p, "seed": job.request.seed}
        self.learner.submit(Answer(job.id, job.request.prompt if job.request.chat else None, list(prompt),
                                   list(outcome.tokens), self.engine.detokenize(outcome.tokens), outcome.finish,
                                   {"model": self.engine.model_id, "variant": job.variant.label, **sampling}))

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.engine.model_id, "object": "model", "created": self.created,
                                            "owned_by": "taps", "taps": self.engine.describe()}]}

    def _most_prompt_tokens(self) -> int:
        return self.limits.max_prompt_tokens or self.engine.context_window - 1

    def _too_long(self, param: str, what: str) -> RequestError:
        most, window = self._most_prompt_tokens(), self.engine.context_window
        return RequestError(f"the prompt ({param}) has {what}; this server takes at most {most} tokens (the "
                            f"target's context window is {window})", param=param, code="context_length_exceeded")

    def _prompt(self, request: GenerationRequest) -> tuple[list[int], str]:
        engine, param = self.engine, "messages" if request.chat else "prompt"
        most = self._most_prompt_tokens()
        if isinstance(request.prompt, list) and not request.chat:
            if len(request.prompt) > most:
                raise self._too_long(param, f"{len(request.prompt)} tokens")
        else:  # text: a prompt of more characters than `most` tokens can hold is refused untokenised
            chars = len(request.prompt) if isinstance(request.prompt, str) else \
                sum(len(m["content"]) for m in request.prompt)
            if chars > most * engine.max_token_chars:
                raise self._too_long(param, f"{chars:,} characters, more than {most} tokens of at most "
                                            f"{engine.max_token_chars} characters each can hold")
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
        if len(prompt) > self._most_prompt_tokens():
            raise self._too_long(param, f"{len(prompt)} tokens")
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

    def _prepare(self, raw: bytes, chat: bool):
        """The request checked, its variant and its prompt's tokens (in the prepare thread)."""
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
        return request, variant, prompt, self._sampling(request, prompt, param)

    async def generate(self, http: Request, chat: bool):
        arrived = time.perf_counter()
        raw = await read_body(http)
        loop = asyncio.get_running_loop()
        request, variant, prompt, sampling = await loop.run_in_executor(self.prepare_pool, self._prepare, raw, chat)
        del raw
        await self.scheduler.acquire(http.client.host if http.client else "?")
        try:
            job = Job(self, request, prompt, variant, sampling, "chat" if chat else "completions", arrived)
            job.start()
        except BaseException:
            self.scheduler.release(0.0)
            raise
        rid = job.id
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
            error = err if isinstance(err, RequestError) else _internal(err)
            yield f"data: {json.dumps(error.body())}\n\n"
        yield DONE

    def begin_shutdown(self, timeout: float) -> None:
        """Shutdown starts (on the event loop): new requests get 503; running and queued ones have
        `timeout` seconds to finish, then what is left is cut (Scheduler.cut)."""
        self.scheduler.closing = True
        asyncio.get_running_loop().call_later(timeout, self.scheduler.cut)

    async def shutdown(self) -> None:
        """The end of shutdown: cut what still runs, wait for it (a few seconds), say what was cut."""
        self.scheduler.cut()
        for _ in range(100):
            if not self.scheduler.running:
                break
            await asyncio.sleep(0.05)
        self.prepare_pool.shutdown(wait=False, cancel_futures=True)
        if self.swapper is not None:
            self.swapper.close()
        if self.learner is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.learner.close)
        if self.cut_answers:
            LOG.warning(f"taps serve: shut down; cut {self.cut_answers} answer(s) short of their end, each reported "
                        "as cut (503, or an error event in its stream)")


async def read_body(http: Request) -> bytes:
    """The request body, refused (413) as soon as it is known to pass MAX_BODY_BYTES: by its
    Content-Length, or while it streams in."""
    def too_big(size: str) -> RequestError:
        return RequestError(f"the request body has {size} bytes; the limit is {MAX_BODY_BYTES}", param="body",
                            status=413)

    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_big(declared)
    parts, size = [], 0
    async for part in http.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise too_big(f"more than {MAX_BODY_BYTES}")
        parts.append(part)
    return b"".join(parts)


def _internal(err: BaseException) -> RequestError:
    return RequestError(f"internal error: {type(err).__name__}: {err}", status=500, kind="server_error")


def guarded(handler):
    """An endpoint whose unexpected errors become RequestError 500s: answered by the app's own
    handler, which keeps the connection open (an exception left to Starlette's last-resort handler
    is re-raised to uvicorn, which drops the keep-alive connection)."""
    @functools.wraps(handler)
    async def run(*args, **kwargs):
        try:
            return await handler(*args, **kwargs)
        except (RequestError, HTTPException):
            raise
        except Exception as err:
            LOG.exception("taps serve: internal error")
            raise _internal(err) from err
    return run


def create_app(engine: Engine, limits: Limits = Limits(), api_key: str | None = None,
               learner: Learner | None = None, swapper: HeadSwapper | None = None) -> FastAPI:
    """The app; with `--learn DIR`: its `learner` (serve/learn.py), which keeps finished answers,
    and its `swapper` (serve/swap.py), which serves new head versions between requests."""
    server = Server(engine, limits, learner, swapper)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await server.shutdown()

    app = FastAPI(title="taps serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.taps = server
    if api_key is not None:
        app.add_middleware(BearerKey, key=api_key, rejected=server.metrics.reject)

    def error(err: RequestError) -> JSONResponse:
        if not getattr(err, "counted", False):
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
    async def _bug(request: Request, err: Exception):  # outside an endpoint (guarded catches those)
        return error(_internal(err))

    @app.get("/v1/models")
    @guarded
    async def models():
        return server.models()

    @app.get("/health")
    async def health():
        return {"status": "shutting_down" if server.scheduler.closing else "ok"}

    @app.post("/v1/chat/completions")
    @guarded
    async def chat_completions(request: Request):
        return await server.generate(request, chat=True)

    @app.post("/v1/completions")
    @guarded
    async def completions(request: Request):
        return await server.generate(request, chat=False)

    @app.get("/metrics")
    @guarded
    async def metrics():
        s = server.scheduler
        page = server.metrics.render(s.waiting, s.running, s.max_queue, server.engine.learned(),
                                     server.swapper.rows() if server.swapper is not None else ())
        return PlainTextResponse(page, media_type=CONTENT_TYPE)

    return app


class DrainingServer(uvicorn.Server):
    """uvicorn's server, its shutdown preceded by the app's drain (Server.begin_shutdown): uvicorn
    stops accepting connections, the app answers new requests 503, lets running and queued ones
    finish for `drain_s` seconds, then cuts the rest and reports them as cut. uvicorn's own
    deadline comes CUT_GRACE_S later, so those answers go out before it drops connections."""

    def __init__(self, app, drain_s: float, **config):
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=drain_s + CUT_GRACE_S, **config))
        self.drain_s = drain_s
        self.taps = _taps_server(app)

    async def shutdown(self, sockets=None) -> None:
        if self.taps is not None:
            self.taps.begin_shutdown(self.drain_s)
        await super().shutdown(sockets)


def _taps_server(app) -> Server | None:
    """The Server under `app` (which may be wrapped in ASGI middleware exposing `.app`)."""
    while app is not None and not hasattr(getattr(app, "state", None), "taps"):
        app = getattr(app, "app", None)
    return None if app is None else app.state.taps


def run(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 30.0,
        log_level: str = "info") -> None:
    """Serve until SIGINT / SIGTERM: then drain (DrainingServer: running requests may finish for up
    to `shutdown_timeout` seconds, the rest is cut and reported as cut), and return."""
    import signal

    # uvicorn shuts down gracefully on the signal, then raises it again for the handler it found;
    # this one lets the command return (exit code 0) instead of dying of it after a clean shutdown
    done = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        DrainingServer(app, shutdown_timeout, host=host, port=port, log_level=log_level).run()
    finally:
        for sig, handler in done.items():
            signal.signal(sig, handler)


@contextmanager
def serving(app: FastAPI, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 5.0):
    """Serve `app` from a background thread (tests, benchmarks, notebooks) until the block ends;
    yields (the uvicorn server, its base URL). Port 0: a free port, chosen by the system. Setting
    the server's `should_exit` drains it as SIGTERM would."""
    server = DrainingServer(app, shutdown_timeout, host=host, port=port, log_level="warning")
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
        thread.join(30 + shutdown_timeout)
