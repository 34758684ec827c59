"""generation.engine=vllm_server against a real vLLM server (`mhgpo serve-generation`, vLLM's OpenAI server in a
process of its own; run with a venv that has vLLM: `bash scripts/setup.sh --vllm`; skipped without it), on the tiny
model of tests/system/test_vllm.py in fp32: the server's log-probs of the step's outputs are the trainer's after
every hand-over of the versioned adapter; its greedy answers are the in-process engine's and, for the same seed, so
are its sampled rollouts and the run's metrics; one step off-policy, every trained tree is one version old and the
figures say so; a server that dies stops the run in one line with the completed steps saved."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

import requests  # noqa: E402
from conftest import build_tiny_model  # noqa: E402
from helpers import REPO, free_port, long_prompts, make_config, trainer_for  # noqa: E402

from mhgpo.errors import ServiceError  # noqa: E402
from mhgpo.model.checkpoint import list_checkpoints  # noqa: E402
from mhgpo.model.vllm_server import wait_until_serving  # noqa: E402
from mhgpo.runtime.runlog import read_metrics  # noqa: E402

IN_SYNC = 1e-4  # fp32 on both sides
START_SECONDS = 600


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-vllm"), hidden_size=64, heads=2, kv_heads=1, max_positions=4096
    )


def _start(model_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "mhgpo", "serve-generation", "--model", str(model_dir), "--precision", "fp32"]
    command += ["--port", str(port), "--kv-cache-gb", "1", "--lora-rank", "16", "--adapters", "8", "--full-weights"]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # (a session of its own: killed, the server's engine process goes with it)
    process = subprocess.Popen(
        command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(process, url, START_SECONDS, log)
    except ServiceError as e:
        raise AssertionError(f"{e}: {log.read_text()[-3000:]}") from None
    return process, url


@pytest.fixture(scope="module")
def server(vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    process, url = _start(vllm_model_dir, tmp_path_factory.mktemp("server") / "server.log")
    yield url
    _stop(process)


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        pass
    _kill(process)  # (and whatever of the server outlived its main process)


def _kill(process: subprocess.Popen) -> None:
    """SIGKILL the server and its engine process (vLLM's engine core outlives a killed API server)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(30)


def _config(model_dir: Path, world: Path, out: Path, url: str, **extra: object):
    settings = {
        "generation.engine": "vllm_server",
        "generation.server_urls": f"[{url}]",
        "generation.server_timeout": 120,
        "precision": "fp32",
        "eval_every": 0,
        "save_every": 1,
        "optim.lr": 0.05,
        "questions_per_step": 2,
        "group_size": 2,
        **extra,
    }
    return make_config(model_dir, world, out, **settings)


def test_the_servers_log_probs_are_the_trainers_after_every_hand_over(
    vllm_model_dir: Path, world: Path, tmp_path: Path, server: str
) -> None:
    out = tmp_path / "run"
    trainer = trainer_for(_config(vllm_model_dir, world, out, server, steps=2), out)
    trainer.run()
    tag = trainer.setup.generator.suffix
    rows = read_metrics(out)
    assert [r["staleness/max"] for r in rows] == [0.0, 0.0]
    for r in rows:  # the check scored the step's outputs on the server, as the update's adapter
        assert 0 <= r["engine/logprob_gap_mean"] < IN_SYNC and r["engine/logprob_gap_max"] < 10 * IN_SYNC
        assert r["engine/old_logprob_gap"] < IN_SYNC and r["engine/is_ess"] > 1 - 1e-6
    served = [m["id"] for m in requests.get(server + "/v1/models", timeout=10).json()["data"]]
    assert f"shared-v2{tag}" in served and f"shared-v1{tag}" not in served and f"shared-v0{tag}" not in served
    trainer.setup.generator.close()  # (the run's adapters unloaded; the server keeps running)
    served = [m["id"] for m in requests.get(server + "/v1/models", timeout=10).json()["data"]]
    assert not any(name.endswith(tag) for name in served)


def test_full_fine_tuning_the_servers_log_probs_are_the_trainers_after_every_reload(
    vllm_model_dir: Path, world: Path, tmp_path: Path, server: str
) -> None:
    """lora.enabled=false: every weight reloaded in place on the server (--full-weights) after each update; its
    log-probs of the step's outputs are the trainer's, and they are not those of the weights it started on, to
    which closing the run gives it back."""
    from mhgpo.rl.engine_sync import checked, gap_figures, scored

    out = tmp_path / "run"
    trainer = trainer_for(_config(vllm_model_dir, world, out, server, steps=2, **{"lora.enabled": False}), out)
    kept: list = []
    real = trainer.learn

    def learn(samples, metrics):
        kept[:] = samples
        return real(samples, metrics)

    trainer.learn = learn
    try:
        trainer.run()
        rows = read_metrics(out)
        for r in rows:
            assert 0 <= r["engine/logprob_gap_mean"] < IN_SYNC and r["engine/logprob_gap_max"] < 10 * IN_SYNC
        picked = checked(kept, 8)
        engine_lp, trainer_lp = scored(trainer.setup.generator, trainer.setup.policy, picked)
        assert gap_figures(engine_lp, trainer_lp)["engine/logprob_gap_mean"] < IN_SYNC  # the last update's weights
    finally:
        trainer.setup.generator.close()  # the server's own weights again
    engine_lp, trainer_lp = scored(trainer.setup.generator, trainer.setup.policy, picked)
    assert gap_figures(engine_lp, trainer_lp)["engine/logprob_gap_mean"] > 100 * IN_SYNC  # (the updates moved it)


def test_seeded_requests_whose_prompts_overflow_one_prefill_budget_sample_on_the_server(
    vllm_model_dir: Path, server: str
) -> None:
    """As in process (tests/system/test_vllm.py): the server prefills whole prompts, so seeded requests whose prompts
    are more than one step's budget sample, and the same seeds draw the same tokens."""
    from mhgpo.model.generation import SamplingParams
    from mhgpo.model.pretrained import stop_token_ids
    from mhgpo.model.trained import load_model
    from mhgpo.model.vllm_server import ServerGenerator

    lm = load_model(str(vllm_model_dir), device="cpu")
    client = ServerGenerator([server], lm.tokenizer, stop_token_ids(lm.tokenizer, lm.model), timeout=120)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=0.9)
    runs = []
    for _ in range(2):
        with client.seeded((1, 2, 3)):
            runs.append([g.output_ids for g in client.generate(long_prompts(), params)])
    assert runs[0] == runs[1] and len(runs[0]) == 16 and len({tuple(o) for o in runs[0]}) > 1


