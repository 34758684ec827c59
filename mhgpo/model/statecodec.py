"""State that checkpoints keep besides the weights, in forms that load without running code: nested state dicts
(optimisers, schedulers) as JSON with their tensors set apart for a safetensors file, and the random number
generators' states (Python, NumPy's global state and a NumPy Generator, torch CPU and CUDA) as plain JSON.

JSON keeps what plain JSON loses with tags: ``{"$tensor": KEY}`` (a tensor stored under KEY), ``{"$tuple": [...]}``,
``{"$map": [[key, value], ...]}`` (a dict whose keys are not all strings, or that uses a tag as a key) and
``{"$ndarray": {"dtype": ..., "shape": [...], "data": [...]}}``. Floats round-trip exactly (Python's repr).
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

TAGS = ("$tensor", "$tuple", "$map", "$ndarray")


class StateError(ValueError):
    """A stored state that does not decode (a missing tensor, an unknown tag, a malformed RNG state)."""


def encode(obj: Any, tensors: dict[str, torch.Tensor], prefix: str) -> Any:
    """`obj` as JSON-able data; its tensors go into `tensors` under keys that start with `prefix`."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        key = f"{prefix}{len(tensors)}"
        tensors[key] = obj.detach().cpu().clone().contiguous()  # own storage: safetensors refuses shared tensors
        return {"$tensor": key}
    if isinstance(obj, np.ndarray):
        return {"$ndarray": {"dtype": str(obj.dtype), "shape": list(obj.shape), "data": obj.ravel().tolist()}}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return {"$tuple": [encode(v, tensors, prefix) for v in obj]}
    if isinstance(obj, list):
        return [encode(v, tensors, prefix) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and k not in TAGS for k in obj):
            return {k: encode(v, tensors, prefix) for k, v in obj.items()}
        return {"$map": [[encode(k, tensors, prefix), encode(v, tensors, prefix)] for k, v in obj.items()]}
    raise TypeError(f"cannot store a {type(obj).__name__} in a checkpoint")


def decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of :func:`encode`; raises StateError on a missing tensor or a malformed tag."""
    if isinstance(obj, list):
        return [decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    tag = next((t for t in TAGS if t in obj), None)
    if tag is None:
        return {k: decode(v, tensors) for k, v in obj.items()}
    if len(obj) != 1:
        raise StateError(f"malformed {tag} entry")
    value = obj[tag]
    if tag == "$tensor":
        if value not in tensors:
            raise StateError(f"tensor {value!r} is missing")
        return tensors[value]
    if tag == "$tuple" and isinstance(value, list):
        return tuple(decode(v, tensors) for v in value)
    if tag == "$map" and isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        return {_hashable(decode(k, tensors)): decode(v, tensors) for k, v in value}
    if tag == "$ndarray" and isinstance(value, dict):
        try:
            return np.asarray(value["data"], dtype=np.dtype(value["dtype"])).reshape(value["shape"])
        except (KeyError, TypeError, ValueError) as e:
            raise StateError(f"malformed $ndarray entry ({e})") from None
    raise StateError(f"malformed {tag} entry")


def _hashable(key: Any) -> Any:
    if isinstance(key, (list, dict, torch.Tensor, np.ndarray)):
        raise StateError("a mapping key is not a plain value")
    return key


# ---------------------------------------------------------------------------------------------------- RNG


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _bytes_tensor(text: Any, like: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(text, str):
        raise StateError(f"rng.{what}: expected a base64 string")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except ValueError:
        raise StateError(f"rng.{what}: invalid base64") from None
    if len(raw) != like.numel():
        raise StateError(f"rng.{what}: {len(raw)} bytes, expected {like.numel()}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def rng_states(np_rng: np.random.Generator) -> dict[str, Any]:
    """Every random number generator a run draws from, as JSON-able data."""
    version, internal, gauss = random.getstate()
    legacy = np.random.get_state(legacy=False)
    return {
        "python": [version, list(internal), gauss],
        "numpy_global": {
            "key": legacy["state"]["key"].tolist(),
            "pos": int(legacy["state"]["pos"]),
            "has_gauss": int(legacy["has_gauss"]),
            "gauss": float(legacy["gauss"]),
        },
        "numpy": encode(np_rng.bit_generator.state, {}, ""),
        "torch": _b64(torch.get_rng_state()),
        "cuda": [_b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
    }


def decode_rng_states(states: Any, np_rng: np.random.Generator) -> dict[str, Any]:
    """Check stored RNG states and turn them into what the generators take (nothing is changed yet)."""
    if not isinstance(states, dict):
        raise StateError("rng: expected a mapping")
    missing = [k for k in ("python", "numpy_global", "numpy", "torch") if k not in states]
    if missing:
        raise StateError(f"rng: {missing[0]} is missing")
    try:
        version, internal, gauss = states["python"]
        python = (int(version), tuple(int(x) for x in internal), gauss)
        random.Random().setstate(python)  # validates the state without touching the global generator
        g = states["numpy_global"]
        numpy_global = {
            "bit_generator": "MT19937",
            "state": {"key": np.asarray(g["key"], dtype=np.uint32), "pos": int(g["pos"])},
            "has_gauss": int(g["has_gauss"]),
            "gauss": float(g["gauss"]),
        }
        np.random.RandomState().set_state(numpy_global)
        numpy = decode(states["numpy"], {})
        probe = type(np_rng.bit_generator)()
        probe.state = numpy
    except StateError:
        raise
    except (TypeError, ValueError, KeyError) as e:
        raise StateError(f"rng: malformed state ({e})") from None
    cuda = states.get("cuda") or []
    if not isinstance(cuda, list):
        raise StateError("rng.cuda: expected a list")
    cuda_now = torch.cuda.get_rng_state_all() if cuda and torch.cuda.is_available() else []
    return {
        "python": python,
        "numpy_global": numpy_global,
        "numpy": numpy,
        "torch": _bytes_tensor(states["torch"], torch.get_rng_state(), "torch"),
        "cuda": [_bytes_tensor(s, like, "cuda") for s, like in zip(cuda, cuda_now)],
    }


def restore_rng_states(decoded: dict[str, Any], np_rng: np.random.Generator) -> None:
    """Set every generator from :func:`decode_rng_states`'s result."""
    random.setstate(decoded["python"])
    np.random.set_state(decoded["numpy_global"])
    np_rng.bit_generator.state = decoded["numpy"]
    torch.set_rng_state(decoded["torch"])
    if decoded["cuda"]:
        torch.cuda.set_rng_state_all(decoded["cuda"])
