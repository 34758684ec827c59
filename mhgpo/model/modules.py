"""Module mechanics the policy and the critic rely on: LoRA adapters switched, negated or cast, dropout turned off
for training passes, activation checkpointing turned on. Each acts on a Hugging Face (and peft) model in place."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from mhgpo.config import LoraConfig
from mhgpo.model.lora import peft_lora_config
from mhgpo.model.precision import weight_dtype


def cast_trainable(params: list[torch.nn.Parameter], precision: str) -> None:
    """Store the trainable `params` (LoRA adapters, made in the base's dtype; a value head) in
    :func:`mhgpo.model.precision.weight_dtype` ``(precision, trainable=True)``: float32 unless pure ``bf16``."""
    dtype = weight_dtype(precision, trainable=True)
    for p in params:
        p.data = p.data.to(dtype)


def add_negated_adapters(model: Any, adapters: list[tuple[LoraConfig, dict[str, torch.Tensor]]]) -> list[str]:
    """Add to the PEFT `model` one frozen, inactive adapter per (config, checkpoint tensors) with its B negated (its
    delta negated); return their names. The trained adapter `default` stays the only active (and trainable) one."""
    names = []
    for i, (lora, tensors) in enumerate(adapters):
        name = f"reference{i}"
        model.add_adapter(name, peft_lora_config(lora, model, dropout=0.0))
        params = dict(model.named_parameters())
        with torch.no_grad():
            for key, value in tensors.items():
                target = params[re.sub(r"\.(lora_[AB])\.default\.", rf".\1.{name}.", key)]
                target.copy_((-value if ".lora_B." in key else value).to(target.device, target.dtype))
        names.append(name)
    return names


def set_active_adapter(model: Any, name: str, trainable: list[torch.nn.Parameter]) -> None:
    """Make adapter `name` the active one; peft then marks only its weights trainable, so `trainable` (every trained
    adapter's weights) is marked again."""
    model.base_model.set_adapter(name)
    for p in trainable:
        p.requires_grad_(True)


@contextmanager
def only_adapters(model: Any, names: list[str]) -> Iterator[None]:
    """Forward passes with the adapters `names` alone (no gradients flow to them: they are frozen)."""
    active = list(model.base_model.active_adapters)
    trainable = [p for p in model.parameters() if p.requires_grad]
    model.base_model.set_adapter(names)
    try:
        yield
    finally:
        model.base_model.set_adapter(active[0] if len(active) == 1 else active)
        for p in trainable:
            p.requires_grad_(True)


@contextmanager
def no_dropout(model: torch.nn.Module) -> Iterator[None]:
    """Train ``model`` with dropout off: every module in eval mode (``nn.Dropout`` layers, peft's LoRA dropout,
    attention dropout that reads ``self.training``) except those that carry a ``gradient_checkpointing`` flag
    (transformers' decoder layers, or the model itself in older versions), which checkpoint only in train mode;
    float ``*dropout*`` rates those modules hold themselves are set to 0. Gradients flow as usual. Restores every
    module's mode and rate on exit."""
    modes = {m: m.training for m in model.modules()}
    rates: list[tuple[torch.nn.Module, str, float]] = []
    model.eval()
    for m in model.modules():
        if getattr(m, "gradient_checkpointing", False) is True:
            m.training = True  # this module only: its children stay in eval mode
            rates += [(m, k, v) for k, v in vars(m).items() if "dropout" in k and isinstance(v, float) and v > 0]
    for m, k, _ in rates:
        setattr(m, k, 0.0)
    try:
        yield
    finally:
        for m, k, v in rates:
            setattr(m, k, v)
        for m, mode in modes.items():
            m.training = mode


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute the decoder layers' activations in the backward pass (in train mode only; generation and
    no-grad forwards are unchanged). Non-reentrant, so a frozen base under LoRA needs no input gradients."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"optim.gradient_checkpointing: {type(model).__name__} does not support it")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name for it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
