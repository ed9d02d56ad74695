"""`create_app(lm)`: an OpenAI-compatible HTTP API (FastAPI) over the async engine.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both with
`stream: true` as server-sent events ending in `data: [DONE]`),
`GET /v1/models`, `GET /health`.

What a request goes through:
  1. validation (protocol.py)        -> 400 with an OpenAI error body
  2. model name                      -> 404 if it is not the one served
  3. tokenize (chat template for chat), check prompt + max_tokens fit the context -> 400
  4. AsyncEngine.submit              -> 503 when the waiting line is full
  5. text deltas from the engine thread, as SSE chunks or one JSON body.
A client that disconnects is aborted, which frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE
from phases.p3_5_paged_attention.engine import DEFAULT_MAX_RUNNING
from phases.p5_serving import protocol as P
from phases.p5_serving.async_engine import DEFAULT_MAX_WAITING, AsyncEngine, EngineFailed, QueueFull
from phases.p5_serving.samples import SAMPLES

DISCONNECT_POLL_S = 0.25   # how often a non-streamed request checks that its client is still there
RETRY_AFTER_S = 1          # what a 503 suggests


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


def _error(status: int, message: str, type: str, param=None, code=None, headers=None) -> JSONResponse:
    return JSONResponse(P.error_body(message, type, param, code), status_code=status, headers=headers)


def _sse(payload) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    body = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class _CompletionFormat:
    """/v1/completions: choices carry `text`."""
    prefix = "cmpl"

    def __init__(self, model: str, rid: str, created: int):
        self.model, self.rid, self.created = model, rid, created

    def opening(self, n: int) -> list:
        return []

    def chunk(self, d) -> P.CompletionResponse:
        choice = P.CompletionChoice(index=d.index, text=d.text, finish_reason=d.finish_reason)
        return P.CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=[choice])

    def usage_chunk(self, usage: P.Usage) -> P.CompletionResponse:
        return P.CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=[], usage=usage)

    def response(self, texts, reasons, usage) -> P.CompletionResponse:
        choices = [P.CompletionChoice(index=i, text=t, finish_reason=r) for i, (t, r) in enumerate(zip(texts, reasons))]
        return P.CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage)


class _ChatFormat(_CompletionFormat):
    """/v1/chat/completions: choices carry a `message`, chunks a `delta` (the first one names the role)."""
    prefix = "chatcmpl"

    def _chunk(self, choices, usage=None) -> P.ChatCompletionChunk:
        return P.ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage)

    def opening(self, n: int) -> list:
        return [self._chunk([P.ChatChunkChoice(index=i, delta=P.ChatDelta(role="assistant", content=""))])
                for i in range(n)]

    def chunk(self, d) -> P.ChatCompletionChunk:
        delta = P.ChatDelta(content=d.text) if d.text or d.finish_reason is None else P.ChatDelta()
        return self._chunk([P.ChatChunkChoice(index=d.index, delta=delta, finish_reason=d.finish_reason)])

    def usage_chunk(self, usage: P.Usage) -> P.ChatCompletionChunk:
        return self._chunk([], usage)

    def response(self, texts, reasons, usage) -> P.ChatCompletionResponse:
        choices = [P.ChatChoice(index=i, message=P.AssistantMessage(content=t), finish_reason=r)
                   for i, (t, r) in enumerate(zip(texts, reasons))]
        return P.ChatCompletionResponse(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage)


def create_app(lm, max_running: int = DEFAULT_MAX_RUNNING, max_waiting: int = DEFAULT_MAX_WAITING,
               block_size: int = DEFAULT_BLOCK_SIZE, n_blocks: int | None = None, engine=None,
               model_name: str | None = None, prefix_caching: bool = True,
               preemption_mode: str = "recompute") -> FastAPI:
    """The app for one loaded model. The engine thread starts and stops with the app (lifespan).

    The engine is the last of the line (phase 4.4's, samples.py) unless one is given: prefix caching on
    unless `prefix_caching=False`, preemption by recomputation unless `preemption_mode="swap"`."""
    engine = engine or SAMPLES.engine_class(lm, max_running=max_running, block_size=block_size, n_blocks=n_blocks,
                                            prefix_caching=prefix_caching, preemption_mode=preemption_mode)
    aengine = AsyncEngine(engine, max_waiting=max_waiting)
    served = model_name or lm.name
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.start()
        yield
        await aengine.stop()

    app = FastAPI(title="inference-engine-phases: OpenAI-compatible server", lifespan=lifespan)
    app.state.engine = aengine

    # --- errors, all in OpenAI's shape ---------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return _error(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        if err.get("type") == "json_invalid":
            return _error(400, f"the request body is not valid JSON: {err.get('ctx', {}).get('error', '')}",
                          "invalid_request_error")
        loc = [str(p) for p in err.get("loc", []) if p != "body"]
        param = ".".join(loc) or None
        msg = err.get("msg", "invalid request").removeprefix("Value error, ")
        return _error(400, f"{param}: {msg}" if param else msg, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(e.status_code, str(e.detail), kind)

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception):
        return _error(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    # --- small routes ------------------------------------------------------------------
    @app.get("/health")
    async def health():
        s = aengine.stats
        return {"status": "ok", "model": served, "running": s.running, "waiting": s.waiting,
                "queued_requests": aengine.n_queued, "max_waiting": aengine.max_waiting,
                "free_blocks": s.free_blocks, "total_blocks": s.total_blocks}

    @app.get("/v1/models")
    async def models():
        return P.ModelList(data=[P.ModelCard(id=served, created=started, max_model_len=lm.max_context)])

    # --- generation --------------------------------------------------------------------
    def check_model(name: str) -> None:
        if name != served:
            raise APIError(404, f"the model '{name}' does not exist here; this server serves '{served}'",
                           param="model", code="model_not_found")

    def max_tokens_for(n_prompt: int, requested: int | None, default: int, prompt_param: str) -> int:
        room = lm.max_context - n_prompt
        if room < 1:
            raise APIError(400, f"the prompt is {n_prompt} tokens; the model's context is {lm.max_context}",
                           param=prompt_param, code="context_length_exceeded")
        if requested is None:
            return min(default, room)
        if requested > room:
            raise APIError(400, f"{n_prompt} prompt tokens + max_tokens {requested} exceed the model's context "
                                f"of {lm.max_context} tokens", param="max_tokens", code="context_length_exceeded")
        return requested

    async def generate(request: Request, body: P._Sampling, prompt_ids: list[int], max_tokens: int, fmt_cls):
        n = body.n_samples
        try:
            req = await aengine.submit(prompt_ids, n=n, max_tokens=max_tokens, sampling=body.sampling_params(),
                                       ignore_eos=bool(body.ignore_eos))
        except QueueFull as e:
            raise APIError(503, str(e), "server_overloaded", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        except EngineFailed as e:
            raise APIError(503, str(e), "server_error", headers={"Retry-After": str(RETRY_AFTER_S)})
        except ValueError as e:  # the engine's own checks (e.g. bigger than the whole KV pool)
            raise APIError(400, str(e))
        fmt = fmt_cls(served, P.new_id(fmt_cls.prefix), int(time.time()))
        if body.stream:
            return StreamingResponse(stream(req, body, fmt), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await collect(request, req, body, fmt)

    async def stream(req, body: P._Sampling, fmt):
        n_tokens = [0] * req.n
        try:
            for chunk in fmt.opening(req.n):
                yield _sse(chunk)
            async for d in aengine.texts(req, body.stop):
                n_tokens[d.index] = d.n_tokens
                yield _sse(fmt.chunk(d))
            if body.include_usage:
                yield _sse(fmt.usage_chunk(P.Usage.of(len(req.prompt_ids), sum(n_tokens))))
        except EngineFailed as e:
            yield _sse(P.error_body(str(e), "server_error"))
        # A client that disconnects never gets here: the cancellation ran through
        # aengine.tokens(), whose `finally` aborted the request and freed its blocks.
        yield SSE_DONE

    async def collect(request: Request, req, body: P._Sampling, fmt):
        texts, reasons, n_tokens = [""] * req.n, [None] * req.n, [0] * req.n

        async def run():
            async for d in aengine.texts(req, body.stop):
                texts[d.index] += d.text
                n_tokens[d.index] = d.n_tokens
                reasons[d.index] = d.finish_reason or reasons[d.index]

        task = asyncio.ensure_future(run())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    task.cancel()  # aborts the request in the engine
                    raise APIError(499, "client closed the request", "client_closed")
            task.result()
        except EngineFailed as e:
            raise APIError(500, str(e), "server_error")
        finally:
            if not task.done():
                task.cancel()  # the handler itself was cancelled (shutdown)
        return fmt.response(texts, reasons, P.Usage.of(len(req.prompt_ids), sum(n_tokens)))

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        check_model(body.model)
        ids = lm.prompt_ids(body.prompt, chat=False)
        max_tokens = max_tokens_for(len(ids), body.max_tokens, P.DEFAULT_COMPLETION_MAX_TOKENS, "prompt")
        return await generate(request, body, ids, max_tokens, _CompletionFormat)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        check_model(body.model)
        tok = lm.tokenizer
        if getattr(tok, "chat_template", None) is None:
            raise APIError(400, f"'{served}' has no chat template; use /v1/completions", param="messages")
        text = tok.apply_chat_template(body.template_messages(), tokenize=False, add_generation_prompt=True,
                                       enable_thinking=False)  # Qwen3 would otherwise think at length first
        ids = tok(text, add_special_tokens=False)["input_ids"]  # the template has its special tokens already
        max_tokens = max_tokens_for(len(ids), body.requested_max_tokens(), P.DEFAULT_CHAT_MAX_TOKENS, "messages")
        return await generate(request, body, ids, max_tokens, _ChatFormat)

    return app
