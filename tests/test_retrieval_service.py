"""`mhgpo serve-retriever` as a real process on the loopback interface: its answers are those of the in-process
retriever (alone and under concurrent requests), its limits answer 4xx, and `mhgpo eval --retriever URL` through it
predicts exactly what `mhgpo eval` with the in-process BM25 retriever predicts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from mhgpo.cli.main import main
from mhgpo.data.formats import load_corpus_jsonl
from mhgpo.data.synth import write_world
from mhgpo.retrieval.bm25 import BM25Retriever
from mhgpo.retrieval.http import HTTPRetriever

REPO = Path(__file__).resolve().parents[1]
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    assert health["corpus"].endswith("corpus.jsonl")


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

    monkeypatch.setattr("mhgpo.cli.main.load_generator", no_model)
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

    monkeypatch.setattr("mhgpo.team.build.build_retriever", no_index)
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
