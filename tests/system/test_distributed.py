"""Data parallelism on CPU: two ranks (gloo) against one process, on the same recorded rollouts."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed_worker import replay_step
from helpers import REPO, comparable, free_port, launch, make_config, train_overrides, trainer_for, training_setup

from mhgpo.model.distributed import share_bounds, shares

WORKER = Path(__file__).with_name("distributed_worker.py")
VOLATILE = ("seconds/", "memory/")


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What a launcher (accelerate launch, torchrun) sets for each rank."""
    return {
        **os.environ,
        "WORLD_SIZE": str(world),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}",
    }


def run_ranks(
    world: int, args: list[str], timeout: int = 300, env: dict[str, str] | None = None
) -> list[subprocess.CompletedProcess]:
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, *args],
            env={**rank_env(r, world, port), **(env or {})},
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for r in range(world)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def record_step(cfg, world: int) -> list[tuple[tuple[str, ...], object]]:
    """One step's rollout trees, sampled once in this process, recorded as one part per rank's share of questions."""
    trainer = trainer_for(cfg)
    questions = trainer._next_questions(cfg.questions_per_step)
    parts = []
    for r in range(world):
        lo, hi = share_bounds(len(questions), world, r)
        parts.append((tuple(q.id for q in questions[lo:hi]), trainer._grow(questions[lo:hi], trainer.rng)))
    return parts


# (name, algo, overrides): one launch per sharding mode runs them all, one after the other in each rank's process
UPDATE_CASES = (
    ("mhgpo-rr", "mhgpo", {"sampler": "rr", "rr_probs": "[0,0.5,0.5]"}),  # the rewriter calls before a fork: singletons
    ("mappo", "mappo", {"sampler": "chains"}),
    ("mhgpo-full", "mhgpo", {"sampler": "fof", "lora.enabled": "false"}),  # full fine-tuning: a frozen reference copy
)


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_two_ranks_update_as_one_process_on_the_same_rollouts(tiny_model_dir, world, tmp_path, fsdp) -> None:
    """Each rank holds the whole model (ddp), or the actor's layers are sharded (fsdp, as `accelerate launch` with
    distributed_type: FSDP asks): the same update as one process, for MHGPO-RR (LoRA), MAPPO (its critic) and MHGPO
    with full fine-tuning."""
    cases, args = [], []
    for name, algo, extra in UPDATE_CASES:
        folder = tmp_path / name
        settings = dict(algo=algo, questions_per_step=4, eval_every=0, save_every=0, steps=1, precision="fp32")
        cfg = make_config(tiny_model_dir, world, folder / "run", **settings, **extra)
        records = record_step(cfg, world=2)
        folder.mkdir(exist_ok=True)
        (folder / "records.pkl").write_bytes(pickle.dumps(records))
        overrides = train_overrides(tiny_model_dir, world, folder / "run", **settings, **extra)
        (folder / "config.json").write_text(json.dumps(overrides))
        one = replay_step(cfg, records)  # one process on the whole step
        cases.append((name, cfg, extra, one, folder / "rank.pt"))
        args += [str(folder / "config.json"), str(folder / "records.pkl"), str(folder / "rank.pt")]
    runs = run_ranks(
        2,
        [str(WORKER), *args],
        timeout=600,
        env={"ACCELERATE_USE_FSDP": "true", "SINGLETON_BATCHES_ON_RANK": "1"} if fsdp else None,
    )
    assert [r.returncode for r in runs] == [0, 0], "\n".join(r.stderr[-3000:] for r in runs)
    for name, cfg, extra, one, out in cases:
        two = torch.load(out, weights_only=False)  # rank 1 wrote last or first: the same state
        _same_update(name, cfg, extra, one, two, out, fsdp)


