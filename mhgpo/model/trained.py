"""Trained teams as models: `--model` may name a run directory or one of its checkpoints.

A run directory (`mhgpo train`, `mhgpo demo`) holds `config.yaml` (the run's config, with its base `model` and its
`lora` section) and `checkpoints/step_N/model.safetensors`: the tensors that training changed, by parameter name,
either the LoRA adapter's (`....lora_A.default.weight`) or every parameter of the model (full fine-tuning). Loading a
run loads its base model and applies the checkpoint: the LoRA adapter merged into the base weights, or the full
weights copied in place, in float32 on the CPU, then rounded once to the dtype asked for (:func:`merged_model`, which
`mhgpo export` uses too: a run and its export load the same weights bit for bit). A run directory means its latest
checkpoint; `RUN/checkpoints/step_N` names one.

Runs chain: a run started from another run (`--model RUN`) has that run as its `model`, and loading it loads that run
first (recursively), then applies its own checkpoint. The chain's first model is its *base*.

Where a run's `model:` points. When a run starts, a relative local path in `model` is rewritten relative to the run
directory's parent (`--model runs/sft --output-dir runs/rl` stores `model: sft`; `--model ./base` stores
`model: ../base`); absolute paths and names (`smollm2-135m`, hub ids) are stored as given. When a run is read, a
relative `model` is looked up beside the run directory first, then as written (relative to the working directory:
config files written by hand). So runs that start from one another can be moved together, and opened from anywhere.

A `lora.per_role` run has one adapter per agent, so no single merged model: it loads as the merged stages beneath
with the agents' adapters unmerged, and so does its export (the shared weights in `base/`, each agent's PEFT adapter
beside: :func:`load_agents`). Neither can start another run.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mhgpo.config import LoraConfig, from_dict
from mhgpo.config.load import read_yaml
from mhgpo.errors import InputError
from mhgpo.model.checkpoint import STEP_PREFIX, list_checkpoints
from mhgpo.model.lora import Reference, peft_lora_config
from mhgpo.model.pretrained import (
    AGENTS_KIND,
    DEFAULT_MODEL,
    RUN_CONFIG,
    SHARED_FOLDER,
    TRAINED_KINDS,
    LoadedModel,
    ModelNotFoundError,
    agent_folders,
    device_and_dtype,
    load_pretrained,
    resolve_model,
    stored_as,
)

WEIGHTS = "model.safetensors"
LORA_ADAPTER = "default"  # the adapter name of a LoRA checkpoint's tensors
_MAX_CHAIN = 64
_ADAPTER_OF = re.compile(r"\.lora_[A-Za-z_]+\.([^.]+)\.")


class TrainedModelError(ModelNotFoundError):
    """A run directory or checkpoint that cannot be loaded; the message names the file and what is wrong."""


@dataclass(frozen=True)
class Stage:
    """One run of a chain: the checkpoint to apply and what its run's config.yaml says."""

    run_dir: Path
    checkpoint: Path
    step: int
    model: str  # the run's `model`, as stored in its config.yaml
    lora: LoraConfig
    config: dict[str, Any] = field(repr=False)

    @property
    def weights(self) -> Path:
        return self.checkpoint / WEIGHTS

    @property
    def label(self) -> str:
        return f"{self.run_dir.name}/{STEP_PREFIX}{self.step}"


@dataclass(frozen=True)
class TrainedSpec:
    """A resolved run or checkpoint: the base model spec and the stages applied to it, oldest first."""

    base: str
    stages: tuple[Stage, ...]

    @property
    def last(self) -> Stage:
        return self.stages[-1]


# ------------------------------------------------------------------------------------------------ resolving


def run_model_spec(value: str, run_dir: Path) -> str:
    """The model spec that a run's stored `model` names (see the module's rule): beside the run first."""
    text = str(value).strip()
    path = Path(text).expanduser()
    if text.lower() != DEFAULT_MODEL and text and not path.is_absolute():
        beside = Path(run_dir).parent / path
        if beside.exists():
            return str(beside)
    return text


def portable_model_spec(value: str, run_dir: Path) -> str:
    """How a new run stores `model` (see the module's rule): an existing relative path becomes relative to the run
    directory's parent; anything else is kept."""
    text = str(value).strip()
    path = Path(text).expanduser()
    if text.lower() == DEFAULT_MODEL or not text or path.is_absolute() or not path.exists():
        return text
    return os.path.relpath(os.path.abspath(path), os.path.abspath(Path(run_dir).parent))


