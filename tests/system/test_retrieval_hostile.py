"""The retrieval client (`--retriever URL`) against hostile and broken services on loopback, written by hand on raw
sockets so that they can misbehave as no HTTP library would: compression bombs, endless and dripping answers,
answers with too many or too large passages, odd scores, redirects, escape sequences. Each case ends in one
`ServiceError` that says what happened, within the limits set (bytes read, passages kept, seconds spent), naming
the URL with its password redacted and showing the service's words with their control characters made visible.
The password itself is sent as HTTP auth and appears in no message, config file or tracker config."""

from __future__ import annotations

import base64
import contextlib
import gzip
import json
import re
import socket
import sys
import threading
import time
import tracemalloc

import pytest
import yaml

import mhgpo.config.eval as config_eval
from mhgpo.config import EvalConfig, RetrievalConfig, ServeConfig, dump_config, from_dict, load_config
from mhgpo.errors import InputError, ServiceError
from mhgpo.retrieval.http import MAX_BACKOFF, MAX_ID_CHARS, HTTPRetriever


class RawServer:
    """A TCP server on loopback: each connection's request (line, headers, Content-Length body) is read and the
    connection handed to `answer(conn, request)`; `requests` records the requests."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.requests: list[bytes] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/retrieve"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                request = read_request(conn)
                self.requests.append(request)
                self.answer(conn, request)
            except OSError:  # the client hung up, as it should past a limit
                pass


def read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"(?i)content-length: *(\d+)", head)
    while length and len(body) < int(length.group(1)):
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body


@contextlib.contextmanager
def hostile(answer):
    srv = RawServer(answer)
    try:
        yield srv
    finally:
        srv.sock.close()


def respond(conn: socket.socket, body: bytes, status: str = "200 OK", headers: tuple[str, ...] = ()) -> None:
    head = [f"HTTP/1.1 {status}", f"Content-Length: {len(body)}", "Content-Type: application/json", *headers]
    head.append("Connection: close")  # (this server answers one request a connection)
    conn.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)


def replying(body: bytes | str, status: str = "200 OK", headers: tuple[str, ...] = ()):
    raw = body.encode() if isinstance(body, str) else body
    return lambda conn, request: respond(conn, raw, status, headers)


def doc(i: int, text: str = "text", title: str = "T") -> dict:
    return {"id": f"d{i}", "contents": f'"{title}"\n{text}'}


def client(url: str, **kw) -> HTTPRetriever:
    return HTTPRetriever(url, **{"backoff": 0.01, "timeout": 5.0, "retries": 0, **kw})


def failure(url: str, **kw) -> str:
    with pytest.raises(ServiceError) as err:
        client(url, **kw).search_batch(["alpha"], 2)
    return str(err.value)


# ------------------------------------------------------------------------------------------------- bytes


@pytest.fixture(scope="module")
def gzip_bomb() -> bytes:
    """64 MiB of a JSON answer's opening, gzipped to about 64 KiB."""
    return gzip.compress(b'{"result": [[' + b" " * (64 << 20), 9)


def test_a_gzip_bomb_is_read_up_to_the_limit_and_no_further(gzip_bomb) -> None:
    headers = ("Content-Encoding: gzip",)
    with hostile(replying(gzip_bomb, headers=headers)) as srv:
        tracemalloc.start()
        try:
            message = failure(srv.url, max_answer_bytes=1 << 20)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert message == f"retrieval service {srv.url}: the answer is over 1048576 bytes (retrieval.max_answer_bytes)"
    assert len(gzip_bomb) < 1 << 20 and peak < 6 << 20  # compressed under the limit; decoded, stopped at it


def test_a_declared_length_over_the_limit_is_refused_before_the_body() -> None:
    def announce(conn, request):  # 10 GB announced, then nothing: waiting for it would meet the time-out
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10000000000\r\n\r\n")
        time.sleep(3)

    with hostile(announce) as srv:
        message = failure(srv.url, max_answer_bytes=1 << 20, timeout=30)
    assert message.endswith("the answer is 10000000000 bytes; at most 1048576 (retrieval.max_answer_bytes)")


