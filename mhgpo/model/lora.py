"""LoRA: the PEFT config of mhgpo's `lora:` section for a model, and a reference policy built from adapters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mhgpo.config import LoraConfig


def peft_lora_config(lora: LoraConfig, model: torch.nn.Module, dropout: float | None = None) -> Any:
    """The PEFT config of `lora` for `model`: its `target_modules` that the model has (ValueError if none)."""
    from peft import LoraConfig as PeftLoraConfig

    present = {name.split(".")[-1] for name, _ in model.named_modules()}
    targets = [t for t in lora.target_modules if t in present]
    if not targets:
        raise ValueError(f"lora.target_modules {lora.target_modules} match no module of the model")
    return PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout if dropout is None else dropout,
        target_modules=targets,
        bias="none",
    )


@dataclass
class Reference:
    """A reference policy other than the initial weights. ``model``: a frozen model of its own. ``adapters``
    (LoRA only): LoRA adapters already merged into the initial weights, each a (LoraConfig, tensors named as in a
    checkpoint: `....lora_A.default.weight`); the policy keeps their negations as frozen adapters and switches them
    on, alone, for the reference's forward passes: initial weights minus their deltas = the weights before them,
    for the memory of the adapters only."""

    model: torch.nn.Module | None = None
    adapters: list[tuple[LoraConfig, dict[str, torch.Tensor]]] = field(default_factory=list)
