"""`mhgpo serve-retriever` as a real process on the loopback interface: its answers are those of the in-process
retriever (alone and under concurrent requests), its limits answer 4xx, and `mhgpo eval --retriever URL` through it
predicts exactly what `mhgpo eval` with the in-process BM25 retriever predicts."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from helpers import free_port

from mhgpo.cli.main import main
from mhgpo.data.formats import load_corpus_jsonl
from mhgpo.data.synth_files import write_world
from mhgpo.retrieval.bm25 import BM25Retriever
from mhgpo.retrieval.http import HTTPRetriever

REPO = Path(__file__).resolve().parents[2]
SMALL_SEARCH = [
    "search.rewriter.max_new_tokens=8",
    "search.reranker.max_new_tokens=4",
    "search.answerer.max_new_tokens=4",
]
QUERIES = [
    "who founded the company",
    "glass company founded in 1958",
    "river",
    "",
    "the of and",
    "headquartered stock exchange employer region",
]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("world")
    write_world(folder, seed=1, n_train=10, n_dev=4)
    return folder


@pytest.fixture(scope="module")
def served(world: Path, tmp_path_factory: pytest.TempPathFactory):
    """`python -m mhgpo serve-retriever` over the world's corpus on a free loopback port; yields its URL (the tests
    that use it need the `serve` extra)."""
    pytest.importorskip("fastapi", reason="the `serve` extra (fastapi, uvicorn) is not installed")
    pytest.importorskip("uvicorn", reason="the `serve` extra (fastapi, uvicorn) is not installed")
    port = free_port()
    env = {
        **os.environ,
        "MHGPO_CACHE": str(tmp_path_factory.mktemp("serve-cache")),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mhgpo",
                "serve-retriever",
                "--corpus",
                str(world / "corpus.jsonl"),
                "--port",
                str(port),
                "max_queries=64",
                "max_topk=10",
                "max_body_bytes=20000",
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {log.read_text()}")
            time.sleep(0.2)
        yield f"{base}/retrieve"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def local(world: Path) -> BM25Retriever:
    return BM25Retriever.build(load_corpus_jsonl(world / "corpus.jsonl"))


def test_health_names_the_retriever_and_its_corpus(served, local) -> None:
    health = requests.get(served.replace("/retrieve", "/health"), timeout=5).json()
    assert health == {
        "status": "ok",
        "retriever": "bm25",
        "corpus": health["corpus"],
        "passages": len(local),
        "sha256": local.fingerprint["sha256"],
        "max_queries": 64,
        "max_topk": 10,
        "max_passages": 10000,
        "max_query_chars": 2000,
    }
    assert health["corpus"] == "corpus.jsonl"  # the file's name, not its folder


def test_answers_are_the_in_process_retrievers_in_both_shapes(served, local) -> None:
    for k in (1, 3, 10):
        assert HTTPRetriever(served).search_batch(QUERIES, k) == local.search_batch(QUERIES, k)
    body = requests.post(served, json={"queries": QUERIES, "topk": 3, "return_scores": True}, timeout=10).json()
    expected = local.search_scored(QUERIES, 3)
    assert [[item["document"]["id"] for item in hits] for hits in body["result"]] == [
        [p.id for p, _ in hits] for hits in expected
    ]
    assert [[item["score"] for item in hits] for hits in body["result"]] == [[s for _, s in hits] for hits in expected]
    first = expected[0][0][0]
    assert body["result"][0][0]["document"] == {"id": first.id, "contents": f'"{first.title}"\n{first.text}'}
    plain = requests.post(served, json={"queries": ["river"]}, timeout=10).json()  # topk left out: default 3
    assert plain == {"result": [[{"id": p.id, "contents": f'"{p.title}"\n{p.text}'} for p in local.search("river", 3)]]}


@pytest.mark.parametrize(
    "body, status, detail",
    [
        ({"queries": ["q"] * 65, "topk": 1}, 413, "65 queries in one request; at most 64 (split the request)"),
        ({"queries": ["q"], "topk": 11}, 422, "topk=11: must be between 1 and 10"),
        ({"queries": ["q"], "topk": 0}, 422, "topk=0: must be between 1 and 10"),
        ({"queries": "q", "topk": 1}, 422, "body.queries: Input should be a valid list"),
        ({"topk": 1}, 422, "body.queries: Field required"),
        (
            {"queries": ["q"], "topk": "many"},
            422,
            "body.topk: Input should be a valid integer, unable to parse string as an integer",
        ),
    ],
)
def test_bad_requests_get_a_4xx_that_says_what_is_wrong(served, body, status, detail) -> None:
    answer = requests.post(served, json=body, timeout=10)
    assert (answer.status_code, answer.json()) == (status, {"detail": detail})


def test_a_body_over_the_limit_is_a_413(served) -> None:
    under = {"queries": ["word " * 300] * 13, "topk": 1}
    assert requests.post(served, json=under, timeout=10).status_code == 200
    over = {"queries": ["word " * 300] * 14, "topk": 1}
    answer = requests.post(served, json=over, timeout=10)
    size = len(json.dumps(over))
    assert size > 20000 and (answer.status_code, answer.json()) == (
        413,
        {"detail": f"request body of {size} bytes; at most 20000"},
    )


def test_a_body_that_is_not_json_is_a_422(served) -> None:
    answer = requests.post(served, data=b"not json", headers={"Content-Type": "application/json"}, timeout=10)
    assert answer.status_code == 422 and answer.json()["detail"].startswith("body.0: JSON decode error")
    assert requests.get(served, timeout=10).status_code == 405


def test_concurrent_requests_each_get_their_own_answer(served, local) -> None:
    words = sorted({w for p in local.passages[:200] for w in p.title.lower().split()})
    jobs = [
        [f"{words[(i * 7 + j) % len(words)]} {words[(i * 13 + j) % len(words)]}" for j in range(4)] for i in range(40)
    ]
    expected = [local.search_batch(q, 3) for q in jobs]
    got: dict[int, list] = {}

    def worker(offset: int) -> None:
        client = HTTPRetriever(served, cache_size=0)
        for i in range(offset, len(jobs), 8):
            got[i] = client.search_batch(jobs[i], 3)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(len(jobs))] == expected


def _eval(out: Path, world: Path, model: Path, *extra: str) -> int:
    return main(
        [
            "eval",
            "--data",
            f"hotpotqa:{world / 'dev.jsonl'}",
            "--model",
            str(model),
            "--limit",
            "4",
            "--output-dir",
            str(out),
            *extra,
            *SMALL_SEARCH,
        ]
    )


def test_eval_through_the_service_predicts_what_the_in_process_retriever_predicts(
    served, world, tiny_model_dir, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("MHGPO_CACHE", str(tmp_path / "cache"))
    assert _eval(tmp_path / "local", world, tiny_model_dir, "--corpus", str(world / "corpus.jsonl")) == 0
    assert _eval(tmp_path / "http", world, tiny_model_dir, "--retriever", served) == 0
    rows = [
        [json.loads(line) for line in (tmp_path / name / "predictions.jsonl").read_text().splitlines()]
        for name in ("local", "http")
    ]
    assert len(rows[0]) == 4 and rows[0] == rows[1]
    assert any(r["trace"]["retrieved_ids"] for r in rows[0])  # the service was searched and found passages
    metrics = [json.loads((tmp_path / name / "metrics.json").read_text()) for name in ("local", "http")]
    assert {k: v for k, v in metrics[0].items() if k != "seconds"} == {
        k: v for k, v in metrics[1].items() if k != "seconds"
    }


def test_an_unreachable_service_is_one_error_before_the_model_loads(world, tmp_path, monkeypatch, capsys) -> None:
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("mhgpo.run.setup.load_generator", no_model)
    url = f"http://127.0.0.1:{free_port()}/retrieve"
    assert _eval(tmp_path / "out", world, tmp_path / "no-model", "--retriever", url, "retrieval.retries=1") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"mhgpo: error: retrieval service {url}: cannot connect (connection refused) after 2 tries; is the server "
        f"running? (mhgpo serve-retriever starts one)"
    )
    assert not (tmp_path / "out").exists()  # nothing was written


def test_serve_retriever_serves_only_local_retrievers(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["serve-retriever", "--retriever", "http://127.0.0.1:1/retrieve"])
    assert "invalid choice" in capsys.readouterr().err
    assert main(["serve-retriever", "retrieval.retriever=http://127.0.0.1:1/retrieve"]) == 2
    assert capsys.readouterr().err.strip() == (
        "mhgpo: error: retrieval.retriever: serve-retriever serves a local "
        "retriever (bm25 or dense), not http://127.0.0.1:1/retrieve"
    )
    assert main(["serve-retriever", "max_topk=2", "default_topk=3"]) == 2
    assert capsys.readouterr().err.strip() == "mhgpo: error: default_topk: 3 is above max_topk=2"
    assert main(["serve-retriever", "--port", "0"]) == 2
    assert capsys.readouterr().err.strip() == "mhgpo: error: port: expected 1..65535, got 0"


def test_a_port_in_use_is_one_line_before_the_index_is_built(served, monkeypatch, capsys) -> None:
    def no_index(*args, **kwargs):
        raise AssertionError("the index was built")

    monkeypatch.setattr("mhgpo.retrieval.build.build_retriever", no_index)
    port = served.split(":")[2].split("/")[0]
    assert main(["serve-retriever", "--port", port]) == 2
    assert capsys.readouterr().err.strip() == (
        f"mhgpo: error: --port: cannot listen on 127.0.0.1:{port} (Address already in use)"
    )
    assert main(["serve-retriever", "--host", "no-such-host.invalid"]) == 2
    assert capsys.readouterr().err.strip().startswith("mhgpo: error: --host: cannot resolve 'no-such-host.invalid'")


def test_without_the_serve_extra_the_command_names_it(monkeypatch, capsys) -> None:
    import mhgpo.retrieval.service as service

    if service._IMPORT_ERROR is None:  # installed: as if it were not
        monkeypatch.setattr(service, "_IMPORT_ERROR", ModuleNotFoundError("No module named 'fastapi'", name="fastapi"))
    assert main(["serve-retriever"]) == 2
    assert capsys.readouterr().err.strip() == (
        "mhgpo: error: serving a retriever needs FastAPI and uvicorn (fastapi "
        "is not installed): pip install 'mhgpo[serve]'"
    )


# ------------------------------------------------------------------------------------------------- hostile clients
# The app of `mhgpo serve-retriever` under its uvicorn server (`mhgpo.retrieval.service.server`), in this process and
# with small limits, against clients that send too much, too slowly, too often or the wrong thing.

LIMITS = dict(
    max_queries=64,
    max_topk=10,
    max_passages=100,
    max_query_chars=500,
    max_body_bytes=20000,
    max_header_bytes=4096,
    cache_bytes=20000,
    header_timeout=0.5,
    body_timeout=0.5,
    keep_alive=0.5,
    max_connections=8,
    turn_queries=4,
)


@pytest.fixture(scope="module")
def bounded(local):
    """(base URL, retriever) of the service over `local`'s corpus within `LIMITS`, on a loopback port."""
    pytest.importorskip("fastapi", reason="the `serve` extra (fastapi, uvicorn) is not installed")
    from mhgpo.retrieval.service import Limits, create_app, server

    retriever = BM25Retriever.build(local.passages)
    limits = Limits(**LIMITS)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = server(create_app(retriever, limits, name="hostile"), "127.0.0.1", 0, limits)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", retriever
    srv.should_exit = True
    thread.join(10)


