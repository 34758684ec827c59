"""A retriever behind the retrieval-service protocol (FastAPI; `mhgpo serve-retriever` runs it with uvicorn).

`POST /retrieve` takes `{"queries": [...], "topk": k, "return_scores": bool}` and answers
`{"result": [[ITEM, ...], ...]}`: per query, best first, `{"document": {"id", "contents"}, "score": s}` with
scores, the document alone without; `contents` is `"Title"\\ntext` (the shape of Search-R1's retrieval server, which
`mhgpo.retrieval.http.HTTPRetriever` reads). `GET /health` names the retriever and its corpus.

Everything a client controls is bounded (`Limits`), and a refusal is a 4xx whose `detail` says which limit, never
echoing the request, a path or a traceback:
- one request: at most `max_queries` queries (413) of `max_query_chars` characters each (413), `topk` in
  1..`max_topk` (422), `max_passages` passages in its answer (queries x topk, 413), a body that is such a JSON
  object (422, naming the field);
- its bytes: a declared Content-Length over `max_body_bytes` is refused before the body is read, a chunked body as
  soon as it passes the limit (413, and the connection is closed: nothing more is read); line and headers at most
  `max_header_bytes` (431; 400 when they come in several reads, refused by h11 before they are complete);
- its time: the headers must be in within `header_timeout` seconds of the connection (or of the previous answer on
  it), else the connection is closed; the body within `body_timeout` seconds of the headers (408);
- connections: at most `max_connections` at once (one more is answered 503 and closed), an idle one is closed after
  `keep_alive` seconds;
- the search: requests are served by a thread pool and take turns on one lock (the index and the result cache are
  shared), `turn_queries` queries a turn, in the order they asked, so a large request cannot hold the others back;
  the result cache holds at most `cache_bytes`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from typing import Any

from mhgpo.config import ServeConfig
from mhgpo.retrieval.bm25 import CachedRetriever
from mhgpo.retrieval.http import contents_of

__all__ = ["DEFAULT_LIMITS", "Limits", "create_app", "server"]

try:  # the optional extra `serve`
    import anyio
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict
    from starlette.requests import ClientDisconnect
except ImportError as _missing:  # pragma: no cover - checked by require_server
    FastAPI = None  # type: ignore[assignment,misc]
    _IMPORT_ERROR: ImportError | None = _missing
else:
    _IMPORT_ERROR = None

    class RetrieveRequest(BaseModel):
        """The body of `POST /retrieve` (other keys are ignored)."""

        model_config = ConfigDict(extra="ignore")
        queries: list[str]
        topk: int | None = None
        return_scores: bool = False


# What one request may ask and send, how long it may take, and how many connections are served at once: the keys of
# `ServeConfig` (which documents them and holds their defaults, typed once), and the queries searched in one turn of
# the search lock.
LIMIT_KEYS = (
    "max_queries", "max_topk", "max_passages", "max_query_chars", "max_body_bytes", "max_header_bytes",
    "default_topk", "cache_bytes", "header_timeout", "body_timeout", "keep_alive", "max_connections",
)  # fmt: skip
Limits = dataclasses.make_dataclass(
    "Limits",
    [
        (f.name, f.type, dataclasses.field(default=f.default))
        for f in dataclasses.fields(ServeConfig)
        if f.name in LIMIT_KEYS
    ]
    + [("turn_queries", int, dataclasses.field(default=32))],
    frozen=True,
)
Limits.__module__ = __name__


DEFAULT_LIMITS = Limits()


def require_server() -> None:
    """InputError naming the extra to install when FastAPI is missing."""
    if _IMPORT_ERROR is not None:
        from mhgpo.errors import InputError

        raise InputError(
            f"serving a retriever needs FastAPI and uvicorn ({_IMPORT_ERROR.name} is not installed): "
            f"pip install 'mhgpo[serve]'"
        )


def document(passage: Any) -> dict[str, str]:
    """A passage as a document of the protocol."""
    return {"id": passage.id, "contents": contents_of(passage)}


def answer(found: list[list[tuple[Any, float]]], return_scores: bool) -> dict[str, Any]:
    """The body of a `/retrieve` answer from each query's (passage, score) pairs."""
    if return_scores:
        return {"result": [[{"document": document(p), "score": s} for p, s in hits] for hits in found]}
    return {"result": [[document(p) for p, _ in hits] for hits in found]}


