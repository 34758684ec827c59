"""Data SPECs: what `--data` (and `data:` in a config) accepts, resolved to a list of `Example`s.

| SPEC | layout |
|---|---|
| `synthetic`, `synthetic:train`, `synthetic:dev` | the embedded mini-wiki world (HotpotQA layout) |
| `hotpotqa:PATH` | HotpotQA: `_id, question, answer, type, supporting_facts, context [title, sentences]` |
| `2wiki:PATH` | 2WikiMultihopQA: the HotpotQA layout plus `evidences` (and `entity_ids, evidences_id, answer_id`) |
| `musique:PATH` | MuSiQue: `id, question, answer, answer_aliases, answerable, paragraphs` (`title, paragraph_text, is_supporting`) |
| `jsonl:PATH` | generic: `id, question, answers` (optional `type`, `context`, `supporting_titles`) |
| `hotpotqa`, `2wiki`, `musique` | the validation split from the Hugging Face hub (`mhgpo.data.hub`; needs the network) |

The file layouts are read by `mhgpo/data/formats.py`, the hub's splits fetched by `mhgpo/data/hub.py`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from mhgpo.data.formats import (
    PathLike,
    generic_example,
    hotpot_example,
    load_2wiki,
    load_generic,
    load_hotpotqa,
    load_musique,
    musique_example,
    parsed_records,
)
from mhgpo.data.records import Example
from mhgpo.errors import InputError

__all__ = ["DATA_SPECS", "HUB_NAMES", "load_data", "question_records", "spec_path"]

DATA_SPECS = (
    "synthetic",
    "synthetic:train",
    "synthetic:dev",
    "hotpotqa:PATH",
    "2wiki:PATH",
    "musique:PATH",
    "jsonl:PATH",
    "hotpotqa",
    "2wiki",
    "musique",
)
HUB_NAMES = ("hotpotqa", "2wiki", "musique")

LOADERS: dict[str, Callable[[PathLike], list[Example]]] = {
    "hotpotqa": load_hotpotqa,
    "2wiki": load_2wiki,
    "musique": load_musique,
    "jsonl": load_generic,
}


PARSERS: dict[str, Callable[[dict, str, int], Example | None]] = {
    "hotpotqa": hotpot_example,
    "2wiki": hotpot_example,
    "musique": musique_example,
    "jsonl": generic_example,
}


def question_records(spec: str) -> tuple[str, Path, list[dict]]:
    """The raw records of the questions a local data SPEC loads (MuSiQue's unanswerable ones left out), in file
    order, with the layout's name and the file: `(layout, path, records)`."""
    spec = spec.strip()
    prefix, sep, rest = spec.partition(":")
    if prefix == "synthetic" and rest in ("", "train", "dev"):
        from mhgpo.data import synth_files

        layout, path = "hotpotqa", Path(synth_files.ensure_default_world()) / f"{rest or 'dev'}.jsonl"
    elif sep and rest and prefix in PARSERS:
        layout, path = prefix, Path(os.path.expanduser(rest))
    elif not sep and prefix in HUB_NAMES:
        raise InputError(f"data spec '{spec}': a local file is needed here ({prefix}:PATH)")
    else:
        raise _spec_error(spec)
    return layout, path, [record for record, _ in parsed_records(path, PARSERS[layout])]


def _spec_error(spec: str) -> InputError:
    forms = ", ".join(DATA_SPECS)
    return InputError(f"unknown data spec '{spec}'; accepted forms: {forms}")


def _synthetic(split: str) -> list[Example]:
    from mhgpo.data import synth_files  # imported here: building the world is only needed for this spec

    folder = Path(synth_files.ensure_default_world())
    return load_hotpotqa(folder / f"{split}.jsonl")


def spec_path(spec: str) -> Path | None:
    """The local file a data SPEC names (`hotpotqa:PATH` → PATH), or None (`synthetic`, hub names)."""
    prefix, sep, rest = spec.strip().partition(":")
    return Path(os.path.expanduser(rest)) if sep and rest and prefix in LOADERS else None


def load_data(spec: str = "synthetic") -> list[Example]:
    """Resolve a data SPEC to its questions.

    `synthetic` (the default world's dev set), `synthetic:train`, `synthetic:dev`; `hotpotqa:PATH`,
    `2wiki:PATH`, `musique:PATH`, `jsonl:PATH` (local files in the official layouts, or the generic one);
    `hotpotqa`, `2wiki`, `musique` alone: the validation split from the Hugging Face hub (needs the network).
    """
    spec = spec.strip()
    if spec == "synthetic":
        return _synthetic("dev")
    prefix, sep, rest = spec.partition(":")
    if sep and prefix == "synthetic" and rest in ("train", "dev"):
        return _synthetic(rest)
    if not sep and prefix in HUB_NAMES:
        from mhgpo.data.hub import load_from_hub

        return load_from_hub(prefix)
    if sep and prefix in LOADERS:
        if not rest:
            raise InputError(f"data spec '{spec}': missing PATH after '{prefix}:'")
        return LOADERS[prefix](os.path.expanduser(rest))
    raise _spec_error(spec)