def _same_update(name: str, cfg, extra: dict, one: dict, two: dict, out: Path, fsdp: bool) -> None:
    assert (two["rank"] in (0, 1)) and two["world"] == 2, name
    assert two["sharded"] == fsdp, name
    # each rank holds half the decoder layers' weights under FSDP (the embedding and head whole), all of them else
    assert two["held"] == pytest.approx({"layers": 0.5 if fsdp else 1.0, "other": 1.0}, abs=0.01), name
    if not cfg.lora.enabled:  # the frozen reference copy: sharded alike
        assert two["held_reference"] == pytest.approx({"layers": 0.5 if fsdp else 1.0, "other": 1.0}, abs=0.01)
    else:
        assert two["held_reference"] is None, name  # the reference is the model, its adapter off
    if fsdp:  # rank 1 cut its share into one micro-batch per sample: rank 0 ran zero-weight ones to match
        counts = [json.loads(out.with_name(f"{out.name}.batches{r}.json").read_text()) for r in range(2)]
        assert counts[1] > counts[0] >= 1, name

    m1 = {k: v for k, v in one["metrics"].items() if not k.startswith(VOLATILE)}
    m2 = {k: v for k, v in two["metrics"].items() if not k.startswith(VOLATILE)}
    assert m1.keys() == m2.keys(), name
    for k in m1:
        assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), (name, k)
    assert m1["loss"] != 0 and m1["samples"] >= 8, name
    assert one["weights"].keys() == two["weights"].keys(), name
    init = replay_initial_weights(cfg)
    full_ft = not cfg.lora.enabled
    for k, w in one["weights"].items():
        # Adam's first step moves each weight by about lr * g / (|g| + eps): where |g| is near eps the float sums'
        # order (micro-batches per rank, then the all-reduce) shows, at ~1e-6 against steps of lr = 1e-2; under full
        # fine-tuning about one entry in a thousand of the whole model has such a gradient (seen up to 1.6e-4 apart),
        # and one of MAPPO's critic's LoRA entries on a CPU with AVX2 only (2.2e-5): every entry within 3% of a step,
        # and the weights on average within 1e-6
        torch.testing.assert_close(two["weights"][k], w, rtol=1e-5, atol=3e-4, msg=lambda m, k=k: f"{name} {k}: {m}")
        assert float((two["weights"][k] - w).abs().mean()) < 1e-6, (name, k)
    assert any(
        not torch.equal(one["weights"][k], init[k]) for k in init if "lora_B" in k or "value_head" in k or full_ft
    ), name
    if extra["sampler"] == "rr":  # RR pooled singletons of both ranks' questions into groups, as one process does
        assert two["groups"] == one["groups"], name
        members: dict[int, set[bool]] = {}
        for q, g in one["groups"]:
            members.setdefault(g, set()).add(q < 2)
        assert any(m == {True, False} for m in members.values()), f"{name}: no group spans the ranks: nothing checked"


def replay_initial_weights(cfg) -> dict[str, torch.Tensor]:
    from mhgpo.model.checkpoint import trainable_state

    setup = training_setup(cfg)
    out = {f"policy/{k}": v for k, v in trainable_state(setup.policy.model).items()}
    if setup.critic is not None:
        out.update({f"critic/{k}": v for k, v in trainable_state(setup.critic.model).items()})
    return out