def test_an_endless_chunked_answer_stops_at_the_limit() -> None:
    def endless(conn, request):
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b'{"result": [' + b" " * 8000
        for _ in range(100_000):  # ~800 MB, or until the client hangs up
            conn.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")

    with hostile(endless) as srv:
        message = failure(srv.url, max_answer_bytes=100_000)
    assert message.endswith("the answer is over 100000 bytes (retrieval.max_answer_bytes)")


def test_a_5xx_with_a_huge_body_is_read_only_for_its_reason() -> None:
    def huge_error(conn, request):
        conn.sendall(b"HTTP/1.1 503 Busy\r\nContent-Length: 100000000\r\n\r\n")
        for _ in range(10_000):
            conn.sendall(b"overloaded " * 1000)

    with hostile(huge_error) as srv:
        message = failure(srv.url)
    assert message == (
        f"retrieval service {srv.url}: HTTP 503 ({'overloaded ' * 10}overloaded...) after 1 try; is the server "
        f"running? (mhgpo serve-retriever starts one)"
    )


# ------------------------------------------------------------------------------------------------- time


def dripping(head: bytes, body: bytes, every: float = 0.05):
    def drip(conn, request):
        conn.sendall(head)
        for b in body:
            conn.sendall(bytes([b]))
            time.sleep(every)

    return drip


def test_an_answer_dripping_byte_by_byte_meets_the_deadline() -> None:
    body = json.dumps({"result": [[doc(0)]]}).encode()
    with hostile(dripping(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode(), body)) as srv:
        started = time.monotonic()
        message = failure(srv.url, timeout=0.5)
        seconds = time.monotonic() - started
    assert message == (
        f"retrieval service {srv.url}: no complete answer within 0.5 s (its headers came, its body did not end) "
        f"after 1 try"
    )
    assert seconds < 2  # each byte came well within a read's time-out: only the deadline ends it


def test_headers_dripping_byte_by_byte_meet_the_deadline() -> None:
    with hostile(dripping(b"", b"HTTP/1.1 200 OK\r\n" + b"X-Slow: " + b"a" * 400)) as srv:
        started = time.monotonic()
        message = failure(srv.url, timeout=0.5)
        assert time.monotonic() - started < 2
    assert message == f"retrieval service {srv.url}: no answer within 0.5 s after 1 try"


def test_retries_and_their_waits_end_within_the_total_time() -> None:
    with hostile(replying('{"detail": "busy"}', "503 Service Unavailable")) as srv:
        started = time.monotonic()
        message = failure(srv.url, retries=10, backoff=0.2, total_timeout=1.0)
        seconds = time.monotonic() - started
    tries = re.search(r"after (\d+) tries in ([\d.]+) s \(retrieval.total_timeout=1\)", message)
    assert message.startswith(f"retrieval service {srv.url}: HTTP 503 (busy) after ") and tries, message
    assert int(tries.group(1)) == len(srv.requests) < 11 and seconds < 1.5


def test_the_back_off_is_capped_and_the_retries_too(monkeypatch) -> None:
    waits: list[float] = []
    monkeypatch.setattr("mhgpo.retrieval.http.time.sleep", waits.append)
    with hostile(replying('{"detail": "busy"}', "503 Service Unavailable")) as srv:
        failure(srv.url, retries=4, backoff=8.0, total_timeout=1e6)
        assert waits == [8.0, MAX_BACKOFF, MAX_BACKOFF, MAX_BACKOFF] and len(srv.requests) == 5
    assert HTTPRetriever(srv.url, retries=1000).retries == 10
    with pytest.raises(InputError, match=r"^retrieval.retries: must be between 0 and 10, got 11$"):
        from_dict(RetrievalConfig, {"retries": 11})


