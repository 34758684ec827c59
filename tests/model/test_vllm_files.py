"""The engine's files (generation.engine=vllm, mhgpo/model/vllm_files.py), without vLLM: the model folder the
engine is given (a plain folder as it is, the default GGUF model converted once into the cache, another GGUF file
refused); the converted model in the cache is written by one process at a time and reused only when whole; the
scratch folders of killed processes are removed by the next run (the engine itself: tests/system/test_vllm.py)."""

from __future__ import annotations

import json
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
from mhgpo.model.vllm_files import COMPLETE, SCRATCH, converted, scratch_dir, whole

CONVERTER = """
import os, sys, time
from pathlib import Path
from mhgpo.model.vllm_files import converted

folder, log, ready, other = (Path(a) for a in sys.argv[1:5])
ready.touch()
while not other.exists():  # both processes ask for the folder at the same moment
    time.sleep(0.01)

def write(part):
    with open(log, "a") as f:
        f.write(f"start {os.getpid()}\\n")
    (part / "config.json").write_text("{}")
    time.sleep(1.0)  # the other process asks meanwhile
    (part / "model.safetensors").write_bytes(b"w" * 100)
    (part / "tokenizer.json").write_text("{}")
    with open(log, "a") as f:
        f.write(f"end {os.getpid()}\\n")

print(converted(folder, write))
"""


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **extra}


def _write(part: Path, calls: list[Path]) -> None:
    calls.append(part)
    (part / "config.json").write_text("{}")
    (part / "model.safetensors").write_bytes(b"w" * 10)
    (part / "tokenizer.json").write_text("{}")


def test_two_first_conversions_at_once_write_the_folder_once(tmp_path: Path) -> None:
    folder, log = tmp_path / "cache" / "model-bfloat16", tmp_path / "log"
    ready = [tmp_path / "ready-0", tmp_path / "ready-1"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONVERTER, str(folder), str(log), str(ready[i]), str(ready[1 - i])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [out.strip() for out, _ in outs] == [str(folder)] * 2
    lines = log.read_text().split()
    assert lines[::2] == ["start", "end"] and lines[1] == lines[3]  # one writer; the other waited, then reused
    assert whole(folder) and json.loads((folder / COMPLETE).read_text()) == {
        "config.json": 2,
        "model.safetensors": 100,
        "tokenizer.json": 2,
    }
    assert sorted(p.name for p in folder.parent.iterdir()) == ["model-bfloat16", "model-bfloat16.lock"]


def test_a_whole_folder_is_reused_and_a_partial_one_written_again(tmp_path: Path) -> None:
    folder, calls = tmp_path / "model", []
    assert converted(folder, lambda part: _write(part, calls)) == folder and len(calls) == 1
    assert converted(folder, lambda part: _write(part, calls)) == folder and len(calls) == 1  # reused
    breakages = [
        lambda: (folder / "tokenizer.json").unlink(),  # a folder without its tokenizer
        lambda: (folder / "model.safetensors").write_bytes(b"w"),  # cut short
        lambda: (folder / COMPLETE).unlink(),  # no marker: an older or interrupted conversion
        lambda: (folder / COMPLETE).write_text('{"config.json": 2, "model.safetensors": 10}'),  # lists no tokenizer
    ]
    for n, breaking in enumerate(breakages, start=2):
        breaking()
        assert not whole(folder)
        converted(folder, lambda part: _write(part, calls))
        assert len(calls) == n and whole(folder), n


def test_a_failed_conversion_leaves_nothing_and_a_killed_ones_leftovers_are_removed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "model"

    def fails(part: Path) -> None:
        (part / "config.json").write_text("{}")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        converted(folder, fails)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.lock"]
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = tmp_path / f".model.tmp-{_HOST}-{int(dead.stdout)}-0a1b2c3d"  # a converter killed half-way
    left.mkdir()
    (left / "config.json").write_text("{}")
    converted(folder, lambda part: _write(part, []))
    assert not left.exists() and whole(folder)
    assert f"mhgpo: removed {left}, left by an interrupted model conversion" in capsys.readouterr().err


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
