"""The HTTP side: OpenAI's `/v1/chat/completions`, `/v1/completions`, `/v1/models`, Ollama's `/api/chat`,
`/api/generate`, `/api/tags`, `/api/show`, `/api/ps`, `/api/version`, and `/health`, `/metrics`, on FastAPI. Every
handler reads its request (protocol.py), submits a `Job` to the engine's thread (worker.py) and turns the job's events
into one JSON answer, server-sent events (OpenAI) or NDJSON lines (Ollama). Errors are JSON bodies with a 4xx (bad
input, a missing key, a full queue) or 5xx status (the model failed), never a traceback."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from gguf import LlamaFileType
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

import tandem
from tandem.api import LLM
from tandem.server import protocol
from tandem.server.protocol import MAX_BODY_BYTES, APIError, Generation
from tandem.server.worker import EngineWorker, Event, Failed, Finished, Job, Piece, Started

# A request body must have arrived this long after its headers: a client that stalls mid-body (or a slowloris) would
# otherwise hold its connection and a handler for ever (uvicorn has no timeout for the body).
BODY_TIMEOUT_S = 60.0

Handler = Callable[[Request], Awaitable[Response]]


class Metrics:
    """The Prometheus series of one server (its own registry): requests by endpoint and status, prompt and
    generated tokens, requests waiting for a slot, busy slots, the KV cache's positions in use and in all."""

    def __init__(self, worker: EngineWorker, n_slots: int, n_ctx: int) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("tandem_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)  # fmt: skip
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens of the requests admitted", registry=r)
        self.generated_tokens = Counter("tandem_generated_tokens", "Tokens generated", registry=r)
        Gauge("tandem_requests_waiting", "Requests waiting for a slot", registry=r).set_function(lambda: worker.waiting)
        Gauge("tandem_slots_busy", "Slots running a sequence", registry=r).set_function(lambda: worker.busy_slots)
        Gauge("tandem_slots", "Slots of the engine (-np)", registry=r).set(n_slots)
        Gauge("tandem_kv_cache_tokens", "Positions held in the slots' KV caches (running and kept for prefix reuse)",
              registry=r).set_function(lambda: worker.kv_tokens)  # fmt: skip
        Gauge("tandem_kv_cache_capacity_tokens", "Positions the KV caches hold in all (-np x -c)",
              registry=r).set(n_slots * n_ctx)  # fmt: skip
        worker.on_tokens = self._count

    def _count(self, prompt: int, generated: int) -> None:  # called on the engine's thread
        if prompt:
            self.prompt_tokens.inc(prompt)
        if generated:
            self.generated_tokens.inc(generated)


def _now_iso() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _ndjson(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


def _usage(end: Finished) -> dict[str, int]:
    return {"prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens,
            "total_tokens": end.prompt_tokens + end.completion_tokens}  # fmt: skip


def _ollama_stats(end: Finished) -> dict[str, Any]:
    ns = 1_000_000_000
    return {"done_reason": end.reason, "total_duration": int(end.total_seconds * ns), "load_duration": 0,
            "prompt_eval_count": end.prompt_tokens, "prompt_eval_duration": int(end.prompt_seconds * ns),
            "eval_count": end.completion_tokens,
            "eval_duration": int((end.total_seconds - end.prompt_seconds) * ns)}  # fmt: skip


class _JobStream(StreamingResponse):
    """A streamed answer whose job is cancelled however the stream ends (done, client gone, server stopping)."""

    def __init__(self, content: AsyncIterator[str], media_type: str, cancel: Callable[[], None]) -> None:
        super().__init__(content, media_type=media_type, headers={"Cache-Control": "no-cache",
                                                                  "X-Accel-Buffering": "no"})  # fmt: skip
        self._cancel = cancel

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cancel()


class Server:
    """The routes of one loaded model; `app` is the ASGI application."""

    def __init__(self, worker: EngineWorker, llm: LLM, api_key: str | None = None) -> None:
        self.worker = worker
        self.api_key = api_key
        path = Path(llm.file.path)
        self.model_id = path.name.removesuffix(".gguf")
        self.created = int(path.stat().st_mtime)
        self.model_info = {
            "size": llm.file.file_size,
            "modified_at": datetime.fromtimestamp(self.created, UTC).isoformat().replace("+00:00", "Z"),
            "family": llm.config.arch,
            "parameters": sum(t.n_elements for t in llm.file.tensors.values()),
        }
        cfg = llm.config
        self.model_info["details"] = {
            "format": "gguf", "family": cfg.arch, "families": [cfg.arch],
            "parameter_size": _parameter_size(self.model_info["parameters"]),
            "quantization_level": _quantization(llm.file.metadata.get("general.file_type")),
        }  # fmt: skip
        self.arch_info = {  # Ollama's `model_info`: clients read the context length from it
            "general.architecture": cfg.arch,
            "general.parameter_count": self.model_info["parameters"],
            f"{cfg.arch}.context_length": cfg.context_length,
            f"{cfg.arch}.embedding_length": cfg.hidden,
            f"{cfg.arch}.block_count": cfg.n_layers,
        }
        self.template_source = llm.file.metadata.get("tokenizer.chat_template") or ""
        self.vram_bytes = llm.plan.gpu_bytes() if llm.plan.compute_device != "cpu" else 0
        self.n_slots = llm.engine.pool.n_slots
        self.n_ctx = llm.n_ctx
        self.metrics = Metrics(worker, self.n_slots, self.n_ctx)
        app = self.app = FastAPI(title="tandem", docs_url=None, redoc_url=None, openapi_url=None)
        routes: list[tuple[str, str, Handler, bool]] = [
            ("POST", "/v1/chat/completions", self.chat_completions, False),
            ("POST", "/v1/completions", self.completions, False),
            ("GET", "/v1/models", self.models, False),
            ("POST", "/api/chat", self.ollama_chat, True),
            ("POST", "/api/generate", self.ollama_generate, True),
            ("GET", "/api/tags", self.ollama_tags, True),
            ("POST", "/api/show", self.ollama_show, True),
            ("GET", "/api/ps", self.ollama_ps, True),
            ("GET", "/api/version", self.ollama_version, True),
            ("GET", "/health", self.health, False),
            ("GET", "/metrics", self.prometheus, False),
        ]
        for method, route, handler, ollama in routes:
            app.add_api_route(route, self._endpoint(route, handler, ollama), methods=[method])
        app.add_exception_handler(StarletteHTTPException, self._http_error)  # 404, 405: JSON too
        app.add_exception_handler(Exception, self._internal_error)

    # -- plumbing --------------------------------------------------------------------------------------------
    @staticmethod
    def error_response(e: APIError, ollama: bool) -> JSONResponse:
        body = {"error": e.message} if ollama else e.openai_body()
        return JSONResponse(body, status_code=e.status, headers=e.headers)

    def _endpoint(self, route: str, handler: Handler, ollama: bool) -> Handler:
        async def endpoint(request: Request) -> Response:
            try:
                if route != "/health":
                    self._authorize(request)
                response = await handler(request)
            except APIError as e:
                response = self.error_response(e, ollama)
            self.metrics.requests.labels(route, str(response.status_code)).inc()
            return response

        return endpoint

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)  # its headers: a 405's Allow
        e = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                     "invalid_request_error" if exc.status_code < 500 else "server_error",
                     headers=exc.headers)  # fmt: skip
        return self.error_response(e, request.url.path.startswith("/api/"))

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        e = APIError(500, f"internal error: {type(exc).__name__}", "server_error")
        return self.error_response(e, request.url.path.startswith("/api/"))

    def _authorize(self, request: Request) -> None:
        """With --api-key: `Authorization: Bearer KEY` (or `X-Api-Key: KEY`), compared in constant time."""
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode("latin-1"), self.api_key.encode("utf-8")):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY)", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})  # fmt: skip

    @staticmethod
    async def _json(request: Request) -> dict[str, Any]:
        """The body as a JSON object, at most MAX_BODY_BYTES (413 past it), within BODY_TIMEOUT_S (408 past it)."""
        too_large = APIError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise too_large
        chunks, size = [], 0
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > MAX_BODY_BYTES:
                        raise too_large
                    chunks.append(chunk)
        except ClientDisconnect:
            raise APIError(400, "the client disconnected before sending the whole body") from None
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s",
                           code="request_timeout", headers={"Connection": "close"}) from None  # fmt: skip
        return protocol.parse_json(b"".join(chunks))

    async def _start(self, gen: Generation) -> tuple[Job, Started]:
        """Submit `gen` to the engine's thread; its Started event, or the request's error (429 when full)."""
        if not self.worker.alive:
            raise APIError(503, "the engine is not running", "server_error")
        job = Job(gen, asyncio.get_running_loop())
        if not self.worker.try_submit(job):
            raise APIError(429, f"the server is busy ({self.worker.capacity} requests running or waiting): "
                           "retry later", "rate_limit_exceeded", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"})  # fmt: skip
        try:
            event = await job.events.get()
        except BaseException:
            self.worker.cancel(job)
            raise
        if isinstance(event, Failed):
            raise event.error
        assert isinstance(event, Started)
        return job, event

    @staticmethod
    async def _events(job: Job) -> AsyncIterator[Event]:
        """The job's events after Started, consecutive pieces joined, up to and including the last one."""
        pending: Event | None = None
        while True:
            event = pending or await job.events.get()
            pending = None
            if isinstance(event, Piece):
                texts = [event.text]
                while not job.events.empty():
                    nxt = job.events.get_nowait()
                    if not isinstance(nxt, Piece):
                        pending = nxt
                        break
                    texts.append(nxt.text)
                event = Piece("".join(texts))
            yield event
            if isinstance(event, Finished | Failed):
                return

    async def _collect(self, request: Request, job: Job) -> tuple[str, Finished]:
        """The whole text of a job answered in one response; a client that goes away cancels the job."""

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.worker.cancel(job)
            job.events.put_nowait(Failed(APIError(499, "the client disconnected")))

        watcher = asyncio.ensure_future(watch())
        texts = []
        try:
            async for event in self._events(job):
                if isinstance(event, Piece):
                    texts.append(event.text)
                elif isinstance(event, Failed):
                    raise event.error
                elif isinstance(event, Finished):
                    return "".join(texts), event
        finally:
            watcher.cancel()
            self.worker.cancel(job)
        raise AssertionError("unreachable: a job ends with Finished or Failed")

    def _stream(self, job: Job, lines: AsyncIterator[str], media_type: str) -> Response:
        return _JobStream(lines, media_type, lambda: self.worker.cancel(job))

    # -- OpenAI ----------------------------------------------------------------------------------------------
    def _openai_head(self, prefix: str, obj: str) -> dict[str, Any]:
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
                "model": self.model_id}  # fmt: skip

    async def chat_completions(self, request: Request) -> Response:
        body = await self._json(request)
        gen = protocol.openai_chat(body)
        stream, usage = self._stream_flags(body)
        job, _ = await self._start(gen)
        if not stream:
            text, end = await self._collect(request, job)
            head = self._openai_head("chatcmpl", "chat.completion")
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": end.reason}  # fmt: skip
            return JSONResponse({**head, "choices": [choice], "usage": _usage(end)})

        def choice(delta: dict[str, str], reason: str | None) -> dict[str, Any]:
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}

        return self._openai_sse(
            job, self._openai_head("chatcmpl", "chat.completion.chunk"), usage,
            opening=choice({"role": "assistant", "content": ""}, None),
            piece=lambda text: choice({"content": text}, None), last=lambda reason: choice({}, reason),
        )  # fmt: skip

    async def completions(self, request: Request) -> Response:
        body = await self._json(request)
        gen = protocol.openai_completion(body)
        stream, usage = self._stream_flags(body)
        job, _ = await self._start(gen)
        if not stream:
            text, end = await self._collect(request, job)
            head = self._openai_head("cmpl", "text_completion")
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": end.reason}
            return JSONResponse({**head, "choices": [choice], "usage": _usage(end)})

        def choice(text: str, reason: str | None) -> dict[str, Any]:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

        return self._openai_sse(
            job, self._openai_head("cmpl", "text_completion"), usage, opening=None,
            piece=lambda text: choice(text, None), last=lambda reason: choice("", reason),
        )  # fmt: skip

    def _openai_sse(
        self,
        job: Job,
        head: dict[str, Any],
        usage: bool,
        opening: dict[str, Any] | None,
        piece: Callable[[str], dict[str, Any]],
        last: Callable[[str], dict[str, Any]],
    ) -> Response:
        """An OpenAI answer as server-sent events: the `opening` choice (if any), a `piece` choice per text piece,
        the `last` choice with the finish reason, the usage chunk when asked for, an error event on a failure."""

        def chunk(choice: dict[str, Any]) -> dict[str, Any]:
            out = {**head, "choices": [choice]}
            return {**out, "usage": None} if usage else out

        async def lines() -> AsyncIterator[str]:
            if opening is not None:
                yield _sse(chunk(opening))
            async for event in self._events(job):
                if isinstance(event, Piece):
                    yield _sse(chunk(piece(event.text)))
                elif isinstance(event, Finished):
                    yield _sse(chunk(last(event.reason)))
                    if usage:
                        yield _sse({**head, "choices": [], "usage": _usage(event)})
                elif isinstance(event, Failed):
                    yield _sse(event.error.openai_body())
            yield "data: [DONE]\n\n"

        return self._stream(job, lines(), "text/event-stream")

    @staticmethod
    def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
        f = protocol.Fields(body)
        options = f.get("stream_options", dict, "an object") or {}
        return f.boolean("stream", False), protocol.Fields(options, "stream_options.").boolean("include_usage", False)

    async def models(self, request: Request) -> Response:
        model = {
            "id": self.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "tandem",
            "meta": {"n_ctx": self.n_ctx, "n_parallel": self.n_slots, "size": self.model_info["size"]},
        }
        return JSONResponse({"object": "list", "data": [model]})

    # -- Ollama ----------------------------------------------------------------------------------------------
    async def ollama_chat(self, request: Request) -> Response:
        body = await self._json(request)
        return await self._ollama(request, body, protocol.ollama_chat(body), "message")

    async def ollama_generate(self, request: Request) -> Response:
        body = await self._json(request)
        return await self._ollama(request, body, protocol.ollama_generate(body), "response")

    async def _ollama(self, request: Request, body: dict[str, Any], gen: Generation, field: str) -> Response:
        stream = protocol.Fields(body).boolean("stream", True)  # Ollama streams unless told not to

        def line(text: str, done: bool) -> dict[str, Any]:
            value = {"role": "assistant", "content": text} if field == "message" else text
            return {"model": self.model_id, "created_at": _now_iso(), field: value, "done": done}

        if gen.messages is None and gen.prompt is None:  # no prompt: Ollama's answer to "load the model"
            return JSONResponse({**line("", True), "done_reason": "load"})
        job, _ = await self._start(gen)
        if not stream:
            text, end = await self._collect(request, job)
            return JSONResponse({**line(text, True), **_ollama_stats(end)})

        async def lines() -> AsyncIterator[str]:
            async for event in self._events(job):
                if isinstance(event, Piece):
                    yield _ndjson(line(event.text, False))
                elif isinstance(event, Finished):
                    yield _ndjson({**line("", True), **_ollama_stats(event)})
                elif isinstance(event, Failed):
                    yield _ndjson({"error": event.error.message})

        return self._stream(job, lines(), "application/x-ndjson")

    def _ollama_model(self) -> dict[str, Any]:
        info = self.model_info
        return {"name": self.model_id, "model": self.model_id, "modified_at": info["modified_at"],
                "size": info["size"], "digest": "", "details": info["details"]}  # fmt: skip

    async def ollama_tags(self, request: Request) -> Response:
        return JSONResponse({"models": [self._ollama_model()]})

    async def ollama_show(self, request: Request) -> Response:
        f = protocol.Fields(await self._json(request))
        name = f.get("model", str, "a string") or f.get("name", str, "a string")
        if not name:
            raise APIError(400, "model is required", param="model")
        if name.removesuffix(":latest") != self.model_id:
            raise APIError(404, f"model '{name[:200]}' not found", code="model_not_found")
        return JSONResponse({
            "modelfile": "", "parameters": "", "template": self.template_source,
            "details": self.model_info["details"], "model_info": self.arch_info,
            "capabilities": ["completion"], "modified_at": self.model_info["modified_at"],
        })  # fmt: skip

    async def ollama_ps(self, request: Request) -> Response:
        # Loaded for as long as the server runs: Ollama's "expires_at" of a model kept forever.
        model = {**self._ollama_model(), "expires_at": "2318-01-01T00:00:00Z", "size_vram": self.vram_bytes,
                 "context_length": self.n_ctx}  # fmt: skip
        return JSONResponse({"models": [model]})

    async def ollama_version(self, request: Request) -> Response:
        return JSONResponse({"version": tandem.__version__})

    # -- operations ------------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if not self.worker.alive:
            raise APIError(503, "the engine is not running", "server_error")
        busy = self.worker.busy_slots
        return JSONResponse({"status": "ok", "slots_idle": self.n_slots - busy, "slots_processing": busy,
                             "requests_waiting": self.worker.waiting})  # fmt: skip

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _quantization(file_type: Any) -> str:
    """llama.cpp's file type (general.file_type) by name, as Ollama shows it ("Q4_K_M"); "" if unknown."""
    try:
        return LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        return ""


def _parameter_size(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def create_app(worker: EngineWorker, llm: LLM, api_key: str | None = None) -> FastAPI:
    return Server(worker, llm, api_key).app
