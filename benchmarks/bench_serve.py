"""A bounded load test of `mhgpo serve-retriever` on the loopback interface: `--clients` threads each send
`--requests` requests of `--queries` distinct questions (the synthetic world's training questions, so that the
server's cache answers none of them) and check every answer against the in-process BM25 retriever over the same
corpus. Prints how many answers were correct, wrong and lost, the latency percentiles (p50 / p90 / p99) and the
throughput.

    python benchmarks/bench_serve.py [--clients 8] [--requests 50] [--queries 4] [--topk 3] [--json OUT]

The server runs as its own process (`python -m mhgpo serve-retriever`, BM25 over the default synthetic world); the
`serve` extra (fastapi, uvicorn) must be installed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import requests

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "mhgpo", "serve-retriever", "--port", str(port)], env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except requests.ConnectionError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("bench_serve: the server did not start")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=50, help="requests per client")
    ap.add_argument("--queries", type=int, default=4, help="queries per request")
    ap.add_argument("--topk", type=int, default=3)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()

    from mhgpo.config import RetrievalConfig
    from mhgpo.data.spec import load_data
    from mhgpo.retrieval.service import document
    from mhgpo.team.build import build_retriever

    local = build_retriever("synthetic", RetrievalConfig())  # the corpus the server serves (its index, cached)
    questions = list(dict.fromkeys(e.question for e in load_data("synthetic:train")))
    total = args.clients * args.requests
    if len(questions) < total * args.queries:
        raise SystemExit(f"bench_serve: {len(questions)} distinct questions for {total * args.queries} queries")
    batches = [questions[i * args.queries : (i + 1) * args.queries] for i in range(total)]
    expected = [[[document(p) for p in hits] for hits in local.search_batch(b, args.topk)] for b in batches]

    port = free_port()
    url = f"http://127.0.0.1:{port}/retrieve"
    proc = start_server(port)
    latencies: list[float] = []
    outcome = {"correct": 0, "wrong": 0, "lost": 0}
    lock = threading.Lock()

    def client(c: int) -> None:
        session = requests.Session()
        for r in range(args.requests):
            i = c * args.requests + r
            start = time.perf_counter()
            try:
                answer = session.post(url, json={"queries": batches[i], "topk": args.topk}, timeout=60)
                ok = answer.status_code == 200 and answer.json() == {"result": expected[i]}
                kind = "correct" if ok else "wrong"
            except (requests.RequestException, ValueError):
                kind = "lost"
            seconds = time.perf_counter() - start
            with lock:
                outcome[kind] += 1
                latencies.append(seconds)

    try:
        started = time.perf_counter()
        threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - started
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    ms = np.asarray(latencies) * 1000
    figures = {
        "clients": args.clients,
        "requests": total,
        "queries_per_request": args.queries,
        "topk": args.topk,
        "passages": len(local),
        **outcome,
        "p50_ms": float(np.percentile(ms, 50)),
        "p90_ms": float(np.percentile(ms, 90)),
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()),
        "seconds": wall,
        "requests_per_s": total / wall,
        "queries_per_s": total * args.queries / wall,
        "cpus": os.cpu_count(),
    }
    print(
        f"{total} requests ({args.clients} clients x {args.requests}, {args.queries} queries each, topk "
        f"{args.topk}, BM25 over {len(local)} passages): {outcome['correct']} correct, {outcome['wrong']} wrong, "
        f"{outcome['lost']} lost"
    )
    print(
        f"latency p50 {figures['p50_ms']:.1f} ms, p90 {figures['p90_ms']:.1f} ms, p99 {figures['p99_ms']:.1f} ms "
        f"(max {figures['max_ms']:.1f}); {figures['requests_per_s']:.1f} requests/s, "
        f"{figures['queries_per_s']:.1f} queries/s in {wall:.2f} s on {os.cpu_count()} CPUs"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    return 0 if outcome["correct"] == total else 1


if __name__ == "__main__":
    sys.exit(main())
