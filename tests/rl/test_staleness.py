"""rollout.max_staleness on generation.engine=vllm_server, against a stand-in server (tests/fake_vllm_server.py; no
vLLM): the trees of the next step are grown while this step updates, each records the version that sampled it, a
tree older than the bound is not trained and is counted, and a server that fails stops the run with the completed
steps saved. (The tiny model's own log-probs are not the stand-in's: the sync check's gap is not checked here.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fake_vllm_server import FakeVLLMServer
from helpers import make_config, trainer_for

from mhgpo.errors import InputError, ServiceError
from mhgpo.model.checkpoint import list_checkpoints
from mhgpo.runtime.runlog import read_metrics


@pytest.fixture
def server(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tiny_model_dir))
    with FakeVLLMServer(vocab=vocab) as s:
        yield s


def _config(model_dir: Path, world: Path, out: Path, url: str, **extra: object):
    settings = {
        "generation.engine": "vllm_server",
        "generation.server_urls": f"[{url}]",
        "generation.sync_check": 0,
        "generation.server_timeout": 10,
        "precision": "fp32",
        "eval_every": 0,
        "steps": 3,
        "save_every": 1,
        "questions_per_step": 2,
        "group_size": 2,
        **extra,
    }
    return make_config(model_dir, world, out, **settings)


def _records(out: Path, step: int) -> list[dict]:
    path = out / "rollouts" / f"step_{step:06d}.jsonl"
    if not path.exists():
        path = next((out / "rollouts").glob(f"*{step}*"))
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_one_step_off_policy_every_trained_tree_is_one_version_old(
    tiny_model_dir: Path, world: Path, tmp_path: Path, server: FakeVLLMServer
) -> None:
    out = tmp_path / "run"
    trainer = trainer_for(_config(tiny_model_dir, world, out, server.url, **{"rollout.max_staleness": 1}), out)
    trainer.run()
    rows = read_metrics(out)
    assert [r["staleness/max"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["staleness/mean"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["staleness/dropped_trees"] for r in rows] == [0.0, 0.0, 0.0]
    for r in rows:
        assert 0.0 <= r["idle/trainer"] <= 1.0 and 0.0 <= r["idle/server"] <= 1.0
        assert 0.0 < r["engine/is_ess"] <= 1.0
    for step, version in ((1, 0), (2, 0), (3, 1)):  # the version that sampled each tree, in the records
        assert {row["version"] for row in _records(out, step)} == {version}
    # each batch sampled on one version's adapter: step 2's trees on version 0's, grown while update 1 ran
    tag = trainer.setup.generator.suffix
    models = [body["model"] for body in server.completions()]
    assert models[0] == f"shared-v0{tag}" and set(models) == {f"shared-v0{tag}", f"shared-v1{tag}"}
    assert server.events[:2] == [f"load shared-v0{tag}", f"load shared-v1{tag}"]
    assert f"unload shared-v0{tag}" in server.events and set(server.loaded) == {f"shared-v3{tag}"}
    # the checkpoint's data position is that of the completed steps: no question drawn ahead is skipped on resume
    assert json.loads((list_checkpoints(out)[-1] / "state.json").read_text())["position"] == 6


def test_the_trainers_wait_in_the_hand_over_counts_in_its_idle_time(
    tiny_model_dir: Path, world: Path, tmp_path: Path, server: FakeVLLMServer
) -> None:
    out = tmp_path / "run"
    server.load_delay = 0.4  # each step's hand-over loads one adapter (the shared one), as a busy server would
    trainer_for(_config(tiny_model_dir, world, out, server.url, **{"rollout.max_staleness": 1}), out).run()
    rows = read_metrics(out)
    assert len(rows) == 3
    for r in rows:
        handover = r["seconds/engine_sync"] + r["seconds/engine_check"]
        assert 0.4 <= r["seconds/handover_wait"] <= handover
        assert r["idle/trainer"] * r["seconds/step"] >= r["seconds/handover_wait"] - 1e-9


def test_full_fine_tuning_hands_every_weight_to_the_server_before_each_step(
    tiny_model_dir: Path, world: Path, tmp_path: Path
) -> None:
    """lora.enabled=false: the initial weights, then those of every update, reloaded by the server from a folder of
    their version (vLLM's development mode); the last ones are the trainer's, tensor for tensor; closing the
    generator gives the server back the weights it was started on."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tiny_model_dir))
    with FakeVLLMServer(vocab=vocab, dev_mode=True) as server:
        out = tmp_path / "run"
        trainer = trainer_for(
            _config(tiny_model_dir, world, out, server.url, **{"lora.enabled": False, "steps": 2}), out
        )
        trainer.run()
        tag = trainer.setup.generator.suffix
        folders = [Path(path).name for path, _ in server.reloaded]
        assert folders == [f"weights-v{v}{tag}" for v in (0, 1, 2)]
        assert server.events[1::2] == ["reset_prefix_cache"] * 3  # after every reload
        model = trainer.setup.policy.model
        kept = load_file(str(Path(server.reloaded[-1][0]) / "model.safetensors"))
        assert set(kept) == set(server.reloaded[-1][1]) and "model.embed_tokens.weight" in kept
        for name, tensor in kept.items():
            assert torch.equal(tensor, model.state_dict()[name]), name
        assert not Path(server.reloaded[0][0]).exists()  # an older version's folder is gone
        trainer.setup.generator.close()
        assert server.events[-2:] == ["reload /models/base", "reset_prefix_cache"]


def test_a_tree_older_than_the_bound_is_not_trained_and_is_counted(
    tiny_model_dir: Path, world: Path, tmp_path: Path, server: FakeVLLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mhgpo.model.vllm_server import ServerGenerator

    pin = ServerGenerator.pin

    def older(self):  # the trees grown ahead claim a version one update older than they are
        names, version = pin(self)
        return names, version - 1

    out = tmp_path / "run"
    trainer = trainer_for(
        _config(tiny_model_dir, world, out, server.url, **{"rollout.max_staleness": 1, "steps": 2}), out
    )
    monkeypatch.setattr(ServerGenerator, "pin", older)
    trainer.run()
    first, second = read_metrics(out)
    assert first["staleness/dropped_trees"] == 0.0 and first["samples"] > 0
    assert second["staleness/max"] == 2.0 and second["staleness/dropped_trees"] == 2.0
    assert second["samples"] == 0.0  # neither tree is trained
    assert not any(row["trained"] for row in _records(out, 2))


def test_synchronous_on_the_server_every_tree_is_the_current_version(
    tiny_model_dir: Path, world: Path, tmp_path: Path, server: FakeVLLMServer
) -> None:
    out = tmp_path / "run"
    trainer_for(_config(tiny_model_dir, world, out, server.url, steps=2), out).run()
    rows = read_metrics(out)
    assert [r["staleness/max"] for r in rows] == [0.0, 0.0]
    assert [{row["version"] for row in _records(out, s)} for s in (1, 2)] == [{0}, {1}]


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_server_that_fails_stops_the_run_in_one_line_with_the_completed_steps_saved(
    tiny_model_dir: Path, world: Path, tmp_path: Path, server: FakeVLLMServer, staleness: int
) -> None:
    out = tmp_path / "run"
    trainer = trainer_for(_config(tiny_model_dir, world, out, server.url, **{"rollout.max_staleness": staleness}), out)
    real = trainer.learn

    def learn_then_break(samples, metrics):  # the server answers garbage from the second step's rollouts on
        result = real(samples, metrics)
        server.mode = "garbage"
        return result

    trainer.learn = learn_then_break
    with pytest.raises(ServiceError) as info:
        trainer.run()
    # one step off-policy, step 2's trees were grown before the server broke: step 3's are the first it failed
    failing = 2 + staleness
    line = str(info.value)
    assert "\n" not in line and line.startswith(f"step {failing}: generation server {server.url}: malformed answer")
    assert f"(in its rollouts); the run stops at step {failing - 1}" in line
    assert list_checkpoints(out)[-1].name == f"step_{failing - 1}"


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_server_that_dies_in_the_hand_over_stops_the_run_after_saving_the_updated_step(
    tiny_model_dir: Path, world: Path, tmp_path: Path, server: FakeVLLMServer, staleness: int
) -> None:
    from safetensors.torch import load_file

    from mhgpo.model.checkpoint import trainable_state

    out = tmp_path / "run"
    trainer = trainer_for(_config(tiny_model_dir, world, out, server.url, **{"rollout.max_staleness": staleness}), out)
    policy = trainer.setup.policy
    real = policy.update
    updated = {}

    def update_then_die(samples, *rest):  # the server dies once step 2's update is done, before its hand-over
        result = real(samples, *rest)
        if trainer.step == 1:
            updated.update({k: t.detach().clone() for k, t in trainable_state(policy.model).items()})
            server.close()
        return result

    policy.update = update_then_die
    with pytest.raises(ServiceError) as info:
        trainer.run()
    line = str(info.value)
    assert "\n" not in line and line == (
        f"step 2: generation server {server.url}: cannot connect (ConnectionError); is it running? (mhgpo "
        f"serve-generation starts one) (in its hand-over); the run stops at step 2; its completed steps are saved "
        f"(its last checkpoint is step_2); continue with: mhgpo train --resume {out}"
    )
    # the updated step is saved: its weights (not step 1's), its metrics, its rollouts; the questions drawn ahead
    # for step 3 are not (a resumed run draws them again)
    last = list_checkpoints(out)[-1]
    assert last.name == "step_2" and json.loads((last / "state.json").read_text())["position"] == 4
    saved = load_file(str(last / "model.safetensors"))
    assert updated and set(saved) == set(updated) and all(torch.equal(saved[k], t) for k, t in updated.items())
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and "seconds/engine_sync" in rows[0]
    assert "seconds/engine_sync" not in rows[1]  # (the hand-over did not end)
    assert (out / "rollouts" / "step_000002.jsonl").exists()
    errors = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert [(e["step"], e["phase"]) for e in errors] == [(2, "hand-over")]


def test_a_failed_sync_check_on_the_server_names_the_server_engine(
    tiny_model_dir: Path, world: Path, tmp_path: Path, server: FakeVLLMServer
) -> None:
    from mhgpo.rl.engine_sync import EngineOutOfSync

    out = tmp_path / "run"  # the stand-in's log-probs are not the tiny model's: the check's gap stops the run
    trainer = trainer_for(_config(tiny_model_dir, world, out, server.url, **{"generation.sync_check": 2}), out)
    with pytest.raises(EngineOutOfSync) as info:
        trainer.run()
    line = str(info.value)
    assert line.startswith(
        "generation.engine=vllm_server: after the update of step 1 the engine's log-probs of the step's outputs "
        "differ from the trainer's by "
    )
    assert line.endswith(
        "(generation.sync_tolerance=0.001): the engine does not sample from the trained weights (is the server "
        f"serving the run's model? mhgpo serve-generation --model {tiny_model_dir}); the run stops; it has no "
        "checkpoint yet"
    )


def test_a_resumed_run_one_step_off_policy_grows_the_trees_ahead_as_the_uninterrupted_run(
    tiny_model_dir: Path, world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import zlib

    from transformers import AutoTokenizer

    from mhgpo.rl.policy import Policy
    from mhgpo.run.pipeline import resume

    vocab = len(AutoTokenizer.from_pretrained(tiny_model_dir))

    def tokens(prompt, body):  # the stand-in samples by the prompt, the request's seed and the adapter's version
        version = body["model"].split("-")[1] if "-v" in body["model"] else "base"
        h = zlib.crc32(repr((prompt[-1], body.get("seed"), version)).encode())
        return [(h >> k) % vocab for k in (0, 8, 16)]

    def run(out: Path, server: FakeVLLMServer) -> None:
        cfg = _config(tiny_model_dir, world, out, server.url, **{"rollout.max_staleness": 1, "steps": 4})
        trainer_for(cfg, out).run()

    reference = tmp_path / "reference"
    with FakeVLLMServer(vocab=vocab, tokens=tokens) as server:
        run(reference, server)
    out = tmp_path / "cut"
    real_update, calls = Policy.update, []

    def update(self, samples, *rest):  # interrupted in step 3's update: step 2's checkpoint is the last
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_update(self, samples, *rest)

    monkeypatch.setattr(Policy, "update", update)
    with FakeVLLMServer(vocab=vocab, tokens=tokens) as server, pytest.raises(KeyboardInterrupt):
        run(out, server)
    monkeypatch.setattr(Policy, "update", real_update)
    last = list_checkpoints(out)[-1]
    state = json.loads((last / "state.json").read_text())
    assert last.name == "step_2" and (state["position"], state["ahead_version"]) == (4, 1)
    port = int(server.url.rsplit(":", 1)[1])
    with FakeVLLMServer(vocab=vocab, tokens=tokens, port=port) as again:  # the server started again, same address
        assert resume(out, progress=False).step == 4
    # step 3's trees grown again on version 1's adapter, handed over before the checkpoint's own (version 2)
    assert [e.rsplit("-", 1)[0] for e in again.events[:2]] == ["load shared-v1", "load shared-v2"]
    got, want = read_metrics(out), read_metrics(reference)
    drop = ("seconds/", "memory/", "idle/")
    assert [{k: v for k, v in r.items() if not k.startswith(drop)} for r in got] == [
        {k: v for k, v in r.items() if not k.startswith(drop)} for r in want
    ]
    for step in (1, 2, 3, 4):
        assert _records(out, step) == _records(reference, step)
    assert [r["version"] for r in _records(out, 3)][:1] == [1]


def test_a_slow_server_stops_the_run_at_its_timeout(
    tiny_model_dir: Path, world: Path, tmp_path: Path, server: FakeVLLMServer
) -> None:
    import time

    out = tmp_path / "run"
    trainer = trainer_for(_config(tiny_model_dir, world, out, server.url, **{"generation.server_timeout": 1}), out)
    server.mode, server.delay = "slow", 30.0
    started = time.perf_counter()
    with pytest.raises(ServiceError, match=r"within generation.server_timeout=1 s"):
        trainer.run()
    assert time.perf_counter() - started < 15


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (
            {"rollout.max_staleness": 1, "generation.engine": "vllm", "generation.server_urls": "[]"},
            "rollout.max_staleness: rollouts overlap",
        ),
        ({"rollout.max_staleness": 2}, "rollout.max_staleness: expected 0 or 1, got 2"),
        (
            {"lora.enabled": False, "rollout.max_staleness": 1},
            "rollout.max_staleness: full fine-tuning reloads the servers' weights in place",
        ),
        ({"optim.loss": "icepop", "optim.old_logprobs": "engine"}, "optim.loss: icepop compares"),
        ({"generation.server_urls": "[ftp://x]"}, "generation.server_urls: 'ftp://x' is not an http://HOST:PORT"),
    ],
)
def test_settings_that_cannot_work_are_refused_naming_the_key(
    tiny_model_dir: Path, world: Path, tmp_path: Path, extra: dict, says: str
) -> None:
    with pytest.raises(InputError, match=says.replace("(", r"\(")):
        _config(tiny_model_dir, world, tmp_path / "run", "http://127.0.0.1:1", **extra)


def test_an_engine_that_takes_adapters_only_refuses_full_fine_tuning(
    tiny_model_dir: Path, world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine table entry with full_weights=False (an engine that takes LoRA adapters only)."""
    import dataclasses

    from mhgpo.config.tables import ENGINES

    monkeypatch.setitem(ENGINES, "vllm_server", dataclasses.replace(ENGINES["vllm_server"], full_weights=False))
    with pytest.raises(
        InputError, match=r"^lora.enabled: generation.engine=vllm_server takes the trained weights as LoRA"
    ):
        _config(tiny_model_dir, world, tmp_path / "run", "http://127.0.0.1:1", **{"lora.enabled": False})


def test_server_urls_belong_to_the_server_engine(tiny_model_dir: Path, world: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="generation.server_urls: only generation.engine=vllm_server"):
        _config(tiny_model_dir, world, tmp_path / "run", "http://127.0.0.1:1", **{"generation.engine": "hf"})
    with pytest.raises(InputError, match="generation.server_urls: generation.engine=vllm_server needs at least one"):
        make_config(tiny_model_dir, world, tmp_path / "run", **{"generation.engine": "vllm_server"})
