"""Checkpoints: `checkpoints/step_N/` of a run directory, written so that loading one never runs code.

- `model.safetensors`: the model's trainable tensors by parameter name (the LoRA adapter, or the whole model under
  full fine-tuning); `critic.safetensors` the same for the MAPPO / PPO critic.
- `optimizer.safetensors`: the tensors of every optimiser's state (the actor's under `actor/`, the critic's under
  `critic/`).
- `ahead.safetensors` (one step off-policy, when trees grew ahead as it was taken): the adapters that grow them.
- `state.json`: the format version, step, data position, validation history, the optimisers' state structure
  (which refers to the tensors above by key), the scheduler, every RNG state, and the size of each file.

A checkpoint is written into `.tmp_step_N/`, each file and the folder flushed to disk, then renamed to `step_N/`
(and the parent folder flushed): a `step_N/` folder is always complete. The last `keep` are kept. Loading checks
every file (present, of its recorded size, parses, tensors and optimiser state match the model) before any state
changes. Checkpoints of earlier versions (a pickled `trainer.pt`) are refused, never unpickled.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from mhgpo.errors import InputError
from mhgpo.io import fsync_dir, fsync_file, usual_permissions, write_synced
from mhgpo.model.sharding import full, is_dtensor, placed
from mhgpo.model.statecodec import StateError, decode, decode_rng_states, encode, restore_rng_states

FORMAT = 2  # 1: the earlier layout with a pickled trainer.pt (refused)
STEP_PREFIX = "step_"
STATE_FILE = "state.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
OLD_FILE = "trainer.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")

Extras = dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]


class CheckpointError(InputError):
    """A checkpoint that cannot be loaded; the message names the file and what is wrong with it."""


class CheckpointMismatch(CheckpointError):
    """A sound checkpoint that does not fit the model or algorithm it is loaded into (another config)."""


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that training changes (LoRA: the adapter only; else the whole model), whole: of a sharded
    model (FSDP) every rank must call it (each sharded tensor is gathered)."""
    return {n: full(p.detach()).cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.state_dict()` with whole tensors: the state of sharded parameters (FSDP) gathered, so that every
    rank must call it."""
    sd = optimizer.state_dict()
    state = {
        i: {k: full(v).cpu() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
        for i, entry in sd["state"].items()
    }
    return {**sd, "state": state}


@dataclass
class Snapshot:
    """What a checkpoint writes of the trained modules: whole tensors (:func:`snapshot`)."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    extras: dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]]


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer, extras: Extras | None = None) -> Snapshot:
    """The trained tensors and optimiser states of a checkpoint; a collective when `model` is sharded (FSDP):
    every rank calls it, rank 0 writes it."""
    return Snapshot(
        trainable_state(model),
        optimizer_state(optimizer),
        {name: (trainable_state(module), optimizer_state(opt)) for name, (module, opt) in (extras or {}).items()},
    )


def checkpoint_step(path: Path) -> int:
    return int(_STEP_DIR.match(Path(path).name).group(1))  # type: ignore[union-attr]


def list_checkpoints(run_dir: Path) -> list[Path]:
    """The `checkpoints/step_N/` folders of a run, by step."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()]
    return sorted(found, key=checkpoint_step)


# ------------------------------------------------------------------------------------------------ writing


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    try:  # tied weights share storage, and safetensors wants distinct tensors
        save_file({k: v.clone() for k, v in tensors.items()}, str(path))
    except SafetensorError as e:  # an I/O error (a full disk) comes back as this: make it the OSError it is
        code = re.search(r"os error (\d+)", str(e))
        if code is None:
            raise OSError(f"{path}: {e}") from e
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from e
    usual_permissions(path)
    fsync_file(path)


def _state_text(state: dict[str, Any]) -> bytes:
    """One top-level key per line: the step and position stay readable, the long states stay compact."""
    body = ",\n".join(f" {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in state.items())
    return ("{\n" + body + "\n}\n").encode("utf-8")


def _remove(path: Path) -> None:
    """Rename a folder out of the checkpoint names (atomic), then delete it."""
    doomed = path.with_name(f".del_{path.name}")
    shutil.rmtree(doomed, ignore_errors=True)
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def clean_leftovers(run_dir: Path) -> list[Path]:
    """Remove what an interrupted save leaves behind (`checkpoints/.tmp_step_N/`, `.del_step_N/`, the temporary
    files of the atomic writes of the run's logs, `.NAME.XXXX.tmp`), printing one line for each. Call it holding
    the run's lock (nothing else writes there then). Returns what was removed."""
    run_dir = Path(run_dir)
    root = run_dir / "checkpoints"
    found = [p for p in root.iterdir() if p.name.startswith((".tmp_", ".del_")) and p.is_dir()] if root.is_dir() else []
    for folder in (run_dir, run_dir / "rollouts"):
        if folder.is_dir():
            found += [p for p in folder.glob(".*.tmp") if p.is_file() and not p.is_symlink()]
    for p in sorted(found):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        print(f"mhgpo: removed {p}, left by an interrupted save", file=sys.stderr, flush=True)
    return sorted(found)


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    rng: dict[str, Any],
    trainer_state: dict[str, Any],
    keep: int,
    extras: Extras | None = None,
    taken: Snapshot | None = None,
    aside: dict[str, dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Write `checkpoints/step_N/`. `rng` comes from :func:`mhgpo.model.statecodec.rng_states`; `trainer_state` is JSON
    (position, validation history); `extras` are further trained modules with their optimisers (the critic);
    `taken`: their :func:`snapshot` already taken (by every rank of a sharded model), else it is taken here;
    `aside`: further tensors kept as they are, `NAME.safetensors` each (the weights that sample trees grown ahead)."""
    taken = taken or snapshot(model, optimizer, extras)
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    clean_leftovers(run_dir)
    final = root / f"{STEP_PREFIX}{step}"
    tmp = root / f".tmp_{STEP_PREFIX}{step}"
    tmp.mkdir()
    try:
        _write_tensors(tmp / MODEL_FILE, taken.model)
        opt_tensors: dict[str, torch.Tensor] = {}
        optimizers = {"actor": encode(taken.optimizer, opt_tensors, "actor/")}
        for name, (tensors, opt_state) in taken.extras.items():
            _write_tensors(tmp / f"{name}.safetensors", tensors)
            optimizers[name] = encode(opt_state, opt_tensors, f"{name}/")
        _write_tensors(tmp / OPTIMIZER_FILE, opt_tensors)
        for name, tensors in (aside or {}).items():
            _write_tensors(tmp / f"{name}.safetensors", tensors)
        sched_tensors: dict[str, torch.Tensor] = {}
        sched = encode(scheduler.state_dict(), sched_tensors, "") if scheduler is not None else None
        if sched_tensors:
            raise TypeError("the scheduler's state holds tensors; checkpoints keep it as JSON")
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        state = {
            "format": FORMAT,
            "step": step,
            **trainer_state,
            "files": files,
            "optimizers": optimizers,
            "scheduler": sched,
            "rng": rng,
        }
        write_synced(tmp / STATE_FILE, _state_text(state))
        fsync_dir(tmp)
        if final.exists():
            _remove(final)
        os.rename(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        _remove(old)
    fsync_dir(root)
    return final


# ------------------------------------------------------------------------------------------------ reading


def check_checkpoint(path: Path) -> dict[str, Any]:
    """Cheap checks that need no model: `state.json` parses and is of this format, every file it lists is there,
    of its recorded size, and a readable safetensors file. Returns the parsed state; raises CheckpointError."""
    path = Path(path)
    state_file = path / STATE_FILE
    old = path / OLD_FILE
    if old.exists():
        raise CheckpointError(
            f"{old}: a checkpoint of an earlier mhgpo version, with pickled optimiser state; "
            f"mhgpo never unpickles files, so it cannot be resumed (start a new run)"
        )
    if not state_file.is_file():
        raise CheckpointError(f"{state_file}: missing")
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{state_file}: unreadable or invalid JSON ({e})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{state_file}: expected a JSON object")
    version = state.get("format")
    if version != FORMAT:
        what = "an earlier" if not isinstance(version, int) or version < FORMAT else "a newer"
        raise CheckpointError(
            f"{state_file}: written by {what} mhgpo version (checkpoint format {version}; this "
            f"version reads format {FORMAT})"
        )
    for key, kind in (("step", int), ("position", int), ("files", dict), ("optimizers", dict), ("rng", dict)):
        if not isinstance(state.get(key), kind):
            raise CheckpointError(
                f"{state_file}: {key} is missing or not a{'n' if kind is int else ''} {kind.__name__}"
            )
    if state["step"] != checkpoint_step(path) or state["position"] < 0:
        raise CheckpointError(
            f"{state_file}: step {state['step']} / position {state['position']} do not fit the folder {path.name}"
        )
    for name, size in state["files"].items():
        file = path / str(name)
        if Path(str(name)).name != name or not name.endswith(".safetensors"):
            raise CheckpointError(f"{state_file}: lists an unexpected file {name!r}")
        if not file.is_file():
            raise CheckpointError(f"{file}: missing")
        actual = file.stat().st_size
        if actual != size:
            raise CheckpointError(f"{file}: {actual} bytes, but {size} were written (truncated or altered)")
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
    if MODEL_FILE not in state["files"] or OPTIMIZER_FILE not in state["files"]:
        missing = MODEL_FILE if MODEL_FILE not in state["files"] else OPTIMIZER_FILE
        raise CheckpointError(f"{path / missing}: missing from the checkpoint")
    return state


def previous_complete(run_dir: Path, before_step: int) -> Path | None:
    """The latest checkpoint before `before_step` that passes :func:`check_checkpoint`."""
    for p in reversed(list_checkpoints(run_dir)):
        if checkpoint_step(p) < before_step:
            try:
                check_checkpoint(p)
                return p
            except CheckpointError:
                continue
    return None


@dataclass
class LoadedCheckpoint:
    """Everything a checkpoint holds, checked against the live model and optimisers, not yet applied."""

    path: Path
    state: dict[str, Any]  # step, position, val_history
    tensors: dict[str, dict[str, torch.Tensor]]  # "model" and each extra's name -> tensors by parameter name
    optimizers: dict[str, dict[str, Any]]  # "actor" and each extra's name -> optimizer state dict
    scheduler: dict[str, Any] | None
    rng: dict[str, Any]  # decoded, ready for restore_rng_states


def _load_file(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def _check_tensors(file: Path, tensors: dict[str, torch.Tensor], module: torch.nn.Module) -> None:
    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if extra:
        raise CheckpointMismatch(
            f"{file}: holds {len(extra)} tensors the model does not train, e.g. {extra[0]} "
            f"(another model or LoRA setting?)"
        )
    if missing:
        raise CheckpointMismatch(
            f"{file}: lacks {len(missing)} of the model's trained tensors, e.g. {missing[0]} "
            f"(another model or LoRA setting?)"
        )
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(params[name].shape):
            raise CheckpointMismatch(
                f"{file}: {name} has shape {list(t.shape)}, the model's is "
                f"{list(params[name].shape)} (another model or LoRA setting?)"
            )


def _check_optimizer(file: Path, name: str, saved: Any, optimizer: torch.optim.Optimizer) -> None:
    live = optimizer.state_dict()
    where = f"{file}: the {name} optimiser state"
    if (
        not isinstance(saved, dict)
        or not isinstance(saved.get("param_groups"), list)
        or not isinstance(saved.get("state"), dict)
    ):
        raise CheckpointError(f"{where} is malformed")
    groups = saved["param_groups"]
    if len(groups) != len(live["param_groups"]) or any(
        not isinstance(g, dict) or len(g.get("params", [])) != len(h["params"])
        for g, h in zip(groups, live["param_groups"])
    ):
        raise CheckpointMismatch(f"{where} does not fit the model (another model or LoRA setting?)")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for g in groups for i in g["params"]]
    for index, entry in saved["state"].items():
        if index not in ids or not isinstance(entry, dict):
            raise CheckpointError(f"{where} refers to an unknown parameter {index!r}")
        shape = tuple(params[ids.index(index)].shape)
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != shape:
                raise CheckpointMismatch(
                    f"{where}: {key} of parameter {index} has shape {list(value.shape)}, "
                    f"the parameter's is {list(shape)}"
                )


@dataclass
class Live:
    """What a checkpoint restores: the model, its optimiser and scheduler, the run's NumPy Generator (the global
    RNGs come along), and `extras`, further trained modules with their optimisers (the critic)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    np_rng: np.random.Generator
    extras: Extras = field(default_factory=dict)


def read_checkpoint(path: Path, live: Live) -> LoadedCheckpoint:
    """Read and check every file of a checkpoint against the live objects; nothing is changed."""
    model, optimizer, scheduler, np_rng, extras = live.model, live.optimizer, live.scheduler, live.np_rng, live.extras
    path = Path(path)
    state = check_checkpoint(path)
    state_file = path / STATE_FILE
    tensors = {"model": _load_file(path / MODEL_FILE)}
    _check_tensors(path / MODEL_FILE, tensors["model"], model)
    opt_file = path / OPTIMIZER_FILE
    opt_tensors = _load_file(opt_file)
    wanted = {"actor": optimizer, **{name: opt for name, (_, opt) in extras.items()}}
    optimizers = {}
    for name, opt in wanted.items():
        if name not in state["optimizers"]:
            raise CheckpointMismatch(
                f"{state_file}: holds no {name} optimiser state (was the run trained with another algo?)"
            )
        try:
            optimizers[name] = decode(state["optimizers"][name], opt_tensors)
        except StateError as e:
            raise CheckpointError(f"{opt_file}: the {name} optimiser state: {e}") from None
        _check_optimizer(opt_file, name, optimizers[name], opt)
    for name, (module, _) in extras.items():
        file = path / f"{name}.safetensors"
        if file.name not in state["files"]:
            raise CheckpointMismatch(f"{file}: missing (was the run trained with another algo?)")
        tensors[name] = _load_file(file)
        _check_tensors(file, tensors[name], module)
    sched = None
    if scheduler is not None:
        try:
            sched = decode(state.get("scheduler"), {})
        except StateError as e:
            raise CheckpointError(f"{state_file}: the scheduler state: {e}") from None
        if not isinstance(sched, dict) or set(sched) != set(scheduler.state_dict()):
            raise CheckpointMismatch(f"{state_file}: the scheduler state is missing or does not fit the scheduler")
    try:
        rng = decode_rng_states(state["rng"], np_rng)
    except StateError as e:
        raise CheckpointError(f"{state_file}: {e}") from None
    trainer_state = {k: v for k, v in state.items() if k not in ("format", "files", "optimizers", "scheduler", "rng")}
    if not isinstance(trainer_state.get("val_history", []), list):
        raise CheckpointError(f"{state_file}: val_history is not a list")
    return LoadedCheckpoint(path, trainer_state, tensors, optimizers, sched, rng)


def apply_checkpoint(loaded: LoadedCheckpoint, live: Live) -> dict[str, Any]:
    """Set the model, optimisers, scheduler and RNGs from a checked checkpoint; return its trainer state."""
    modules = {"model": live.model, **{name: module for name, (module, _) in live.extras.items()}}
    with torch.no_grad():
        for key, module in modules.items():
            params = dict(module.named_parameters())
            for name, value in loaded.tensors[key].items():
                params[name].copy_(placed(value.to(params[name].device, params[name].dtype), params[name]))
    for name, opt in (("actor", live.optimizer), *((n, o) for n, (_, o) in live.extras.items())):
        opt.load_state_dict(loaded.optimizers[name])
        _place_state(opt)
    if live.scheduler is not None and loaded.scheduler is not None:
        live.scheduler.load_state_dict(loaded.scheduler)
    restore_rng_states(loaded.rng, live.np_rng)
    return loaded.state


def _place_state(optimizer: torch.optim.Optimizer) -> None:
    """After `load_state_dict` of whole tensors: the state of a sharded parameter (FSDP) cut to its shard."""
    for p, entry in optimizer.state.items():
        if is_dtensor(p):
            for k, v in entry.items():
                if isinstance(v, torch.Tensor) and not is_dtensor(v) and v.shape == p.shape:
                    entry[k] = placed(v, p)


def load_checkpoint(path: Path, live: Live) -> dict[str, Any]:
    """Check, then restore a checkpoint (model, optimisers, scheduler, RNGs); return the trainer state."""
    return apply_checkpoint(read_checkpoint(path, live), live)
