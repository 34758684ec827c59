"""Models converted once into the cache (mhgpo/model/converted.py): a folder is written by one process at a time,
reused only when whole, and a failed or killed conversion leaves nothing behind; a GGUF file is read once and its
de-quantised copy after, the same tensors and tokenizer, where the cache can be written (the tiny model stands in
for the GGUF file's contents; the real default model: the slow test at the end)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

from mhgpo.io import _HOST
from mhgpo.model.converted import COMPLETE, MODELS, converted, gguf_folder, gguf_key, whole

CONVERTER = """
import os, sys, time
from pathlib import Path
from mhgpo.model.converted import converted

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


# ------------------------------------------------------------------------------ a GGUF file read once, then its copy


@pytest.fixture
def fake_gguf(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """A `.gguf` file whose reading (`pretrained._from_gguf`) gives the tiny model, counting the reads; the cache in
    `tmp_path/cache`."""
    from mhgpo.model import pretrained
    from mhgpo.model.trained import load_model

    monkeypatch.setenv("MHGPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MHGPO_MODEL_CACHE", raising=False)
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    reads: list[Path] = []

    def from_gguf(source):
        reads.append(source.gguf_path)
        loaded = load_model(str(tiny_model_dir), device="cpu")
        return loaded.model, loaded.tokenizer

    monkeypatch.setattr(pretrained, "_from_gguf", from_gguf)
    return gguf, reads


def test_a_gguf_file_is_read_once_and_its_copy_loads_the_same_model(fake_gguf, tiny_lm) -> None:
    import torch

    from mhgpo.model.pretrained import encode_chat, load_pretrained
    from mhgpo.paths import cache_root

    gguf, reads = fake_gguf
    first = load_pretrained(str(gguf), device="cpu")
    folder = cache_root() / MODELS / f"tiny-{gguf_key(gguf)}"
    assert reads == [gguf] and whole(folder)
    second = load_pretrained(str(gguf), device="cpu")
    assert reads == [gguf]  # the copy, not the file
    expected = tiny_lm.model.state_dict()
    for loaded in (first, second):
        state = loaded.model.state_dict()
        assert state.keys() == expected.keys()
        assert all(state[k].dtype == torch.float32 and torch.equal(state[k], expected[k]) for k in state)
        assert loaded.name == "tiny" and loaded.dtype == torch.float32 and not loaded.model.training
    messages = [{"role": "user", "content": "Who wrote Hamlet?"}]
    assert encode_chat(second.tokenizer, messages) == encode_chat(tiny_lm.tokenizer, messages)
    assert second.tokenizer.padding_side == "left" and second.tokenizer.pad_token_id == tiny_lm.tokenizer.pad_token_id
    # bfloat16 from the copy: each float32 tensor rounded once, as from the file
    bf16 = load_pretrained(str(gguf), device="cpu", dtype=torch.bfloat16).model.state_dict()
    assert reads == [gguf] and all(torch.equal(bf16[k], expected[k].bfloat16()) for k in bf16)


def test_a_changed_gguf_file_is_converted_again(fake_gguf) -> None:
    from mhgpo.model.pretrained import load_pretrained

    gguf, reads = fake_gguf
    load_pretrained(str(gguf), device="cpu")
    key = gguf_key(gguf)
    gguf.write_bytes(b"GGUF stand-in, another version")
    assert gguf_key(gguf) != key
    load_pretrained(str(gguf), device="cpu")
    load_pretrained(str(gguf), device="cpu")
    assert reads == [gguf, gguf]


def test_without_a_writable_cache_or_with_the_cache_off_the_file_is_read_each_time(
    fake_gguf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mhgpo.model.pretrained import load_pretrained

    gguf, reads = fake_gguf
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("MHGPO_CACHE", str(tmp_path / "a-file" / "cache"))  # cannot be made
    load_pretrained(str(gguf), device="cpu")
    load_pretrained(str(gguf), device="cpu")
    assert reads == [gguf, gguf]
    monkeypatch.setenv("MHGPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MHGPO_MODEL_CACHE", "0")
    load_pretrained(str(gguf), device="cpu")
    assert reads == [gguf] * 3 and not (tmp_path / "cache").exists()


def test_a_copy_damaged_after_it_was_written_is_written_again_once(
    fake_gguf, tiny_lm, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from mhgpo.model.pretrained import load_pretrained
    from mhgpo.paths import cache_root

    gguf, reads = fake_gguf
    load_pretrained(str(gguf), device="cpu")
    folder = cache_root() / MODELS / f"tiny-{gguf_key(gguf)}"
    weights = folder / "model.safetensors"
    weights.write_bytes(b"\xff" * weights.stat().st_size)  # the same size: the marker still says whole
    assert whole(folder)
    capsys.readouterr()
    loaded = load_pretrained(str(gguf), device="cpu")
    assert reads == [gguf, gguf] and whole(folder)
    [line] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("mhgpo:")]
    assert line.startswith(f"mhgpo: the cached copy {folder} of {gguf} could not be read (")
    assert line.endswith("); it is written again")
    state, expected = loaded.model.state_dict(), tiny_lm.model.state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    load_pretrained(str(gguf), device="cpu")
    assert reads == [gguf, gguf]


def test_a_full_disk_leaves_no_copy_and_the_model_still_loads(
    fake_gguf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from mhgpo.model import converted as converted_module
    from mhgpo.model.pretrained import load_pretrained

    gguf, reads = fake_gguf

    def disk_full(model, tokenizer, dtype, folder, what):
        (folder / "config.json").write_text("{}")
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "model.safetensors"))

    monkeypatch.setattr(converted_module, "save_unpacked", disk_full)
    loaded = load_pretrained(str(gguf), device="cpu")
    assert loaded.model is not None and reads == [gguf]  # what was read for the copy is the model loaded
    assert [p.name for p in (tmp_path / "cache" / MODELS).iterdir()] == [f"tiny-{gguf_key(gguf)}.lock"]


def test_a_copy_larger_than_half_the_free_space_is_not_written_and_says_so(
    fake_gguf, tiny_lm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    from mhgpo.model import converted as converted_module
    from mhgpo.model.pretrained import load_pretrained

    gguf, reads = fake_gguf
    size = sum(t.numel() * 4 for t in tiny_lm.model.state_dict().values())
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(converted_module.shutil, "disk_usage", lambda path: usage._replace(free=2 * size - 1))
    capsys.readouterr()
    load_pretrained(str(gguf), device="cpu")
    load_pretrained(str(gguf), device="cpu")
    assert reads == [gguf, gguf] and not (tmp_path / "cache" / MODELS / f"tiny-{gguf_key(gguf)}").exists()
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("mhgpo:")]
    assert (
        lines
        == [
            f"mhgpo: {gguf} is read from the file on every load: its de-quantised copy ({size / 1e9:.1f} GB) would take "
            f"more than half the free space of {tmp_path / 'cache' / MODELS} ({(2 * size - 1) / 1e9:.1f} GB)"
        ]
        * 2
    )
    monkeypatch.setattr(converted_module.shutil, "disk_usage", lambda path: usage._replace(free=2 * size))
    load_pretrained(str(gguf), device="cpu")
    load_pretrained(str(gguf), device="cpu")
    assert reads == [gguf] * 3  # written at exactly half


def test_a_gguf_file_that_cannot_be_read_is_one_error_and_leaves_no_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mhgpo.model.pretrained import ModelNotFoundError, load_pretrained

    monkeypatch.setenv("MHGPO_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"not a GGUF file")
    with pytest.raises(ModelNotFoundError, match=r"Could not load model '.*broken\.gguf' \(gguf "):
        load_pretrained(str(gguf), device="cpu")
    assert [p.name for p in (tmp_path / "cache" / MODELS).iterdir()] == [f"broken-{gguf_key(gguf)}.lock"]


def test_gguf_folder_names_the_file_and_writes_what_load_gives(tiny_lm, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MHGPO_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    folder = gguf_folder(gguf, "m", lambda: (tiny_lm.model, tiny_lm.tokenizer))
    assert folder == tmp_path / "cache" / MODELS / f"m-{gguf_key(gguf)}"
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"
    assert gguf_folder(gguf, "m", lambda: pytest.fail("read again")) == folder


@pytest.mark.slow
def test_the_default_models_copy_is_the_gguf_file_bit_for_bit(default_lm) -> None:
    """After `default_lm` (whose load wrote the cache's copy, or read it), a load reads the copy; the GGUF file read
    directly gives the same tensors, buffers, tokenizer and generation settings."""
    import torch

    from mhgpo.model.pretrained import (
        DEFAULT_MODEL,
        _from_gguf,
        encode_chat,
        load_pretrained,
        prepare_tokenizer,
        resolve_model,
        stop_token_ids,
    )

    copy = load_pretrained(DEFAULT_MODEL, device="cpu")
    model, tokenizer = _from_gguf(resolve_model(DEFAULT_MODEL))
    tokenizer = prepare_tokenizer(tokenizer)
    cached = copy.model
    assert cached.config._name_or_path != model.config._name_or_path  # it did load the copy
    a, b = cached.state_dict(), model.state_dict()
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    bufs, file_bufs = dict(cached.named_buffers()), dict(model.named_buffers())
    assert bufs.keys() == file_bufs.keys() and all(torch.equal(bufs[k], file_bufs[k]) for k in bufs)
    assert cached.lm_head.weight is cached.model.embed_tokens.weight
    assert cached.generation_config.to_diff_dict() == model.generation_config.to_diff_dict()
    assert stop_token_ids(copy.tokenizer, cached) == stop_token_ids(tokenizer, model)
    messages = [{"role": "system", "content": "Rewrite."}, {"role": "user", "content": "Wer schrieb 東京 🎉?\n\t x"}]
    assert encode_chat(copy.tokenizer, messages) == encode_chat(tokenizer, messages)
    assert copy.tokenizer.chat_template == tokenizer.chat_template and len(copy.tokenizer) == len(tokenizer)
