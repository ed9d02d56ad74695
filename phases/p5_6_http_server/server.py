"""`create_app(lm)`: an OpenAI-compatible HTTP API (FastAPI) over the async engine.

Routes: `POST /v1/completions` and `/v1/chat/completions` (`stream: true`: server-sent events ending in
`data: [DONE]`), `GET /v1/models`, `/health`, `/metrics`, `/pool` (its stream and files), and
`POST /reset_prefix_cache`. The routes are module-level functions that read one server's `ServerState`
on `app.state.server`, so every server in one process (tests start several) has its own.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse

from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE
from phases.p3_6_batched_engine.engine import DEFAULT_MAX_RUNNING
from phases.p3_8_chunked_prefill.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS
from phases.p4_5_speculative_decoding.engine import DEFAULT_NUM_SPECULATIVE_TOKENS
from phases.p5_1_served_engine.engine import ServingEngine
from phases.p5_2_async_engine.async_engine import DEFAULT_MAX_WAITING, EngineFailed, QueueFull
from phases.p5_3_metrics.metrics import exposition, metrics_registry
from phases.p5_3_metrics.vllm_metrics import VllmCollector
from phases.p5_4_pool_view.kv_events import (DEFAULT_KV_EVENTS_TOPIC, EventRecordingAllocator, ZmqEventPublisher,
                                             reset_prefix_cache)
from phases.p5_4_pool_view.pool_stream import POOL_PAGE, PoolWatch
from phases.p5_4_pool_view.watched import WatchedAsyncEngine
from phases.p5_5_openai_api import protocol as P
from phases.p5_5_openai_api.errors import APIError, add_error_handlers
from phases.p5_5_openai_api.formats import ChatFormat, CompletionFormat

DISCONNECT_POLL_S = 0.25   # how often a non-streamed request checks that its client is still there
RETRY_AFTER_S = 1          # what a 503 suggests
SSE_DONE = "data: [DONE]\n\n"
POOL_FILES = {"pool.css": "text/css", "pool.js": "text/javascript"}


@dataclass
class ServerState:
    """One server: what its routes read."""
    lm: object               # the LoadedModel
    aengine: WatchedAsyncEngine
    served: str              # the model name clients must send
    started: int             # unix time, for /v1/models
    metrics: object          # its prometheus-client registry
    pool: PoolWatch          # the /pool pages' frames
    kv_events: ZmqEventPublisher | None = None   # None: events off


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _sse(payload) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    body = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {body}\n\n"


router = APIRouter()


# --- small routes ----------------------------------------------------------------------
@router.get("/health")
async def health(request: Request):
    state = _state(request)
    s, aengine = state.aengine.stats, state.aengine
    body = {"status": "ok", "model": state.served, **s.as_dict(), "queued_requests": aengine.n_queued,
            "max_waiting": aengine.max_waiting, "tokens_per_s": aengine.token_rate.per_second()}
    group = getattr(aengine.engine, "tensor_parallel", None)
    if group is not None:
        body["tensor_parallel"] = workers = group.health()
        if workers["error"]:          # the engine can run nothing more: a load balancer should stop sending
            return JSONResponse(body | {"status": "unhealthy"}, status_code=503)
    return body


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    body, content_type = exposition(_state(request).metrics)
    return Response(body, media_type=content_type)


# --- the pool, live ----------------------------------------------------------------------
@router.get("/pool", response_class=FileResponse, include_in_schema=False)   # a page, not the API
async def pool_page(request: Request) -> FileResponse:
    return FileResponse(POOL_PAGE / "index.html", media_type="text/html")


@router.get("/pool/stream", include_in_schema=False)
async def pool_stream(request: Request) -> StreamingResponse:
    """One frame per engine step, as server-sent events, while the page is open (pool_stream.py)."""
    return StreamingResponse(_state(request).pool.frames(request.is_disconnected), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


@router.get("/pool/{name}", response_class=FileResponse, include_in_schema=False)
async def pool_file(name: str) -> FileResponse:
    if name not in POOL_FILES:
        raise APIError(404, f"no file '{name}' here", "not_found_error")
    return FileResponse(POOL_PAGE / name, media_type=POOL_FILES[name])


@router.post("/reset_prefix_cache", include_in_schema=False)   # an operator's route, not the OpenAI API
async def reset_cache(request: Request) -> dict:
    """Forget every cached block (vLLM's route), on the engine thread; refused while a block is in use."""
    state = _state(request)
    allocator = state.aengine.engine.allocator
    if not hasattr(allocator, "evictor"):
        raise APIError(400, "prefix caching is off on this server")
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def reset() -> None:   # engine thread
        cleared = reset_prefix_cache(allocator)
        if state.kv_events is not None:
            state.kv_events(state.aengine.engine, [])   # AllBlocksCleared goes out now, not after the next step
        loop.call_soon_threadsafe(done.set_result, cleared)

    state.aengine.call_on_engine(reset)
    if not await done:
        raise APIError(409, "blocks are in use; reset the prefix cache when no request runs", code="blocks_in_use")
    return {"reset": True}


@router.get("/v1/models")
async def models(request: Request) -> P.ModelList:
    state = _state(request)
    return P.ModelList(data=[P.ModelCard(id=state.served, created=state.started, max_model_len=state.lm.max_context)])


# --- generation ------------------------------------------------------------------------
@router.post("/v1/completions")
async def completions(body: P.CompletionRequest, request: Request):
    state = _state(request)
    _check_model(state, body.model)
    ids = _tokenize(lambda: state.lm.prompt_ids(body.prompt, chat=False), "prompt")
    max_tokens = _max_tokens_for(state, len(ids), body.max_tokens, P.DEFAULT_COMPLETION_MAX_TOKENS, "prompt")
    return await _generate(request, state, body, ids, max_tokens, CompletionFormat)


@router.post("/v1/chat/completions")
async def chat_completions(body: P.ChatCompletionRequest, request: Request):
    state = _state(request)
    _check_model(state, body.model)
    tok = state.lm.tokenizer
    if getattr(tok, "chat_template", None) is None:
        raise APIError(400, f"'{state.served}' has no chat template; use /v1/completions", param="messages")

    def template_ids() -> list[int]:
        text = tok.apply_chat_template(body.template_messages(), tokenize=False, add_generation_prompt=True,
                                       enable_thinking=False)  # Qwen3 would otherwise think at length first
        return tok(text, add_special_tokens=False)["input_ids"]  # the template has its special tokens already

    ids = _tokenize(template_ids, "messages")
    max_tokens = _max_tokens_for(state, len(ids), body.requested_max_tokens(), P.DEFAULT_CHAT_MAX_TOKENS, "messages")
    return await _generate(request, state, body, ids, max_tokens, ChatFormat)


def _check_model(state: ServerState, name: str) -> None:
    if name != state.served:
        raise APIError(404, f"the model '{name}' does not exist here; this server serves '{state.served}'",
                       param="model", code="model_not_found")


def _tokenize(make_ids, param: str) -> list[int]:
    """Token ids, or a 400 naming `param` for text the tokenizer cannot take (e.g. a lone UTF-16 surrogate)."""
    try:
        ids = make_ids()
    except (ValueError, TypeError, UnicodeError) as e:
        raise APIError(400, f"{param}: the text cannot be tokenized: {e}", param=param)
    if not ids:
        raise APIError(400, f"{param}: the text tokenizes to nothing", param=param)
    return ids


def _max_tokens_for(state: ServerState, n_prompt: int, requested: int | None, default: int, prompt_param: str) -> int:
    context = state.lm.max_context
    room = context - n_prompt
    if room < 1:
        raise APIError(400, f"the prompt is {n_prompt} tokens; the model's context is {context}",
                       param=prompt_param, code="context_length_exceeded")
    if requested is None:
        return min(default, room)
    if requested > room:
        raise APIError(400, f"{n_prompt} prompt tokens + max_tokens {requested} exceed the model's context "
                            f"of {context} tokens", param="max_tokens", code="context_length_exceeded")
    return requested


async def _generate(request: Request, state: ServerState, body: P._Sampling, prompt_ids: list[int],
                    max_tokens: int, fmt_cls):
    fmt = fmt_cls(state.served, P.new_id(fmt_cls.prefix), int(time.time()))
    group = getattr(state.aengine.engine, "tensor_parallel", None)
    broken = group.health()["error"] if group is not None else None
    if broken:
        raise APIError(503, f"the engine cannot run: {broken}", "server_error")
    try:
        req = await state.aengine.submit(prompt_ids, n=body.n_samples, max_tokens=max_tokens,
                                         sampling=body.sampling_params(), ignore_eos=bool(body.ignore_eos),
                                         label=fmt.rid)
    except QueueFull as e:
        raise APIError(503, str(e), "server_overloaded", code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
    except EngineFailed as e:
        raise APIError(503, str(e), "server_error", headers={"Retry-After": str(RETRY_AFTER_S)})
    except ValueError as e:  # the engine's own checks: SamplingParams (names its param), the KV pool, n
        raise APIError(400, str(e), param=getattr(e, "param", None))
    if body.stream:
        return StreamingResponse(_stream(state.aengine, req, body, fmt), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await _collect(request, state.aengine, req, body, fmt)


async def _stream(aengine: WatchedAsyncEngine, req, body: P._Sampling, fmt):
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
    # A client that disconnects never gets here: aengine.tokens()'s `finally` aborted its request.
    yield SSE_DONE


async def _collect(request: Request, aengine: WatchedAsyncEngine, req, body: P._Sampling, fmt):
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


# --- the app -------------------------------------------------------------------------
@asynccontextmanager
async def lifespan(app: FastAPI):
    """The engine thread starts and stops with the app."""
    state = app.state.server
    state.aengine.start()
    yield
    await state.aengine.stop()
    if state.kv_events is not None:
        state.kv_events.close()
    group = getattr(state.aengine.engine, "tensor_parallel", None)
    if group is not None:
        group.close()                 # the workers go with the server


def create_app(lm, max_running: int = DEFAULT_MAX_RUNNING, max_waiting: int = DEFAULT_MAX_WAITING,
               block_size: int = DEFAULT_BLOCK_SIZE, n_blocks: int | None = None, engine=None,
               model_name: str | None = None, prefix_caching: bool = True, preemption_mode: str = "recompute",
               max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, speculative: str | None = None,
               num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS, draft_layers: int | None = None,
               kv_events_endpoint: str | None = None, kv_events_topic: str = DEFAULT_KV_EVENTS_TOPIC,
               tensor_parallel=None) -> FastAPI:
    """The app for one loaded model, on a `ServingEngine` (phase 5.1) unless `engine` is given; the README
    says what each option turns on. `kv_events_endpoint` (a ZMQ address such as "tcp://*:5557") runs the
    engine on an `EventRecordingAllocator`; `tensor_parallel` (the group phase 4.7's `launch` returned with
    `lm`) runs the model across its workers, and the server closes the group when it stops."""
    events_on = kv_events_endpoint is not None
    if events_on and (engine is not None or not prefix_caching):
        raise ValueError("KV events come from the prefix cache of the engine create_app builds: "
                         "leave prefix caching on and pass no engine")
    if engine is None:
        if tensor_parallel is not None and speculative == "draft":
            raise ValueError("speculative='draft' is not supported under tensor parallelism; use 'ngram'")
        allocator = EventRecordingAllocator.for_model(lm, block_size=block_size, n_blocks=n_blocks) \
            if events_on else None
        engine = ServingEngine(lm, max_running=max_running, block_size=block_size, n_blocks=n_blocks,
                               prefix_caching=prefix_caching, preemption_mode=preemption_mode,
                               max_num_batched_tokens=max_num_batched_tokens, speculative=speculative,
                               num_speculative_tokens=num_speculative_tokens, draft_layers=draft_layers,
                               allocator=allocator, group=tensor_parallel,
                               **({} if tensor_parallel is None else {"cuda_graphs": False}))
    aengine = WatchedAsyncEngine(engine, max_waiting=max_waiting)
    served = model_name or lm.name
    kv_events = None
    if events_on:
        kv_events = ZmqEventPublisher(allocator, kv_events_endpoint, kv_events_topic)
        aengine.add_step_observer(kv_events)
    app = FastAPI(title="inference-engine-phases: OpenAI-compatible server", lifespan=lifespan)
    app.state.server = ServerState(lm, aengine, served, int(time.time()),
                                   metrics_registry(aengine, VllmCollector(aengine, served)), PoolWatch(aengine),
                                   kv_events)
    app.state.engine = aengine
    add_error_handlers(app)
    app.include_router(router)
    return app
