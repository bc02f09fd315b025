"""An OpenAI-compatible HTTP server over the stored documents (`longctx serve`), on FastAPI.

- `GET /v1/models`: one model per stored document (or segmented collection) of the served model;
- `POST /v1/chat/completions`: `model` names a document; the messages after it are the
  conversation (system messages are ignored: the document's layout is fixed at ingest). Streams as
  server-sent events (`: keepalive` comments while a document is restored or a turn prefilled,
  then `data: {chunk}` lines and `data: [DONE]`) or answers in one JSON; `usage` counts the
  document and the conversation's reused tokens as `prompt_tokens_details.cached_tokens`; each
  choice (and the last stream chunk) carries the answer's `sources`.
- `GET /health`.

The model stays loaded. Restored documents stay warm in a byte-bounded LRU (`Warm`), dropped after
`keep_alive` seconds unused. Each conversation is a fork of its document's warm prefix
(`conversation.Conversation`, never a copy), kept after its answer under its history, so a
follow-up request whose messages extend that history prefills only its new turn. One MLX worker
thread serves requests one at a time in arrival order; a client that disconnects mid-answer stops
its answer at the next token and frees the worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse

from longctx import __version__
from longctx.errors import ContextLengthError, EntryNotFound, LongctxError
from longctx.runtime import models
from longctx.store import Store, groups
from longctx import multidoc
from longctx import session
from longctx.conversation import Conversation
from longctx import asking
from longctx.session import Answer

_log = logging.getLogger("longctx.server")
KEEPALIVE_SECONDS = 5.0
MAX_CONVERSATIONS = 32  # forks kept for follow-ups, least recently used dropped first


class ApiError(Exception):
    """An error with OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None, kind: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.status, self.code, self.param, self.kind = status, code, param, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Request:
    """A validated chat completion request."""

    model: str
    history: list[tuple[str, str]]  # earlier (question, answer) turns
    question: str
    stream: bool
    max_tokens: int
    temperature: float
    stop: list[str]
    seed: int | None
    include_usage: bool