def raw_exchange(base: str, data: bytes, wait: float = 3.0) -> tuple[bytes, float]:
    """Send `data` on a new connection and read until the server closes it (or `wait` passes): (what came, seconds)."""
    port = int(base.rsplit(":", 1)[1])
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(wait)
        got = b""
        try:
            s.sendall(data)
            while chunk := s.recv(65536):
                got += chunk
        except OSError:  # reset, or our own time-out
            pass
    return got, time.monotonic() - started


def status_and_detail(raw: bytes) -> tuple[int, str]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["detail"]


POST = b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def test_a_huge_declared_body_is_refused_before_it_is_sent(bounded) -> None:
    raw, _ = raw_exchange(bounded[0], POST + b"Content-Length: 10000000000\r\n\r\n")
    assert status_and_detail(raw) == (413, "request body of 10000000000 bytes; at most 20000")
    assert b"connection: close" in raw.lower()


def test_a_chunked_body_bomb_is_refused_once_past_the_limit_and_no_more_is_read(bounded) -> None:
    port = int(bounded[0].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(5)
        s.sendall(POST + b"Transfer-Encoding: chunked\r\n\r\n")
        chunk, sent = b"1000\r\n" + b"[" * 4096 + b"\r\n", 0
        try:
            while sent < 1 << 30:  # a gigabyte, unless the server stops reading
                s.sendall(chunk)
                sent += len(chunk)
        except OSError:  # closed by the server: the rest is not read
            pass
        assert sent < 16 << 20  # (what the socket buffers held when the server stopped reading)
        raw = b""
        with contextlib.suppress(OSError):
            while part := s.recv(65536):
                raw += part
    if raw:  # (a reset may drop the answer that was on its way)
        assert status_and_detail(raw) == (413, "request body of more than 20000 bytes; at most 20000")


@pytest.mark.parametrize(
    "data",
    [b"", b"POST /retrieve HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100],
    ids=["idle", "slow-headers"],
)
def test_a_connection_without_headers_in_time_is_closed(bounded, data) -> None:
    raw, seconds = raw_exchange(bounded[0], data, wait=5.0)
    assert raw == b"" and seconds < 3  # closed by the server at header_timeout=0.5, not by our 5 s


def test_headers_dripping_byte_by_byte_are_cut_at_the_deadline(bounded) -> None:
    port = int(bounded[0].rsplit(":", 1)[1])
    started, closed = time.monotonic(), False
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /retrieve HTTP/1.1\r\n")
        for _ in range(200):  # a byte every 20 ms: 4 s, if the server waited
            try:
                s.sendall(b"a")
            except OSError:
                closed = True
                break
            time.sleep(0.02)
    assert closed and time.monotonic() - started < 3


def test_a_slow_body_gets_a_408(bounded) -> None:
    raw, seconds = raw_exchange(bounded[0], POST + b'Content-Length: 100\r\n\r\n{"queries"')
    assert status_and_detail(raw) == (408, "request body incomplete after 0.5 s (10 bytes)") and seconds < 3


def test_headers_over_the_limit_are_refused(bounded) -> None:
    raw, _ = raw_exchange(bounded[0], b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8000 + b"\r\n\r\n")
    status, detail = status_and_detail(raw)
    assert status == 431 and re.fullmatch(r"request line and headers of 80\d\d bytes; at most 4096", detail)
    port = int(bounded[0].rsplit(":", 1)[1])  # the same, coming in several reads: refused by h11 before complete
    raw = b""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        s.settimeout(0.05)
        with contextlib.suppress(OSError):
            for _ in range(10):  # what is answered is read before more is sent (which would reset the connection)
                s.sendall(b"a" * 1000)
                with contextlib.suppress(TimeoutError):
                    raw += s.recv(65536)
                if raw:
                    break
    assert raw.startswith(b"HTTP/1.1 400 ")


def test_connections_over_the_limit_get_a_503_and_the_service_recovers(bounded) -> None:
    base, _ = bounded
    port = int(base.rsplit(":", 1)[1])
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(LIMITS["max_connections"])]
    try:
        time.sleep(0.1)
        answer = requests.post(f"{base}/retrieve", json={"queries": ["river"]}, timeout=5)
        assert (answer.status_code, answer.json()) == (503, {"detail": "8 connections already; try again"})
        time.sleep(1.0)  # the idle connections are closed at header_timeout
        assert requests.post(f"{base}/retrieve", json={"queries": ["river"]}, timeout=5).status_code == 200
    finally:
        for s in held:
            s.close()


def test_many_concurrent_clients_all_get_their_answers_within_the_connection_limit(bounded, local) -> None:
    base, _ = bounded
    jobs = [[f"town {i}", f"river {i % 7}", "company"] for i in range(48)]
    expected = [local.search_batch(q, 3) for q in jobs]
    got: dict[int, list] = {}

    def worker(offset: int) -> None:  # 24 clients for 8 connections: the 503s are retried
        client = HTTPRetriever(f"{base}/retrieve", cache_size=0, backoff=0.05, retries=10)
        for i in range(offset, len(jobs), 24):
            got[i] = client.search_batch(jobs[i], 3)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got.get(i) for i in range(len(jobs))] == expected


