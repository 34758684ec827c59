"""On-policy pipelining inside a step (`rollout.pipeline`): a step's rollouts with a slow retrieval service, pipelined
against not, with the demo's settings.

The rollouts are the demo's RL step (`mhgpo/config/demo.yaml`: the default model, the synthetic world, MHGPO-IS, 4
questions, G = 4, generation batches of `gen_batch_size`, no warm start), the in-process engine (`hf`), and the
Retriever a retrieval service over HTTP (`mhgpo.retrieval.http.HTTPRetriever`): a server of the protocol in a
process of its own (BM25 over the world's corpus, as `mhgpo serve-retriever` serves it) that waits `--request-s`
seconds per request plus `--query-s` seconds per query before it answers, the cost of a search service elsewhere (a
round trip, then a search over a large index, which grows with the queries). For each query cost the same rollouts
run with the pipeline off and on, alternating, `--repeats` times each, from the same seed, the client's cache
cleared before each; the rollouts of the two are checked to be the same (token ids, rewards). Prints, per setting,
the median wall seconds of the step's rollouts off and on, the saving, the seconds the rollout itself spent in its
tool rounds (the retrieval it waited for: what the pipeline hides, and a figure that other load on the machine
hardly moves, unlike the rollouts' wall time), the retrieval requests made and the seconds the service waited in all
(the client's cache answers a query asked before: an untrained Rewriter repeats the question, so few distinct
queries reach the service).

    python benchmarks/bench_pipeline.py [--query-s 0.02,0.5] [--request-s 0.05] [--repeats 2] [--threads 2]
        [key=value ...]

The saving is at most the retrieval of the batches before an agent call's last: the last batch's retrieval still
waits for its answer, with or without the pipeline; a fixed round trip per request, which the pipeline pays once
per batch instead of once per call, is not saved at all.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(port: int, request_s, query_s, waited, ready) -> None:
    """The slow retrieval service (a child process): the protocol's `/retrieve` over BM25 on the synthetic world."""
    from mhgpo.config import RetrievalConfig
    from mhgpo.retrieval.build import build_retriever
    from mhgpo.retrieval.service import answer

    retriever = build_retriever("synthetic:train", RetrievalConfig())

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            self._send({"retriever": "bm25"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            queries, k = body["queries"], int(body.get("topk") or 3)
            pause = request_s.value + query_s.value * len(queries)
            time.sleep(pause)
            with waited.get_lock():
                waited.value += pause
            found = [[(p, 0.0) for p in hits] for hits in retriever.search_batch(queries, k)]
            self._send(answer(found, bool(body.get("return_scores"))))

        def _send(self, data) -> None:
            raw = json.dumps(data).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    ready.set()
    server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--query-s", default="0.02,0.5", help="the service's seconds per query, comma-separated")
    parser.add_argument("--request-s", type=float, default=0.05, help="the service's seconds per request")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("overrides", nargs="*", help="config key=value, on top of the demo's")
    args = parser.parse_args()

    ctx = mp.get_context("fork")  # before torch starts its threads
    request_s, query_s, waited = ctx.Value("d", args.request_s), ctx.Value("d", 0.0), ctx.Value("d", 0.0)
    ready, port = ctx.Event(), free_port()
    server = ctx.Process(target=serve, args=(port, request_s, query_s, waited, ready), daemon=True)
    server.start()
    if not ready.wait(300):
        raise SystemExit("the retrieval service did not start")

    import numpy as np
    import torch

    from mhgpo.config import TrainConfig, demo_config_path, load_config
    from mhgpo.model.allocator import keep_freed_memory
    from mhgpo.rl.rollout import run_rollouts
    from mhgpo.run.setup import build_training, settle

    keep_freed_memory()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(
            TrainConfig,
            demo_config_path(),
            [
                "warm_start.enabled=false",
                "eval_every=0",
                "report_to=[]",
                f"output_dir={run_dir}/run",
                f"retrieval.retriever=http://127.0.0.1:{port}/retrieve",
                *args.overrides,
            ],
        )
        job = settle(cfg)
        setup = build_training(job)
        cfg = job.cfg
        from mhgpo.rl.trainer import Trainer

        spec = Trainer(cfg, setup, job.run_dir, progress=False)._spec()
        questions = setup.train[: cfg.questions_per_step]
        retriever = setup.workflow.retriever
        print(
            f"mhgpo {cfg.model}, {cfg.precision}, sampler {spec.sampler}, {len(questions)} questions, G = "
            f"{spec.group_size}, gen_batch_size {cfg.gen_batch_size}, torch threads {torch.get_num_threads()}, "
            f"CPU: {cpu_name()}; service: {args.request_s:g} s per request",
            flush=True,
        )

        import mhgpo.rl.rollout as rollout_module

        run_tool, exposed = rollout_module._run_tool, [0.0]

        def timed_tool(*a, **k):  # the rollout's own time in its tool rounds: the retrieval it waits for
            started = time.perf_counter()
            try:
                return run_tool(*a, **k)
            finally:
                exposed[0] += time.perf_counter() - started

        rollout_module._run_tool = timed_tool

        def rollout(pipeline: bool):
            retriever.cache_clear()
            exposed[0] = 0.0
            torch.manual_seed(cfg.seed)
            answered, before = retriever.answered, waited.value
            started = time.perf_counter()
            batch = run_rollouts(
                questions,
                setup.workflow,
                setup.generator,
                setup.encode,
                spec,
                np.random.default_rng(cfg.seed),
                on_error="skip",
                pipeline=pipeline,
            )
            seconds = time.perf_counter() - started
            sign = [(n.output_ids, n.terminal, n.info.get("ids")) for n in batch.nodes]
            return seconds, retriever.answered - answered, waited.value - before, sign, exposed[0]

        rows = []
        for cost in [float(x) for x in args.query_s.split(",")]:
            query_s.value = cost
            runs: dict[bool, list] = {False: [], True: []}
            for _ in range(args.repeats):
                for pipeline in (False, True):
                    runs[pipeline].append(rollout(pipeline))
            signs = {r[3].__repr__() for mode in runs.values() for r in mode}
            off = statistics.median(r[0] for r in runs[False])
            on = statistics.median(r[0] for r in runs[True])
            row = {
                "query_s": cost,
                "off_s": off,
                "on_s": on,
                "saved_s": off - on,
                "saved_pct": 100 * (off - on) / off,
                "requests_off": runs[False][0][1],
                "requests_on": runs[True][0][1],
                "service_wait_off_s": runs[False][0][2],
                "service_wait_on_s": runs[True][0][2],
                "tool_wait_off_s": statistics.median(r[4] for r in runs[False]),
                "tool_wait_on_s": statistics.median(r[4] for r in runs[True]),
                "same_rollouts": len(signs) == 1,
                "off_runs": [round(r[0], 2) for r in runs[False]],
                "on_runs": [round(r[0], 2) for r in runs[True]],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(
        "| service s/query | rollouts off s | on s | saved | rollout waited in tool rounds off / on, s "
        "| requests off / on | service waited off / on, s | same rollouts |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['query_s']:g} | {r['off_s']:.1f} | {r['on_s']:.1f} | {r['saved_s']:.1f} s ({r['saved_pct']:.0f}%) "
            f"| {r['tool_wait_off_s']:.1f} / {r['tool_wait_on_s']:.1f} | {r['requests_off']} / {r['requests_on']} | {r['service_wait_off_s']:.1f} / "
            f"{r['service_wait_on_s']:.1f} | {'yes' if r['same_rollouts'] else 'NO'} |"
        )
    server.terminate()


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