def _run_config(run_dir: Path) -> dict[str, Any]:
    import yaml

    path = run_dir / RUN_CONFIG
    if not path.is_file():
        raise TrainedModelError(f"{run_dir}: no {RUN_CONFIG}, so the base model of its checkpoints is unknown")
    try:
        tree = read_yaml(path)
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise TrainedModelError(f"{path}: not readable YAML ({type(err).__name__})") from None
    if not isinstance(tree, dict) or not isinstance(tree.get("model"), str) or not tree["model"].strip():
        raise TrainedModelError(f"{path}: no 'model' key naming the run's base model")
    return tree


def _stage(path: Path, kind: str) -> Stage:
    if kind == "checkpoint":
        checkpoint, run_dir = path, path.parent.parent
    else:
        run_dir = path
        found = list_checkpoints(path)
        if not found:
            raise TrainedModelError(
                f"{path}: no checkpoint to load (checkpoints/{STEP_PREFIX}N/{WEIGHTS}); the run has saved none"
            )
        checkpoint = found[-1]
    tree = _run_config(run_dir)
    try:
        lora = from_dict(LoraConfig, tree.get("lora") or {}, prefix="lora.")
    except InputError as err:
        raise TrainedModelError(f"{run_dir / RUN_CONFIG}: {err}") from None
    try:
        step = int(checkpoint.name[len(STEP_PREFIX) :])
    except ValueError:
        raise TrainedModelError(f"{checkpoint}: not a checkpoint name ({STEP_PREFIX}N)") from None
    if not (checkpoint / WEIGHTS).is_file():
        raise TrainedModelError(f"{checkpoint}: no {WEIGHTS} (the checkpoint is incomplete)")
    return Stage(run_dir, checkpoint, step, tree["model"].strip(), lora, tree)


def resolve_trained(path: Path, kind: str) -> TrainedSpec:
    """Follow a run's `model` through the runs it started from, down to a model that is not a run."""
    stages: list[Stage] = []
    seen: set[Path] = set()
    while True:
        stage = _stage(Path(path), kind)
        key = stage.checkpoint.resolve()
        if key in seen or len(stages) >= _MAX_CHAIN:
            raise TrainedModelError(f"{stage.run_dir / RUN_CONFIG}: its model {stage.model!r} leads back to itself")
        seen.add(key)
        stages.append(stage)
        spec = run_model_spec(stage.model, stage.run_dir)
        try:
            source = resolve_model(spec)
        except ModelNotFoundError as err:
            raise TrainedModelError(f"{stage.run_dir / RUN_CONFIG}: model {stage.model!r}: {err}") from None
        if source.kind not in TRAINED_KINDS:
            return TrainedSpec(spec, tuple(reversed(stages)))
        path, kind = Path(source.location), source.kind


# ------------------------------------------------------------------------------------------------- loading


def read_weights(stage: Stage) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (CPU); a missing, truncated or damaged file is a TrainedModelError."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(stage.weights))
    except (SafetensorError, OSError, ValueError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise TrainedModelError(
            f"{stage.weights}: not a readable safetensors file, truncated or damaged ({first})"
        ) from None


def copy_exactly(
    module: torch.nn.Module, tensors: dict[str, torch.Tensor], stage: Stage, base: str, adapter_only: bool
) -> None:
    """Copy `tensors` into `module`'s parameters of the same names: the adapter's (`adapter_only`) or all of them,
    which must match one to one in names and shapes (else a TrainedModelError saying what does not fit)."""
    params = {n: p for n, p in module.named_parameters() if not adapter_only or ".lora_" in n}
    origin = f"the base model {base!r} (from {stage.run_dir / RUN_CONFIG})"
    extra = sorted(set(tensors) - set(params))
    if extra:
        raise TrainedModelError(
            f"{stage.weights}: tensor {extra[0]!r} (and {len(extra) - 1} more) has no place in "
            f"{origin}: the checkpoint was trained from another model or another lora setting"
        )
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise TrainedModelError(
                f"{stage.weights}: tensor {name!r} has shape {list(tensor.shape)} where "
                f"{origin} has {list(params[name].shape)}: the checkpoint was trained from "
                f"another base model"
            )
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise TrainedModelError(
            f"{stage.weights}: lacks {len(missing)} of the {len(params)} tensors that the run "
            f"trains, {missing[0]!r} first"
        )
    with torch.no_grad():
        for name, tensor in tensors.items():
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))