def test_pipelined_requests_neither_hang_nor_answer_out_of_order(bounded) -> None:
    get = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    raw, seconds = raw_exchange(bounded[0], get + b"GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n" + get, wait=5.0)
    statuses = [line.split(b" ")[1] for line in raw.split(b"\r\n") if line.startswith(b"HTTP/1.1")]
    assert statuses == [b"200", b"404", b"200"][: len(statuses)] and statuses and seconds < 3


@pytest.mark.parametrize(
    "body, status, detail",
    [
        ({"queries": ["a" * 501]}, 413, "queries[0] has 501 characters; at most 500"),
        ({"queries": ["q"] * 11, "topk": 10}, 413, "11 queries x topk 10 = 110 passages in one answer; at most 100"),
        ({"queries": [1, 2]}, 422, "body.queries.0: Input should be a valid string; body.queries.1: Input should be"),
        ({"queries": [["/etc/passwd"]]}, 422, "body.queries.0: Input should be a valid string"),
        ({"queries": ["q"], "topk": 1.5}, 422, "body.topk: Input should be a valid integer, got a number with a"),
        ({"queries": ["q"], "topk": 1e300}, 422, "body.topk: "),
        ({"queries": ["q"], "return_scores": "maybe"}, 422, "body.return_scores: Input should be a valid boolean"),
        (["q"], 422, "body: Input should be a valid dictionary or object to extract fields from"),
    ],
)
def test_requests_over_the_limits_or_of_the_wrong_types_say_which_without_echoing(bounded, body, status, detail):
    answer = requests.post(f"{bounded[0]}/retrieve", json=body, timeout=5)
    assert answer.status_code == status and answer.json()["detail"].startswith(detail), answer.text
    assert "/etc/passwd" not in answer.text and "Traceback" not in answer.text


