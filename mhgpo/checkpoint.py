"""Checkpoints: `checkpoints/step_N/` holds the model (or LoRA adapter) as safetensors (and, for MAPPO / PPO,
the critic as `critic.safetensors`), the optimizers and scheduler, every RNG state and the data position.
Written under a temporary name and renamed; the last K kept."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

STEP_PREFIX = "step_"


def rng_states(np_rng: np.random.Generator) -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy_global": np.random.get_state(),
        "numpy": np_rng.bit_generator.state,
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_states(states: dict[str, Any], np_rng: np.random.Generator) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy_global"])
    np_rng.bit_generator.state = states["numpy"]
    torch.set_rng_state(states["torch"])
    if states.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that training changes (LoRA: the adapter only; else the whole model)."""
    return {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    rng: dict[str, Any],
    trainer_state: dict[str, Any],
    keep: int,
    extras: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] | None = None,
) -> Path:
    """Write `checkpoints/step_N/`. `extras` are further trained modules with their optimisers (the MAPPO / PPO
    critic): `NAME.safetensors` each, their optimiser states in `trainer.pt`."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{STEP_PREFIX}{step}"
    tmp = root / f".tmp_{STEP_PREFIX}{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    tensors = trainable_state(model)
    # tied weights share storage; safetensors wants distinct tensors
    save_file({k: v.clone() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
    extra_optimizers = {}
    for name, (module, opt) in (extras or {}).items():
        save_file({k: v.clone() for k, v in trainable_state(module).items()}, str(tmp / f"{name}.safetensors"))
        extra_optimizers[name] = opt.state_dict()
    torch.save(
        {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict() if scheduler else None, "rng": rng,
         "extras": extra_optimizers},
        tmp / "trainer.pt",
    )
    (tmp / "state.json").write_text(json.dumps({"step": step, **trainer_state}, indent=2))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX)]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX) :]))


def _load_tensors(file: Path, model: torch.nn.Module) -> None:
    if not file.is_file():
        raise ValueError(f"{file}: missing from the checkpoint")
    tensors = load_file(str(file))
    params = dict(model.named_parameters())
    missing = [k for k in tensors if k not in params]
    if missing:
        raise ValueError(f"{file.parent}: checkpoint tensors not in the model: {missing[:3]}")
    with torch.no_grad():
        for k, v in tensors.items():
            params[k].copy_(v.to(params[k].device, params[k].dtype))


def load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    extras: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore the model's trainable tensors, optimizer and scheduler (and the `extras`, as saved); return
    (trainer state, rng states)."""
    _load_tensors(Path(path) / "model.safetensors", model)
    blob = torch.load(Path(path) / "trainer.pt", weights_only=False)
    optimizer.load_state_dict(blob["optimizer"])
    for name, (module, opt) in (extras or {}).items():
        if name not in blob.get("extras", {}):
            raise ValueError(f"{path}: the checkpoint holds no {name} (was the run trained with another algo?)")
        _load_tensors(Path(path) / f"{name}.safetensors", module)
        opt.load_state_dict(blob["extras"][name])
    if scheduler is not None and blob["scheduler"] is not None:
        scheduler.load_state_dict(blob["scheduler"])
    state = json.loads((Path(path) / "state.json").read_text())
    return state, blob["rng"]
