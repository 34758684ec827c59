"""The retrieval-service client (`--retriever http://HOST:PORT/retrieve`) against a minimal server written here to
the protocol's published shape (Search-R1's retrieval server), so that it is not only tested against our own:
parsing, batching, the cache, retries and the one-line errors."""

from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mhgpo.config import RetrievalConfig, from_dict
from mhgpo.data.records import Passage
from mhgpo.errors import InputError, ServiceError
from mhgpo.retrieval.http import HTTPRetriever, contents_of, passage_from_document

CORPUS = [
    Passage("d0", "Alpha River", "The Alpha River flows through Brenn."),
    Passage("d1", 'The "Quoted" Mill', "A mill on the Alpha River.\nIt was built in 1820."),
    Passage("d2", "Brenn", "Brenn is a town founded by Cora Vell."),
    Passage("d3", "Cora Vell", "Cora Vell was a miller."),
]


def overlap_search(query: str, k: int) -> list[tuple[Passage, float]]:
    """Passages sharing words with the query, most shared first (ties by corpus order)."""
    words = set(query.lower().split())
    scored = [
        (len(words & set(f"{p.title} {p.text}".lower().replace(".", "").split())), i) for i, p in enumerate(CORPUS)
    ]
    ranked = sorted((-s, i) for s, i in scored if s > 0)[:k]
    return [(CORPUS[i], float(-s)) for s, i in ranked]


class ProtocolServer(ThreadingHTTPServer):
    """`POST /retrieve` as Search-R1's server answers it: `{"result": [[{"document": {"id", "contents"}, "score"}]]}`
    (with return_scores; the documents alone without). `script` holds what to answer instead of the next requests
    (an HTTP status, or raw bytes with status 200); `bodies` records the requests."""

    daemon_threads = True

    def __init__(self, search=overlap_search) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.search = search  # (query, k) -> [(passage, score), ...]
        self.failing = False  # every answer a 503
        self.script: list[int | bytes] = []
        self.bodies: list[dict] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/retrieve"


