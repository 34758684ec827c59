"""Loading typed configs: dataclasses built from (partial) nested dicts, YAML files that are dumps of them and
dotted `key=value` overrides (`search.top_k=5`, `optim.lr=1e-5`). Unknown keys and values of the wrong type are
rejected with an `InputError` that names the key (and the file when there is one)."""

from __future__ import annotations

import copy
import dataclasses
import math
import reprlib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from mhgpo.errors import InputError

T = TypeVar("T")

# A config, a table of rows or a run's config.yaml is small; a few hundred bytes of nested aliases can stand for
# billions of values (each alias is the anchored value again), which every reader of the tree would walk.
MAX_YAML_BYTES = 1 << 20
MAX_YAML_VALUES = 100_000  # values of a document, its aliases expanded
MAX_YAML_DEPTH = 100  # nested mappings and lists

_REPR = reprlib.Repr()  # values shown in messages: a long string or a big tree is cut (`...`)
_REPR.maxstring, _REPR.maxother, _REPR.maxlevel = 200, 200, 3
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxdict = 10


def shown(value: Any) -> str:
    """`repr(value)` cut to a few hundred characters (a message never repeats a huge value)."""
    return _REPR.repr(value)


def parse_yaml(text: str, where: object) -> Any:
    """`yaml.safe_load(text)`, refusing with an InputError naming `where` (a file, an override) a document larger
    than MAX_YAML_BYTES, nested deeper than MAX_YAML_DEPTH, whose aliases expand it beyond MAX_YAML_VALUES values,
    that holds itself, or a mapping that gives a key twice (the first value would be dropped unseen); invalid YAML
    raises yaml.YAMLError as yaml.safe_load does."""
    if len(text) > MAX_YAML_BYTES:
        raise InputError(f"{where}: more than {MAX_YAML_BYTES} characters; refused (a YAML document here is small)")
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_size(node, where)
        return loader.construct_document(node)
    except RecursionError:
        raise InputError(f"{where}: nested too deeply (at most {MAX_YAML_DEPTH} levels)") from None
    finally:
        loader.dispose()


def _check_size(root: yaml.Node, where: object) -> None:
    """The values under `root` counted with each alias expanded (a node met again is counted from its memo, so
    this takes the time of the document, not of its expansion)."""
    sizes: dict[int, int] = {}
    started: set[int] = set()  # begun and not finished: the node being counted and its ancestors
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, done = stack.pop()
        key = id(node)
        children = [] if isinstance(node, yaml.ScalarNode) else _children(node)
        if done:
            started.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[key] > MAX_YAML_VALUES:
                raise InputError(
                    f"{where}: its aliases (*name) expand it beyond {MAX_YAML_VALUES} values; refused (write the "
                    f"values out)"
                )
            continue
        if key in sizes:
            continue
        if key in started:
            raise InputError(f"{where}: an alias (*name) inside the value it names; refused")
        if depth > MAX_YAML_DEPTH:
            raise InputError(f"{where}: nested too deeply (at most {MAX_YAML_DEPTH} levels)")
        if isinstance(node, yaml.MappingNode):
            _check_keys(node, where)
        started.add(key)
        stack.append((node, depth, True))
        stack.extend((c, depth + 1, False) for c in children if id(c) not in sizes)


def _check_keys(node: yaml.MappingNode, where: object) -> None:
    seen = set()
    for k, _ in node.value:
        if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
            if (k.tag, k.value) in seen:
                raise InputError(f"{where}:{k.start_mark.line + 1}: key {shown(k.value)} given twice in one mapping")
            seen.add((k.tag, k.value))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value)


def read_yaml(path: str | Path) -> Any:
    """The YAML file `path` (:func:`parse_yaml`, named by its path); OSError, UnicodeDecodeError and
    yaml.YAMLError as reading and `yaml.safe_load` raise them."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise InputError(f"{path}: not a regular file (a YAML file is read whole)")
    with path.open("rb") as f:
        data = f.read(MAX_YAML_BYTES + 1)
    return parse_yaml(data.decode("utf-8"), path)


def at_least(obj: Any, key: str, least: int, prefix: str = "") -> None:
    value = getattr(obj, key)
    if value < least:
        raise InputError(f"{prefix}{key}: must be at least {least}, got {value}")


MAX_SEED = 2**32 - 1  # numpy's global seed (`np.random.seed`) takes 0 to 2**32 - 1


def check_seed(seed: int, key: str = "seed") -> None:
    if not 0 <= seed <= MAX_SEED:
        raise InputError(f"{key}: must be between 0 and {MAX_SEED} (2**32 - 1), got {seed}")


def check_counts(obj: Any, keys: tuple[str, ...], optional: str = "") -> None:
    """Counts that must be at least 1 (and an optional one: null or at least 1)."""
    for key in keys:
        at_least(obj, key, 1)
    if optional and getattr(obj, optional) is not None:
        at_least(obj, optional, 1)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check (and mildly coerce) `value` against the annotation `tp`; raise InputError naming `key`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except InputError as e:
                errors.append(str(e))
        if len(errors) == 1:
            raise InputError(errors[0] + (" (or null)" if type(None) in args else ""))
        raise InputError(f"{key}: expected {' or '.join(_type_name(a) for a in args)}, got {shown(value)}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise InputError(f"{key}: expected a mapping of {tp.__name__} fields, got {shown(value)}")
        return from_dict(tp, value, prefix=key + ".")
    if origin is dict:
        if not isinstance(value, dict):
            raise InputError(f"{key}: expected a mapping of keys to values, got {shown(value)}")
        inner = typing.get_args(tp)[1] if len(typing.get_args(tp)) == 2 else Any
        return {k: _coerce(v, inner, f"{key}.{k}") for k, v in value.items()}
    if origin in (list, tuple):
        (inner, *_) = typing.get_args(tp) or (Any,)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise InputError(f"{key}: expected a list, got {shown(value)}")
        items = [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise InputError(f"{key}: expected true or false, got {shown(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise InputError(f"{key}: expected an integer, got {shown(value)}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise InputError(f"{key}: expected a number, got {shown(value)}")
        if not math.isfinite(number):
            raise InputError(f"{key}: expected a finite number, got {shown(value)}")
        return number
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise InputError(f"{key}: expected a string, got {shown(value)}")
    return value


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass `cls` from a (partial) nested dict; unknown keys raise InputError naming them. A class's
    `resolved()` (if it has one) fills in the defaults that depend on other keys, then its `validate()` checks."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise InputError(
            f"unknown config key {prefix}{unknown[0]!s}; valid keys here: {', '.join(prefix + n for n in sorted(names))}"
        )
    defaults: Any = None
    kwargs = {}
    for name, value in data.items():
        if isinstance(value, dict) and dataclasses.is_dataclass(hints[name]):
            # a partial section starts from this field's own default (its default_factory may differ from the
            # section class's defaults: `search.reranker.top_p=0.95` keeps the Reranker's max_new_tokens)
            defaults = cls() if defaults is None else defaults
            value = merge_trees(to_dict(getattr(defaults, name)), value)
        kwargs[name] = _coerce(value, hints[name], prefix + name)
    obj = cls(**kwargs)
    resolved = getattr(obj, "resolved", None)  # defaults that depend on other keys, filled before the checks
    if callable(resolved):
        obj = resolved()
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


def to_dict(obj: Any) -> dict[str, Any]:
    """The config as nested dicts, as a YAML file holds it: a section's own keys first, then its sections (the
    keys of a base config class, `TeamRunConfig`'s, come first in field order and are sorted in that way too)."""
    return _keys_first(obj, dataclasses.asdict(obj))


