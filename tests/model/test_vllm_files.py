"""The engine's files (generation.engine=vllm, mhgpo/model/vllm_files.py), without vLLM: the model folder the
engine is given (a plain folder as it is, the default GGUF model converted once into the cache, another GGUF file
refused); the scratch folders of killed processes are removed by the next run (the engine itself:
tests/system/test_vllm.py; the conversion's one writer and whole folders: tests/model/test_converted.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import REPO

from mhgpo.errors import InputError
from mhgpo.io import _HOST
from mhgpo.model.vllm_files import SCRATCH, scratch_dir


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **extra}


SCRATCH_USER = """
import os, signal, sys
from mhgpo.model.vllm_files import scratch_dir

folder = scratch_dir()
(folder / "weights").write_text("merged weights")
print(folder, flush=True)
if sys.argv[1] == "killed":
    os.kill(os.getpid(), signal.SIGKILL)  # no exit handler runs
"""


def _scratch_user(tmp_path: Path, how: str) -> tuple[subprocess.CompletedProcess, Path]:
    res = subprocess.run(
        [sys.executable, "-c", SCRATCH_USER, how], capture_output=True, text=True, env=_env(TMPDIR=str(tmp_path))
    )
    return res, Path(res.stdout.strip())


def test_the_scratch_folder_of_a_killed_run_is_removed_by_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    res, finished = _scratch_user(tmp_path, "exits")
    assert res.returncode == 0 and finished.parent == tmp_path and not finished.exists()  # removed at exit
    res, killed = _scratch_user(tmp_path, "killed")
    assert res.returncode == -signal.SIGKILL and (killed / "weights").is_file()  # left behind
    assert killed.name.startswith(f".{SCRATCH}.tmp-{_HOST}-")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        running = tmp_path / f".{SCRATCH}.tmp-{_HOST}-{live.pid}-0a1b2c3d"  # another run, still going
        running.mkdir()
        other_host = tmp_path / f".{SCRATCH}.tmp-otherhost-{live.pid + 1}-0a1b2c3d"  # a folder shared with another
        other_host.mkdir()
        unrelated = tmp_path / "mhgpo-engine-notes"
        unrelated.mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        mine = scratch_dir()
        assert not killed.exists() and running.is_dir() and other_host.is_dir() and unrelated.is_dir()
        assert mine.is_dir() and mine.name.startswith(f".{SCRATCH}.tmp-{_HOST}-{os.getpid()}-")
        assert capsys.readouterr().err == f"mhgpo: removed {killed}, left by an interrupted vLLM run\n"
    finally:
        live.kill()
        live.wait()


# ---------------------------------------------------------------------------- the model folder the engine is given


def test_another_gguf_file_is_refused(tmp_path: Path) -> None:
    from mhgpo.model.vllm_files import engine_folder

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
    from mhgpo.model.vllm_files import engine_folder

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
    from mhgpo.model.vllm_files import engine_folder

    assert engine_folder(str(tiny_model_dir), None, None, "float32", tmp_path) == tiny_model_dir
