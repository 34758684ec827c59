"""A retriever that is a service: `retrieval.retriever: http://HOST:PORT/retrieve` (`--retriever URL`).

The protocol is the one search-agent RL trains against (Search-R1's retrieval server; `mhgpo serve-retriever`
speaks it too): `POST URL` with `{"queries": [...], "topk": k, "return_scores": bool}` answers
`{"result": [[ITEM, ...], ...]}`, one list per query, best first, where ITEM is `{"document": DOC, "score": s}`
with scores asked for and DOC alone without. DOC is `{"id", "contents"}`, `contents` being the passage's title in
double quotes on the first line and its text after it (`"Title"\\ntext`); a DOC with `title` and `text` fields is
read as it is.

`HTTPRetriever` keeps the per-query cache of every retriever (`CachedRetriever`, bounded in entries and bytes):
each round of queries is one request (split above `request_queries`), only the queries not searched before.

Everything the service controls is bounded. A request has `timeout` seconds in all, from connecting to the last
byte of the answer (a watchdog cuts its connection then, so that a server dripping bytes cannot hold it); an answer
has at most `max_answer_bytes`, as sent and decoded (it is streamed and counted, so that a compressed bomb stops
at the limit); a query keeps at most the `k` passages asked for, each passage at most `max_passage_chars` of title
and of text. Redirects are not followed. Connection errors, time-outs and 5xx answers are retried `retries` times
(at most 10) with doubling back-off (each wait at most `MAX_BACKOFF`), all within `total_timeout` seconds; then,
or on a 4xx, a redirect or a malformed answer, a `ServiceError` names the URL (its password redacted) and what was
wrong, the service's own words with their control characters made visible. `probe()` (called when the retriever
is built, before any model loads) sends one small request, so that an unreachable or foreign server is reported at
start.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import math
import socket
import sys
import threading
import time
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from mhgpo.config.choices import split_userinfo
from mhgpo.config.eval import MAX_RETRIES
from mhgpo.data.records import Passage
from mhgpo.errors import ServiceError, printable
from mhgpo.retrieval.bm25 import DEFAULT_CACHE_BYTES, DEFAULT_CACHE_SIZE, CachedRetriever

__all__ = ["HTTPRetriever", "contents_of", "passage_from_document"]

PROBE_QUERY = "retrieval service probe"
BACKOFF = 0.5  # seconds before the first retry; doubled for each next one
MAX_BACKOFF = 10.0  # seconds, the longest wait between two tries
MAX_ID_CHARS = 256  # a longer document id is replaced by its digest
CHUNK = 64 << 10  # bytes read (and decoded) at a time
ERROR_BODY_BYTES = 64 << 10  # of a 4xx/5xx answer, read for its reason


def contents_of(passage: Passage) -> str:
    """The `contents` of a document in the protocol: `"Title"` on the first line, then the text."""
    return f'"{passage.title}"\n{passage.text}'


def passage_from_document(doc: Any, max_chars: int | None = None) -> Passage:
    """A `Passage` from a document of an answer (ValueError when it is not one): `{"id", "contents"}` with the
    title split off the first line (its double quotes stripped), or `{"id", "title", "text"}`. A document
    without an id gets one from its contents (so that repeated documents still merge); an id longer than
    `MAX_ID_CHARS` is replaced by its digest. With `max_chars`, the title and the text are cut at that length."""
    if not isinstance(doc, dict):
        raise ValueError(f"a document is {type(doc).__name__}, not an object")
    if isinstance(doc.get("contents"), str):
        head, sep, text = doc["contents"].partition("\n")
        if not sep:  # one line: all of it is text
            head, text = "", head
        title = head[1:-1] if len(head) >= 2 and head.startswith('"') and head.endswith('"') else head
    elif isinstance(doc.get("text"), str):
        title, text = doc.get("title") or "", doc["text"]
        if not isinstance(title, str):
            raise ValueError(f"a document's title is {type(title).__name__}, not a string")
    else:
        keys = printable(", ".join(sorted(str(k)[:40] for k in list(doc)[:20])))
        raise ValueError(f"a document has neither contents nor text (keys: {keys or 'none'})")
    if max_chars is not None:
        title, text = title[:max_chars], text[:max_chars]
    pid = doc.get("id", doc.get("_id"))
    if pid is None:
        pid = "sha1:" + hashlib.sha1(f"{title}\n{text}".encode("utf-8", "replace")).hexdigest()[:16]
    elif not isinstance(pid, (str, int)) or isinstance(pid, bool):
        raise ValueError(f"a document's id is {type(pid).__name__}, not a string")
    pid = str(pid)
    if len(pid) > MAX_ID_CHARS:
        pid = "sha1:" + hashlib.sha1(pid.encode("utf-8", "replace")).hexdigest()
    return Passage(id=pid, title=title, text=text)


def _score(item: dict[str, Any]) -> float | None:
    """An item's score: None when it has none; ValueError unless it is a finite number."""
    score = item.get("score")
    if score is None:
        return None
    try:
        value = math.nan if isinstance(score, bool) or not isinstance(score, (int, float)) else float(score)
    except OverflowError:  # an integer beyond the floats
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"score {_short(repr(score))} is not a finite number")
    return value


