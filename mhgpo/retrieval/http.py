"""A retriever that is a service: `retrieval.retriever: http://HOST:PORT/retrieve` (`--retriever URL`).

The protocol is the one search-agent RL trains against (Search-R1's retrieval server; `mhgpo serve-retriever`
speaks it too): `POST URL` with `{"queries": [...], "topk": k, "return_scores": bool}` answers
`{"result": [[ITEM, ...], ...]}`, one list per query, best first, where ITEM is `{"document": DOC, "score": s}`
with scores asked for and DOC alone without. DOC is `{"id", "contents"}`, `contents` being the passage's title in
double quotes on the first line and its text after it (`"Title"\\ntext`); a DOC with `title` and `text` fields is
read as it is.

`HTTPRetriever` keeps the per-query cache of every retriever (`CachedRetriever`): each round of queries is one
request (split above `request_queries`), only the queries not searched before. Connection errors, time-outs and
5xx answers are retried `retries` times with doubling back-off; then, or on a 4xx or a malformed answer, a
`ServiceError` names the URL and what was wrong. `probe()` (called when the retriever is built, before any model
loads) sends one small request, so an unreachable or foreign server is reported at start.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import requests

from mhgpo.data.records import Passage
from mhgpo.errors import ServiceError
from mhgpo.retrieval.bm25 import DEFAULT_CACHE_SIZE, CachedRetriever

__all__ = ["HTTPRetriever", "contents_of", "passage_from_document"]

PROBE_QUERY = "retrieval service probe"
BACKOFF = 0.5  # seconds before the first retry; doubled for each next one


def contents_of(passage: Passage) -> str:
    """The `contents` of a document in the protocol: `"Title"` on the first line, then the text."""
    return f'"{passage.title}"\n{passage.text}'


def passage_from_document(doc: Any) -> Passage:
    """A `Passage` from a document of an answer (ValueError when it is not one): `{"id", "contents"}` with the
    title split off the first line (its double quotes stripped), or `{"id", "title", "text"}`. A document
    without an id gets one from its contents (so that repeated documents still merge)."""
    if not isinstance(doc, dict):
        raise ValueError(f"a document is {type(doc).__name__}, not an object")
    if isinstance(doc.get("contents"), str):
        head, sep, text = doc["contents"].partition("\n")
        if not sep:  # one line: all of it is text
            head, text = "", head
        title = head[1:-1] if len(head) >= 2 and head.startswith('"') and head.endswith('"') else head
    elif isinstance(doc.get("text"), str):
        title, text = str(doc.get("title") or ""), doc["text"]
    else:
        raise ValueError(f"a document has neither contents nor text (keys: {', '.join(sorted(doc)) or 'none'})")
    pid = doc.get("id", doc.get("_id"))
    if pid is None:
        pid = "sha1:" + hashlib.sha1(f"{title}\n{text}".encode()).hexdigest()[:16]
    elif not isinstance(pid, (str, int)):
        raise ValueError(f"a document's id is {type(pid).__name__}, not a string")
    return Passage(id=str(pid), title=title, text=text)


def _parse_result(data: Any, n: int) -> list[tuple[tuple[Passage, float | None], ...]]:
    """The passages (and scores, when given) of each of the `n` queries of an answer; ValueError naming what is
    wrong otherwise."""
    if not isinstance(data, dict) or "result" not in data:
        keys = ", ".join(sorted(data)) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f'expected an object with a "result" list, got {keys or "an empty object"}')
    result = data["result"]
    if not isinstance(result, list) or len(result) != n:
        size = len(result) if isinstance(result, list) else type(result).__name__
        raise ValueError(f'"result" should hold one list per query ({n}), got {size}')
    out = []
    for q, items in enumerate(result):
        if not isinstance(items, list):
            raise ValueError(f"result[{q}] is {type(items).__name__}, not a list")
        found = []
        for j, item in enumerate(items):
            try:
                if isinstance(item, dict) and "document" in item:
                    score = item.get("score")
                    if score is not None and not isinstance(score, (int, float)):
                        raise ValueError(f"score {score!r} is not a number")
                    found.append((passage_from_document(item["document"]), score))
                else:
                    found.append((passage_from_document(item), None))
            except ValueError as e:
                raise ValueError(f"result[{q}][{j}]: {e}") from None
        out.append(tuple(found))
    return out


class HTTPRetriever(CachedRetriever):
    """The retriever behind a retrieval service's URL (see the module docstring); its `passages` are unknown
    (the service's corpus), so it is empty."""

    kind = "http"

    def __init__(
        self,
        url: str,
        *,
        request_queries: int = 256,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = BACKOFF,
        cache_size: int = DEFAULT_CACHE_SIZE,
        session: requests.Session | None = None,
    ) -> None:
        super().__init__((), cache_size)
        self.url = url
        self.request_queries = max(1, int(request_queries))
        self.timeout, self.retries, self.backoff = float(timeout), max(0, int(retries)), float(backoff)
        self._session = session or requests.Session()
        self.answered = 0  # requests answered (for tests and benchmarks)

    def probe(self) -> None:
        """One small request: ServiceError (naming the URL) when the service is unreachable or answers in
        another shape."""
        self._request([PROBE_QUERY], 1)

    def close(self) -> None:
        self._session.close()

    def _search_uncached(self, queries: list[str], k: int) -> list[tuple[Passage, ...]]:
        return [tuple(p for p, _ in found) for found in self._batched(queries, k, scores=False)]

    def _search_scored(self, queries: list[str], k: int) -> list[tuple[tuple[Passage, float], ...]]:
        """With the service's scores (NaN where it gives none)."""
        return [
            tuple((p, float("nan") if s is None else float(s)) for p, s in found)
            for found in self._batched(queries, k, scores=True)
        ]

    def _batched(self, queries: list[str], k: int, scores: bool) -> list[tuple[tuple[Passage, float | None], ...]]:
        """One request per `request_queries` queries (the search itself asks for no scores: a server may cache
        its answers without them)."""
        if k == 0:
            return [() for _ in queries]
        out: list[tuple[tuple[Passage, float | None], ...]] = []
        for start in range(0, len(queries), self.request_queries):
            out.extend(self._request(queries[start : start + self.request_queries], k, scores))
        return out

    def _request(
        self, queries: list[str], k: int, scores: bool = False
    ) -> list[tuple[tuple[Passage, float | None], ...]]:
        """POST one batch; retried on connection errors, time-outs and 5xx answers; ServiceError after that,
        on a 4xx or on a malformed answer."""
        body = {"queries": queries, "topk": k, "return_scores": scores}
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                answer = self._session.post(self.url, json=body, timeout=self.timeout)
            except requests.Timeout:
                problem = f"no answer within {self.timeout:g} s"
                continue
            except requests.ConnectionError as e:
                problem = f"cannot connect ({_reason(e)})"
                continue
            except requests.RequestException as e:
                raise ServiceError(f"retrieval service {self.url}: {_reason(e)}") from None
            if answer.status_code >= 500:
                problem = f"HTTP {answer.status_code} ({_detail(answer)})"
                continue
            if answer.status_code >= 400:
                raise ServiceError(
                    f"retrieval service {self.url}: HTTP {answer.status_code} ({_detail(answer)}) "
                    f"for a request of {len(queries)} queries, topk={k}"
                )
            try:
                data = answer.json()
            except ValueError:
                raise ServiceError(
                    f"retrieval service {self.url}: the answer is not JSON ({_snippet(answer.text)})"
                ) from None
            try:
                parsed = _parse_result(data, len(queries))
            except ValueError as e:
                raise ServiceError(f"retrieval service {self.url}: malformed answer: {e}") from None
            self.answered += 1
            return parsed
        tries = f"{self.retries + 1} tries" if self.retries else "1 try"
        raise ServiceError(
            f"retrieval service {self.url}: {problem} after {tries}; is the server running? "
            f"(mhgpo serve-retriever starts one)"
        )


def _reason(e: Exception) -> str:
    """The innermost reason of a requests error, in a few words."""
    inner: Any = e
    while inner.__context__ is not None and inner.__context__ is not inner:
        inner = inner.__context__
    text = str(inner) or type(inner).__name__
    if "Connection refused" in text or "Errno 111" in text:
        return "connection refused"
    return " ".join(text.split())[:200]


def _detail(answer: requests.Response) -> str:
    """A 4xx/5xx answer's reason: FastAPI's `detail` when there is one, else the start of its body."""
    try:
        detail = answer.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    if detail is not None:
        return " ".join(str(detail).split())[:300]
    return _snippet(answer.text) or answer.reason or "no body"


def _snippet(text: str) -> str:
    text = " ".join(text.split())
    return text[:120] + ("..." if len(text) > 120 else "")
