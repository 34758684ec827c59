"""The vLLM engine's files (``generation.engine=vllm``, docs/vllm.md): the Hugging Face folder it loads
(:func:`engine_folder`: the default model's GGUF file converted once into the cache, by one process at a time,
:func:`mhgpo.model.converted.converted`; a trained run's merged weights written to a scratch folder) and the
scratch folder of what is handed to it (:func:`scratch_dir`), removed at exit, or by the next run when its process
was killed. No vLLM import: these are plain files."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mhgpo.errors import InputError
from mhgpo.io import remove_stale_temps, temp_path
from mhgpo.model.converted import converted, save_unpacked

CONVERTED = "vllm-models"  # under the cache root: GGUF models converted to Hugging Face folders
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
        return converted(folder, lambda part: save_unpacked(model, tokenizer, dtype, part))
    folder = scratch / "initial"
    folder.mkdir()
    save_unpacked(model, tokenizer, dtype, folder)
    return folder
