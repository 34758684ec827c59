"""Reading question sets and passage corpora from local files in the benchmarks' official layouts.

A file whose first non-space character is `[` is read as one JSON array of objects; any other file
as JSON Lines (one object a line, blank lines skipped). Every error is an `InputError` that names
where it happened: `path:LINE` for JSON Lines, `path[INDEX]` for an array element.

Question sets: the layouts of `mhgpo/data/spec.py`'s data SPECs (`hotpotqa:PATH`, `2wiki:PATH`, `musique:PATH`,
`jsonl:PATH`), one parser a layout (`hotpot_example`, `musique_example`, `generic_example`).

Corpora: JSON Lines `{id, title, text}`, DPR `psgs_w100.tsv` (`id<TAB>text<TAB>title` with a header), or the
"context corpus": the paragraphs of a question set itself, de-duplicated by (title, text).
"""

from __future__ import annotations

import csv
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Union

from mhgpo.data.records import Example, Passage
from mhgpo.errors import InputError

__all__ = [
    "read_jsonl",
    "read_json_array",
    "read_records",
    "hotpot_example",
    "musique_example",
    "generic_example",
    "load_hotpotqa",
    "load_2wiki",
    "load_musique",
    "read_musique",
    "load_generic",
    "read_corpus",
    "load_corpus_jsonl",
    "load_corpus_tsv",
    "corpus_file",
    "context_corpus",
]

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]

_UNDECODABLE = re.compile("[\udc80-\udcff]")  # bytes that were not UTF-8, kept by errors="surrogateescape"


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


# --- shared field parsers -----------------------------------------------------------------------


def _require(record: dict, key: str, where: str) -> Any:
    if key not in record or record[key] is None:
        raise InputError(f"{where}: missing key '{key}'")
    return record[key]


def _text(value: Any, key: str, where: str) -> str:
    if not isinstance(value, str):
        raise InputError(f"{where}: '{key}' must be a string, got {type(value).__name__}")
    return value


def _answer_list(value: Any, key: str, where: str) -> tuple[str, ...]:
    aliases = value if isinstance(value, list) else [value]
    answers = tuple(_text(a, key, where).strip() for a in aliases)
    if not answers or not all(answers):
        raise InputError(f"{where}: '{key}' is empty")
    return tuple(dict.fromkeys(answers))


def _question(record: dict, where: str) -> str:
    question = _text(_require(record, "question", where), "question", where).strip()
    if not question:
        raise InputError(f"{where}: 'question' is empty")
    return question


def _record_id(record: dict, ordinal: int, *keys: str) -> str:
    for key in keys:
        if record.get(key) is not None:
            return str(record[key])
    return f"q{ordinal}"


def _join_sentences(sentences: Iterable[str]) -> str:
    """Join sentences so the text reads naturally: add a space only where neither side has one."""
    text = ""
    for sentence in sentences:
        if text and sentence and not text[-1].isspace() and not sentence[0].isspace():
            text += " "
        text += sentence
    return text.strip()


def _paragraph(item: Any, where: str) -> tuple[str, str]:
    if isinstance(item, dict) and isinstance(item.get("title"), str):  # generic layout: {"title", "text"}
        item = [item["title"], item.get("text", item.get("sentences"))]
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
    if isinstance(value, dict):  # column layout: {"title": [...], "sentences" (or "content"): [[...], ...]}
        value = list(zip(value.get("title", []), value.get("sentences", value.get("content", []))))
    if not isinstance(value, list):
        raise InputError(f"{where}: 'context' must be a list of [title, sentences] pairs")
    return tuple(_paragraph(item, where) for item in value)


def _supporting_titles(record: dict, where: str, key: str = "supporting_facts") -> tuple[str, ...]:
    value = record.get(key) or []
    if isinstance(value, dict):  # column layout: {"title": [...], "sent_id": [...]}
        titles = list(value.get("title", []))
    elif isinstance(value, list):
        titles = [fact[0] if isinstance(fact, (list, tuple)) and fact else fact for fact in value]
    else:
        titles = [None]
    if not all(isinstance(t, str) for t in titles):
        if key == "supporting_facts":
            raise InputError(f"{where}: 'supporting_facts' must be a list of [title, sentence_id] pairs")
        raise InputError(f"{where}: '{key}' must be a list of titles")
    return tuple(dict.fromkeys(titles))


