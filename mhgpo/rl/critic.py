"""The critic of the MAPPO and PPO baselines (docs/design.md §3; paper §2 "PPO" and the appendix "Implementation Details").

MAPPO here is the paper's baseline: the team's shared actor (the same model, the same clipped policy loss and k3 KL
as MHGPO) with per-token GAE advantages from one critic shared by all agents (parameter sharing, like the actor).
PPO is the same thing on the single-agent system (`system=llm`). What this module settles:

- Architecture: the actor's decoder with a scalar value head, ``V = w^T h + b`` on the final hidden state h.
  Under LoRA (the default) the critic's decoder *shares the actor's frozen base weights* (the same tensors, no
  second copy of the model) and has its own LoRA adapter (the actor's rank and target modules) and the value
  head: the extra memory is two adapters' worth plus activations. ``critic.own_base`` gives it a copy of the
  frozen base instead, as the paper's two models (for its memory comparison). Under full fine-tuning it is a full
  copy of the decoder, as in the paper ("the same backbone LLM architecture as the actor"): one more model and its
  optimiser state. Both start from the initial actor weights; LoRA B starts at 0, the value head's weights
  ~ N(0, 1/(H+1)) and its bias 0.
- Values at output positions: ``V_t`` is read at position ``len(prompt) - 1 + t``, the state before output token
  t (the position whose hidden state predicts it, as for the log-probs); the state after the last token is
  terminal (``V = 0``).
- Rewards: each output is its own episode: the agent's composite reward R (propagated shared reward + its
  penalty, exactly MHGPO's R) at the output's last token, 0 elsewhere; GAE (``critic.gamma``, ``critic.lam``)
  within the output; value targets ``returns = A + V_old``; the step's advantages whitened over its tokens
  (``critic.whiten``) before the policy loss.
- Precision (``mhgpo.model.precision``): the critic's trainable weights (adapter or full copy, and the value head) and
  their optimiser state are float32 except under pure ``bf16``; under ``bf16-mixed`` its forwards run under
  bfloat16 autocast, and under LoRA the shared frozen base is the actor's (bfloat16). Its forwards run with
  dropout off (``mhgpo.model.modules.no_dropout``), like the actor's.
- Update: ``optim.ppo_epochs`` passes over the step's samples, each one optimiser step (AdamW, ``critic.lr``: null
  means 2 × ``optim.lr``, the paper's ratio of 1e-6 to 5e-7,
  gradient norm clipped at ``optim.max_grad_norm``) of the clipped value loss (:func:`mhgpo.rl.losses.value_loss`)
  accumulated over micro-batches, with the actor's token weights (token mean within an output, sample mean per
  agent, mean over agents), so the critic, like the actor, gives each agent the same weight.
- Warm-up: during the first ``critic.warmup_steps`` steps only the critic learns (the trainer skips the actor).

Departures from the paper: it gives the critic's architecture and learning rate only; the rest above is this
implementation's choice, documented here and in docs/design.md §3.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from mhgpo.config import CriticConfig, LoraConfig, OptimConfig, critic_lr
from mhgpo.model.distributed import Single
from mhgpo.model.logprobs import backbone_and_head, check_pairs, output_hidden_states
from mhgpo.model.lora import peft_lora_config
from mhgpo.model.modules import cast_trainable, enable_gradient_checkpointing
from mhgpo.model.precision import autocast, module_device
from mhgpo.rl.advantages import gae, terminal_token_rewards, whiten
from mhgpo.rl.losses import value_loss
from mhgpo.rl.policy import Sample, accumulated_steps, micro_batches, owned, pad_rows

CRITIC_ADAPTER = "critic"


class ValueModel(torch.nn.Module):
    """A decoder and a scalar value head: ``values(prompts, outputs)`` gives V at every output position."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        device = next(backbone.parameters()).device
        self.value_head = torch.nn.Linear(hidden_size, 1, device=device, dtype=torch.float32)
        torch.nn.init.normal_(self.value_head.weight, std=1.0 / (hidden_size + 1))
        torch.nn.init.zeros_(self.value_head.bias)

    def values(
        self, prompts: list[list[int]], outputs: list[list[int]], pad_id: int, share: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, mask)``, both (B, T_out): float32 values (0 on padding) and the bool mask of output tokens;
        ``share``: samples with identical prompts share the prompt's computation (:mod:`mhgpo.model.packing`)."""
        check_pairs(prompts, outputs, 1.0)
        device = module_device(self.backbone)
        batch, t_out = len(prompts), max((len(o) for o in outputs), default=0)
        mask = torch.zeros((batch, t_out), dtype=torch.bool, device=device)  # (B, T)
        for row, out in enumerate(outputs):
            mask[row, : len(out)] = True
        values = torch.zeros((batch, t_out), dtype=torch.float32, device=device)  # (B, T)
        if batch == 0 or t_out == 0:
            return values, mask
        hidden = output_hidden_states(self.backbone, prompts, outputs, pad_id, device, share)  # (N, H)
        head = self.value_head
        flat = head(hidden.to(head.weight.dtype)).squeeze(-1).float()  # (N,)
        return values.masked_scatter(mask, flat), mask  # (B, T), row-major order as `hidden`


