"""A retriever behind the retrieval-service protocol (FastAPI; `mhgpo serve-retriever` runs it with uvicorn).

`POST /retrieve` takes `{"queries": [...], "topk": k, "return_scores": bool}` and answers
`{"result": [[ITEM, ...], ...]}`: per query, best first, `{"document": {"id", "contents"}, "score": s}` with
scores, the document alone without; `contents` is `"Title"\\ntext` (the shape of Search-R1's retrieval server, which
`mhgpo.retrieval.http.HTTPRetriever` reads). `GET /health` names the retriever and its corpus.

Limits answer 4xx with a `detail` that says which: more than `max_queries` queries or a body over
`max_body_bytes` (413), `topk` outside 1..`max_topk` (422), a body that is not such a JSON object (422, naming the
field). Requests are served by a thread pool; the searches of concurrent requests take turns on one lock (the index
and the result cache are shared).
"""

from __future__ import annotations

import threading
from typing import Any

from mhgpo.retrieval.bm25 import CachedRetriever
from mhgpo.retrieval.http import contents_of

__all__ = ["DEFAULT_LIMITS", "Limits", "create_app"]

try:  # the optional extra `serve`
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict
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


class Limits:
    """What one request may ask: queries, passages per query, and bytes of body."""

    def __init__(
        self, max_queries: int = 1024, max_topk: int = 100, max_body_bytes: int = 4 << 20, default_topk: int = 3
    ) -> None:
        self.max_queries, self.max_topk = max_queries, max_topk
        self.max_body_bytes, self.default_topk = max_body_bytes, default_topk


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


def create_app(retriever: CachedRetriever, limits: Limits = DEFAULT_LIMITS, name: str = "") -> Any:
    """The FastAPI application serving `retriever` (`name`: what /health calls its corpus)."""
    require_server()
    lock = threading.Lock()

    app = FastAPI(title="mhgpo retriever", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: Any) -> Any:  # short, without echoing the body
        return JSONResponse({"detail": validation_detail(exc.errors())}, status_code=422)

    @app.middleware("http")
    async def limit_body(request: Request, call_next: Any) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            return _too_large(int(declared), limits)
        if request.method == "POST":
            body = await request.body()  # (cached by Starlette for the endpoint)
            if len(body) > limits.max_body_bytes:
                return _too_large(len(body), limits)
        return await call_next(request)

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
        }

    @app.post("/retrieve")
    def retrieve(req: RetrieveRequest) -> dict[str, Any]:  # a plain def: FastAPI runs it in its thread pool
        k = limits.default_topk if req.topk is None else req.topk
        if len(req.queries) > limits.max_queries:
            raise HTTPException(
                413, f"{len(req.queries)} queries in one request; at most {limits.max_queries} (split the request)"
            )
        if not 1 <= k <= limits.max_topk:
            raise HTTPException(422, f"topk={k}: must be between 1 and {limits.max_topk}")
        with lock:
            if req.return_scores:
                found = retriever.search_scored(req.queries, k)
            else:
                found = [[(p, 0.0) for p in hits] for hits in retriever.search_batch(req.queries, k)]
        return answer(found, req.return_scores)

    return app


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


def _too_large(size: int, limits: Limits) -> Any:
    return JSONResponse({"detail": f"request body of {size} bytes; at most {limits.max_body_bytes}"}, status_code=413)