def _by_title(titles: Sequence[str], context: Sequence[tuple[str, str]]) -> tuple[tuple[int, ...], ...]:
    """For each title, the indices of the context paragraphs that carry it (none when it is absent)."""
    if not context:
        return ()
    return tuple(tuple(j for j, (t, _) in enumerate(context) if t == title) for title in titles)


def parsed_records(path: PathLike, parse: Callable[[dict, str, int], Example | None]) -> list[tuple[dict, Example]]:
    """Every record of `path` with its parsed `Example` (records parsed to None are skipped); duplicate ids and
    files without questions are rejected."""
    pairs: list[tuple[dict, Example]] = []
    seen: dict[str, str] = {}
    records = 0
    for ordinal, (where, record) in enumerate(read_records(path)):
        records += 1
        example = parse(record, where, ordinal)
        if example is None:
            continue
        if example.id in seen:
            raise InputError(f"{where}: duplicate id '{example.id}' (first at {seen[example.id]})")
        seen[example.id] = where
        pairs.append((record, example))
    if not pairs:
        raise InputError(f"{path}: no questions in file" if not records else f"{path}: no answerable questions in file")
    return pairs


def _load(path: PathLike, parse: Callable[[dict, str, int], Example | None]) -> list[Example]:
    """Parse every record of `path` (None: skipped) and reject duplicate ids and empty files."""
    return [example for _, example in parsed_records(path, parse)]


def _decomposition(record: dict, where: str) -> tuple[str, ...]:
    """The optional `decomposition` list of a record (the hops as sub-questions; the synthetic world writes it)."""
    value = record.get("decomposition")
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InputError(f"{where}: 'decomposition' must be a list of strings")
    return tuple(_text(q, "decomposition", where).strip() for q in value if str(q).strip())