class Turns:
    """A lock granted in the order it was asked for (`threading.Lock` is not: a thread that releases it and asks
    again at once usually gets it back before the threads already waiting), so that the turns of a large request
    alternate with those of the requests that came meanwhile."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._queue: collections.deque[object] = collections.deque()

    def __enter__(self) -> None:
        me = object()
        with self._changed:
            self._queue.append(me)
            while self._queue[0] is not me:
                self._changed.wait()

    def __exit__(self, *exc: Any) -> None:
        with self._changed:
            self._queue.popleft()
            self._changed.notify_all()


def check_request(req: Any, k: int, limits: Limits) -> None:
    """HTTPException (413, 422) when the request asks for more than `limits` allow."""
    n = len(req.queries)
    if n > limits.max_queries:
        raise HTTPException(413, f"{n} queries in one request; at most {limits.max_queries} (split the request)")
    if not 1 <= k <= limits.max_topk:
        raise HTTPException(422, f"topk={k}: must be between 1 and {limits.max_topk}")
    if n * k > limits.max_passages:
        raise HTTPException(
            413,
            f"{n} queries x topk {k} = {n * k} passages in one answer; at most {limits.max_passages} (split the request)",
        )
    for i, query in enumerate(req.queries):
        if len(query) > limits.max_query_chars:
            raise HTTPException(413, f"queries[{i}] has {len(query)} characters; at most {limits.max_query_chars}")


def create_app(retriever: CachedRetriever, limits: Limits = DEFAULT_LIMITS, name: str = "") -> Any:
    """The FastAPI application serving `retriever` (`name`: what /health calls its corpus), within `limits`."""
    require_server()
    turns = Turns()
    retriever.bound_cache(limits.cache_bytes)
    app = FastAPI(title="mhgpo retriever", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limits=limits)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: Any) -> Any:  # short, without echoing the body
        return JSONResponse({"detail": validation_detail(exc.errors())}, status_code=422)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "retriever": retriever.kind,
            "corpus": name,
            "passages": len(retriever),
            "sha256": retriever.fingerprint.get("sha256"),
            "max_queries": limits.max_queries,
            "max_topk": limits.max_topk,
            "max_passages": limits.max_passages,
            "max_query_chars": limits.max_query_chars,
        }

    @app.post("/retrieve")
    def retrieve(req: RetrieveRequest) -> Any:  # a plain def: FastAPI runs it in its thread pool
        k = limits.default_topk if req.topk is None else req.topk
        check_request(req, k, limits)
        found: list[list[tuple[Any, float]]] = []
        for start in range(0, len(req.queries), limits.turn_queries):
            part = req.queries[start : start + limits.turn_queries]
            with turns:
                if req.return_scores:
                    found += retriever.search_scored(part, k)
                else:
                    found += [[(p, 0.0) for p in hits] for hits in retriever.search_batch(part, k)]
        return JSONResponse(answer(found, req.return_scores))  # (rendered here, in the thread pool)

    return app


class BodyLimit:
    """ASGI middleware that refuses a request line and headers over `max_header_bytes` (431) and reads a request's
    body before the application does, within `max_body_bytes` and `body_timeout`: a declared Content-Length over
    the limit is refused before anything is read, a chunked body as soon as the bytes read pass it (413), a body
    still incomplete at its deadline with a 408. A refusal closes the connection: the rest is never read."""

    def __init__(self, app: Any, limits: Limits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body, refusal = None, self._refusal(scope)
        if refusal is None:
            try:
                body, refusal = await self._read(scope, receive)
            except ClientDisconnect:  # gone: nobody to answer
                return
        if refusal is not None:
            status, detail = refusal
            closing = JSONResponse({"detail": detail}, status_code=status, headers={"Connection": "close"})
            await closing(scope, receive, send)
        else:
            await self.app(scope, _replay(body or b"", receive), send)

    def _refusal(self, scope: dict[str, Any]) -> tuple[int, str] | None:
        """(status, detail) for a request whose headers, or declared body, are over the limits."""
        head = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        head += sum(4 + len(name) + len(value) for name, value in scope["headers"])
        if head > self.limits.max_header_bytes:  # (h11 refuses more only when it comes in several reads)
            return 431, f"request line and headers of {head} bytes; at most {self.limits.max_header_bytes}"
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limits.max_body_bytes:
            return 413, f"request body of {int(declared)} bytes; at most {self.limits.max_body_bytes}"
        return None

    async def _read(self, scope: dict[str, Any], receive: Any) -> tuple[bytes, tuple[int, str] | None]:
        """The body, read until its end, its limit or its deadline; (what was read, the refusal or None)."""
        body, limit = bytearray(), self.limits.max_body_bytes
        try:
            with anyio.fail_after(self.limits.body_timeout):
                async for chunk in Request(scope, receive).stream():
                    body += chunk
                    if len(body) > limit:
                        return bytes(body), (413, f"request body of more than {limit} bytes; at most {limit}")
        except TimeoutError:
            detail = f"request body incomplete after {self.limits.body_timeout:g} s ({len(body)} bytes)"
            return bytes(body), (408, detail)
        return bytes(body), None


def _replay(body: bytes, receive: Any) -> Any:
    """An ASGI `receive` that gives `body` whole, then what `receive` gives (a disconnect)."""
    given = False

    async def replay() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def validation_detail(errors: list[dict[str, Any]]) -> str:
    """FastAPI's validation errors in one line: `body.topk: Input should be a valid integer; ...`."""
    parts = []
    for e in errors[:5]:
        where = ".".join(str(x) for x in e.get("loc", ()))
        parts.append(f"{where}: {e.get('msg', 'invalid')}")
    hint = (
        " (send a JSON object with Content-Type: application/json)"
        if any(tuple(e.get("loc", ())) == ("body",) for e in errors)
        else ""
    )
    return "; ".join(parts) + (f"; and {len(errors) - 5} more" if len(errors) > 5 else "") + hint