def build_value_model(
    model: torch.nn.Module, lora: LoraConfig, precision: str = "fp32", own_base: bool = False
) -> ValueModel:
    """The critic for the actor ``model`` (call it before the actor is wrapped with its own LoRA adapter); its
    trainable weights in :func:`mhgpo.model.precision.weight_dtype` ``(precision, trainable=True)``. Under LoRA its
    frozen base is the actor's tensors, or with ``own_base`` a copy of its own (``critic.own_base``)."""
    if hasattr(model, "peft_config"):
        raise ValueError("build the critic from the plain model, before the policy adds its LoRA adapter")
    backbone, _ = backbone_and_head(model)
    hidden_size = int(model.config.hidden_size)
    if lora.enabled:
        from peft import inject_adapter_in_model

        shared = {} if own_base else {id(p): p for p in backbone.parameters()}  # deepcopy keeps these: shared
        critic_backbone = copy.deepcopy(backbone, memo=shared)
        peft_cfg = peft_lora_config(lora, critic_backbone)
        inject_adapter_in_model(peft_cfg, critic_backbone, adapter_name=CRITIC_ADAPTER)  # base frozen, adapter trains
    else:
        critic_backbone = copy.deepcopy(backbone)
        for p in critic_backbone.parameters():
            p.requires_grad_(True)
    value_model = ValueModel(critic_backbone, hidden_size)
    # the adapter is made in the base's dtype, the value head in float32
    cast_trainable([p for p in value_model.parameters() if p.requires_grad], precision)
    return value_model