ENGINE_LOGPROB_KEYS = ("engine/", "rewriter/entropy", "reranker/entropy", "answerer/entropy")


def test_synchronous_on_the_server_the_rollouts_and_metrics_are_the_in_process_engines(
    vllm_model_dir: Path, world: Path, tmp_path: Path, server: str
) -> None:
    """The same seed, rollout.max_staleness=0: each request samples with its own seed (generation.seeded), so the
    server and the in-process engine draw the same tokens. Their log-probs of those tokens agree to fp32 rounding
    only: a call's prompts are scheduled as one batch in the process and as separate requests on the server, and
    the batch's layout moves a row's rounding (docs/vllm.md, "Sampling seeds"); what is computed from them (the
    roles' entropies, the engine/ figures) agrees as closely, everything else exactly."""
    from safetensors.torch import load_file

    runs = {}
    for engine in ("vllm", "vllm_server"):
        out = tmp_path / engine
        extra = {"generation.engine": engine, "generation.kv_cache_gb": 1, "lora.r": 16}  # (the server's LoRA rank)
        if engine == "vllm":
            extra["generation.server_urls"] = "[]"
        trainer = trainer_for(_config(vllm_model_dir, world, out, server, steps=2, **extra), out)
        calls: list = []
        real = trainer.setup.generator.generate

        def record(prompts, params, real=real, calls=calls, **chunks):  # (on_chunk: the rollout's pipeline)
            done = real(prompts, params, **chunks)
            calls.append([(g.prompt_ids, g.output_ids, g.logprobs, "on_chunk" in chunks) for g in done])
            return done

        trainer.setup.generator.generate = record
        trainer.run()
        trainer.setup.generator.close()
        runs[engine] = calls, read_metrics(out), out
        del trainer
        gc.collect()
    (local, local_rows, local_out), (remote, remote_rows, remote_out) = runs["vllm"], runs["vllm_server"]
    assert len(local) == len(remote) and sum(len(c) for c in local) >= 20
    # rollout.pipeline (null): on for the server, off in the process; the results do not depend on it
    assert {g[3] for c in remote for g in c} == {True} and {g[3] for c in local for g in c} == {False}
    for a, b in zip(local, remote):
        assert [g[:2] for g in a] == [g[:2] for g in b]  # the same prompts, the same tokens
        for x, y in zip(a, b):
            assert max((abs(u - v) for u, v in zip(x[2], y[2])), default=0.0) < 1e-5
    assert len({tuple(g[1]) for c in local for g in c}) > 1  # (sampled, not all alike)
    for a, b in zip(local_rows, remote_rows):
        assert {k for k in b if k not in a} == {
            *("staleness/mean", "staleness/max", "staleness/dropped_trees"),
            *("idle/trainer", "idle/server", "seconds/step", "seconds/handover_wait"),
        }
        for k, v in a.items():
            if k.startswith(("seconds/", "memory/")):
                continue
            if k == "reference/ahead":  # the pipelined server's reference pass ran beside its rollouts, all of it
                assert (v, b[k]) == (0.0, 1.0)
                continue
            if k.startswith(ENGINE_LOGPROB_KEYS):
                assert abs(b[k] - v) < 1e-5, k
            else:
                assert b[k] == v, k
    for step in (1, 2):
        name = f"step_{step:06d}.jsonl"
        mine = [json.loads(x) for x in (local_out / "rollouts" / name).read_text().splitlines()]
        theirs = [json.loads(x) for x in (remote_out / "rollouts" / name).read_text().splitlines()]
        assert [{k: v for k, v in r.items() if k != "version"} for r in theirs] == mine
    a = load_file(str(local_out / "checkpoints" / "step_2" / "model.safetensors"))
    b = load_file(str(remote_out / "checkpoints" / "step_2" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the same updates, bit for bit


def test_greedy_answers_on_the_server_are_the_in_process_engines(
    vllm_model_dir: Path, world: Path, server: str
) -> None:
    from mhgpo.api import evaluate

    settings = [
        f"model={vllm_model_dir}",
        f"data=hotpotqa:{world / 'dev.jsonl'}",
        "limit=3",
        "precision=fp32",
        f"retrieval.corpus={world / 'corpus.jsonl'}",
        "search.rewriter.max_new_tokens=8",
        "search.reranker.max_new_tokens=4",
        "search.answerer.max_new_tokens=6",
        "generation.kv_cache_gb=1",
    ]
    local = evaluate(overrides=[*settings, "generation.engine=vllm"], progress=False)
    gc.collect()
    remote = evaluate(
        overrides=[*settings, "generation.engine=vllm_server", f"generation.server_urls=[{server}]"], progress=False
    )
    assert [p["prediction"] for p in remote.predictions] == [p["prediction"] for p in local.predictions]
    assert remote.metrics["f1"] == local.metrics["f1"]


def test_one_step_off_policy_every_trained_tree_is_one_version_old(
    vllm_model_dir: Path, world: Path, tmp_path: Path, server: str
) -> None:
    out = tmp_path / "run"
    cfg = _config(vllm_model_dir, world, out, server, steps=3, **{"rollout.max_staleness": 1, "optim.loss": "icepop"})
    trainer_for(cfg, out).run()
    rows = read_metrics(out)
    assert [r["staleness/max"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["staleness/dropped_trees"] for r in rows] == [0.0, 0.0, 0.0]
    for step in (2, 3):  # the trees of steps 2 and 3 were sampled by the weights of updates 0 and 1
        records = [json.loads(x) for x in (out / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert {r["version"] for r in records} == {step - 2}
    first, later = rows[0], rows[1:]
    assert first["engine/old_logprob_gap"] < IN_SYNC and first["engine/is_masked"] == 0.0
    # one update old at a large learning rate: the trainer's log-probs moved away from the sampler's, once an update
    # had a gradient (a step whose groups all have equal rewards has none but the KL term's; Adam moves the weights on after one that
    # had); before that the older version holds nearly the same weights
    informative = [r["groups"] - r["zero_variance_groups"] > 0 for r in rows]
    assert any(informative[:2])  # (the seed's draws: a move is checked)
    for k, r in enumerate(later, start=1):  # the trees of step k + 1 were sampled before update k
        if any(informative[:k]):
            assert r["engine/old_logprob_gap"] > 100 * IN_SYNC and r["engine/is_ess"] < 1
        else:  # no signal yet: the weights moved by Adam's step on the KL term's rounding alone (the reference pass
            # cuts its micro-batches by segment, the update's forward by the step: ~1e-7 of KL at the warm start),
            # 30x and more below an informative update's move (measured: a gap of 3.1e-4, ESS 1 - 2.5e-7)
            assert r["engine/old_logprob_gap"] < 10 * IN_SYNC and r["engine/is_ess"] > 1 - 1e-5
    assert all(0.0 <= r["engine/is_masked"] <= 1.0 for r in later)
    assert all(0.0 <= r["idle/trainer"] <= 1.0 and 0.0 <= r["idle/server"] <= 1.0 for r in rows)
    assert all(r["engine/logprob_gap_mean"] < IN_SYNC for r in rows)  # the check: the server holds each update


def test_a_server_that_dies_stops_the_run_in_one_line_with_the_completed_steps_saved(
    vllm_model_dir: Path, world: Path, tmp_path: Path
) -> None:
    process, url = _start(vllm_model_dir, tmp_path / "server.log")
    out = tmp_path / "run"
    trainer = trainer_for(_config(vllm_model_dir, world, out, url, steps=3), out)
    real = trainer.learn

    def learn_then_kill(samples, metrics):  # the server dies once the first step's update is handed over
        result = real(samples, metrics)
        _kill(process)
        return result

    trainer.learn = learn_then_kill
    try:
        with pytest.raises(ServiceError) as info:
            trainer.run()
    finally:
        _kill(process)
    line = str(info.value)
    assert "\n" not in line and line.startswith(f"step 2: generation server {url}: cannot connect")
    assert list_checkpoints(out)[-1].name == "step_1"