def _musique_hops(record: dict, where: str) -> tuple[str, ...]:
    """MuSiQue's `question_decomposition` as search queries: `>>` becomes a space and a reference `#k` to an earlier
    hop is replaced by that hop's query without its question mark (never by its answer, which a query rewriter
    cannot know)."""
    value = record.get("question_decomposition")
    if not isinstance(value, list):
        return ()
    hops: list[str] = []
    for i, item in enumerate(value):
        text = item.get("question") if isinstance(item, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise InputError(f"{where}: question_decomposition[{i}]: missing key 'question'")
        text = re.sub(
            r"#(\d+)",
            lambda m: hops[int(m.group(1)) - 1].rstrip("?") if 0 < int(m.group(1)) <= len(hops) else m.group(0),
            text,
        )
        hops.append(" ".join(text.replace(">>", " ").split()))
    return tuple(hops)


def _titled_example(
    record: dict, where: str, ordinal: int, answer_key: str, titles_key: str, id_keys: tuple[str, ...]
) -> Example:
    """An `Example` from a record whose gold paragraphs are named by title (HotpotQA layout, generic JSONL)."""
    question = _question(record, where)
    answers = _answer_list(_require(record, answer_key, where), answer_key, where)
    context = _context(record, where)
    titles = _supporting_titles(record, where, titles_key)
    return Example(
        id=_record_id(record, ordinal, *id_keys),
        question=question,
        answers=answers,
        type=str(record.get("type") or ""),
        supporting_titles=titles,
        context=context,
        supporting_context=_by_title(titles, context),
        decomposition=_decomposition(record, where),
    )


# --- HotpotQA and 2WikiMultihopQA ---------------------------------------------------------------


def hotpot_example(record: dict, where: str, ordinal: int) -> Example:
    """One HotpotQA-layout record (HotpotQA, 2WikiMultihopQA) as an `Example`; InputError names `where`.

    Supporting facts are read for their titles only, so a sentence index past a paragraph's end (as in a few
    2WikiMultihopQA records) is harmless; a title repeated in `context` makes every copy count as gold.
    """
    return _titled_example(record, where, ordinal, "answer", "supporting_facts", ("_id", "id"))


def load_hotpotqa(path: PathLike) -> list[Example]:
    """Read a question set in HotpotQA layout (JSON Lines or a JSON array).

    Required keys: `question`, `answer` (a string, or a list of aliases). Optional: `_id` or `id`
    (default `q<N>`, N counting records from 0), `type`, `supporting_facts`, `context`.
    """
    return _load(path, hotpot_example)


def load_2wiki(path: PathLike) -> list[Example]:
    """Read 2WikiMultihopQA (JSON array as released, or JSON Lines): the HotpotQA layout plus `evidences`
    (and, in the later release, `entity_ids`, `evidences_id`, `answer_id`), which are not needed and ignored."""
    return _load(path, hotpot_example)


# --- MuSiQue ------------------------------------------------------------------------------------


def _musique_paragraphs(record: dict, where: str) -> list[tuple[str, str, bool]]:
    value = _require(record, "paragraphs", where)
    if not isinstance(value, list):
        raise InputError(f"{where}: 'paragraphs' must be a list of objects")
    out = []
    for i, item in enumerate(value):
        at = f"{where}: paragraphs[{i}]"
        if not isinstance(item, dict):
            raise InputError(f"{at}: expected an object, got {type(item).__name__}")
        for key in ("title", "paragraph_text"):
            if item.get(key) is None:
                raise InputError(f"{at}: missing key '{key}'")
            _text(item[key], key, at)
        out.append((item["title"], item["paragraph_text"].strip(), item.get("is_supporting") is True))
    return out


def musique_example(record: dict, where: str, ordinal: int) -> Example | None:
    """One MuSiQue record as an `Example`, or None when it is marked `answerable: false`.

    Gold answers are `answer` and the `answer_aliases`; gold paragraphs are those with `is_supporting: true`, each
    its own gold unit even when another paragraph shares its title. The type is the id's prefix (`2hop`, ...).
    """
    if record.get("answerable") is False:
        return None
    question = _question(record, where)
    answers = _answer_list(_require(record, "answer", where), "answer", where)
    aliases = record.get("answer_aliases") or []
    if not isinstance(aliases, list):
        raise InputError(f"{where}: 'answer_aliases' must be a list of strings")
    answers = tuple(dict.fromkeys(answers + tuple(_text(a, "answer_aliases", where).strip() for a in aliases if a)))
    paragraphs = _musique_paragraphs(record, where)
    gold = [j for j, (_, _, supporting) in enumerate(paragraphs) if supporting]
    example_id = _record_id(record, ordinal, "id", "_id")
    return Example(
        id=example_id,
        question=question,
        answers=answers,
        type=example_id.split("__")[0] if "__" in example_id else "",
        supporting_titles=tuple(paragraphs[j][0] for j in gold),
        context=tuple((title, text) for title, text, _ in paragraphs),
        supporting_context=tuple((j,) for j in gold),
        decomposition=_musique_hops(record, where),
    )


def read_musique(path: PathLike) -> tuple[list[Example], int]:
    """The answerable questions of a MuSiQue file (JSON Lines) and how many unanswerable ones were skipped."""
    skipped = 0

    def parse(record: dict, where: str, ordinal: int) -> Example | None:
        nonlocal skipped
        example = musique_example(record, where, ordinal)
        skipped += example is None
        return example

    return _load(path, parse), skipped


def load_musique(path: PathLike) -> list[Example]:
    """`read_musique`, logging the number of skipped unanswerable records."""
    examples, skipped = read_musique(path)
    if skipped:
        log.warning("%s: skipped %d unanswerable record(s)", path, skipped)
    return examples


# --- generic JSONL ------------------------------------------------------------------------------


def generic_example(record: dict, where: str, ordinal: int) -> Example:
    """`{id, question, answers}`; `answers` is a list of strings (or one string). Optional: `type`, `context`
    (a list of `{title, text}` objects or `[title, text]` pairs) and `supporting_titles`."""
    return _titled_example(record, where, ordinal, "answers", "supporting_titles", ("id", "_id"))


def load_generic(path: PathLike) -> list[Example]:
    """Read a generic question set: one `{id, question, answers}` object a line (or a JSON array of them)."""
    return _load(path, generic_example)


# --- corpora ------------------------------------------------------------------------------------


def _passage(record: dict, where: str) -> Passage:
    raw_id = _require(record, "id", where)
    if not isinstance(raw_id, (str, int)) or isinstance(raw_id, bool):
        raise InputError(f"{where}: 'id' must be a string or an integer")
    title = _text(_require(record, "title", where), "title", where)
    text = _text(_require(record, "text", where), "text", where)
    return Passage(id=str(raw_id), title=title, text=text)


def _unique_passages(rows: Iterable[tuple[str, Passage]], path: PathLike) -> list[Passage]:
    passages: list[Passage] = []
    seen: dict[str, str] = {}
    for where, passage in rows:
        if passage.id in seen:
            raise InputError(f"{where}: duplicate id '{passage.id}' (first at {seen[passage.id]})")
        seen[passage.id] = where
        passages.append(passage)
    if not passages:
        raise InputError(f"{path}: no passages in file")
    return passages


def load_corpus_jsonl(path: PathLike) -> list[Passage]:
    """Read a passage corpus: one object a line with keys `id`, `title`, `text` (ids unique)."""
    return _unique_passages(((where, _passage(record, where)) for where, record in read_records(path)), path)


def _tsv_rows(path: PathLike) -> Iterator[tuple[str, Passage]]:
    try:
        handle = open(path, encoding="utf-8-sig", errors="surrogateescape", newline="")
    except FileNotFoundError:
        raise InputError(f"{path}: file not found") from None
    except OSError as err:
        raise InputError(f"{path}: cannot read ({err.strerror or err})") from None
    with handle:
        reader = csv.reader(handle, delimiter="\t")
        line = 0
        try:
            header = next(reader, None)
            columns = {name.strip(): i for i, name in enumerate(header or [])}
            missing = [key for key in ("id", "text", "title") if key not in columns]
            if missing:
                raise InputError(
                    f"{path}:1: the header must name the columns id, text and title (missing {', '.join(missing)})"
                )
            at = [columns["id"], columns["title"], columns["text"]]
            line = reader.line_num
            for row in reader:
                where, line = f"{path}:{line + 1}", reader.line_num
                if not row:
                    continue
                if len(row) != len(columns):
                    raise InputError(f"{where}: expected {len(columns)} tab-separated fields, got {len(row)}")
                if _UNDECODABLE.search("\t".join(row)):
                    raise InputError(f"{where}: not valid UTF-8")
                pid, title, body = (row[i] for i in at)
                if not pid.strip():
                    raise InputError(f"{where}: empty 'id'")
                yield where, Passage(id=pid.strip(), title=title, text=body)
        except csv.Error as err:
            raise InputError(f"{path}:{line + 1}: malformed TSV ({err})") from None


def load_corpus_tsv(path: PathLike) -> list[Passage]:
    """Read a DPR-style corpus (`psgs_w100.tsv`): a header `id<TAB>text<TAB>title` (any column order), then one
    passage a line (fields may be quoted, `""` inside quotes being one `"`); errors name the line."""
    return _unique_passages(_tsv_rows(path), path)


def corpus_file(spec: str) -> tuple[Path, Callable[[PathLike], list[Passage]]]:
    """The file and reader of a corpus SPEC: `jsonl:PATH`, `tsv:PATH`, or a PATH (`.tsv` read as DPR TSV,
    anything else as JSON Lines)."""
    prefix, sep, rest = spec.partition(":")
    if sep and prefix in ("jsonl", "tsv") and rest:
        path = Path(os.path.expanduser(rest))
        return path, load_corpus_tsv if prefix == "tsv" else load_corpus_jsonl
    path = Path(os.path.expanduser(spec))
    return path, load_corpus_tsv if path.suffix.lower() == ".tsv" else load_corpus_jsonl


def read_corpus(spec: str) -> list[Passage]:
    """Read the corpus a SPEC names (see `corpus_file`)."""
    path, reader = corpus_file(spec)
    return reader(path)


def context_corpus(examples: Sequence[Example]) -> list[Passage]:
    """All context paragraphs of `examples`, de-duplicated by (title, text), with ids `ctx0`,
    `ctx1`, ... in first-seen order."""
    unique: dict[tuple[str, str], None] = {}
    for example in examples:
        for title, text in example.context:
            unique.setdefault((title, text), None)
    return [Passage(id=f"ctx{n}", title=t, text=x) for n, (t, x) in enumerate(unique)]