class Critic:
    """The value model, its optimiser, and the two things a step asks of it: :meth:`estimate` (rollout-time
    values → GAE advantages and returns on the samples) and :meth:`update` (the value loss)."""

    def __init__(
        self,
        model: torch.nn.Module,
        pad_id: int,
        cfg: CriticConfig,
        optim: OptimConfig,
        lora: LoraConfig,
        precision: str = "fp32",
    ):
        self.cfg, self.optim, self.pad_id, self.precision = cfg, optim, pad_id, precision
        self.ranks: Single = Single()  # the ranks of a data-parallel run (set by the trainer)
        self.model = build_value_model(model, lora, precision, cfg.own_base)
        if optim.gradient_checkpointing:
            enable_gradient_checkpointing(self.model.backbone)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.lr = critic_lr(cfg, optim)
        self.optimizer = torch.optim.AdamW(params, lr=self.lr, weight_decay=optim.weight_decay)

    def _values(self, batch: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
        with autocast(self.precision, module_device(self.model)):
            return self.model.values(
                [s.prompt_ids for s in batch], [s.output_ids for s in batch], self.pad_id, self.optim.share_prefix
            )

    @torch.no_grad()
    def values(self, samples: list[Sample]) -> list[np.ndarray]:
        """V at every output token of every sample (1-D float64 arrays), without gradients."""
        out: list[np.ndarray | None] = [None] * len(samples)
        was_training = self.model.training
        self.model.eval()
        for idx in micro_batches(samples, self.optim.micro_batch_tokens, share=self.optim.share_prefix):
            v, mask = self._values([samples[i] for i in idx])  # (b, T) (b, T)
            for row, i in enumerate(idx):
                out[i] = v[row, : int(mask[row].sum())].double().cpu().numpy()
        self.model.train(was_training)
        return out  # type: ignore[return-value]

    def estimate(self, samples: list[Sample]) -> dict[str, float]:
        """Fill each sample's ``old_values``, ``returns`` and per-token ``advantage`` (GAE, whitened over the step
        when ``critic.whiten``) from its ``reward``; return the step's critic statistics. With several ranks
        (``self.ranks``, each holding the whole step's samples) each computes the values of its share and gathers
        the others'."""
        if not samples:
            return {}
        ranks = self.ranks
        if ranks.world == 1:
            old = self.values(samples)
        else:
            mine = owned(samples, ranks, self.optim.share_prefix)
            old = [np.zeros(0)] * len(samples)
            for idx, vals in ranks.gather((mine, self.values([samples[i] for i in mine]))):
                for i, v in zip(idx, vals):
                    old[i] = v
        lengths = np.array([len(s.output_ids) for s in samples])  # (B,)
        width = int(lengths.max())
        mask = np.arange(width)[None, :] < lengths[:, None]  # (B, T)
        values = np.zeros(mask.shape)  # (B, T)
        for i, v in enumerate(old):
            values[i, : len(v)] = v
        rewards = terminal_token_rewards(np.array([s.reward for s in samples]), lengths, width)  # (B, T)
        adv, returns = gae(rewards, values, mask, self.cfg.gamma, self.cfg.lam)  # (B, T) (B, T)
        raw_mean = float(adv[mask].mean()) if mask.any() else 0.0
        if self.cfg.whiten:
            adv = whiten(adv, mask)  # (B, T)
        for i, s in enumerate(samples):
            n = int(lengths[i])
            s.old_values = values[i, :n].tolist()
            s.returns = returns[i, :n].tolist()
            s.advantage = adv[i, :n].tolist()
        v_tok, g_tok = values[mask], returns[mask]
        var_g = float(g_tok.var()) if g_tok.size else 0.0
        explained = 1.0 - float((g_tok - v_tok).var()) / var_g if var_g > 0 else 0.0
        return {
            "critic/value_mean": float(v_tok.mean()) if v_tok.size else 0.0,
            "critic/return_mean": float(g_tok.mean()) if g_tok.size else 0.0,
            "critic/advantage_mean": raw_mean,
            "critic/explained_variance": explained,
        }

    def update(self, samples: list[Sample]) -> dict[str, float]:
        """``optim.ppo_epochs`` optimiser steps of the clipped value loss on samples that went through
        :meth:`estimate`; returns ``critic/loss``, ``critic/value_clip_fraction``, ``critic/grad_norm`` and
        ``critic/lr``. Several ranks: as for :meth:`mhgpo.rl.policy.Policy.update`."""
        samples = [s for s in samples if s.output_ids]
        if not samples:
            return {
                "critic/loss": 0.0,
                "critic/value_clip_fraction": 0.0,
                "critic/grad_norm": 0.0,
                "critic/lr": self.lr,
            }
        if any(s.returns is None or s.old_values is None for s in samples):
            raise ValueError("Critic.update needs samples with returns and old_values (run Critic.estimate first)")

        def batch_loss(idx: list[int], weights: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            batch = [samples[i] for i in idx]
            v, mask = self._values(batch)  # (b, T) (b, T)
            width = v.shape[1]
            old = pad_rows([torch.tensor(s.old_values, dtype=v.dtype) for s in batch], width).to(v.device)  # (b, T)
            ret = pad_rows([torch.tensor(s.returns, dtype=v.dtype) for s in batch], width).to(v.device)  # (b, T)
            return value_loss(v, old, ret, weights.to(v.device), mask, self.cfg.value_clip)

        params = [p for p in self.model.parameters() if p.requires_grad]
        out = accumulated_steps(
            self.model,
            self.optimizer,
            params,
            self.optim,
            samples,
            batch_loss,
            ("value_clip_fraction",),
            ranks=self.ranks,
        )
        return {
            "critic/loss": out["loss"],
            "critic/value_clip_fraction": out["value_clip_fraction"],
            "critic/grad_norm": out["grad_norm"],
            "critic/lr": self.lr,
        }

    def state(self) -> tuple[torch.nn.Module, Any]:
        """What a checkpoint holds of the critic: its module (trainable tensors) and its optimiser."""
        return self.model, self.optimizer