class Handler(BaseHTTPRequestHandler):
    server: ProtocolServer

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.bodies.append(body)
            scripted = self.server.script.pop(0) if self.server.script else None
            if self.server.failing:
                scripted = 503
        if isinstance(scripted, int):
            self._send(scripted, json.dumps({"detail": f"scripted {scripted}"}).encode())
            return
        if isinstance(scripted, bytes):
            self._send(200, scripted)
            return
        result = []
        for q in body["queries"]:
            hits = self.server.search(q, body.get("topk") or 3)
            docs = [{"id": p.id, "contents": contents_of(p)} for p, _ in hits]
            result.append(
                [{"document": d, "score": s} for d, (_, s) in zip(docs, hits)] if body.get("return_scores") else docs
            )
        self._send(200, json.dumps({"result": result}).encode())

    def _send(self, status: int, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@contextlib.contextmanager
def serving(search=overlap_search):
    srv = ProtocolServer(search)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def server():
    with serving() as srv:
        yield srv


def client(url: str, **kw) -> HTTPRetriever:
    return HTTPRetriever(url, **{"backoff": 0.01, "timeout": 5.0, **kw})


# ------------------------------------------------------------------------------------------------ documents


def test_documents_map_to_passages_with_the_title_split_off_and_unquoted() -> None:
    for p in CORPUS:
        assert passage_from_document({"id": p.id, "contents": contents_of(p)}) == p
    assert passage_from_document({"id": 7, "contents": '"T"\nline one\nline two'}) == Passage(
        "7", "T", "line one\nline two"
    )
    assert passage_from_document({"id": "x", "contents": "no title line"}) == Passage("x", "", "no title line")
    assert passage_from_document({"id": "x", "title": "T", "text": "body"}) == Passage("x", "T", "body")
    a = passage_from_document({"contents": '"T"\nbody'})
    assert (a.title, a.text) == ("T", "body") and a.id == passage_from_document({"contents": '"T"\nbody'}).id
    assert a.id != passage_from_document({"contents": '"T"\nother'}).id
    for bad in ("text", {"id": "x"}, {"id": ["x"], "contents": "a"}):
        with pytest.raises(ValueError):
            passage_from_document(bad)


# --------------------------------------------------------------------------------------------------- client


def test_the_client_returns_the_servers_passages_in_order_for_both_answer_shapes(server) -> None:
    queries = ["alpha river", "cora vell miller", "nothing here", "brenn town"]
    expected = [[p for p, _ in overlap_search(q, 2)] for q in queries]
    assert client(server.url).search_batch(queries, 2) == expected
    assert server.bodies == [{"queries": queries, "topk": 2, "return_scores": False}]
    assert expected[0] == [CORPUS[0], CORPUS[1]] and expected[2] == []
    scored = client(server.url).search_scored(queries, 2)  # (uncached) with scores: the other answer shape
    assert [[p for p, _ in hits] for hits in scored] == expected
    assert [[s for _, s in hits] for hits in scored] == [[s for _, s in overlap_search(q, 2)] for q in queries]
    assert server.bodies[1] == {"queries": queries, "topk": 2, "return_scores": True}


def test_one_request_per_round_split_above_request_queries_and_cached(server) -> None:
    r = client(server.url, request_queries=2)
    queries = ["alpha", "brenn", "alpha", "mill", "cora", "vell"]  # 5 distinct
    first = r.search_batch(queries, 3)
    assert [b["queries"] for b in server.bodies] == [["alpha", "brenn"], ["mill", "cora"], ["vell"]]
    assert first == [[p for p, _ in overlap_search(q, 3)] for q in queries]
    again = r.search_batch(["vell", "alpha", "river"], 3)  # only the new query is sent
    assert [b["queries"] for b in server.bodies[3:]] == [["river"]]
    assert again == [first[5], first[0], [p for p, _ in overlap_search("river", 3)]]
    assert r.answered == 4 and r.cache_info().hits == 3


def test_5xx_answers_are_retried_then_succeed(server) -> None:
    server.script = [503, 500]
    r = client(server.url, retries=2)
    assert r.search_batch(["alpha"], 1) == [[CORPUS[0]]]
    assert len(server.bodies) == 3


def test_5xx_after_the_last_retry_is_one_error_naming_the_url(server) -> None:
    server.script = [500] * 3
    with pytest.raises(ServiceError) as err:
        client(server.url, retries=2).search_batch(["alpha"], 1)
    assert str(err.value) == (
        f"retrieval service {server.url}: HTTP 500 (scripted 500) after 3 tries; is the server "
        f"running? (mhgpo serve-retriever starts one)"
    )
    assert len(server.bodies) == 3


def test_4xx_is_not_retried(server) -> None:
    server.script = [422]
    with pytest.raises(ServiceError, match=r"HTTP 422 \(scripted 422\) for a request of 1 queries, topk=1"):
        client(server.url, retries=3).search_batch(["alpha"], 1)
    assert len(server.bodies) == 1


@pytest.mark.parametrize(
    "raw, problem",
    [
        (b"<html>oops</html>", "the answer is not JSON (<html>oops</html>)"),
        (b'{"results": []}', 'malformed answer: expected an object with a "result" list, got results'),
        (b'{"result": [[], []]}', 'malformed answer: "result" should hold one list per query (1), got 2'),
        (
            b'{"result": [[{"document": {"id": "a"}}]]}',
            "malformed answer: result[0][0]: a document has neither contents nor text (keys: id)",
        ),
        (
            b'{"result": [[{"document": {"id": "a", "contents": "x"}, "score": "high"}]]}',
            "malformed answer: result[0][0]: score 'high' is not a finite number",
        ),
    ],
)
def test_a_malformed_answer_is_one_error_naming_the_url_and_the_problem(server, raw, problem) -> None:
    server.script = [raw]
    with pytest.raises(ServiceError) as err:
        client(server.url, retries=3).search_batch(["alpha"], 1)
    assert str(err.value) == f"retrieval service {server.url}: {problem}"
    assert len(server.bodies) == 1  # not retried


def test_an_unreachable_server_is_one_error_after_the_retries() -> None:
    srv = ProtocolServer()  # bound, then closed: nothing listens on its port
    url = srv.url
    srv.server_close()
    with pytest.raises(ServiceError) as err:
        client(url, retries=1).probe()
    assert str(err.value) == (
        f"retrieval service {url}: cannot connect (connection refused) after 2 tries; is the "
        f"server running? (mhgpo serve-retriever starts one)"
    )


def test_a_server_that_does_not_answer_in_time_is_one_error() -> None:
    import socket

    sock = socket.socket()  # accepts connections (the backlog) but never answers
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/retrieve"
    try:
        with pytest.raises(ServiceError, match=r"no answer within 0.2 s after 1 try"):
            client(url, retries=0, timeout=0.2).probe()
    finally:
        sock.close()


# --------------------------------------------------------------------------------------------------- config


def test_the_retriever_key_takes_a_url_and_rejects_what_a_service_cannot_use() -> None:
    cfg = from_dict(RetrievalConfig, {"retriever": "http://127.0.0.1:8000/retrieve", "request_queries": 8})
    assert cfg.retriever == "http://127.0.0.1:8000/retrieve" and cfg.request_queries == 8
    cases = [
        (
            {"retriever": "bm26"},
            "retrieval.retriever: expected bm25 or dense or the URL of a retrieval service "
            "(http://HOST:PORT/retrieve), got 'bm26'",
        ),
        ({"retriever": "http:///retrieve"}, "retrieval.retriever: 'http:///retrieve' names no host"),
        (
            {"retriever": "http://h:1/retrieve", "corpus": "c.jsonl"},
            "retrieval.corpus: the retrieval service at http://h:1/retrieve searches its own corpus",
        ),
        ({"retriever": "http://h:1/retrieve", "index": "idx"}, "retrieval.index: the retrieval service"),
        ({"request_queries": 0}, "retrieval.request_queries: must be at least 1, got 0"),
        ({"timeout": 0}, "retrieval.timeout: must be positive, got 0"),
        ({"retries": -1}, "retrieval.retries: must be between 0 and 10, got -1"),
    ]
    for data, message in cases:
        with pytest.raises(InputError) as err:
            from_dict(RetrievalConfig, data)
        assert str(err.value).startswith(message), str(err.value)


def test_build_retriever_probes_the_service(server) -> None:
    from mhgpo.retrieval.build import build_retriever

    retrieval = from_dict(RetrievalConfig, {"retriever": server.url, "retries": 0})
    r = build_retriever("synthetic", retrieval)
    assert isinstance(r, HTTPRetriever) and r.url == server.url and r.retries == 0
    assert server.bodies == [{"queries": ["retrieval service probe"], "topk": 1, "return_scores": False}]
    server.script = [b"[]"]
    with pytest.raises(ServiceError, match="malformed answer: expected an object"):
        build_retriever("synthetic", retrieval)


# ------------------------------------------------------------------------------------------------- training


@pytest.mark.parametrize("where", ["rollouts", "validation"])
def test_a_service_failure_mid_run_stops_training_cleanly_and_resume_gives_the_uninterrupted_run(
    where, reference_run, tiny_model_dir, world, tmp_path, capsys, monkeypatch
) -> None:
    """The service answers 503 from step 2's rollouts on (step 1 saved), or from step 2's validation on (after its
    update; checkpoints every 3 steps): the run stops with one line naming the step, the URL and the checkpoint
    saved. A step whose update is done is complete: its validation failing, it is logged without it and saved.
    Resumed once the service is back, either run is the reference run (which searched the same corpus in-process),
    less step 2's validation in the second."""
    from helpers import assert_same_run, train_overrides

    import mhgpo.rl.trainer as trainer_module
    from mhgpo.cli.main import main
    from mhgpo.data.formats import load_corpus_jsonl
    from mhgpo.model.checkpoint import list_checkpoints
    from mhgpo.retrieval.bm25 import BM25Retriever, CachedRetriever
    from mhgpo.runtime.runlog import read_metrics

    _, reference, _ = reference_run
    local = BM25Retriever.build(load_corpus_jsonl(world / "corpus.jsonl"))
    out = tmp_path / "run"
    from mhgpo.rl.policy import Policy

    real_save, real_update, updates = trainer_module.save_checkpoint, Policy.update, []
    with serving(lambda q, k: local.search_scored([q], k)[0]) as srv:

        def fail() -> None:  # from now on every request fails (and no answer comes from a cache)
            srv.failing = True
            monkeypatch.setattr(CachedRetriever, "_cache_get", lambda self, key: None)

        def save_then_fail(*args, **kwargs):  # step 1 saved: step 2's rollouts fail
            path = real_save(*args, **kwargs)
            fail()
            return path

        def update_then_fail(self, samples, *rest):  # step 2's update done: its validation fails
            out = real_update(self, samples, *rest)
            updates.append(1)
            if len(updates) == 2:
                fail()
            return out

        if where == "rollouts":
            monkeypatch.setattr(trainer_module, "save_checkpoint", save_then_fail)
        else:
            monkeypatch.setattr(Policy, "update", update_then_fail)
        save_every = 1 if where == "rollouts" else 3
        overrides = train_overrides(tiny_model_dir, world, out, save_every=save_every, **{"retrieval.corpus": "null"})
        capsys.readouterr()
        rc = main(["train", *overrides, f"retrieval.retriever={srv.url}", "retrieval.retries=0"])
        err = capsys.readouterr().err
        assert rc == 2, err
        lines = [line for line in err.strip().splitlines() if line.startswith("mhgpo: error")]
        step, phase = (1, "rollouts") if where == "rollouts" else (2, "validation")
        assert lines == [
            f"mhgpo: error: step 2: retrieval service {srv.url}: HTTP 503 (scripted 503) after 1 try; is the "
            f"server running? (mhgpo serve-retriever starts one) (in its {phase}); the run stops at step {step}; its "
            f"completed steps are saved (its last checkpoint is step_{step}); continue with: mhgpo train --resume {out}"
        ], err
        rows = read_metrics(out)
        assert [r["step"] for r in rows] == list(range(1, step + 1)) and not any("val/f1" in r for r in rows)
        assert [p.name for p in list_checkpoints(out)] == [f"step_{step}"]
        assert "saved" not in capsys.readouterr().out  # the error line says what was saved
        monkeypatch.undo()
        srv.failing = False
        assert main(["train", "--resume", str(out)]) == 0
    assert_same_run(out, reference, unlogged={2: "val/"} if where == "validation" else None)


def test_a_service_failure_mid_eval_keeps_the_finished_questions_and_resume_completes_them(
    tiny_model_dir, world, tmp_path, capsys, monkeypatch
) -> None:
    """The service fails once the first batch of questions is written: the evaluation ends with one line, the
    finished questions stay in predictions.jsonl, and `--resume` completes what an uninterrupted evaluation writes."""
    import mhgpo.io
    import mhgpo.run.evaluate
    from mhgpo.cli.main import main
    from mhgpo.data.formats import load_corpus_jsonl
    from mhgpo.retrieval.bm25 import BM25Retriever, CachedRetriever

    local = BM25Retriever.build(load_corpus_jsonl(world / "corpus.jsonl"))
    small = ["search.rewriter.max_new_tokens=8", "search.reranker.max_new_tokens=4", "search.answerer.max_new_tokens=4"]
    with serving(lambda q, k: local.search_scored([q], k)[0]) as srv:

        def run(out):
            return main(
                [
                    "eval",
                    "--data",
                    f"hotpotqa:{world / 'dev.jsonl'}",
                    "--model",
                    str(tiny_model_dir),
                    "--limit",
                    "4",
                    "--batch-size",
                    "2",
                    "--retriever",
                    srv.url,
                    "retrieval.retries=0",
                    *small,
                    "--output-dir",
                    str(out),
                ]
            )

        assert run(tmp_path / "whole") == 0
        real = mhgpo.run.evaluate.append_jsonl

        def append_then_fail(path, rows, *args, **kwargs):
            real(path, rows, *args, **kwargs)
            srv.failing = True
            monkeypatch.setattr(CachedRetriever, "_cache_get", lambda self, key: None)

        monkeypatch.setattr(mhgpo.run.evaluate, "append_jsonl", append_then_fail)  # the routine's per-batch save
        capsys.readouterr()
        assert run(tmp_path / "cut") == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1] == (
            f"mhgpo: error: retrieval service {srv.url}: HTTP 503 (scripted 503) after 1 try; is the "
            f"server running? (mhgpo serve-retriever starts one)"
        )
        kept = (tmp_path / "cut" / "predictions.jsonl").read_text().splitlines()
        whole = (tmp_path / "whole" / "predictions.jsonl").read_text().splitlines()
        assert kept == whole[:2]
        monkeypatch.undo()
        srv.failing = False
        assert main(["eval", "--resume", str(tmp_path / "cut")]) == 0
        assert (tmp_path / "cut" / "predictions.jsonl").read_text().splitlines() == whole
