"""Question sets from the Hugging Face hub: the data SPECs `hotpotqa`, `2wiki` and `musique` with no path.

Each name maps to a public dataset repository and its validation split (`HUB_SOURCES`). Rows are parsed by the
same record parsers as the local files, so the hub's column layouts (`context: {title, sentences}`) and the
official row layouts are both accepted. Nothing is tried when the machine is offline: `HF_HUB_OFFLINE`,
`HF_DATASETS_OFFLINE` or `TRANSFORMERS_OFFLINE` set, or the hub not answering within a few seconds, ends with
one sentence asking for a local path. The `datasets` package is optional (`pip install datasets`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from mhgpo.data.formats import hotpot_example, musique_example
from mhgpo.data.records import Example
from mhgpo.errors import InputError

log = logging.getLogger(__name__)

__all__ = ["HUB_SOURCES", "HubSource", "hub_offline", "hub_reachable", "load_from_hub"]

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
PROBE_SECONDS = 3.0


@dataclass(frozen=True)
class HubSource:
    """Where a named benchmark lives on the hub, and how its rows are parsed."""

    repo: str
    config: str | None
    split: str
    parse: Callable[[dict, str, int], Example | None]
    local_example: str  # the spec to suggest when the hub cannot be used


HUB_SOURCES: dict[str, HubSource] = {
    "hotpotqa": HubSource(
        "hotpotqa/hotpot_qa", "distractor", "validation", hotpot_example, "hotpotqa:hotpot_dev_distractor_v1.json"
    ),
    "2wiki": HubSource("framolfese/2WikiMultihopQA", None, "validation", hotpot_example, "2wiki:dev.json"),
    "musique": HubSource(
        "dgslibisey/MuSiQue", None, "validation", musique_example, "musique:musique_ans_v1.0_dev.jsonl"
    ),
}


def hub_offline() -> bool:
    """True when an environment variable puts the Hugging Face libraries offline."""
    return any(os.environ.get(v, "").strip().lower() in {"1", "true", "yes", "on"} for v in OFFLINE_VARIABLES)


def hub_reachable(timeout: float = PROBE_SECONDS) -> bool:
    """One TCP connection to the hub endpoint, given up after `timeout` seconds (name resolution included)."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    answered: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                answered.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answered)


def _rows(source: HubSource) -> Any:
    import datasets  # type: ignore[import-not-found]

    if source.config is None:
        return datasets.load_dataset(source.repo, split=source.split)
    return datasets.load_dataset(source.repo, source.config, split=source.split)


def load_from_hub(name: str) -> list[Example]:
    """The validation split of benchmark `name` (`hotpotqa`, `2wiki`, `musique`) from the Hugging Face hub."""
    source = HUB_SOURCES[name]
    hint = f"pass a local file instead, e.g. {source.local_example}"
    if hub_offline() or not hub_reachable():
        raise InputError(f"{name}: the Hugging Face hub cannot be reached from this machine; {hint}")
    try:
        import datasets  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        raise InputError(f"{name}: loading from the Hugging Face hub needs `pip install datasets`; or {hint}") from None
    try:
        rows = _rows(source)
    except Exception as err:  # noqa: BLE001 - any hub failure becomes one sentence
        raise InputError(f"{name}: could not load {source.repo} from the Hugging Face hub ({err}); {hint}") from None
    examples: list[Example] = []
    skipped = 0
    for ordinal, row in enumerate(rows):
        example = source.parse(dict(row), f"{source.repo}[{ordinal}]", ordinal)
        if example is None:
            skipped += 1
        else:
            examples.append(example)
    if skipped:
        log.warning("%s: skipped %d unanswerable record(s)", source.repo, skipped)
    if not examples:
        raise InputError(f"{name}: {source.repo} ({source.split}) holds no questions")
    return examples