def adapter_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The LoRA adapters a checkpoint's tensors belong to: `default`, or one per agent (`lora.per_role`)."""
    return sorted({m.group(1) for key in tensors if (m := _ADAPTER_OF.search(key))})


def with_adapter(model: torch.nn.Module, stage: Stage, tensors: dict[str, torch.Tensor], base: str) -> Any:
    """`model` wrapped in the PEFT adapter(s) of a LoRA stage, their weights loaded (not merged): one adapter
    `default`, or one per agent for a `lora.per_role` run (the first active)."""
    from peft import get_peft_model

    names = adapter_names(tensors)
    if stage.lora.per_role:
        if not names or LORA_ADAPTER in names:
            raise TrainedModelError(
                f"{stage.weights}: holds the adapters {names}; a lora.per_role run has one adapter per agent"
            )
    elif names and names != [LORA_ADAPTER]:
        raise TrainedModelError(
            f"{stage.weights}: holds the adapters {names}; one adapter named {LORA_ADAPTER!r} is expected"
        )
    names = names or [LORA_ADAPTER]
    try:
        config = peft_lora_config(stage.lora, model)
    except ValueError as err:
        raise TrainedModelError(f"{stage.run_dir / RUN_CONFIG}: {err} {base!r}") from None
    wrapped = get_peft_model(model, config, adapter_name=names[0])
    for name in names[1:]:
        wrapped.add_adapter(name, peft_lora_config(stage.lora, model))
    copy_exactly(wrapped, tensors, stage, base, adapter_only=True)
    wrapped.base_model.set_adapter(names[0])
    return wrapped


def per_agent_refusal(where: Any, beneath: Any) -> str:
    """Why a team with one adapter per agent (a `lora.per_role` run, or its export) cannot be one model, and which
    model lies beneath its adapters: the same words for the run and for its export."""
    return (
        f"{where}: one adapter per agent (lora.per_role), so no single set of weights to start another run "
        f"from; start from the model beneath the adapters ({beneath})"
    )


def apply_stage(model: torch.nn.Module, stage: Stage, base: str) -> torch.nn.Module:
    """`model` with the stage's checkpoint applied: LoRA merged into the weights, or full weights in place."""
    if stage.lora.per_role:
        raise TrainedModelError(per_agent_refusal(stage.run_dir, run_model_spec(stage.model, stage.run_dir)))
    tensors = read_weights(stage)
    if stage.lora.enabled:
        return with_adapter(model, stage, tensors, base).merge_and_unload()
    copy_exactly(model, tensors, stage, base, adapter_only=False)
    return model


@contextmanager
def _acting_as(model: Any, roles: list[str], agent: str | None) -> Iterator[None]:
    """A per-role model acting as `agent` (its adapter active); every call names its agent."""
    if agent not in roles:
        raise ValueError(f"this team has no adapter for agent {agent!r} (adapters: {', '.join(roles)})")
    model.base_model.set_adapter(agent)
    yield


def load_model(spec: str | os.PathLike[str] = DEFAULT_MODEL, device: Any = None, dtype: Any = None) -> LoadedModel:
    """Load model and tokenizer for any model ``spec`` (see :func:`mhgpo.model.pretrained.resolve_model`) onto
    ``device``: a trained run or checkpoint with its stages applied (:func:`load_trained`), else the pretrained
    model. Default device: CUDA when available, else CPU; default dtype float32. The model is in eval mode."""
    source = resolve_model(spec)
    if source.kind in TRAINED_KINDS:
        return load_trained(resolve_trained(Path(source.location), source.kind), device, dtype)
    if source.kind == AGENTS_KIND:
        return load_agents(Path(source.location), device, dtype)
    return load_pretrained(spec, device, dtype)


