"""A bounded load test of `mhgpo serve-retriever` on the loopback interface, in two phases.

1. Normal load: `--clients` threads each send `--requests` requests of `--queries` distinct questions (the synthetic
   world's training questions, so that the server's cache answers none of them) and check every answer against the
   in-process BM25 retriever over the same corpus.
2. Under attack: the same normal clients again (other queries, still checked), while attackers run alongside:
   `--slow-headers` connections dripping their headers a byte at a time, `--slow-bodies` dripping their bodies,
   `--large-bodies` threads sending bodies far over the limit (a huge Content-Length, then endless chunks), and
   `--heavy` threads sending the largest requests the limits allow (1000 queries x topk 10), and `--flood` idle
   connections (with the others, past the server's `max_connections`). A normal request answered 503 (the
   connection limit) is retried after 0.1 s, as a client would.

Prints, for each phase, how many answers were correct, wrong and lost and the normal clients' latency percentiles
(p50 / p90 / p99); for the attack, what the attackers got (how long a slow connection lived, the statuses), and the
server's peak resident memory (VmHWM) after each phase.

    python benchmarks/bench_serve.py [--clients 8] [--requests 50] [--queries 4] [--topk 3] [--slow-headers 16]
        [--slow-bodies 16] [--large-bodies 4] [--heavy 2] [--flood 40] [--attack-seconds 10] [--json OUT]

The server runs as its own process (`python -m mhgpo serve-retriever`, BM25 over the default synthetic world, the
default limits but shorter header and body deadlines: `--server-limits`); the `serve` extra (fastapi, uvicorn) must be installed. Linux (the memory is read from /proc).
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
from collections import Counter
from pathlib import Path

import numpy as np
import requests

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, overrides: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "mhgpo", "serve-retriever", "--port", str(port), *overrides]
    proc = subprocess.Popen(command, env=env)
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


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident memory (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def normal_clients(url: str, batches: list, expected: list, args: argparse.Namespace) -> dict:
    """`args.clients` threads sending their share of `batches`, each answer checked; outcome and latencies."""
    latencies: list[float] = []
    outcome = {"correct": 0, "wrong": 0, "lost": 0, "busy_retries": 0}
    lock = threading.Lock()

    def client(c: int) -> None:
        session = requests.Session()
        for r in range(args.requests):
            i = c * args.requests + r
            start, kind, busy = time.perf_counter(), "lost", 0
            try:
                while True:
                    answer = session.post(url, json={"queries": batches[i], "topk": args.topk}, timeout=60)
                    if answer.status_code != 503 or busy >= 50:
                        break
                    busy += 1
                    time.sleep(0.1)
                ok = answer.status_code == 200 and answer.json() == {"result": expected[i]}
                kind = "correct" if ok else "wrong"
            except (requests.RequestException, ValueError):
                pass
            with lock:
                outcome[kind] += 1
                outcome["busy_retries"] += busy
                latencies.append(time.perf_counter() - start)

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ms = np.asarray(latencies) * 1000
    return {
        **outcome,
        "p50_ms": float(np.percentile(ms, 50)),
        "p90_ms": float(np.percentile(ms, 90)),
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()),
        "seconds": time.perf_counter() - started,
    }


class Attack:
    """The attackers, each a thread that repeats its attack until `stop`; what they saw is tallied in `seen`."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.seen: dict[str, list] = {"slow_headers_s": [], "slow_body": [], "large_body": [], "heavy": [], "flood": []}

    def note(self, key: str, value: object) -> None:
        with self.lock:
            self.seen[key].append(value)

    def _connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port))
        s.settimeout(30)
        return s

    def slow_headers(self) -> None:
        """A request line, then a header byte every 0.2 s: how long until the server closes the connection."""
        while not self.stop.is_set():
            started = time.monotonic()
            with self._connect() as s:
                try:
                    s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                    while not self.stop.is_set():
                        s.sendall(b"a")
                        time.sleep(0.2)
                except OSError:
                    self.note("slow_headers_s", time.monotonic() - started)

    def slow_body(self) -> None:
        """Headers announcing 1000 bytes, then a byte every 0.2 s: the status the server answers."""
        while not self.stop.is_set():
            with self._connect() as s:
                try:
                    s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
                    s.sendall(b"Content-Length: 1000\r\n\r\n")
                    s.settimeout(0.2)
                    while not self.stop.is_set():
                        s.sendall(b" ")
                        try:
                            answer = s.recv(4096)
                        except TimeoutError:
                            continue
                        self.note("slow_body", answer.split(b" ")[1].decode() if answer else "closed")
                        break
                except OSError:
                    self.note("slow_body", "reset")

    def large_body(self) -> None:
        """A body declared at 1 GB, then a chunked one of up to 64 MB: the status and the bytes the server took."""
        chunk = b"10000\r\n" + b" " * 0x10000 + b"\r\n"
        heads = [b"Content-Length: 1000000000\r\n\r\n", b"Transfer-Encoding: chunked\r\n\r\n"]
        n = 0
        while not self.stop.is_set():
            sent, status = 0, "reset"
            with self._connect() as s:
                try:
                    s.sendall(
                        b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + heads[n % 2]
                    )
                    while sent < 64 << 20:
                        s.sendall(chunk)
                        sent += len(chunk)
                except OSError:
                    pass
                try:
                    answer = s.recv(4096)
                    status = answer.split(b" ")[1].decode() if answer else "closed"
                except (OSError, IndexError):
                    pass
            self.note("large_body", (status, sent))
            n += 1

    def flood(self) -> None:
        """A connection that sends nothing: answered 503 at once when the server holds its most connections, else
        closed at the header deadline."""
        while not self.stop.is_set():
            with self._connect() as s:
                try:
                    answer = s.recv(4096)
                    self.note("flood", answer.split(b" ")[1].decode() if answer else "closed")
                except OSError:
                    self.note("flood", "reset")

    def heavy(self, questions: list[str]) -> None:
        """The largest request the default limits allow: 1000 queries, topk 10 (10,000 passages)."""
        session, n = requests.Session(), 0
        while not self.stop.is_set():
            queries = [f"{questions[(n * 1000 + j) % len(questions)]} h{n}" for j in range(1000)]
            started = time.perf_counter()
            try:
                answer = session.post(f"http://127.0.0.1:{self.port}/retrieve", json={"queries": queries, "topk": 10})
                self.note("heavy", (answer.status_code, time.perf_counter() - started))
            except requests.RequestException:
                self.note("heavy", ("lost", time.perf_counter() - started))
            n += 1

    def start(self, args: argparse.Namespace, questions: list[str]) -> list[threading.Thread]:
        jobs = [self.slow_headers] * args.slow_headers + [self.slow_body] * args.slow_bodies
        jobs += [self.large_body] * args.large_bodies + [self.flood] * args.flood
        threads = [threading.Thread(target=job, daemon=True) for job in jobs]
        threads += [threading.Thread(target=self.heavy, args=(questions,), daemon=True) for _ in range(args.heavy)]
        for t in threads:
            t.start()
        return threads

    def summary(self) -> dict:
        lived = self.seen["slow_headers_s"] or [float("nan")]

        def statuses(key: str) -> dict[str, int]:
            return dict(Counter(str(x if isinstance(x, str) else x[0]) for x in self.seen[key]))

        taken = [sent for _, sent in self.seen["large_body"]] or [0]
        heavy_s = [t for status, t in self.seen["heavy"] if status == 200] or [float("nan")]
        return {
            "slow_header_connections": len(self.seen["slow_headers_s"]),
            "slow_header_max_life_s": float(max(lived)),
            "slow_body": statuses("slow_body"),
            "large_body": statuses("large_body"),
            "large_body_max_sent_mib": max(taken) / (1 << 20),
            "heavy": statuses("heavy"),
            "flood": statuses("flood"),
            "heavy_median_s": float(np.median(heavy_s)),
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=50, help="requests per client")
    ap.add_argument("--queries", type=int, default=4, help="queries per request")
    ap.add_argument("--topk", type=int, default=3)
    ap.add_argument("--slow-headers", type=int, default=16, help="attack: connections dripping their headers")
    ap.add_argument("--slow-bodies", type=int, default=16, help="attack: connections dripping their bodies")
    ap.add_argument("--large-bodies", type=int, default=4, help="attack: threads sending bodies over the limit")
    ap.add_argument("--heavy", type=int, default=2, help="attack: threads sending the largest allowed requests")
    ap.add_argument(
        "--flood", type=int, default=40, help="attack: idle connections (past the server's 64, with the rest)"
    )
    ap.add_argument("--attack-seconds", type=float, default=10.0, help="the attack lasts at least this long")
    ap.add_argument(
        "--server-limits",
        default="header_timeout=2 body_timeout=3",
        help="overrides of the server's limits (shorter deadlines, so that the attack meets them)",
    )
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()

    from mhgpo.config import RetrievalConfig
    from mhgpo.data.spec import load_data
    from mhgpo.retrieval.build import build_retriever
    from mhgpo.retrieval.service import document

    local = build_retriever("synthetic", RetrievalConfig())  # the corpus the server serves (its index, cached)
    questions = list(dict.fromkeys(e.question for e in load_data("synthetic:train")))
    total = args.clients * args.requests
    if len(questions) < total * args.queries:
        raise SystemExit(f"bench_serve: {len(questions)} distinct questions for {total * args.queries} queries")
    batches = [questions[i * args.queries : (i + 1) * args.queries] for i in range(total)]
    # the attack phase's queries: the same questions with a word the corpus lacks (same answers, not cached)
    attacked = [[f"{q} zz{i}" for q in b] for i, b in enumerate(batches)]
    expected = [[[document(p) for p in hits] for hits in local.search_batch(b, args.topk)] for b in batches]
    expected_attacked = [[[document(p) for p in hits] for hits in local.search_batch(b, args.topk)] for b in attacked]

    port = free_port()
    url = f"http://127.0.0.1:{port}/retrieve"
    proc = start_server(port, args.server_limits.split())
    attack = Attack(port)
    try:
        normal = normal_clients(url, batches, expected, args)
        normal["server_peak_rss_mib"] = peak_rss_mib(proc.pid)
        attack.start(args, questions)
        began = time.monotonic()
        time.sleep(2)  # the attackers settle in
        under = normal_clients(url, attacked, expected_attacked, args)
        time.sleep(max(1.0, args.attack_seconds - (time.monotonic() - began)))
        attack.stop.set()
        under["server_peak_rss_mib"] = peak_rss_mib(proc.pid)
        under["attack"] = attack.summary()
    finally:
        attack.stop.set()
        proc.terminate()
        proc.wait(timeout=30)

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    figures = {
        "clients": args.clients,
        "requests": total,
        "queries_per_request": args.queries,
        "topk": args.topk,
        "passages": len(local),
        "normal": normal,
        "under_attack": under,
        "cpus": os.cpu_count(),
        "cpu": cpu,
    }
    print(
        f"{total} requests per phase ({args.clients} clients x {args.requests}, {args.queries} queries each, topk "
        f"{args.topk}, BM25 over {len(local)} passages), on {os.cpu_count()} CPUs ({cpu})"
    )
    for name, f in (("normal load", normal), ("under attack", under)):
        print(
            f"{name}: {f['correct']} correct, {f['wrong']} wrong, {f['lost']} lost ({f['busy_retries']} retries after "
            f"a 503); latency p50 {f['p50_ms']:.1f} ms, p90 {f['p90_ms']:.1f} ms, p99 {f['p99_ms']:.1f} ms (max "
            f"{f['max_ms']:.1f}) in {f['seconds']:.2f} s; server peak RSS {f['server_peak_rss_mib']:.0f} MiB"
        )
    a = under["attack"]
    print(
        f"attackers: {args.slow_headers} dripping headers ({a['slow_header_connections']} connections closed by the "
        f"server, the longest after {a['slow_header_max_life_s']:.1f} s); {args.slow_bodies} dripping bodies "
        f"(answers {a['slow_body']}); {args.large_bodies} sending large bodies (answers {a['large_body']}, at most "
        f"{a['large_body_max_sent_mib']:.1f} MiB sent before the server stopped reading); {args.heavy} sending "
        f"1000-query requests (answers {a['heavy']}, median {a['heavy_median_s']:.2f} s); {args.flood} idle "
        f"connections (answers {a['flood']}); server limits: defaults, {args.server_limits}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    return 0 if normal["correct"] == total and under["correct"] == total else 1


if __name__ == "__main__":
    sys.exit(main())