# --- the server ---------------------------------------------------------------------------------------------------


def busy_answer(limits: Limits) -> bytes:
    """The 503 a connection over `max_connections` gets before it is closed."""
    body = json.dumps({"detail": f"{limits.max_connections} connections already; try again"}).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def protocol_class(limits: Limits) -> type:
    """uvicorn's h11 protocol (whose header size h11 bounds) with a deadline for each request's headers and a
    bound on the connections served at once."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    busy = busy_answer(limits)

    class BoundedH11Protocol(H11Protocol):
        _header_timer: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                transport.write(busy)
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:  # a request's headers are complete: its body has its own deadline
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.cycle is None or self.cycle.response_complete:  # (not when a pipelined request has begun)
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(limits.header_timeout, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            """No complete request line and headers in time: the connection is dropped (with what it has not
            read of an earlier answer, if any)."""
            self._header_timer = None
            if self.cycle is None or self.cycle.response_complete:
                if self.transport.get_write_buffer_size():
                    self.transport.abort()
                else:
                    self.transport.close()

    return BoundedH11Protocol


def server(app: Any, host: str, port: int, limits: Limits = DEFAULT_LIMITS) -> Any:
    """The uvicorn server of `app` on `host:port`, within the connection limits of `limits` (`.run()` serves
    until interrupted)."""
    import uvicorn

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol_class(limits),
        ws="none",
        lifespan="off",
        timeout_keep_alive=limits.keep_alive,
        h11_max_incomplete_event_size=limits.max_header_bytes,
        log_level="warning",
        access_log=False,
    )
    return uvicorn.Server(config)