def parse(body: bytes, max_context: int) -> Request:
    """Validate a /v1/chat/completions body (ApiError 400 on anything malformed)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "The request body is not valid JSON.") from None
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required: the name or id of a stored document (GET /v1/models).", param="model")
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' is required: a non-empty list.", param="messages")
    turns = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise ApiError(400, "Each message needs a role (system, user or assistant) and content.", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: their text
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise ApiError(400, "Each message's content must be text.", param="messages")
        if m["role"] in ("user", "assistant"):
            turns.append((m["role"], content))
    if not turns or turns[-1][0] != "user":
        raise ApiError(400, "The last message must be the user's question.", param="messages")
    history, pending = [], None
    for role, content in turns[:-1]:
        if role == "user":
            if pending is not None:
                raise ApiError(400, "User and assistant messages must alternate.", param="messages")
            pending = content
        else:
            if pending is None:
                raise ApiError(400, "An assistant message must follow a user message.", param="messages")
            history.append((pending, content))
            pending = None
    if pending is not None:
        raise ApiError(400, "User and assistant messages must alternate.", param="messages")
    max_tokens = data.get("max_completion_tokens", data.get("max_tokens", 512))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= max_context:
        raise ApiError(400, f"'max_tokens' must be an integer from 1 to {max_context}.", param="max_tokens")
    temperature = data.get("temperature", 0.0)
    if temperature is None:
        temperature = 0.0
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not 0 <= temperature <= 2:
        raise ApiError(400, "'temperature' must be a number from 0 to 2.", param="temperature")
    stop = data.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise ApiError(400, "'stop' must be a string or a list of up to 4 strings.", param="stop")
    seed = data.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ApiError(400, "'seed' must be an integer.", param="seed")
    options = data.get("stream_options") or {}
    return Request(
        model,
        history,
        turns[-1][1],
        bool(data.get("stream", False)),
        max_tokens,
        float(temperature),
        stop,
        seed,
        bool(isinstance(options, dict) and options.get("include_usage")),
    )


class Warm:
    """Restored document caches, least recently used first out, within `max_bytes`; entries
    unused for `keep_alive` seconds are dropped by `expire`."""

    def __init__(self, max_bytes: int, keep_alive: float):
        self.max_bytes, self.keep_alive = max_bytes, keep_alive
        self._items: OrderedDict[str, tuple[list, int, float]] = OrderedDict()

    def get(self, entry, load) -> list:
        if entry.id in self._items:
            cache, size, _ = self._items.pop(entry.id)
        else:
            cache = load()
            size = sum(c.nbytes for c in cache)
        self._items[entry.id] = (cache, size, time.monotonic())
        while len(self._items) > 1 and self.bytes > self.max_bytes:
            self._items.popitem(last=False)
        return cache

    @property
    def bytes(self) -> int:
        return sum(size for _, size, _ in self._items.values())

    def ids(self) -> list[str]:
        return list(self._items)

    def expire(self) -> list[str]:
        now = time.monotonic()
        gone = [k for k, (_, _, used) in self._items.items() if now - used > self.keep_alive]
        for k in gone:
            del self._items[k]
        return gone


class Engine:
    """The loaded model, the warm documents and the conversations, used from one worker thread."""

    def __init__(self, model: str | None, cache_bytes: int, keep_alive: float):
        self.ref = models.resolve(model)
        self.lm = models.load(self.ref)
        self.warm = Warm(cache_bytes, keep_alive)
        self.conversations: OrderedDict[tuple, object] = OrderedDict()
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="longctx-mlx")
        self.lock = threading.Lock()

    def documents(self) -> list:
        """Every stored document (entry or segmented group) of the served model, newest first."""
        store = Store(cleanup=False)
        try:
            found = [*groups.groups(store), *(e for e in store.entries() if not e.group)]
        finally:
            store.close()
        mine = [t for t in found if t.weights_sha256 == self.ref.weights_sha256]
        return sorted(mine, key=lambda t: t.created, reverse=True)

    def find(self, name: str):
        store = Store(cleanup=False)
        try:
            target = multidoc.find(store, name)
        except EntryNotFound:
            raise ApiError(
                404, f"The document '{name}' does not exist; GET /v1/models lists them.", code="model_not_found", param="model"
            ) from None
        finally:
            store.close()
        return target

    def restore(self, entry) -> list:
        def load():
            store = Store(cleanup=False)
            try:
                session.check_same_model(entry, self.ref)
                return session.restore(entry, self.lm, store)
            finally:
                store.close()

        return self.warm.get(entry, load)

    def conversation(self, entry, history: list[tuple[str, str]]):
        """A conversation holding `history`: a kept one (popped: it becomes this request's), or a
        new fork of the warm prefix with the history fed; and how many of its tokens were reused."""
        key = (entry.id, tuple(history))
        prefix = self.restore(entry)
        conv = self.conversations.pop(key, None)
        if conv is not None and conv.prefix is prefix:
            return conv, conv.tokens
        conv = Conversation(self.lm, entry, prefix)
        if history:
            conv.extend(history)
        return conv, 0

    def keep(self, conv) -> None:
        key = (conv.entry.id, tuple((t.question, t.answer) for t in conv.turns))
        self.conversations[key] = conv
        while len(self.conversations) > MAX_CONVERSATIONS:
            self.conversations.popitem(last=False)

    def answer(self, req: Request, emit, cancelled: threading.Event) -> dict:
        """Answer `req` on the worker thread: `emit(kind, value)` with "ready" (prefill done),
        "text" pieces; returns the final facts (finish reason, usage, sources)."""
        target = self.find(req.model)
        sources = []
        if isinstance(target, multidoc.Group):  # segmented: one question at a time, from the best segment
            if req.history:
                raise ApiError(
                    400,
                    f"'{target.name}' is split into segments: it answers one question "
                    "at a time (send only the last user message).",
                    param="messages",
                )
            answer = session.Answer()
            count = 0
            for piece in asking.ask(
                req.question, target.id, self.ref.spec, req.max_tokens, req.temperature, req.seed, answer=answer
            ):
                if cancelled.is_set():
                    break
                if count == 0:
                    emit("ready", None)
                count += 1
                emit("text", piece)
            entry = answer.entry
            sources = [{"file": s, "entry": entry.id, "segment": entry.segment} for s in answer.sources]
            used = entry.tokens + len(session.question_suffix(self.lm, entry, req.question))
            return {
                "finish": "stop",
                "prompt_tokens": used,
                "cached_tokens": entry.tokens,
                "completion_tokens": len(self.lm.tokenizer.encode(answer.text, add_special_tokens=False)),
                "sources": sources,
            }
        entry = target
        conv, reused = self.conversation(entry, req.history)
        ids, _ = conv.fits(req.question, min(req.max_tokens, 1))
        before = conv.tokens
        max_tokens = min(req.max_tokens, conv.room_left - len(ids))
        if max_tokens < 1:
            raise ApiError(
                400,
                f"The conversation fills the {self.lm.context_length:,}-token context after '{entry.name}'; start a new one.",
                code="context_length_exceeded",
                param="messages",
            )

        answer = Answer(entry=entry)
        stream = conv.ask(req.question, max_tokens, req.temperature, req.seed, answer)
        finish = "length"
        try:
            first = True
            for piece in stream:
                if first:
                    emit("ready", None)
                    first = False
                if cancelled.is_set():
                    finish = "cancelled"
                    break
                emit("text", piece)
        finally:
            stream.close()
        turn = conv.turns[-1]
        if finish != "cancelled" and len(turn.answer_ids) < max_tokens:
            finish = "stop"
        self.keep(conv)
        sources = [
            {
                "file": entry.name,
                "pages": entry.pages,
                "entry": entry.id,
                "segment": entry.segment if entry.segment >= 0 else None,
            }
        ]
        return {
            "finish": finish,
            "prompt_tokens": entry.tokens + before + len(turn.prompt_ids),
            "cached_tokens": entry.tokens + reused,
            "completion_tokens": len(turn.answer_ids),
            "sources": sources,
        }


class StopFilter:
    """Cuts streamed text at the first stop string, holding back what could start one."""

    def __init__(self, stops: list[str]):
        self.stops, self.held, self.done = stops, "", False

    def feed(self, piece: str) -> str:
        if self.done:
            return ""
        text = self.held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.done = True
            self.held = ""
            return text[: min(hits)]
        keep = max((len(s) - 1 for s in self.stops), default=0)
        out, self.held = (text[:-keep], text[-keep:]) if keep and len(text) > keep else ((text, "") if not keep else ("", text))
        return out

    def flush(self) -> str:
        out, self.held = ("" if self.done else self.held), ""
        return out


def create_app(engine: Engine, api_key: str | None = None, allowed_origins: list[str] | None = None):
    """The FastAPI application serving `engine`."""
    app = FastAPI(title="longctx", version=__version__)
    if allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"])

    @app.middleware("http")
    async def authorize(request: HttpRequest, call_next):
        if api_key and request.url.path.startswith("/v1") and request.method != "OPTIONS":
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                err = ApiError(
                    401,
                    "Missing or wrong API key (Authorization: Bearer ...).",
                    code="invalid_api_key",
                    kind="authentication_error",
                )
                return JSONResponse(err.body(), status_code=401)
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(_request, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status)

    async def expire_loop():
        while True:
            await asyncio.sleep(min(30.0, max(1.0, engine.warm.keep_alive / 2)))
            await asyncio.get_running_loop().run_in_executor(engine.worker, engine.warm.expire)

    @app.on_event("startup")
    async def start_expiry():
        app.state.expiry = asyncio.create_task(expire_loop())

    @app.get("/health")
    async def health():
        return {
            "status": "ok",
            "model": engine.ref.model_id,
            "warm_documents": engine.warm.ids(),
            "warm_bytes": engine.warm.bytes,
        }

    @app.get("/v1/models")
    async def list_models():
        docs = engine.documents()
        names = [t.name for t in docs]
        data = [
            {
                "id": t.name if names.count(t.name) == 1 else t.id,
                "object": "model",
                "created": int(t.created),
                "owned_by": "longctx",
                "name": t.name,
                "document_id": t.id,
                "tokens": t.tokens,
                "llm": engine.ref.model_id,
            }
            for t in docs
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest):
        req = parse(await request.body(), engine.lm.context_length)
        engine.find(req.model)  # 404 before anything is queued
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()

        def emit(kind, value):
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))

        def work():
            try:
                emit("done", engine.answer(req, emit, cancelled))
            except ApiError as err:
                emit("error", err)
            except ContextLengthError as err:
                emit("error", ApiError(400, str(err), code="context_length_exceeded", param="messages"))
            except LongctxError as err:
                emit("error", ApiError(400, str(err)))
            except Exception as err:  # noqa: BLE001 - reported to the client, the server goes on
                _log.exception("answer failed")
                emit("error", ApiError(500, f"Internal error: {err}", kind="server_error"))

        loop.run_in_executor(engine.worker, work)
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        stops = StopFilter(req.stop)

        def chunk(delta: dict, finish=None, **extra) -> str:
            body = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": req.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}],
            }
            return f"data: {json.dumps(body)}\n\n"

        def usage(facts: dict) -> dict:
            return {
                "prompt_tokens": facts["prompt_tokens"],
                "completion_tokens": facts["completion_tokens"],
                "total_tokens": facts["prompt_tokens"] + facts["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": facts["cached_tokens"]},
            }

        if not req.stream:
            text = ""
            while True:
                kind, value = await queue.get()
                if kind == "text":
                    text += stops.feed(value)
                elif kind == "error":
                    raise value
                elif kind == "done":
                    facts = value
                    break
            text += stops.flush()
            finish = "stop" if stops.done else facts["finish"]
            return {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": req.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": finish,
                        "sources": facts["sources"],
                    }
                ],
                "usage": usage(facts),
            }

        async def events():
            item = None
            try:
                yield chunk({"role": "assistant", "content": ""})
                while True:
                    if item is None:
                        yield ": keepalive\n\n"
                    else:
                        kind, value = item
                        if kind == "ready":
                            pass
                        elif kind == "text":
                            piece = stops.feed(value)
                            if piece:
                                yield chunk({"content": piece})
                            if stops.done:
                                cancelled.set()
                        elif kind == "error":
                            body = value.body()
                            yield f"data: {json.dumps(body)}\n\n"
                            break
                        elif kind == "done":
                            rest = stops.flush()
                            if rest:
                                yield chunk({"content": rest})
                            finish = "stop" if stops.done else value["finish"]
                            yield chunk({}, finish, sources=value["sources"])
                            if req.include_usage:
                                body = {
                                    "id": rid,
                                    "object": "chat.completion.chunk",
                                    "created": created,
                                    "model": req.model,
                                    "choices": [],
                                    "usage": usage(value),
                                }
                                yield f"data: {json.dumps(body)}\n\n"
                            yield "data: [DONE]\n\n"
                            break
                    item = await _next(queue)
            finally:  # a client gone mid-stream stops the answer at its next token
                cancelled.set()

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    return app


async def _next(queue: asyncio.Queue) -> tuple | None:
    """The next event, or None after KEEPALIVE_SECONDS without one (a keepalive is due)."""
    try:
        return await asyncio.wait_for(queue.get(), KEEPALIVE_SECONDS)
    except asyncio.TimeoutError:
        return None


def serve(
    model: str | None,
    host: str,
    port: int,
    cache_bytes: int,
    keep_alive: float,
    api_key: str | None,
    allowed_origins: list[str] | None,
    ready=None,
) -> None:
    """Load the model and serve until interrupted (`ready(url)` once listening)."""
    import uvicorn

    engine = Engine(model, cache_bytes, keep_alive)
    app = create_app(engine, api_key, allowed_origins)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    if ready is not None:

        @app.on_event("startup")
        async def announce():
            ready(f"http://{host}:{port}")

    server.run()