@pytest.mark.parametrize(
    "raw, status",
    [
        (b"[" * 19000, 400),  # nested too deep for the JSON parser
        (b'{"queries": ["a"], "topk": NaN}', 422),
        (b'{"queries": ["a"], "topk": ' + b"9" * 5000 + b"}", 400),  # beyond Python's integer parsing
        (b'{"queries": ["\xff\xfe"]}', 400),  # not UTF-8
    ],
)
def test_bodies_no_parser_likes_are_a_4xx_without_a_traceback(bounded, raw, status) -> None:
    answer = requests.post(f"{bounded[0]}/retrieve", data=raw, headers={"Content-Type": "application/json"}, timeout=5)
    assert answer.status_code == status and set(answer.json()) == {"detail"} and "Traceback" not in answer.text


def test_a_failing_search_is_a_500_that_names_nothing(local) -> None:
    from fastapi.testclient import TestClient

    from mhgpo.retrieval.service import create_app

    broken = BM25Retriever.build(local.passages)

    def explode(queries, k):
        raise RuntimeError("/secret/index/path is corrupt")

    broken._search_scored = explode
    answer = TestClient(create_app(broken), raise_server_exceptions=False).post("/retrieve", json={"queries": ["a"]})
    assert (answer.status_code, answer.text) == (500, "Internal Server Error")


