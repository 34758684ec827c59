"""The vLLM engine's files (``generation.engine=vllm``, docs/vllm.md): the Hugging Face folder it loads
(:func:`engine_folder`: the default model's GGUF file converted once into the cache, by one process at a time,
:func:`converted`; a trained run's merged weights written to a scratch folder) and the scratch folder of what is
handed to it (:func:`scratch_dir`), removed at exit, or by the next run when its process was killed. No vLLM
import: these are plain files."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mhgpo.errors import InputError
from mhgpo.io import remove_stale_temps, temp_path, usual_permissions

CONVERTED = "vllm-models"  # under the cache root: GGUF models converted to Hugging Face folders
COMPLETE = ".complete"  # written last into a converted model's folder: the files it holds and their sizes
SCRATCH = "mhgpo-engine"  # the scratch folders' name in the temp folder (io.temp_path: host and pid in it)


def scratch_dir() -> Path:
    """A folder for what is handed to the engine (adapters, a trained run's weights), removed at exit. Its name
    holds this host and process (:func:`mhgpo.io.temp_path`): the scratch folders that killed processes left in the
    temp folder (no exit handler ran) are removed first."""
    target = Path(tempfile.gettempdir()) / SCRATCH
    remove_stale_temps(target, "vLLM run")
    folder = temp_path(target)
    folder.mkdir(mode=0o700)
    atexit.register(shutil.rmtree, folder, True)
    return folder


def engine_folder(spec: str, model: Any, tokenizer: Any, dtype: str, scratch: Path) -> Path:
    """A Hugging Face folder of ``model``'s weights (the run's initial weights) that vLLM loads: ``spec`` itself when
    it is such a folder and ``model`` holds its weights unchanged; the default model's GGUF file converted once into
    the cache (``dtype`` float32 or bfloat16); else (a trained run, merged weights) written to ``scratch``. Another
    GGUF file: an :class:`InputError` (convert it with ``mhgpo export``)."""
    from mhgpo.model.pretrained import DEFAULT_MODEL, resolve_model

    source = resolve_model(spec)
    if source.kind == "directory":
        return Path(source.location)
    if source.kind == "gguf":
        if source.name != DEFAULT_MODEL:
            raise InputError(
                f"generation.engine=vllm: {spec} is a GGUF file, which vLLM does not train on; save it "
                f"as a Hugging Face folder first (mhgpo export) and pass that folder as the model"
            )
        from mhgpo.paths import cache_root

        folder = cache_root() / CONVERTED / f"{DEFAULT_MODEL}-{dtype}"
        return converted(folder, lambda part: _save(model, tokenizer, dtype, part))
    folder = scratch / "initial"
    folder.mkdir()
    _save(model, tokenizer, dtype, folder)
    return folder


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


def _save(model: Any, tokenizer: Any, dtype: str, folder: Path) -> None:
    """``model``'s weights (in ``dtype``, one safetensors file), its config and ``tokenizer`` into the empty
    ``folder``. Not ``save_pretrained``: transformers refuses it for a model loaded from a GGUF file, though its
    weights are plain tensors once unpacked (the config's GGUF `quantization_config` is left out, so vLLM reads them
    as such)."""
    import torch
    from safetensors.torch import save_file

    state = model.state_dict()
    packed = [name for name, tensor in state.items() if not tensor.is_floating_point()]
    if packed:
        raise InputError(
            f"generation.engine=vllm: the model's weights are packed ({packed[0]}); load it unpacked "
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
