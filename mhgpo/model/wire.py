"""What the ranks of a data-parallel run send each other, as JSON: decoding it never runs code (unlike unpickling,
which runs whatever a peer's bytes name).

Plain JSON values travel as they are (lists of numbers or strings untouched, which keeps token ids fast); the rest
with tags, as in :mod:`mhgpo.model.statecodec`: ``{"$tuple": [...]}``, ``{"$map": [[key, value], ...]}``,
``{"$ndarray": {...}}``, and ``{"$dataclass": NAME, "fields": {...}}`` for the few record types the trainer gathers
(rollout nodes and batches, examples, evaluation results, workflow failures), which their own modules
`register`. A NAME that is not registered is refused, so a peer can make the decoder build nothing but these
records. A value of another type (a workflow's `info` holding an object of its own, say) cannot be sent: the ranks
stop with an error naming its type.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from mhgpo.data.records import Example, Passage

# The record types that may cross between ranks, by class name: the modules that define them register them when
# they are imported (the data records here; the rollout, evaluation and workflow records in theirs).
DATACLASSES: dict[str, type] = {}
TAG = "$dataclass"


def register(*classes: type) -> None:
    """Let the ranks exchange these dataclasses (a name registered twice must be the same class)."""
    for cls in classes:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls!r} is not a dataclass")
        if DATACLASSES.setdefault(cls.__name__, cls) is not cls:
            raise ValueError(f"another record type is registered as {cls.__name__!r}")


register(Example, Passage)


class WireError(ValueError):
    """A value that cannot be sent to the other ranks, or bytes from a rank that do not decode."""


_SCALARS = (int, float, str)  # (bool and None are JSON too, handled one by one)
TAGS = ("$tuple", "$map", "$ndarray", TAG)


def _flat(items: Any) -> bool:
    """Whether a list or tuple holds only ints, floats and strings (token ids, logprobs: sent as they are)."""
    return all(type(v) in _SCALARS for v in items)


def _encode(obj: Any) -> Any:
    """`obj` as JSON-able data, with tags for tuples, odd mappings, arrays and the listed records."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return obj if _flat(obj) else [_encode(v) for v in obj]
    if isinstance(obj, tuple):
        return {"$tuple": list(obj) if _flat(obj) else [_encode(v) for v in obj]}
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) and k not in TAGS for k in obj):
            return {k: _encode(v) for k, v in obj.items()}
        return {"$map": [[_encode(k), _encode(v)] for k, v in obj.items()]}
    if isinstance(obj, np.ndarray):
        return {"$ndarray": {"dtype": str(obj.dtype), "shape": list(obj.shape), "data": obj.ravel().tolist()}}
    if isinstance(obj, np.generic):
        return obj.item()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        name = type(obj).__name__
        if DATACLASSES.get(name) is not type(obj):
            raise WireError(f"a {type(obj).__module__}.{name} cannot be sent between ranks")
        return {TAG: name, "fields": {f.name: _encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
    raise WireError(f"a {type(obj).__name__} cannot be sent between ranks (JSON-like values only)")


def dumps(obj: Any) -> bytes:
    """`obj` as UTF-8 JSON bytes; WireError names a value of a type that cannot be sent."""
    return json.dumps(_encode(obj), ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _decode(obj: Any) -> Any:
    if isinstance(obj, list):
        return obj if _flat(obj) else [_decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    tag = next((t for t in TAGS if t in obj), None)
    if tag is None:
        return {k: _decode(v) for k, v in obj.items()}
    if tag == TAG and set(obj) == {TAG, "fields"}:
        return _record(obj[TAG], obj["fields"])
    if len(obj) != 1:
        raise WireError(f"malformed {tag} entry from another rank")
    value = obj[tag]
    if tag == "$tuple" and isinstance(value, list):
        return tuple(_decode(value))
    if tag == "$map" and isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        pairs = [(_decode(k), _decode(v)) for k, v in value]
        if any(isinstance(k, (list, dict)) for k, _ in pairs):
            raise WireError("a mapping key from another rank is not a plain value")
        return dict(pairs)
    if tag == "$ndarray" and isinstance(value, dict):
        return np.asarray(value["data"], dtype=np.dtype(value["dtype"])).reshape(value["shape"])
    raise WireError(f"malformed {tag} entry from another rank")


def _record(name: Any, fields: Any) -> Any:
    if name not in DATACLASSES or not isinstance(fields, dict):
        raise WireError(f"unknown record type {name!r} from another rank")
    cls = DATACLASSES[name]
    if set(fields) != {f.name for f in dataclasses.fields(cls) if f.init}:
        raise WireError(f"malformed {name} record from another rank")
    return cls(**{k: _decode(v) for k, v in fields.items()})


def loads(data: bytes) -> Any:
    """The inverse of :func:`dumps`: JSON, and the listed record types only."""
    try:
        return _decode(json.loads(data.decode("utf-8")))
    except (UnicodeDecodeError, ValueError, TypeError, KeyError) as e:
        if isinstance(e, WireError):
            raise
        raise WireError(f"undecodable data from another rank ({e})") from None