def merged_model(spec: TrainedSpec, device: Any = None, dtype: Any = None) -> LoadedModel:
    """The base model with the stages of ``spec`` merged into its weights, then stored as ``dtype`` on ``device``:
    the one merge that loading a run (``--model RUN``) and ``mhgpo export`` share. The base is loaded and every
    stage applied in float32 on the CPU (a LoRA adapter's product added to float32 weights), and the result is
    rounded once to ``dtype``, so that a run and its export, loaded with the same dtype, hold the same weights bit
    for bit (a float32 sum rounded once, where a merge into bfloat16 weights would round twice, and a merge on
    a GPU would sum in another order). A last stage with one adapter per agent (``lora.per_role``) is not merged:
    the stages before it are, and :func:`load_trained` adds the adapters."""
    device, dtype = device_and_dtype(device, dtype)
    loaded = load_pretrained(spec.base, device="cpu", dtype=torch.float32)
    model = loaded.model
    merged = spec.stages[:-1] if spec.last.lora.per_role else spec.stages
    for stage in merged:
        model = apply_stage(model, stage, spec.base)
    model = stored_as(model, dtype).to(device)
    for param in model.parameters():  # as `from_pretrained` gives them (merging LoRA leaves them frozen)
        param.requires_grad_(True)
    loaded.model, loaded.device, loaded.dtype = model.eval(), device, dtype
    return loaded


def load_trained(spec: TrainedSpec, device: Any = None, dtype: Any = None) -> LoadedModel:
    """The base model with every stage applied in order (a plain model, in eval mode; see :func:`merged_model`).
    A last stage with one adapter per agent stays unmerged: `LoadedModel.select(agent)` switches to that agent's
    adapter."""
    loaded = merged_model(spec, device, dtype)
    if spec.last.lora.per_role:
        tensors = read_weights(spec.last)
        _per_agent(loaded, with_adapter(loaded.model, spec.last, tensors, spec.base), adapter_names(tensors))
    loaded.name, loaded.trained = spec.last.label, spec
    return loaded


def load_agents(folder: Path, device: Any = None, dtype: Any = None) -> LoadedModel:
    """The export of a team with one adapter per agent (``mhgpo export`` of a ``lora.per_role`` run): the shared
    model in ``base/`` and each agent's PEFT adapter, unmerged as when the run itself is loaded, so the two hold
    the same weights; ``LoadedModel.select(agent)`` switches adapters."""
    from peft import PeftModel

    roles = agent_folders(folder)
    loaded = load_pretrained(folder / SHARED_FOLDER, device, dtype)
    try:
        model = PeftModel.from_pretrained(loaded.model, str(folder / roles[0]), adapter_name=roles[0])
        for role in roles[1:]:
            model.load_adapter(str(folder / role), adapter_name=role)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise TrainedModelError(f"{folder}: the agents' adapters do not load onto {SHARED_FOLDER}/ ({first})") from None
    _per_agent(loaded, model, roles)
    loaded.name = Path(folder).name
    return loaded


def _per_agent(loaded: LoadedModel, model: Any, roles: list[str]) -> None:
    """Make ``loaded`` the PEFT ``model`` with one adapter per agent of ``roles`` (the first active), in eval mode."""
    model.base_model.set_adapter(roles[0])
    for param in model.parameters():  # as `from_pretrained` gives them
        param.requires_grad_(True)
    loaded.model = model.eval()
    loaded.select = lambda agent: _acting_as(model, roles, agent)


def initial_weights(
    spec: str, reference: str, lora_enabled: bool, device: Any = None, dtype: Any = None
) -> tuple[LoadedModel, Reference | None]:
    """A new run's initial model for `spec` (a trained run merged, see :func:`load_trained`), and its reference when
    `reference` is "base" and `spec` is a trained run: the negated adapters of the stages under LoRA when every
    stage is LoRA, else a frozen copy of the base model (one more model in memory)."""
    loaded = load_model(spec, device=device, dtype=dtype)
    trained: TrainedSpec | None = loaded.trained
    if loaded.select is not None:
        if trained is not None:
            last = trained.last
            raise TrainedModelError(per_agent_refusal(last.run_dir, run_model_spec(last.model, last.run_dir)))
        raise TrainedModelError(per_agent_refusal(spec, Path(spec) / SHARED_FOLDER))
    if reference != "base" or trained is None:
        return loaded, None
    if lora_enabled and all(stage.lora.enabled for stage in trained.stages):
        return loaded, Reference(adapters=[(stage.lora, read_weights(stage)) for stage in trained.stages])
    return loaded, Reference(model=load_model(trained.base, device=device, dtype=dtype).model)


def model_record(loaded: LoadedModel) -> dict[str, Any]:
    """What an evaluation records of a trained model: its checkpoint, step and base model (empty otherwise)."""
    trained: TrainedSpec | None = loaded.trained
    if trained is None:
        return {}
    return {"checkpoint": str(trained.last.checkpoint), "step": trained.last.step, "base_model": trained.base}
