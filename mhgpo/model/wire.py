"""What the ranks of a data-parallel run send each other, as JSON: decoding it never runs code (unlike unpickling,
which runs whatever a peer's bytes name).

Plain JSON values travel as they are; the rest with the tags of :mod:`mhgpo.model.statecodec` (`$tuple`, `$map`,
`$ndarray`) and one more, ``{"$dataclass": NAME, "fields": {...}}``, for the few record types the trainer gathers
(rollout nodes and batches, examples, evaluation results, workflow failures). A NAME outside `DATACLASSES` is
refused, so a peer can make the decoder build nothing but these records. A value of another type (a workflow's
`info` holding an object of its own, say) cannot be sent: the ranks stop with an error naming its type.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Mapping
from typing import Any

from mhgpo.model.statecodec import StateError, decode as decode_state, encode as encode_state

# The record types that may cross between ranks: name → the module that defines it (imported by name on decoding:
# these modules are mhgpo's own and are loaded already wherever records are gathered).
DATACLASSES = {
    "Node": "mhgpo.rl.rollout",
    "RolloutBatch": "mhgpo.rl.rollout",
    "EvalResult": "mhgpo.rl.evaluation",
    "RolloutFailure": "mhgpo.team.loader",
    "Example": "mhgpo.data.records",
    "Passage": "mhgpo.data.records",
}
TAG = "$dataclass"


class WireError(ValueError):
    """A value that cannot be sent to the other ranks, or bytes from a rank that do not decode."""


def _plain(obj: Any) -> Any:
    """`obj` with its records (dataclasses) and read-only mappings turned into tagged plain values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        name = type(obj).__name__
        if DATACLASSES.get(name) != type(obj).__module__:
            raise WireError(f"a {type(obj).__module__}.{name} cannot be sent between ranks")
        return {TAG: name, "fields": {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_plain(v) for v in obj)
    if isinstance(obj, Mapping):
        if TAG in obj:
            raise WireError(f"a mapping with the key {TAG!r} cannot be sent between ranks")
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def dumps(obj: Any) -> bytes:
    """`obj` as UTF-8 JSON bytes; WireError names a value of a type that cannot be sent."""
    try:
        data = encode_state(_plain(obj), {}, "")
    except TypeError as e:
        raise WireError(str(e).replace("in a checkpoint", "between ranks")) from None
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _records(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_records(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_records(v) for v in obj)
    if not isinstance(obj, dict):
        return obj
    if TAG in obj and set(obj) == {TAG, "fields"}:
        name, fields = obj[TAG], obj["fields"]
        if name not in DATACLASSES or not isinstance(fields, dict):
            raise WireError(f"unknown record type {name!r} from another rank")
        cls = getattr(importlib.import_module(DATACLASSES[name]), name)
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        if set(fields) != known:
            raise WireError(f"malformed {name} record from another rank")
        return cls(**{k: _records(v) for k, v in fields.items()})
    return {k: _records(v) for k, v in obj.items()}


def loads(data: bytes) -> Any:
    """The inverse of :func:`dumps`: JSON and the listed record types only."""
    try:
        tree = json.loads(data.decode("utf-8"))
        return _records(decode_state(tree, {}))
    except (UnicodeDecodeError, ValueError, TypeError, StateError) as e:
        raise WireError(f"undecodable data from another rank ({e})") from None

