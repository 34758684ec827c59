"""Where mhgpo keeps things on disk: the cache root, the index folder of a corpus and the default world's folder.

The cache root is `$MHGPO_CACHE` when it is set, else `~/.cache/mhgpo` (`~` expanded in both)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Union

PathLike = Union[str, "os.PathLike[str]"]


def cache_root() -> Path:
    """`$MHGPO_CACHE` (`~` expanded), else `~/.cache/mhgpo`."""
    root = os.environ.get("MHGPO_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "mhgpo"


def cached_index_dir(name: str) -> Path:
    """The index folder `name` under the cache root: `<cache>/indexes/<name>`."""
    return cache_root() / "indexes" / name


def index_dir_for(corpus_path: PathLike, suffix: str = "bm25") -> Path:
    """`<corpus_path>.<suffix>` next to the corpus when that folder is writable, else
    `<cache>/indexes/<sha>`, sha from the corpus path (and the suffix, when it is not the default `bm25`)."""
    path = Path(corpus_path).expanduser()
    beside = path.with_name(f"{path.name}.{suffix}")
    parent = path.parent
    if os.access(parent, os.W_OK | os.X_OK) and (not beside.exists() or os.access(beside, os.W_OK | os.X_OK)):
        return beside
    key = str(path.resolve()) if suffix == "bm25" else f"{path.resolve()}.{suffix}"
    digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]
    return cached_index_dir(digest)


def context_index_dir(source: str, suffix: str = "bm25") -> Path:
    """The index folder of a "context corpus" (the paragraphs of a question set), keyed by `source` (the data
    file's resolved path, or the data spec): `<cache>/indexes/context-<sha>[.<suffix>]`."""
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    return cached_index_dir(f"context-{key}" if suffix == "bm25" else f"context-{key}.{suffix}")


def world_dir(version: int, seed: int = 0) -> Path:
    """The cache folder of a generated synthetic world: `<cache>/world-seed<seed>-v<version>`."""
    return cache_root() / f"world-seed{seed}-v{version}"
