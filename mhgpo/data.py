"""Reading question sets and passage corpora from JSON Lines or JSON array files.

A file whose first non-space character is `[` is read as one JSON array of objects; any other file
as JSON Lines (one object a line, blank lines skipped). Every error is an `InputError` that names
where it happened: `path:LINE` for JSON Lines, `path[INDEX]` for an array element.

Question sets use the HotpotQA layout (`_id`/`id`, `question`, `answer`, `type`,
`supporting_facts`, `context`); `load_data` resolves a data SPEC (`synthetic`, `synthetic:train`,
`synthetic:dev`, `hotpotqa:PATH`) to a list of `Example`s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence, Union

from mhgpo.records import Example, InputError, Passage

__all__ = [
    "read_jsonl",
    "read_json_array",
    "read_records",
    "load_hotpotqa",
    "load_data",
    "load_corpus_jsonl",
    "context_corpus",
    "DATA_SPECS",
]

PathLike = Union[str, "os.PathLike[str]"]

DATA_SPECS = ("synthetic", "synthetic:train", "synthetic:dev", "hotpotqa:PATH")


# --- generic readers ----------------------------------------------------------------------------


def _read_bytes(path: PathLike) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise InputError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, not a file") from None
    except OSError as err:
        raise InputError(f"{path}: cannot read ({err.strerror or err})") from None


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"{where}: not valid UTF-8 ({err.reason} at byte {err.start})") from None


def _strip_bom(data: bytes) -> bytes:
    return data[3:] if data.startswith(b"\xef\xbb\xbf") else data


def _object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def _jsonl_lines(data: bytes, path: PathLike) -> Iterator[tuple[int, dict]]:
    for line_no, raw in enumerate(data.splitlines(), start=1):
        where = f"{path}:{line_no}"
        text = _decode(raw, where).strip()
        if not text:
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise InputError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
        yield line_no, _object(value, where)


def read_jsonl(path: PathLike) -> Iterator[tuple[int, dict]]:
    """Yield `(line_number, object)` for each non-blank line of a JSON Lines file (lines count from 1)."""
    data = _strip_bom(_read_bytes(path))
    yield from _jsonl_lines(data, path)


def read_json_array(path: PathLike) -> Iterator[tuple[int, dict]]:
    """Yield `(index, object)` for each element of a file holding one JSON array of objects."""
    yield from _array_items(_strip_bom(_read_bytes(path)), path)


def _array_items(data: bytes, path: PathLike) -> Iterator[tuple[int, dict]]:
    text = _decode(data, str(path))
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError(f"{path}:{err.lineno}: invalid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(value, list):
        raise InputError(f"{path}: expected a JSON array, got {type(value).__name__}")
    for index, item in enumerate(value):
        yield index, _object(item, f"{path}[{index}]")


def read_records(path: PathLike) -> Iterator[tuple[str, dict]]:
    """Yield `(where, object)` from a JSON Lines or JSON array file (detected by its first non-space
    character); `where` is `path:LINE` or `path[INDEX]`, ready to prefix an error message."""
    data = _strip_bom(_read_bytes(path))
    if data.lstrip()[:1] == b"[":
        for index, record in _array_items(data, path):
            yield f"{path}[{index}]", record
    else:
        for line_no, record in _jsonl_lines(data, path):
            yield f"{path}:{line_no}", record


# --- HotpotQA question sets ---------------------------------------------------------------------


def _require(record: dict, key: str, where: str) -> Any:
    if key not in record or record[key] is None:
        raise InputError(f"{where}: missing key '{key}'")
    return record[key]


def _text(value: Any, key: str, where: str) -> str:
    if not isinstance(value, str):
        raise InputError(f"{where}: '{key}' must be a string, got {type(value).__name__}")
    return value


def _answers(record: dict, where: str) -> tuple[str, ...]:
    value = _require(record, "answer", where)
    aliases = value if isinstance(value, list) else [value]
    answers = tuple(_text(a, "answer", where).strip() for a in aliases)
    if not answers or not all(answers):
        raise InputError(f"{where}: 'answer' is empty")
    return answers


def _join_sentences(sentences: Iterable[str]) -> str:
    """Join sentences so the text reads naturally: add a space only where neither side has one."""
    text = ""
    for sentence in sentences:
        if text and sentence and not text[-1].isspace() and not sentence[0].isspace():
            text += " "
        text += sentence
    return text.strip()


def _paragraph(item: Any, where: str) -> tuple[str, str]:
    if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)):
        raise InputError(f"{where}: 'context' must be a list of [title, sentences] pairs")
    title, body = item
    if isinstance(body, str):
        return title, body.strip()
    if not (isinstance(body, list) and all(isinstance(s, str) for s in body)):
        raise InputError(f"{where}: 'context' paragraph '{title}' must hold a list of sentences")
    return title, _join_sentences(body)


def _context(record: dict, where: str) -> tuple[tuple[str, str], ...]:
    value = record.get("context") or []
    if isinstance(value, dict):  # column layout: {"title": [...], "sentences": [[...], ...]}
        value = list(zip(value.get("title", []), value.get("sentences", [])))
    if not isinstance(value, list):
        raise InputError(f"{where}: 'context' must be a list of [title, sentences] pairs")
    return tuple(_paragraph(item, where) for item in value)


def _supporting_titles(record: dict, where: str) -> tuple[str, ...]:
    value = record.get("supporting_facts") or []
    if isinstance(value, dict):  # column layout: {"title": [...], "sent_id": [...]}
        titles = list(value.get("title", []))
    elif isinstance(value, list):
        titles = [fact[0] if isinstance(fact, (list, tuple)) and fact else fact for fact in value]
    else:
        titles = [None]
    if not all(isinstance(t, str) for t in titles):
        raise InputError(f"{where}: 'supporting_facts' must be a list of [title, sentence_id] pairs")
    return tuple(dict.fromkeys(titles))


def _example(record: dict, where: str, ordinal: int) -> Example:
    question = _text(_require(record, "question", where), "question", where).strip()
    if not question:
        raise InputError(f"{where}: 'question' is empty")
    answers = _answers(record, where)
    raw_id = record.get("_id", record.get("id"))
    example_id = str(raw_id) if raw_id is not None else f"q{ordinal}"
    return Example(
        id=example_id,
        question=question,
        answers=answers,
        type=str(record.get("type") or ""),
        supporting_titles=_supporting_titles(record, where),
        context=_context(record, where),
    )


def load_hotpotqa(path: PathLike) -> list[Example]:
    """Read a question set in HotpotQA layout (JSON Lines or a JSON array).

    Required keys: `question`, `answer` (a string, or a list of aliases). Optional: `_id` or `id`
    (default `q<N>`, N counting records from 0), `type`, `supporting_facts`, `context`.
    """
    examples: list[Example] = []
    seen: dict[str, str] = {}
    for ordinal, (where, record) in enumerate(read_records(path)):
        example = _example(record, where, ordinal)
        if example.id in seen:
            raise InputError(f"{where}: duplicate id '{example.id}' (first at {seen[example.id]})")
        seen[example.id] = where
        examples.append(example)
    if not examples:
        raise InputError(f"{path}: no questions in file")
    return examples


# --- data specs ---------------------------------------------------------------------------------


def _spec_error(spec: str) -> InputError:
    forms = ", ".join(DATA_SPECS)
    return InputError(f"unknown data spec '{spec}'; accepted forms: {forms}")


def _synthetic(split: str) -> list[Example]:
    from mhgpo import synth  # imported here: building the world is only needed for this spec

    folder = Path(synth.ensure_default_world())
    return load_hotpotqa(folder / f"{split}.jsonl")


def load_data(spec: str = "synthetic") -> list[Example]:
    """Resolve a data SPEC: `synthetic` (the default world's dev set), `synthetic:train`,
    `synthetic:dev`, or `hotpotqa:PATH` (a HotpotQA-layout file)."""
    spec = spec.strip()
    if spec == "synthetic":
        return _synthetic("dev")
    prefix, sep, rest = spec.partition(":")
    if sep and prefix == "synthetic" and rest in ("train", "dev"):
        return _synthetic(rest)
    if sep and prefix == "hotpotqa":
        if not rest:
            raise InputError(f"data spec '{spec}': missing PATH after 'hotpotqa:'")
        return load_hotpotqa(os.path.expanduser(rest))
    raise _spec_error(spec)


# --- corpora ------------------------------------------------------------------------------------


def _passage(record: dict, where: str) -> Passage:
    raw_id = _require(record, "id", where)
    if not isinstance(raw_id, (str, int)) or isinstance(raw_id, bool):
        raise InputError(f"{where}: 'id' must be a string or an integer")
    title = _text(_require(record, "title", where), "title", where)
    text = _text(_require(record, "text", where), "text", where)
    return Passage(id=str(raw_id), title=title, text=text)


def load_corpus_jsonl(path: PathLike) -> list[Passage]:
    """Read a passage corpus: one object a line with keys `id`, `title`, `text` (ids unique)."""
    passages: list[Passage] = []
    seen: dict[str, str] = {}
    for where, record in read_records(path):
        passage = _passage(record, where)
        if passage.id in seen:
            raise InputError(f"{where}: duplicate id '{passage.id}' (first at {seen[passage.id]})")
        seen[passage.id] = where
        passages.append(passage)
    if not passages:
        raise InputError(f"{path}: no passages in file")
    return passages


def context_corpus(examples: Sequence[Example]) -> list[Passage]:
    """All context paragraphs of `examples`, de-duplicated by (title, text), with ids `ctx0`,
    `ctx1`, ... in first-seen order."""
    unique: dict[tuple[str, str], None] = {}
    for example in examples:
        for title, text in example.context:
            unique.setdefault((title, text), None)
    return [Passage(id=f"ctx{n}", title=t, text=x) for n, (t, x) in enumerate(unique)]