def _parse_result(
    data: Any, n: int, k: int | None = None, max_chars: int | None = None
) -> list[tuple[tuple[Passage, float | None], ...]]:
    """The passages (and scores, when given) of each of the `n` queries of an answer, at most `k` a query (the
    rest is not read) and each cut at `max_chars`; ValueError naming what is wrong otherwise."""
    if not isinstance(data, dict) or "result" not in data:
        keys = printable(", ".join(sorted(str(x)[:40] for x in list(data)[:20]))) if isinstance(data, dict) else ""
        got = keys if isinstance(data, dict) else type(data).__name__
        raise ValueError(f'expected an object with a "result" list, got {got or "an empty object"}')
    result = data["result"]
    if not isinstance(result, list) or len(result) != n:
        size = len(result) if isinstance(result, list) else type(result).__name__
        raise ValueError(f'"result" should hold one list per query ({n}), got {size}')
    out = []
    for q, items in enumerate(result):
        if not isinstance(items, list):
            raise ValueError(f"result[{q}] is {type(items).__name__}, not a list")
        found = []
        for j, item in enumerate(items[:k]):
            try:
                if isinstance(item, dict) and "document" in item:
                    found.append((passage_from_document(item["document"], max_chars), _score(item)))
                else:
                    found.append((passage_from_document(item, max_chars), None))
            except ValueError as e:
                raise ValueError(f"result[{q}][{j}]: {e}") from None
        out.append(tuple(found))
    return out


# --- the deadline of a request ------------------------------------------------------------------------------------


class _Deadline:
    """The time a request has, in all. Each socket read of requests/urllib3 has its own time-out, so a server that
    sends a byte now and then would hold a request for ever; at the deadline this shuts down the sockets of the
    connections the request used (registered by `_WatchedConnection`), which ends a read in progress."""

    current = threading.local()  # the deadline of the request this thread is making

    def __init__(self, seconds: float) -> None:
        self.seconds, self.at = seconds, time.monotonic() + seconds
        self.expired = False
        self._connections: list[HTTPConnection] = []
        self._lock = threading.Lock()
        self._over = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def left(self) -> float:
        return max(0.001, self.at - time.monotonic())

    def watch(self, connection: HTTPConnection) -> None:
        with self._lock:
            self._connections.append(connection)

    def __enter__(self) -> _Deadline:
        _Deadline.current.value = self
        self._timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._timer.cancel()
        with self._lock:
            self._over = True
        _Deadline.current.value = None

    def _expire(self) -> None:
        with self._lock:
            if self._over:
                return
            self.expired = True
            for connection in self._connections:
                sock = connection.sock
                if sock is not None:
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass


class _WatchedConnection(HTTPConnection):
    def request(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        deadline = getattr(_Deadline.current, "value", None)
        if deadline is not None:
            deadline.watch(self)
        super().request(*args, **kwargs)


class _WatchedHTTPSConnection(HTTPSConnection, _WatchedConnection):  # type: ignore[misc]
    pass


class _WatchedPool(HTTPConnectionPool):
    ConnectionCls = _WatchedConnection


class _WatchedHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


class _WatchedAdapter(HTTPAdapter):
    """requests' adapter with connections that a `_Deadline` can cut."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _WatchedPool, "https": _WatchedHTTPSPool}

    def proxy_manager_for(self, *args: Any, **kwargs: Any) -> Any:
        manager = super().proxy_manager_for(*args, **kwargs)
        if hasattr(manager, "pool_classes_by_scheme"):
            manager.pool_classes_by_scheme = {"http": _WatchedPool, "https": _WatchedHTTPSPool}
        return manager


class _Refused(Exception):
    """An answer that is not retried (a 4xx, a redirect, too large, not JSON, malformed): its reason."""


class _Retry(Exception):
    """A try that failed in a way worth another (a 5xx, a time-out, a lost connection): its reason."""


# --- the client ---------------------------------------------------------------------------------------------------


class HTTPRetriever(CachedRetriever):
    """The retriever behind a retrieval service's URL (see the module docstring); its `passages` are unknown
    (the service's corpus), so it is empty. `url` may carry `user:password@` (sent as HTTP basic auth, like
    `auth`); `self.url`, which every message shows, has the password redacted."""

    kind = "http"

    def __init__(
        self,
        url: str,
        *,
        request_queries: int = 256,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = BACKOFF,
        total_timeout: float = 300.0,
        max_answer_bytes: int = 16 << 20,
        max_passage_chars: int = 10000,
        auth: tuple[str, str] | None = None,
        cache_size: int = DEFAULT_CACHE_SIZE,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        session: requests.Session | None = None,
    ) -> None:
        super().__init__((), cache_size, cache_bytes)
        userinfo, self._endpoint, self.url = split_userinfo(url)
        if auth is None and userinfo and self.url != url:
            from urllib.parse import unquote

            user, _, password = userinfo.partition(":")
            auth = (unquote(user), unquote(password))
        self._auth = auth
        self.request_queries = max(1, int(request_queries))
        self.timeout, self.total_timeout = float(timeout), float(total_timeout)
        self.retries, self.backoff = min(max(0, int(retries)), MAX_RETRIES), float(backoff)
        self.max_answer_bytes, self.max_passage_chars = int(max_answer_bytes), int(max_passage_chars)
        self._session = session or requests.Session()
        for prefix in ("http://", "https://"):
            self._session.mount(prefix, _WatchedAdapter())
        self.answered = 0  # requests answered (for tests and benchmarks)

    def probe(self) -> None:
        """One small request: ServiceError (naming the URL) when the service is unreachable or answers in
        another shape."""
        self._request([PROBE_QUERY], 1)

    def close(self) -> None:
        self._session.close()

    def _entry_bytes(self, key: tuple[str, int], hits: tuple[Passage, ...]) -> int:
        """A cache entry holds its query and its passages (this retriever's own copies)."""
        own = sum(100 + sys.getsizeof(p.id) + sys.getsizeof(p.title) + sys.getsizeof(p.text) for p in hits)
        return super()._entry_bytes(key, hits) + own

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
        """POST one batch: each try within `timeout`, all of them within `total_timeout`; retried on connection
        errors, time-outs and 5xx answers; ServiceError after that, or at once on what is not worth a retry."""
        body = {"queries": queries, "topk": k, "return_scores": scores}
        started = time.monotonic()
        problem, tries = "", 0
        while True:
            tries += 1
            left = self.total_timeout - (time.monotonic() - started)
            try:
                with _Deadline(min(self.timeout, left)) as deadline:
                    data = self._try(body, deadline)
            except _Refused as e:
                raise ServiceError(f"retrieval service {self.url}: {e}") from None
            except _Retry as e:
                problem = str(e)
            else:
                try:
                    parsed = _parse_result(data, len(queries), k, self.max_passage_chars)
                except ValueError as e:
                    raise ServiceError(f"retrieval service {self.url}: malformed answer: {e}") from None
                self.answered += 1
                return parsed
            wait = min(self.backoff * 2 ** (tries - 1), MAX_BACKOFF)
            spent = time.monotonic() - started
            if tries > self.retries or spent + wait >= self.total_timeout:
                break
            time.sleep(wait)
        count = f"{tries} tries" if tries > 1 else "1 try"
        if tries <= self.retries:  # stopped by the total time
            count += f" in {spent:.1f} s (retrieval.total_timeout={self.total_timeout:g})"
        down = problem.startswith(("cannot connect", "HTTP 5"))  # (not when it answered, too slowly or wrongly)
        hint = "; is the server running? (mhgpo serve-retriever starts one)" if down else ""
        raise ServiceError(f"retrieval service {self.url}: {problem} after {count}{hint}")

    def _try(self, body: dict[str, Any], deadline: _Deadline) -> Any:
        """One POST and its answer's JSON, within `deadline`; _Retry or _Refused with the reason otherwise."""
        headers_in = False
        try:
            answer = self._session.post(
                self._endpoint,
                json=body,
                auth=self._auth,
                timeout=(deadline.left(), deadline.left()),
                stream=True,
                allow_redirects=False,
            )
            headers_in = True
            with answer:
                raw = self._body(answer, body)
        except (requests.Timeout, requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:
            raise _Retry(_lost(e, deadline, headers_in)) from None
        except requests.exceptions.ContentDecodingError as e:
            raise _Refused(f"the answer cannot be decoded ({_reason(e)})") from None
        except requests.RequestException as e:  # an invalid URL, ...
            raise _Refused(_reason(e)) from None
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            raise _Refused(f"the answer is not JSON ({_snippet(raw.decode('utf-8', 'replace'))})") from None

    def _body(self, answer: requests.Response, body: dict[str, Any]) -> bytes:
        """The body of a 2xx answer, within `max_answer_bytes`; _Retry for a 5xx, _Refused for a 4xx or 3xx."""
        status = answer.status_code
        if 300 <= status < 400:
            where = _short(printable(split_userinfo(answer.headers.get("Location", ""))[2]))
            raise _Refused(f"HTTP {status}, a redirect to {where or 'nowhere'} (redirects are not followed)")
        if status >= 400:
            detail = _detail(_read(answer, ERROR_BODY_BYTES, cut=True), answer.reason)
            if status >= 500:
                raise _Retry(f"HTTP {status} ({detail})")
            raise _Refused(
                f"HTTP {status} ({detail}) for a request of {len(body['queries'])} queries, topk={body['topk']}"
            )
        return _read(answer, self.max_answer_bytes)


def _lost(e: Exception, deadline: _Deadline, headers_in: bool) -> str:
    """What happened to a try that lost its connection or ran out of time."""
    causes = _causes(e)
    if deadline.expired or any(isinstance(c, (TimeoutError, socket.timeout)) for c in causes):
        if headers_in:
            return f"no complete answer within {deadline.seconds:g} s (its headers came, its body did not end)"
        return f"no answer within {deadline.seconds:g} s"
    if headers_in:
        return f"the answer broke off ({_reason(e)})"
    if any(isinstance(c, http.client.RemoteDisconnected) for c in causes):
        return "the connection closed without an answer"
    bad = [c for c in causes if isinstance(c, http.client.HTTPException)]
    if bad:  # a status line or header that is not HTTP
        return f"the answer is not HTTP ({_short(printable(' '.join(str(bad[0]).split())), 200)})"
    return f"cannot connect ({_reason(e)})"


def _causes(e: BaseException) -> list[BaseException]:
    """`e` and the errors it wraps (its context, and the errors among its arguments, as urllib3 wraps them)."""
    found: list[BaseException] = []
    todo = [e]
    while todo and len(found) < 20:
        inner = todo.pop()
        if inner in found:
            continue
        found.append(inner)
        todo += [a for a in inner.args if isinstance(a, BaseException)]
        todo += [inner.__context__] if inner.__context__ is not None else []
    return found


def _read(answer: requests.Response, limit: int, cut: bool = False) -> bytes:
    """The body of `answer`, streamed: at most `limit` bytes as sent (Content-Length, then the bytes counted) and
    decoded; over it, _Refused (or, with `cut`, the first `limit` bytes)."""
    declared = answer.headers.get("Content-Length", "")
    if not cut and declared.isdigit() and int(declared) > limit:
        raise _Refused(f"the answer is {int(declared)} bytes; at most {limit} (retrieval.max_answer_bytes)")
    chunks, size = [], 0
    for chunk in answer.iter_content(CHUNK):
        size += len(chunk)
        if size > limit or answer.raw.tell() > limit:
            if cut:
                chunks.append(chunk[: max(0, limit - (size - len(chunk)))])
                break
            raise _Refused(f"the answer is over {limit} bytes (retrieval.max_answer_bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def _reason(e: Exception) -> str:
    """The innermost reason of a requests error, in a few words (control characters made visible)."""
    inner: Any = e
    while inner.__context__ is not None and inner.__context__ is not inner:
        inner = inner.__context__
    text = str(inner) or type(inner).__name__
    if "Connection refused" in text or "Errno 111" in text:
        return "connection refused"
    return _short(printable(" ".join(text.split())), 200)


def _detail(raw: bytes, reason: str) -> str:
    """A 4xx/5xx answer's reason: FastAPI's `detail` when there is one, else the start of its body."""
    try:
        detail = json.loads(raw).get("detail")
    except (ValueError, AttributeError, RecursionError):
        detail = None
    if detail is not None:
        return _short(printable(" ".join(str(detail).split())), 300)
    return _snippet(raw.decode("utf-8", "replace")) or _short(printable(reason or "")) or "no body"


def _snippet(text: str) -> str:
    return _short(printable(" ".join(text[:2000].split())))


def _short(text: str, n: int = 120) -> str:
    return text[:n] + ("..." if len(text) > n else "")