def test_an_answer_cut_off_midway_is_retried_and_named() -> None:
    def cut(conn, request):
        conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n{"result": [[')

    with hostile(cut) as srv:
        message = failure(srv.url, retries=1)
    assert message.startswith(f"retrieval service {srv.url}: the answer broke off (")
    assert message.endswith(") after 2 tries")
    assert len(srv.requests) == 2


@pytest.mark.parametrize(
    "answer, problem",
    [
        (lambda conn, request: None, "the connection closed without an answer after 1 try"),
        (
            lambda conn, request: conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n"),
            "the answer is not HTTP (SSH-2.0-OpenSSH_9.6)",
        ),
        (replying(b"not gzip", headers=("Content-Encoding: gzip",)), "the answer cannot be decoded (Error -3 "),
    ],
    ids=["hang-up", "not-http", "bad-gzip"],
)
def test_a_broken_answer_says_what_broke(answer, problem) -> None:
    with hostile(answer) as srv:
        message = failure(srv.url)
    assert message.startswith(f"retrieval service {srv.url}: {problem}"), message


# ------------------------------------------------------------------------------------------------- passages


def test_passages_beyond_the_topk_asked_are_not_kept() -> None:
    many = json.dumps({"result": [[doc(i) for i in range(10_000)]]})
    with hostile(replying(many)) as srv:
        r = client(srv.url, max_answer_bytes=4 << 20)
        assert [p.id for p in r.search("alpha", 2)] == ["d0", "d1"]
        assert r.cache_info().nbytes < 2000  # the two kept, not the ten thousand


def test_a_huge_passage_is_cut_and_the_cache_holds_only_the_cut() -> None:
    huge = json.dumps({"result": [[doc(0, text="x" * (1 << 20), title="t" * 5000), {"id": "i" * 5000, "text": "y"}]]})
    with hostile(replying(huge)) as srv:
        r = client(srv.url, max_answer_bytes=4 << 20, max_passage_chars=1000)
        first, second = r.search("alpha", 2)
        assert (first.title, first.text) == ("t" * 1000, "x" * 1000)
        assert second.id.startswith("sha1:") and len(second.id) <= MAX_ID_CHARS
        assert r.cache_info().nbytes < 5000


@pytest.mark.parametrize("score", ["NaN", "Infinity", "-Infinity", "1e999", "true", '"1"', "1" + "0" * 400])
def test_a_score_that_is_not_a_finite_number_is_a_malformed_answer(score) -> None:
    body = '{"result": [[{"document": {"id": "a", "contents": "x"}, "score": ' + score + "}]]}"
    with hostile(replying(body)) as srv, pytest.raises(ServiceError) as err:
        client(srv.url).search_scored(["alpha"], 1)
    assert re.fullmatch(
        rf"retrieval service {srv.url}: malformed answer: result\[0\]\[0\]: score \S+ is not a finite number",
        str(err.value),
    )


@pytest.mark.parametrize(
    "body, problem",
    [
        ("[" * 100_000, "the answer is not JSON ([[[[["),
        ('{"result": {"0": []}}', 'malformed answer: "result" should hold one list per query (1), got dict'),
        ('{"result": ["d0"]}', "malformed answer: result[0] is str, not a list"),
        ('{"result": [[{"id": ["x"], "contents": "a"}]]}', "malformed answer: result[0][0]: a document's id is list"),
        ('{"result": [[{"id": "x", "title": 7, "text": "a"}]]}', "malformed answer: result[0][0]: a document's title"),
        ('{"result": [[{"id": "x", "contents": 7}]]}', "malformed answer: result[0][0]: a document has neither"),
        ('{"result": [[{"id": true, "contents": "a"}]]}', "malformed answer: result[0][0]: a document's id is bool"),
        ("\xff\xfe{}", "the answer is not JSON"),
        ("", "the answer is not JSON ()"),
    ],
)
def test_answers_of_the_wrong_shape_are_one_error(body, problem) -> None:
    raw = body.encode("latin-1")
    with hostile(replying(raw)) as srv:
        message = failure(srv.url, retries=3)
        assert len(srv.requests) == 1  # not retried
    assert message.startswith(f"retrieval service {srv.url}: {problem}"), message


# ------------------------------------------------------------------------------------------------- what is shown


def test_a_redirect_elsewhere_is_not_followed_and_its_password_not_shown() -> None:
    with hostile(replying(json.dumps({"result": [[doc(0)]]}))) as other:
        moved = other.url.replace("http://", "http://admin:hunter2@")
        with hostile(replying(b"", "307 Temporary Redirect", (f"Location: {moved}",))) as srv:
            message = failure(srv.url, retries=3)
        assert other.requests == [] and len(srv.requests) == 1
    assert message == (
        f"retrieval service {srv.url}: HTTP 307, a redirect to {other.url.replace('http://', 'http://admin:***@')} "
        f"(redirects are not followed)"
    )


@pytest.mark.parametrize(
    "answer",
    [
        replying('{"detail": "\\u001b[2J\\u001b]0;owned\\u0007 bad query"}', "422 Unprocessable Entity"),
        replying(b"\x1b[31mnot json\x1b[0m"),
        replying(b'{"result": [[{"\\u001b[31mkey": 1}]]}'),
        replying(b"", "500 \x1b[31mBroken\x1b[0m"),
        lambda conn, request: conn.sendall(b"HTTP/1.1 2\x1b[0m0 OK\r\n\r\n"),
    ],
    ids=["detail", "body", "document-key", "reason", "status-line"],
)
def test_escape_sequences_from_a_service_are_made_visible(answer) -> None:
    with hostile(answer) as srv:
        message = failure(srv.url)
    assert "\\x1b[" in message and not re.search(r"[\x00-\x1f\x7f-\x9f]", message), message


def test_a_password_in_the_url_is_sent_as_auth_and_shown_nowhere(tmp_path, monkeypatch) -> None:
    seen: list[str] = []

    def check_auth(conn, request):
        auth = re.search(rb"(?i)authorization: basic (\S+)", request)
        seen.append(base64.b64decode(auth.group(1)).decode() if auth else "")
        queries = json.loads(request.split(b"\r\n\r\n", 1)[1])["queries"]
        if seen[-1] != "trainer:hunter2@x":
            respond(conn, b'{"detail": "who are you?"}', "401 Unauthorized")
        elif queries == ["beta"]:
            respond(conn, b'{"detail": "gone"}', "503 Service Unavailable")
        else:
            respond(conn, json.dumps({"result": [[doc(0)] for _ in queries]}).encode())

    monkeypatch.setattr(config_eval, "_SERVICE_USERINFO", {})
    with hostile(check_auth) as srv:
        url = srv.url.replace("http://", "http://trainer:hunter2%40x@")
        shown = srv.url.replace("http://", "http://trainer:***@")
        cfg = load_config(EvalConfig, None, [f"retrieval.retriever={url}", "retrieval.retries=0"])
        assert cfg.retrieval.retriever == shown
        from mhgpo.retrieval.build import build_retriever

        r = build_retriever("synthetic", cfg.retrieval)  # probes: one request
        assert r.url == shown and [p.id for p in r.search("alpha", 1)] == ["d0"]
        with pytest.raises(ServiceError) as err:
            r.search("beta", 1)
        assert str(err.value).startswith(f"retrieval service {shown}: HTTP 503 (gone)")
        assert seen == ["trainer:hunter2@x"] * 3
        dump_config(cfg, tmp_path / "config.yaml")
        saved = (tmp_path / "config.yaml").read_text()
        assert "hunter2" not in saved and yaml.safe_load(saved)["retrieval"]["retriever"] == shown

        # resumed in another process: the saved config holds `trainer:***@`, the password comes from the environment
        monkeypatch.setattr(config_eval, "_SERVICE_USERINFO", {})
        resumed = load_config(EvalConfig, tmp_path / "config.yaml")
        with pytest.raises(InputError) as missing:
            build_retriever("synthetic", resumed.retrieval)
        assert str(missing.value) == (
            f"retrieval.retriever: the password of {shown} is not saved with a run; pass the URL with its password "
            f"again (--retriever) or set MHGPO_RETRIEVER_AUTH=user:password"
        )
        monkeypatch.setenv("MHGPO_RETRIEVER_AUTH", "trainer:hunter2%40x")
        assert build_retriever("synthetic", resumed.retrieval).url == shown and seen[-1] == "trainer:hunter2@x"
        monkeypatch.delenv("MHGPO_RETRIEVER_AUTH")
        again = load_config(EvalConfig, tmp_path / "config.yaml", [f"retrieval.retriever={url}"])  # or the URL again
        assert again.retrieval.retriever == shown and build_retriever("synthetic", again.retrieval).url == shown


def test_a_password_stays_out_of_config_errors_and_trackers(capsys, monkeypatch) -> None:
    from mhgpo.cli.main import main
    from mhgpo.runtime import trackers

    url = "http://trainer:hunter2@127.0.0.1:9/retrieve"
    for data, cls in [
        ({"retrieval": {"retriever": url, "corpus": "c.jsonl"}}, EvalConfig),
        ({"retrieval": {"retriever": url.replace("127.0.0.1", "[::1")}}, EvalConfig),
        ({"retrieval": {"retriever": url}}, ServeConfig),
    ]:
        with pytest.raises(InputError) as err:
            from_dict(cls, data)
        assert "trainer:***@" in str(err.value) and "hunter2" not in str(err.value), str(err.value)
    for argv in (
        ["eval-retrieval", "--limit", "1", f"retrieval.retriever={url}"],
        ["serve-retriever", f"retrieval.retriever={url}"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("mhgpo: error: ") and "trainer:***@" in err and "hunter2" not in err, err
    monkeypatch.setattr(sys, "argv", ["mhgpo", "serve-retriever", f"retrieval.retriever={url}"])
    assert main() == 2
    assert sys.argv[2] == "retrieval.retriever=http://trainer:***@127.0.0.1:9/retrieve"  # as W&B would record it
    with pytest.raises(SystemExit):  # argparse's own error quotes the argument
        main(["serve-retriever", "--retriever", url])
    err = capsys.readouterr().err
    assert "invalid choice: 'http://trainer:***@127.0.0.1:9/retrieve'" in err and "hunter2" not in err
    given: list[dict] = []
    monkeypatch.setattr(trackers, "_CLASSES", {"tensorboard": lambda run_dir, step, config, ids: given.append(config)})
    monkeypatch.setattr(trackers, "require_trackers", lambda names: None)
    trackers.open_trackers(["tensorboard"], "unused", 0, {"retrieval": {"retriever": url}, "steps": 3})
    assert given == [{"retrieval": {"retriever": "http://trainer:***@127.0.0.1:9/retrieve"}, "steps": 3}]


# ------------------------------------------------------------------------------------------------- many clients


def test_many_clients_of_a_flaky_service_all_get_their_answers() -> None:
    """16 threads share one client; the service fails each query's first try with a 503 and its second by hanging
    up before answering: every query is answered on its third try."""
    tries: dict[str, int] = {}
    lock = threading.Lock()

    def flaky(conn, request):
        queries = json.loads(request.split(b"\r\n\r\n", 1)[1])["queries"]
        with lock:
            n = tries[queries[0]] = tries.get(queries[0], 0) + 1
        if n == 1:
            respond(conn, b'{"detail": "busy"}', "503 Service Unavailable")
        elif n == 3:
            respond(conn, json.dumps({"result": [[doc(0, text=q)] for q in queries]}).encode())

    with hostile(flaky) as srv:
        r = client(srv.url, retries=2)
        got: dict[int, list] = {}

        def worker(t: int) -> None:
            for i in range(t, 64, 16):
                got[i] = [p.text for p in r.search(f"query {i}", 1)]

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert got == {i: [f"query {i}"] for i in range(64)} and set(tries.values()) == {3}


def test_ask_shows_a_services_titles_with_their_escape_sequences_made_visible(tiny_model_dir, capsys) -> None:
    from mhgpo.cli.main import main

    def evil_titles(conn, request):
        queries = json.loads(request.split(b"\r\n\r\n", 1)[1])["queries"]
        docs = [doc(i, text="\x1b]0;owned\x07 text", title=f"\x1b[2J\x1b[31mTitle {i}") for i in range(3)]
        respond(conn, json.dumps({"result": [docs for _ in queries]}).encode())

    with hostile(evil_titles) as srv:
        assert main(["ask", "who founded it?", "--model", str(tiny_model_dir), "--retriever", srv.url]) == 0
    out = capsys.readouterr().out
    assert "\\x1b[2J\\x1b[31mTitle 0" in out and not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", out)
