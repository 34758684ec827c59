"""Models converted once into the cache: Hugging Face folders written from a loaded model and reused.

A GGUF file is slow to read (transformers walks its metadata and maps its tensor names in Python: about 17 s for
the default model on 2 CPU cores, against well under a second for the same weights in safetensors), so
:func:`gguf_folder` de-quantises it once into ``<cache>/models/`` and every later load reads that folder: the same
float32 tensors, config and tokenizer. The vLLM engine's folder of the default model is written the same way
(``mhgpo.model.vllm_files``). :func:`converted` writes a folder once, one process at a time, and reuses it only when
whole. No vLLM import: these are plain files."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mhgpo.errors import InputError
from mhgpo.io import remove_stale_temps, temp_path, usual_permissions

MODELS = "models"  # under the cache root: GGUF files de-quantised into Hugging Face folders
COMPLETE = ".complete"  # written last into a converted model's folder: the files it holds and their sizes


def converted(folder: Path, write: Callable[[Path], None]) -> Path:
    """``folder``, written once by ``write`` (given an empty folder) and reused: one process at a time (an exclusive
    ``flock`` on a lock file beside it, which the system drops with its process), into a temporary folder beside it
    (:func:`mhgpo.io.temp_path`) renamed onto it once whole. A folder is reused only when whole (:func:`whole`): an
    older or interrupted one is written again; the temporary folders of killed processes are removed."""
    import fcntl

    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if whole(folder):
            return folder
        remove_stale_temps(folder, "model conversion")
        part = temp_path(folder)
        part.mkdir()
        try:
            write(part)
            files = {p.name: p.stat().st_size for p in sorted(part.iterdir())}
            (part / COMPLETE).write_text(json.dumps(files, indent=1))  # last: the folder is whole
            shutil.rmtree(folder, ignore_errors=True)
            part.rename(folder)
        finally:
            shutil.rmtree(part, ignore_errors=True)
    return folder


def whole(folder: Path) -> bool:
    """Whether the converted model's ``folder`` is whole: its marker (:data:`COMPLETE`, written last) lists the
    config, the weights and a tokenizer, and every file it lists is there with the size it had."""
    try:
        files = json.loads((folder / COMPLETE).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(files, dict) or not {"config.json", "model.safetensors"} <= set(files):
        return False
    if not {"tokenizer.json", "tokenizer.model"} & set(files):
        return False
    for name, size in files.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            return False
    return True


def discard(folder: Path) -> None:
    """Mark the converted ``folder`` as not whole (its marker removed), so that :func:`converted` writes it again."""
    (folder / COMPLETE).unlink(missing_ok=True)


def save_unpacked(model: Any, tokenizer: Any, dtype: str, folder: Path, what: str = "generation.engine=vllm") -> None:
    """``model``'s weights (in ``dtype``, one safetensors file), its config and ``tokenizer`` into the empty
    ``folder``. Not ``save_pretrained``: transformers refuses it for a model loaded from a GGUF file, though its
    weights are plain tensors once unpacked (the config's GGUF `quantization_config` is left out, so a loader reads
    them as such). ``what`` names the caller in the error for packed weights."""
    import torch
    from safetensors.torch import save_file

    state = model.state_dict()
    packed = [name for name, tensor in state.items() if not tensor.is_floating_point()]
    if packed:
        raise InputError(
            f"{what}: the model's weights are packed ({packed[0]}); load it unpacked "
            f"(without the GGUF kernels) or pass a Hugging Face folder as the model"
        )
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = config["torch_dtype"] = dtype
    if config.get("tie_word_embeddings"):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    save_file(
        {k: v.detach().to(getattr(torch, dtype)).clone().contiguous() for k, v in state.items()},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    usual_permissions(folder / "model.safetensors")  # (safetensors writes 0600: the cache may be shared)
    (folder / "config.json").write_text(json.dumps(config, indent=2, default=str))
    tokenizer.save_pretrained(folder)


def gguf_key(gguf: Path) -> str:
    """What a GGUF file's conversion depends on, hashed: the file (its resolved path, size and modification time)
    and the transformers version that de-quantises it. Another file, a changed one or another transformers
    converts again."""
    import transformers

    stat = gguf.stat()
    text = f"{gguf.resolve()}\n{stat.st_size}\n{stat.st_mtime_ns}\n{transformers.__version__}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def gguf_folder(gguf: Path, name: str, load: Callable[[], tuple[Any, Any]]) -> Path | None:
    """The cached Hugging Face folder of the GGUF file ``gguf`` (``<cache>/models/<name>-<key>``, :func:`gguf_key`),
    written once from ``load()`` (the model de-quantised in float32, and its tokenizer). None where the cache cannot
    take it (a read-only home, ``MHGPO_CACHE`` on a full or read-only disk, a copy larger than half the free space,
    said in one line): the caller reads the GGUF file itself, as without a cache (``load``'s result, when it was
    called, is still the caller's to use)."""
    from mhgpo.paths import cache_root

    folder = cache_root() / MODELS / f"{name}-{gguf_key(gguf)}"
    if whole(folder):
        return folder
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    if not os.access(folder.parent, os.W_OK | os.X_OK):
        return None

    def write(part: Path) -> None:
        from safetensors import SafetensorError

        model, tokenizer = load()
        size = sum(t.numel() * 4 for t in model.state_dict().values())  # float32
        free = shutil.disk_usage(part).free
        if size > free / 2:
            print(
                f"mhgpo: {gguf} is read from the file on every load: its de-quantised copy ({size / 1e9:.1f} GB) "
                f"would take more than half the free space of {folder.parent} ({free / 1e9:.1f} GB)",
                file=sys.stderr,
                flush=True,
            )
            raise _Unwritable
        try:
            save_unpacked(model, tokenizer, "float32", part, what=str(gguf))
        except (OSError, SafetensorError) as err:
            raise _Unwritable from err

    try:
        return converted(folder, write)
    except _Unwritable:
        return None  # the cache's disk is full, or went read-only: no cache
    except OSError as err:
        if err.filename is not None and Path(err.filename).is_relative_to(folder.parent):
            return None  # the lock file or the temporary folder could not be made
        raise


class _Unwritable(Exception):
    """The conversion could not be written into the cache (not a fault of the model)."""