def _keys_first(obj: Any, tree: dict[str, Any]) -> dict[str, Any]:
    names = [f.name for f in dataclasses.fields(obj)]
    out = {n: tree[n] for n in names if not isinstance(tree[n], dict)}
    for n in names:
        if isinstance(tree[n], dict):
            value = getattr(obj, n)
            out[n] = _keys_first(value, tree[n]) if dataclasses.is_dataclass(value) else tree[n]
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise InputError(f"override {shown(text)} is not of the form key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise InputError(f"override {shown(text)} has an empty key")
    try:
        value = parse_yaml(raw, f"override {key}") if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def set_key(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set the dotted `key` (`optim.lr`) of a nested config tree to `value`, making the sections on the way."""
    _set_path(tree, dotted.split("."), value)


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[path[-1]] = value


def merge_trees(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` with `extra`'s keys over it, nested mappings merged key by key (neither is changed)."""
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge_trees(out[k], v)
        else:
            out[k] = v
    return out


def read_mapping(path: str | Path) -> dict[str, Any]:
    """The YAML file `path` as a mapping (empty for an empty file); a missing file, invalid YAML (with its line) or
    another top level is an InputError naming the file."""
    try:
        tree = read_yaml(path) or {}
    except FileNotFoundError:
        raise InputError(f"{path}: file not found") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise InputError(f"{path}{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(tree, dict):
        raise InputError(f"{path}: expected a mapping of keys to values")
    return tree


def load_config(
    cls: type[T],
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    base: dict[str, Any] | None = None,
) -> T:
    """defaults ← `base` ← YAML file ← `overrides` (`a.b=value`), checked against `cls`."""
    tree: dict[str, Any] = copy.deepcopy(base or {})  # overrides must not reach into the caller's base
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise InputError(f"{p}: config file not found")
        try:
            loaded = read_yaml(p) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            mark = getattr(e, "problem_mark", None)
            where = f":{mark.line + 1}" if mark is not None else ""
            raise InputError(f"{p}{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
        if not isinstance(loaded, dict):
            raise InputError(f"{p}: a config file must be a mapping of keys to values")
        tree = merge_trees(tree, loaded)
        try:
            from_dict(cls, tree)
        except InputError as e:
            raise InputError(f"{p}: {e}") from None
    for text in overrides:
        keys, value = parse_override(text)
        _set_path(tree, keys, value)
    return from_dict(cls, tree)


def dump_config(obj: Any, path: str | Path) -> None:
    """Write the resolved config as YAML (atomically), with the password of any URL in it redacted."""
    from mhgpo.config.choices import redact_urls
    from mhgpo.io import atomic_write_text

    atomic_write_text(Path(path), yaml.safe_dump(redact_urls(to_dict(obj)), sort_keys=False))


def differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two nested config trees, in the order of `a` (then `b`)."""
    found: list[str] = []
    for k in list(a) + [k for k in b if k not in a]:
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            found += differences(x, y, f"{prefix}{k}.")
        elif x != y:
            found.append(prefix + k)
    return found


def first_difference(a: dict, b: dict) -> str | None:
    """The first dotted key whose value differs between two nested config trees, or None."""
    found = differences(a, b)
    return found[0] if found else None


def lookup(tree: dict, key: str) -> Any:
    """The value at dotted `key` of a nested tree (None where a part is missing)."""
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def names_key(path: str | Path | None, overrides: list[str] | tuple[str, ...], key: str) -> bool:
    """Whether the config file `path` (its top level) or one of `overrides` sets `key` explicitly."""
    if any(parse_override(o)[0] == key.split(".") for o in overrides):
        return True
    if path is None:
        return False
    try:
        tree = read_yaml(path)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, InputError):
        return False
    return lookup(tree, key) is not None if isinstance(tree, dict) else False