def test_shares_cut_samples_by_tokens_and_questions_contiguously() -> None:
    assert [share_bounds(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    # longest first, each to the lighter share (ties: rank 0): 5 | 4, 3 | 2 (7 vs 7) | 1 to rank 0: 8 vs 7 tokens
    assert shares([5, 1, 4, 2, 3], 2) == [[0, 1, 3], [2, 4]]
    assert sorted(i for s in shares(list(range(7)), 3) for i in s) == list(range(7))


def test_questions_per_step_not_divisible_by_the_ranks_is_refused(tiny_model_dir, world, tmp_path) -> None:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "mhgpo",
        "train",
        *train_overrides(tiny_model_dir, world, tmp_path / "run", questions_per_step=3),
    ]
    procs = [
        subprocess.Popen(
            cmd, env=rank_env(r, 2, port), cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for r in range(2)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [2, 2]
    assert results[0][1].strip().splitlines()[-1] == (
        "mhgpo: error: questions_per_step=3 is not divisible by the 2 processes of this run: each rank rolls out "
        "questions_per_step / processes questions"
    )
    assert results[1][1].strip() == ""  # rank 0 alone says it
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------ a two-rank run through accelerate


def rank_pid(launcher: subprocess.Popen, rank: int) -> int:
    import psutil

    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "mhgpo" in child.cmdline():
                return child.pid
        except psutil.Error:
            continue
    raise AssertionError(f"no rank {rank} under the launcher")


def test_two_rank_run_logs_once_writes_every_question_once_and_resumes_after_a_rank_dies(
    tiny_model_dir, world, tmp_path
) -> None:
    import signal
    import time

    from mhgpo.model.checkpoint import list_checkpoints

    ref = tmp_path / "ref"
    p = launch(ref, tiny_model_dir, world)
    log, _ = p.communicate(timeout=300)
    assert p.returncode == 0, log[-3000:]
    assert log.count("finished 4 steps") == 1  # rank 0 reports
    rows = [json.loads(line) for line in (ref / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all("seconds/train_communication" in r for r in rows)
    assert [r["samples"] > 0 for r in rows] == [True] * 4
    for r in rows:
        nodes = [
            json.loads(line) for line in (ref / "rollouts" / f"step_{r['step']:06d}.jsonl").read_text().splitlines()
        ]
        assert [n["node_id"] for n in nodes] == list(range(len(nodes)))
        roots = [n["question_id"] for n in nodes if n["parent_id"] == -1]
        assert len(set(roots)) == 4 and len({n["question_id"] for n in nodes}) == 4  # every question, once
        assert len(nodes) == r["llm_calls"] + sum(n["agent"] == "retriever" for n in nodes)
    assert [c.name for c in list_checkpoints(ref)] == ["step_1", "step_2", "step_3", "step_4"]
    exported = subprocess.run(
        [sys.executable, "-m", "mhgpo", "export", str(ref), "--out", str(tmp_path / "export")],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
        text=True,
        capture_output=True,
    )
    assert exported.returncode == 0 and (tmp_path / "export" / "model.safetensors").is_file(), exported.stderr

    killed = tmp_path / "killed"
    p = launch(killed, tiny_model_dir, world)
    deadline = time.time() + 240
    while not (killed / "checkpoints" / "step_1").is_dir() and p.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    os.kill(rank_pid(p, 1), signal.SIGKILL)
    log, _ = p.communicate(timeout=120)
    assert p.returncode != 0
    assert "rank      : 1 (local_rank: 1)" in log and "Signal 9 (SIGKILL)" in log  # the launcher names it
    done = [checkpoint.name for checkpoint in list_checkpoints(killed)]
    assert done and done[-1] != "step_4"

    p = launch(killed, tiny_model_dir, world, resume=True)
    log, _ = p.communicate(timeout=300)
    assert p.returncode == 0, log[-3000:]
    again = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert comparable(again) == comparable(rows)


@pytest.mark.parametrize(
    "how,config",
    [("sigterm to rank 1", "cpu_ddp.yaml"), ("ctrl-c", "cpu_ddp.yaml"), ("sigterm to rank 1", "cpu_fsdp.yaml")],
)
def test_a_signal_stops_every_rank_and_rank_0_saves_the_last_completed_step_once(
    tiny_model_dir, world, tmp_path, how, config
) -> None:
    """SIGTERM to one rank, or Ctrl-C in a terminal (SIGINT to the launcher and every rank, which the launcher
    forwards once more): every rank stops at its next sync point and rank 0 saves once (under FSDP every rank
    gathers the weights for it)."""
    import signal
    import time

    from mhgpo.model.checkpoint import list_checkpoints

    out = tmp_path / "run"
    p = launch(out, tiny_model_dir, world, "steps=40", "save_every=50", config=config)
    deadline = time.time() + 240
    while not (out / "metrics.jsonl").is_file() and p.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    if how == "ctrl-c":
        os.killpg(p.pid, signal.SIGINT)
    else:
        os.kill(rank_pid(p, 1), signal.SIGTERM)
    log, _ = p.communicate(timeout=120)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert 1 <= len(rows) < 40
    assert log.count("interrupted; saved") == 1, log[-3000:]
    assert [c.name for c in list_checkpoints(out)] == [f"step_{len(rows)}"]  # the last completed step
    assert "aborted" not in log and "SIGKILL" not in log  # no rank aborted or had to be killed
    assert ("decoder layers sharded over 2 ranks" in log) == (config == "cpu_fsdp.yaml")


def test_owned_cuts_the_step_between_ranks_keeping_a_shared_prompt_on_one_rank() -> None:
    from types import SimpleNamespace

    from mhgpo.rl.policy import Sample, owned

    def sample(prompt: list[int], out: int) -> Sample:
        return Sample(prompt, [7] * out, [0.0] * out, 0.0, "a")

    samples = [sample([1, 2, 3], 4), sample([5] * 9, 2), sample([1, 2, 3], 5), sample([5] * 9, 1), sample([6], 3)]
    for share in (False, True):
        cuts = [owned(samples, SimpleNamespace(world=2, rank=r), share) for r in range(2)]
        assert sorted(cuts[0] + cuts[1]) == list(range(5))
        if share:  # the prompt [1, 2, 3] (samples 0, 2) and the prompt [5]*9 (samples 1, 3) each on one rank
            assert [{0, 2} <= set(c) or not {0, 2} & set(c) for c in cuts] == [True, True]
            assert [{1, 3} <= set(c) or not {1, 3} & set(c) for c in cuts] == [True, True]
        else:  # by tokens alone (11, 10, 8, 7, 4 to the lighter rank): both prompts split
            assert cuts == [[0, 1, 4], [2, 3]]
    assert owned(samples, SimpleNamespace(world=1, rank=0), True) == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_fsdp_run_checkpoints_whole_weights_exports_and_resumes_as_an_uninterrupted_run(
    tiny_model_dir, world, tmp_path
) -> None:
    """`accelerate launch --config_file configs/accelerate/cpu_fsdp.yaml`: the actor sharded over 2 ranks; 3 steps
    (validation at steps 2 and 3), against the run continued from its step-2 checkpoint; a checkpoint holds whole
    tensors (the shapes of one process's), `mhgpo export` turns the run into a model, and the continued run logs the
    uninterrupted run's metrics."""
    from safetensors.torch import load_file

    from mhgpo.model.checkpoint import list_checkpoints

    def run(out: Path, *extra: str, resume: bool = False) -> str:
        p = launch(out, tiny_model_dir, world, "steps=3", *extra, resume=resume, config="cpu_fsdp.yaml")
        log, _ = p.communicate(timeout=300)
        assert p.returncode == 0, log[-3000:]
        return log

    ref = tmp_path / "ref"
    log = run(ref)
    assert log.count("finished 3 steps") == 1
    assert log.count("mhgpo: FSDP: the actor's decoder layers sharded over 2 ranks") == 1
    rows = [json.loads(line) for line in (ref / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and "val/f1" in rows[1]
    assert all(r["samples"] > 0 and r["grad_norm"] > 0 for r in rows)

    setup = training_setup(make_config(tiny_model_dir, world, tmp_path / "one"))  # one process: the tensors' shapes
    from mhgpo.model.checkpoint import trainable_state

    shapes = {k: tuple(v.shape) for k, v in trainable_state(setup.policy.model).items()}
    saved = load_file(str(list_checkpoints(ref)[-1] / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in saved.items()} == shapes
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in saved.items())  # trained (B starts at 0)

    exported = subprocess.run(
        [sys.executable, "-m", "mhgpo", "export", str(ref), "--out", str(tmp_path / "export")],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
        text=True,
        capture_output=True,
    )
    assert exported.returncode == 0 and (tmp_path / "export" / "model.safetensors").is_file(), exported.stderr

    # the run continued from its step-2 checkpoint (step 3 and what it wrote dropped first) logs step 3 again
    assert [c.name for c in list_checkpoints(ref)] == ["step_1", "step_2", "step_3"]
    cut = tmp_path / "cut"
    shutil.copytree(ref, cut)
    shutil.copytree(ref, tmp_path / "to_ddp")
    run(cut, "--from-step", "2", resume=True)
    again = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert comparable(again) == comparable(rows)

    # the same checkpoint resumed by ranks that each hold the whole model: the same step, but for the order of the
    # gradients' float sums (FSDP's reduce-scatter against one flat all-reduce)
    p = launch(tmp_path / "to_ddp", tiny_model_dir, world, "--from-step", "2", resume=True)
    log, _ = p.communicate(timeout=300)
    assert p.returncode == 0, log[-3000:]
    assert "FSDP" not in log
    last = comparable([json.loads(line) for line in (tmp_path / "to_ddp" / "metrics.jsonl").read_text().splitlines()])[
        -1
    ]
    assert last.keys() == comparable(rows)[-1].keys() and last["step"] == 3
    for k, v in comparable(rows)[-1].items():
        assert last[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k


LOADS_ON_RANK_1 = """
import os, sys, torch
torch.distributed.init_process_group("gloo", init_method="file://" + sys.argv[2], world_size=1, rank=0)
from mhgpo.model import sharding
from mhgpo.model.trained import initial_weights
if sys.argv[3] == "whole":
    sharding.load_whole()
loaded, _ = initial_weights(sys.argv[1], "init", True, device="cpu")
print(min(float(p.abs().sum()) for p in loaded.model.parameters()))
torch.distributed.destroy_process_group()
"""


def test_every_rank_of_an_fsdp_launch_loads_the_whole_model(tiny_model_dir, tmp_path) -> None:
    """`accelerate launch` under FSDP sets FSDP_CPU_RAM_EFFICIENT_LOADING=true, with which transformers (5.19, for
    one) loads zeros on every rank but the first, for a broadcast that mhgpo's own sharding does not do:
    `sharding.load_whole` turns that loading off, so rank 1 loads the model's weights."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "LOCAL_RANK": "1", "RANK": "0"}
    env.update(ACCELERATE_USE_FSDP="true", FSDP_CPU_RAM_EFFICIENT_LOADING="true")
    args = [sys.executable, "-c", LOADS_ON_RANK_1, str(tiny_model_dir), str(tmp_path / "store")]
    done = subprocess.run([*args, "whole"], env=env, cwd=REPO, text=True, capture_output=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split()[-1]) > 0  # no tensor left at zero


def test_fsdp_refuses_one_adapter_per_role(tiny_model_dir, world, tmp_path, monkeypatch) -> None:
    from types import SimpleNamespace

    from mhgpo.errors import InputError
    from mhgpo.run.setup import check_ranks

    two = SimpleNamespace(world=2, rank=0, is_main=True)
    cfg = make_config(tiny_model_dir, world, tmp_path / "run", **{"lora.per_role": "true"})
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    check_ranks(cfg, two)  # plain data parallelism: one adapter per role is fine
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(InputError, match="FSDP: lora.per_role is not supported"):
        check_ranks(cfg, two)
    check_ranks(make_config(tiny_model_dir, world, tmp_path / "run"), two)  # one shared adapter: FSDP runs


def test_train_ends_the_process_group_once_every_rank_is_done(monkeypatch, capsys) -> None:
    """`mhgpo train` closes its ranks after training (a barrier, then the process group destroyed), on every rank,
    before rank 0 reports; a separate engine (vLLM) is closed between the two, and its teardown ends the group."""
    import argparse
    from types import SimpleNamespace

    import mhgpo.model.distributed as distributed
    import mhgpo.run.pipeline
    from mhgpo.cli.train import cmd_train

    calls: list[str] = []
    monkeypatch.setattr(distributed.torch.distributed, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(distributed.torch.distributed, "is_initialized", lambda: "destroy" not in calls)
    monkeypatch.setattr(distributed.torch.distributed, "destroy_process_group", lambda: calls.append("destroy"))

    class Engine:  # a separate engine (vLLM), whose teardown ends the process group too
        def close(self) -> None:
            calls.extend(["engine closed", "destroy"])

    for rank, engine in [(0, None), (1, None), (0, Engine()), (1, Engine())]:
        ranks = distributed.Ranks.__new__(distributed.Ranks)
        ranks.world, ranks.rank, ranks.is_main, ranks.comm_seconds = 2, rank, rank == 0, 0.0
        setup = SimpleNamespace(generator=engine, engine_scratch=None if engine is None else "scratch")
        trainer = SimpleNamespace(ranks=ranks, step=3, run_dir="runs/x", val_history=[], setup=setup)
        monkeypatch.setattr(mhgpo.run.pipeline, "train", lambda cfg, trainer=trainer: trainer)
        args = argparse.Namespace(resume=None, from_step=None, scale=None, config=None, overrides=[])
        assert cmd_train(args) == 0
        assert calls == ["barrier", "destroy"] if engine is None else ["barrier", "engine closed", "destroy"]
        calls.clear()
        assert ("finished 3 steps" in capsys.readouterr().out) == (rank == 0)


def test_gathered_is_reentrant_only_the_outer_block_reshards(monkeypatch) -> None:
    """`sharding.gathered` inside another of the same model neither gathers again nor reshards on its exit: the
    outer block's passes stay free of collectives until the outer exit, which reshards once."""
    import mhgpo.model.sharding as sharding

    calls: list[str] = []

    class Layer:
        def set_reshard_after_forward(self, flag: bool) -> None:
            calls.append(f"after_forward={flag}")

        def unshard(self) -> None:
            calls.append("unshard")

        def reshard(self) -> None:
            calls.append("reshard")

    model = torch.nn.Linear(1, 1)
    monkeypatch.setattr(sharding, "_fsdp_modules", lambda m: [Layer()] if m is model else [])
    with sharding.gathered(model):
        assert calls == ["after_forward=False", "unshard"]
        with sharding.gathered(model):
            pass
        assert calls == ["after_forward=False", "unshard"]
    assert calls == ["after_forward=False", "unshard", "reshard", "after_forward=True"]
    with sharding.gathered(model):  # a later block gathers again
        pass
    assert calls[-4:] == ["after_forward=False", "unshard", "reshard", "after_forward=True"]
    with sharding.gathered(torch.nn.Linear(1, 1)):  # not sharded: nothing
        pass
    assert len(calls) == 8