def test_the_result_cache_is_bounded_in_bytes(bounded) -> None:
    base, retriever = bounded
    for i in range(30):
        query = f"{i} " + "river town " * 40  # ~450 characters: ~500 bytes a cache entry
        assert requests.post(f"{base}/retrieve", json={"queries": [query], "topk": 1}, timeout=5).status_code == 200
    info = retriever.cache_info()
    assert info.maxbytes == 20000 and 0 < info.nbytes <= 20000 and 10 < info.size < 30


def test_the_search_lock_is_granted_in_arrival_order() -> None:
    """A request that takes turn after turn cannot pass the requests that asked meanwhile."""
    from mhgpo.retrieval.service import Turns

    turns, order = Turns(), []
    first_in, release = threading.Event(), threading.Event()

    def big() -> None:
        with turns:
            first_in.set()
            release.wait(5)
            order.append("big 1")
        with turns:  # asks again at once
            order.append("big 2")

    def small(name: str, after: threading.Event) -> None:
        after.wait(5)
        with turns:
            order.append(name)

    threads = [threading.Thread(target=big), threading.Thread(target=small, args=("a", first_in))]
    for t in threads:
        t.start()
    first_in.wait(5)
    time.sleep(0.05)  # "a" is waiting
    release.set()
    for t in threads:
        t.join(5)
    assert order == ["big 1", "a", "big 2"]


def test_the_limit_keys_are_checked_naming_the_key(capsys) -> None:
    for override, message in [
        ("max_query_chars=0", "max_query_chars: must be at least 1, got 0"),
        ("max_connections=0", "max_connections: must be at least 1, got 0"),
        ("max_header_bytes=100", "max_header_bytes: must be at least 1024, got 100"),
        ("cache_bytes=-1", "cache_bytes: must be at least 0, got -1"),
        ("header_timeout=0", "header_timeout: must be positive, got 0.0"),
        ("body_timeout=-1", "body_timeout: must be positive, got -1.0"),
        ("keep_alive=abc", "keep_alive: expected a number, got 'abc'"),
    ]:
        assert main(["serve-retriever", override]) == 2
        assert capsys.readouterr().err.strip() == f"mhgpo: error: {message}"
