"""The synthetic world (`mhgpo.data.synth`) on disk: `corpus.jsonl`, `train.jsonl`, `dev.jsonl` (HotpotQA layout) and
`world.json`, written by `mhgpo data synth`, and the default world generated once into the cache on first use."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from mhgpo.data.synth import DEFAULT_MORE_DEV, DEFAULT_N_DEV, DEFAULT_N_TRAIN, FILES, VERSION, generate_world
from mhgpo.errors import InputError
from mhgpo.io import atomic_write_bytes, check_outputs
from mhgpo.paths import world_dir


def _jsonl(rows: Sequence[dict]) -> bytes:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")


def write_world(
    out_dir: str | os.PathLike[str],
    seed: int = 0,
    n_train: int = DEFAULT_N_TRAIN,
    n_dev: int = DEFAULT_N_DEV,
    n_entities: int | None = None,
    overwrite: bool = False,
    more_dev: int = 0,
) -> dict[str, Path]:
    """Generate a world and write `corpus.jsonl`, `train.jsonl`, `dev.jsonl` and, last, `world.json` (the
    seed and the counts) into `out_dir` (`more_dev`: as for `generate_world`); files already there are refused
    unless `overwrite`. Returns the paths by name: corpus, train, dev, world."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"{out}: exists and is not a folder")
    check_outputs([out / f"{name}.jsonl" for name in ("corpus", "train", "dev")] + [out / "world.json"], [], overwrite)
    world = generate_world(seed=seed, n_train=n_train, n_dev=n_dev, n_entities=n_entities, more_dev=more_dev)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        name: atomic_write_bytes(out / f"{name}.jsonl", _jsonl(rows))
        for name, rows in (("corpus", world.corpus), ("train", world.train), ("dev", world.dev))
    }
    meta = {
        "version": VERSION,
        "seed": seed,
        "n_train": len(world.train),
        "n_dev": len(world.dev),
        "n_passages": len(world.corpus),
    }
    paths["world"] = atomic_write_bytes(out / "world.json", (json.dumps(meta, indent=2) + "\n").encode("utf-8"))
    return paths


def default_world_dir() -> Path:
    """The cache folder of the default world: `$MHGPO_CACHE` (else `~/.cache/mhgpo`) / `world-seed0-v<VERSION>`."""
    return world_dir(VERSION)


def _is_complete(folder: Path) -> bool:
    try:
        meta = json.loads((folder / "world.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("version") == VERSION and all((folder / f).is_file() for f in FILES)


def ensure_default_world() -> Path:
    """The default world's folder, generated on first use. The world is written into a temporary folder beside
    it and renamed into place, so no reader ever sees half a world."""
    target = default_world_dir()
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        write_world(tmp, seed=0, n_train=DEFAULT_N_TRAIN, n_dev=DEFAULT_N_DEV, more_dev=DEFAULT_MORE_DEV)
        if target.exists() and not _is_complete(target):
            shutil.rmtree(target)  # left incomplete by something else
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target):  # unless another process has just put a world in place
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
