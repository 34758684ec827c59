"""The policy side of training: the shared model (full or LoRA), its reference, and one MHGPO update.

The reference policy is the initial model: under LoRA the same model with the adapter disabled (no second
copy), else a frozen copy. A :class:`Reference` makes it something else (`reference=base` with a trained run as
`--model`): a frozen model of its own, or, under LoRA, the initial weights minus the deltas of the run's adapters.
Log-probs are computed only at output positions, in chunks (`mhgpo.model.logprobs`).
One update = `ppo_epochs` passes over the step's samples, each pass one optimiser step whose gradient is
accumulated over micro-batches; the step-wide token weights make it independent of the micro-batch cut.

Log-probabilities for the ratio, the reference and the critic are computed with dropout off
(`mhgpo.model.modules.no_dropout`), as the sampler computed them, so that on-policy data gives a ratio of 1 up to rounding: float32 rounding (the
sampler's incremental decoding and the update's whole-sequence forward sum in other orders, about 1e-6) and bfloat16
rounding under ``bf16-mixed`` / ``bf16`` (the `ratio` metric shows the gap; the clip absorbs it).
Precision (`mhgpo.model.precision`): the trainable weights and the optimiser state are float32 except under
``bf16``; under ``bf16-mixed`` every forward runs under bfloat16 autocast (the reference's too, so that it matches
the actor's at the start).
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from peft.helpers import disable_input_dtype_casting

from mhgpo.config import LoraConfig, OptimConfig
from mhgpo.errors import NotFinite
from mhgpo.model import packing
from mhgpo.model.distributed import Single, shares
from mhgpo.model.logprobs import output_logprobs, output_logprobs_entropy
from mhgpo.model.lora import Reference, peft_lora_config
from mhgpo.model.modules import (
    add_negated_adapters,
    cast_trainable,
    enable_gradient_checkpointing,
    no_dropout,
    only_adapters,
    set_active_adapter,
)
from mhgpo.model.precision import autocast, module_device
from mhgpo.model.sharding import clip_grad_norm, gathered, is_dtensor, is_sharded, shard_model
from mhgpo.rl.losses import mhgpo_policy_loss, token_weights

LORA_ADAPTER = "default"  # the adapter's name when every agent shares one (peft's default name)


@dataclass
class Sample:
    """One trained LLM call. ``advantage`` is one float (MHGPO, GRPO) or one per output token (MAPPO / PPO,
    filled by :meth:`mhgpo.rl.critic.Critic.estimate` with ``old_values`` and ``returns``, the critic's targets)."""

    prompt_ids: list[int]
    output_ids: list[int]
    old_logprobs: list[float]
    advantage: float | list[float]
    agent: str
    temperature: float = 1.0
    reward: float = 0.0  # the agent's composite reward R (the critic's terminal reward)
    old_values: list[float] | None = None
    returns: list[float] | None = None
    # the log-probs of the engine that sampled the output (generation.engine=vllm), kept when the trainer recomputes
    # the old ones: the truncated importance weight's denominator (optim.engine_is_cap)
    engine_logprobs: list[float] | None = None


class Policy:
    """The trainable model, its optimiser and scheduler, and its reference."""

    def __init__(
        self,
        model: torch.nn.Module,
        pad_id: int,
        optim: OptimConfig,
        lora: LoraConfig,
        total_steps: int,
        reference: Reference | None = None,
        precision: str = "fp32",
        keep_reference: bool = True,
        roles: tuple[str, ...] = (),
        loss: Callable[..., tuple[torch.Tensor, dict[str, float]]] = mhgpo_policy_loss,
        loss_engine: bool = False,
        loss_stats: tuple[str, ...] = (),
    ):
        """``model`` comes stored as ``precision`` asks (:func:`mhgpo.model.precision.weight_dtype`: its frozen base
        under LoRA, all of it under full fine-tuning); ``precision`` is a resolved one (not ``auto``).
        ``keep_reference=False``: no frozen copy under full fine-tuning (a warm start has no KL term).
        ``roles``: the agents, which get one LoRA adapter each under ``lora.per_role`` (named after them).
        ``loss``: the policy objective of a micro-batch (an entry of `mhgpo.config.tables.POLICY_LOSSES`);
        ``loss_engine``: it is given the sampler's log-probs (``engine_logp=``) whatever the cap; ``loss_stats``: the
        statistics it adds."""
        self.cfg = optim
        self.loss = loss
        self.loss_engine, self.loss_stats = loss_engine, tuple(loss_stats)
        self.pad_id = pad_id
        self.ranks: Single = Single()  # the ranks of a data-parallel run (set by mhgpo.run.setup)
        self.lora = lora.enabled
        self.precision = precision
        self.reference_adapters: list[str] = []
        self.known_reference = 0  # samples whose reference log-probs the last reference pass was given
        if lora.enabled and lora.per_role and not roles:
            raise ValueError("lora.per_role needs the agents' names (roles)")
        self.roles: tuple[str, ...] = tuple(roles) if lora.enabled and lora.per_role else ()
        reference = reference or Reference()
        if reference.adapters and not lora.enabled:
            raise ValueError("reference adapters need a LoRA policy")
        if optim.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        if lora.enabled:
            from peft import get_peft_model

            # the adapter's weights: float32 (peft casts them up from a bfloat16 base), except under pure bf16
            names = self.roles or (LORA_ADAPTER,)
            model = get_peft_model(
                model, peft_lora_config(lora, model), adapter_name=names[0], autocast_adapter_dtype=precision != "bf16"
            )
            for name in names[1:]:
                model.add_adapter(name, peft_lora_config(lora, model))
            self.reference_adapters = add_negated_adapters(model, reference.adapters)
            set_active_adapter(model, names[0], self._adapter_params(model, names, precision))
        self.ref_model = reference.model
        if self.ref_model is None and not lora.enabled and keep_reference:
            # the reference copy keeps the actor's dtype: the same forward on the same weights, so KL starts at 0
            self.ref_model = copy.deepcopy(model)
        if self.ref_model is not None:
            self.ref_model.eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        self.model = model
        self.total_steps = total_steps
        self._make_optimizer()

    def _make_optimizer(self) -> None:
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        groups: list[dict[str, Any]] = [{"params": self.params}]
        if self.cfg.role_lr:  # one parameter group per role's adapter, at its own lr (`optim.role_lr`)
            if not self.roles:
                raise ValueError("optim.role_lr needs one adapter per role (lora.per_role)")
            named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
            groups = [
                {"params": [p for n, p in named if f".{role}." in n], "lr": self.cfg.role_lr.get(role, self.cfg.lr)}
                for role in self.roles
            ]
            if sum(len(g["params"]) for g in groups) != len(self.params):
                raise ValueError("optim.role_lr: some trainable weights belong to no role's adapter")
        self.optimizer = torch.optim.AdamW(groups, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(self.cfg, self.total_steps))

    def shard(self, device: torch.device, world: int) -> None:
        """Shard the actor's decoder layers over the `world` ranks (FSDP, :mod:`mhgpo.model.sharding`); the optimiser
        and scheduler are made again on the sharded parameters (call it before any update). A frozen reference
        model of its own (full fine-tuning) is sharded the same way; under LoRA the reference is the sharded model
        itself, its adapter off. Both are gathered whole for the reference's log-probs (:meth:`reference_logprobs`)."""
        if self.roles:
            raise ValueError("FSDP: lora.per_role is not supported (each rank would reduce other adapters)")
        if self.reference_adapters:
            raise ValueError(
                "FSDP: a reference made of negated adapters (reference=base on a trained LoRA run) is not supported"
            )
        shard_model(self.model, device, world)
        if self.ref_model is not None:
            shard_model(self.ref_model, device, world)
        self._make_optimizer()

    # ----------------------------------------------------------------------------------------------- helpers

    def _reference_context(self):
        if self.ref_model is not None:
            return nullcontext()
        if self.reference_adapters:
            return only_adapters(self.model, self.reference_adapters)
        return self.model.disable_adapter()

    @staticmethod
    def _adapter_params(model: Any, names: tuple[str, ...], precision: str) -> list[torch.nn.Parameter]:
        """The trainable adapters' parameters, in float32 unless the precision is pure bf16 (an adapter added after
        the first is made in the base's dtype)."""
        params = [
            p for n, p in model.named_parameters() if any(f".lora_A.{a}." in n or f".lora_B.{a}." in n for a in names)
        ]
        cast_trainable(params, precision)
        return params

    @contextmanager
    def acting_as(self, agent: str | None) -> Iterator[None]:
        """Forward passes (generation, log-probs) as `agent`: with its own adapter under ``lora.per_role``, else
        unchanged. The other roles' adapters stay trainable (they take no part in these passes)."""
        if self.roles and agent is not None:
            if agent not in self.roles:
                raise ValueError(f"no adapter for agent {agent!r} (adapters: {', '.join(self.roles)})")
            set_active_adapter(self.model, agent, self.params)
        yield

    @contextmanager
    def _computing(self, model: torch.nn.Module) -> Iterator[None]:
        """The context of `model`'s forward passes: bfloat16 autocast under ``bf16-mixed``, where peft's cast of each
        LoRA layer's input up to its float32 weights is off too (the bfloat16 matmul that follows casts it back,
        and the backward casts the gradient back and forth: the same numbers without the two copies)."""
        casts_off = disable_input_dtype_casting(model, active=self.precision == "bf16-mixed")
        with autocast(self.precision, module_device(model)), casts_off:
            yield

    def _logprobs(self, model: torch.nn.Module, batch: list[Sample], entropy: bool = False) -> tuple[torch.Tensor, ...]:
        """``(logp, mask)`` of ``batch`` under ``model``, and with ``entropy`` the policy's entropy at each output
        position as a third (:func:`mhgpo.model.logprobs.output_logprobs_entropy`), all (b, T)."""
        as_agent = self.acting_as(batch[0].agent) if model is self.model else nullcontext()
        with as_agent, self._computing(model):
            return (output_logprobs_entropy if entropy else output_logprobs)(
                model,
                [s.prompt_ids for s in batch],
                [s.output_ids for s in batch],
                temperature=batch[0].temperature,
                chunk_size=self.cfg.logprob_chunk,
                pad_id=self.pad_id,
                share=self.cfg.share_prefix,
            )

    def logprobs(self, batch: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
        """The current policy's log-probs of every sample's output tokens: (b, T) float32 and the (b, T) mask."""
        return self._logprobs(self.model, batch)

    @torch.no_grad()
    def reference_logprobs(
        self, samples: list[Sample], known: dict[Hashable, list[torch.Tensor]] | None = None
    ) -> list[torch.Tensor]:
        """log pi_ref of every sample's output tokens (list of 1-D tensors), one segment at a time
        (:func:`reference_segments`: the samples of one prompt and temperature), so that a sample's log-probs depend
        on its segment alone, never on the rest of the step. ``known``: segments worked out before, by
        :func:`segment_key` (`mhgpo.rl.reference_ahead`, while the rollouts generated); a segment found there is
        taken as it is, the others computed here, with the same numbers."""
        out: list[torch.Tensor | None] = [None] * len(samples)
        self.known_reference = 0  # the samples taken from `known` (the `reference/ahead` metric)
        with self._reference_pass() as compute:
            for segment in reference_segments(samples):
                members = [samples[i] for i in segment]
                logps = known.get(segment_key(members)) if known else None
                if logps is None:
                    logps = compute(members)
                else:
                    self.known_reference += len(members)
                for i, logp in zip(segment, logps):
                    out[i] = logp
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def reference_segment(self, samples: list[Sample]) -> list[torch.Tensor]:
        """log pi_ref of the output tokens of one segment's samples (one prompt, one temperature), as
        :meth:`reference_logprobs` computes them. Safe to call from another thread only while nothing else uses the
        model (under LoRA the reference is the model with its adapter off), in one process."""
        with self._reference_pass() as compute:
            return compute(samples)

    @contextmanager
    def _reference_pass(self) -> Iterator[Callable[[list[Sample]], list[torch.Tensor]]]:
        """The reference model made ready (a sharded one gathered whole, once: every rank calls this together; the
        adapter off; dropout off), and the computation of one segment on it: micro-batches cut from the segment's
        samples alone."""
        was_training = self.model.training
        self.model.eval()
        model = self.model if self.ref_model is None else self.ref_model

        def compute(samples: list[Sample]) -> list[torch.Tensor]:
            out: list[torch.Tensor | None] = [None] * len(samples)
            for idx in micro_batches(samples, self.cfg.micro_batch_tokens, share=self.cfg.share_prefix):
                with self._computing(model):  # the base, or a frozen model: no roles
                    logp, mask = output_logprobs(
                        model,
                        [samples[i].prompt_ids for i in idx],
                        [samples[i].output_ids for i in idx],
                        temperature=samples[idx[0]].temperature,
                        chunk_size=self.cfg.logprob_chunk,
                        pad_id=self.pad_id,
                        share=self.cfg.share_prefix,
                    )
                for row, i in enumerate(idx):
                    out[i] = logp[row, : int(mask[row].sum())].detach()
            return out  # type: ignore[return-value]

        try:
            # the ranks' shares differ in micro-batches: a sharded model is gathered whole for them
            with gathered(model), self._reference_context():
                yield compute
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def current_logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """log pi of every sample's output tokens under the current weights, each at its sample's temperature and
        as its agent (list of 1-D float32 tensors): the old log-probs when another engine sampled the outputs
        (`optim.old_logprobs=trainer`), and the trainer's side of the engine's sync check. Each rank computes its own
        samples, as many as it has (none included): a sharded model is gathered whole for them, so every rank calls
        it together."""
        out: list[torch.Tensor | None] = [None] * len(samples)
        was_training = self.model.training
        self.model.eval()
        try:
            with gathered(self.model):
                for idx in micro_batches(
                    samples, self.cfg.micro_batch_tokens, by_agent=bool(self.roles), share=self.cfg.share_prefix
                ):
                    logp, mask = self._logprobs(self.model, [samples[i] for i in idx])
                    for row, i in enumerate(idx):
                        out[i] = logp[row, : int(mask[row].sum())].detach().float()
        finally:
            self.model.train(was_training)
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------------------------------------ update

    def update(
        self, samples: list[Sample], known_reference: dict[Hashable, list[torch.Tensor]] | None = None
    ) -> dict[str, float]:
        """`ppo_epochs` optimiser steps on the step's samples; returns loss / kl / clip_fraction / grad_norm. With
        several ranks (``self.ranks``), every rank holds the whole step's samples and computes its share of them
        (:func:`owned`); the gradients and statistics are summed across ranks. ``known_reference``: reference
        log-probs of segments worked out before (:meth:`reference_logprobs`)."""
        samples = [s for s in samples if s.output_ids]
        if not samples:
            with warnings.catch_warnings():  # a step without samples keeps the schedule in step, on purpose
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
                self.scheduler.step()
            return {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "grad_norm": 0.0, "ratio": 1.0}
        ranks = self.ranks
        mine = owned(samples, ranks, self.cfg.share_prefix)
        if is_sharded(self.model) and not mine:
            mine = [0]  # a rank without samples repeats sample 0 with weight 0 (accumulated_steps)
        ref: list[torch.Tensor | None] | None = None
        started = time.perf_counter()
        if self.cfg.kl_beta != 0:  # (its cost: `seconds/reference`, a share of `seconds/train`)
            ref = [None] * len(samples)
            for i, r in zip(mine, self.reference_logprobs([samples[i] for i in mine], known_reference)):
                ref[i] = r
        reference_seconds = time.perf_counter() - started
        ahead = self.known_reference / len(mine) if self.cfg.kl_beta != 0 and mine else 0.0

        cap = self.cfg.engine_is_cap
        bonus = self.cfg.entropy_coef

        def batch_loss(idx: list[int], weights: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            batch = [samples[i] for i in idx]
            logp, mask, *entropy = self._logprobs(self.model, batch, entropy=bonus != 0)  # (b, T) (b, T) [(b, T)]
            old = pad_rows([torch.tensor(s.old_logprobs, dtype=logp.dtype) for s in batch], logp.shape[1])  # (b, T)
            ref_b = pad_rows([ref[i] for i in idx], logp.shape[1]).to(logp.dtype) if ref is not None else None
            adv = _advantages(batch, logp.shape[1], logp.dtype)  # (b,) or (b, T)
            sampler = None
            if cap is not None or self.loss_engine:  # the engine's (the old ones where it reported none: weight 1)
                rows = [s.engine_logprobs if s.engine_logprobs is not None else s.old_logprobs for s in batch]
                sampler = pad_rows([torch.tensor(r, dtype=logp.dtype) for r in rows], logp.shape[1]).to(logp.device)
            loss, stats = self.loss(
                logp,
                old.to(logp.device),
                None if ref_b is None else ref_b.to(logp.device),
                adv.to(logp.device),
                weights.to(logp.device),
                mask,
                self.cfg.clip_eps,
                self.cfg.kl_beta,
                **({"engine_logp": sampler} if sampler is not None else {}),
                **({"is_cap": cap} if cap is not None else {}),
            )
            if entropy:  # the entropy bonus, weighted as the objective's tokens: - c * sum_{i,t} mask * w_i * H_it
                h = entropy[0].masked_fill(~mask, 0.0)  # (b, T)
                loss = loss - bonus * (weights.to(h.device)[:, None] * h).sum()
                stats = {**stats, "entropy": float(h.detach().sum()) / max(int(mask.sum()), 1)}
            return loss, stats

        applied_by_group = self.scheduler.get_last_lr()  # this update's rates (the scheduler then moves on)
        applied = applied_by_group[0]
        totals = accumulated_steps(
            self.model,
            self.optimizer,
            self.params,
            self.cfg,
            samples,
            batch_loss,
            ("kl", "clip_fraction", "ratio")
            + (("entropy",) if bonus != 0 else ())
            + (("is_weight", "is_clipped") if cap is not None else ())
            + self.loss_stats,
            by_agent=bool(self.roles),
            ranks=ranks,
        )
        self.scheduler.step()
        totals["lr"] = applied
        if self.cfg.role_lr:  # each role's own (applied) rate
            totals.update({f"lr/{role}": lr for role, lr in zip(self.roles, applied_by_group)})
        totals["seconds/reference"] = reference_seconds  # (what was left of it: see reference/ahead)
        totals["reference/ahead"] = ahead  # the share of the samples whose reference pass ran beside the rollouts
        # the correction of the sampler / trainer mismatch: the truncated importance weight's mean and share capped,
        # the share of tokens IcePop masked
        for key in ("is_weight", "is_clipped", "is_masked"):
            if key in totals:
                totals[f"engine/{key}"] = totals.pop(key)
        return totals


def accumulated_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    optim: OptimConfig,
    samples: list[Sample],
    batch_loss: Callable[[list[int], torch.Tensor], tuple[torch.Tensor, dict[str, float]]],
    stats: tuple[str, ...],
    by_agent: bool = False,
    ranks: Single | None = None,
) -> dict[str, float]:
    """The update loop of the actor and the critic: `optim.ppo_epochs` passes over `samples` (each with an output),
    each one optimiser step whose gradient is accumulated over micro-batches (:func:`micro_batches`, by agent with
    `by_agent`, shared prompts with `optim.share_prefix`): ``batch_loss(indices, weights)`` gives a micro-batch's
    loss and its stats (with ``n_tokens``), where `weights` are the micro-batch's rows of the step-wide token weights
    (:func:`mhgpo.rl.losses.token_weights`, so the gradient does not depend on the cut); then `params`' gradient norm is
    clipped at `optim.max_grad_norm` and the optimiser steps. Dropout is off (`mhgpo.model.modules.no_dropout`). Returns the last
    pass's ``loss`` (summed over its micro-batches), ``grad_norm`` (before clipping) and each of `stats` as a token
    mean. With several `ranks`, each computes the micro-batches of its share of `samples` (:func:`owned`) under the
    weights of the whole step; the gradients (a sum of the samples' terms) and the statistics are summed across
    ranks before clipping. A sharded `model` (FSDP, :mod:`mhgpo.model.sharding`) reduces its layers' gradients in each
    backward pass: every rank then runs as many micro-batches as the busiest, the others' extra ones zero-weight
    repeats of one of theirs (or of sample 0), which add nothing; only its replicated weights' gradients are summed
    here."""
    ranks = ranks or Single()
    weights = token_weights([s.agent for s in samples], [len(s.output_ids) for s in samples])  # (N,)
    mine = owned(samples, ranks, optim.share_prefix)
    batches = [
        [mine[j] for j in b]
        for b in micro_batches(
            [samples[i] for i in mine], optim.micro_batch_tokens, by_agent=by_agent, share=optim.share_prefix
        )
    ]
    real = len(batches)
    if is_sharded(model):
        busiest = int(max(ranks.gather(real)))
        batches += [batches[0] if batches else [0]] * (busiest - real)
    replicated = [p for p in params if not is_dtensor(p)]
    totals: dict[str, float] = {}
    with no_dropout(model):
        for _epoch in range(optim.ppo_epochs):
            optimizer.zero_grad(set_to_none=True)
            loss_sum, tokens = 0.0, 0.0
            acc = dict.fromkeys(stats, 0.0)
            for j, idx in enumerate(batches):
                if j >= real:  # a zero-weight micro-batch: the backward pass's collectives, no gradient
                    loss, _ = batch_loss(idx, torch.zeros(len(idx), dtype=weights.dtype))
                    loss.backward()
                    continue
                loss, batch_stats = batch_loss(idx, weights[idx])
                loss.backward()
                loss_sum += float(loss.detach())
                n = batch_stats["n_tokens"]
                tokens += n
                for k in acc:
                    acc[k] += batch_stats.get(k, 0.0) * n
            if replicated:
                ranks.sum_grads(replicated)
            loss_sum, tokens, *sums = ranks.sum([loss_sum, tokens, *acc.values()])
            acc = dict(zip(acc, sums))
            grad_norm = clip_grad_norm(params, optim.max_grad_norm)
            check_finite(loss_sum, float(grad_norm))  # the same sums on every rank: all stop, none steps
            optimizer.step()
            means = {k: v / max(tokens, 1) for k, v in acc.items()}
            totals = {"loss": loss_sum, "grad_norm": float(grad_norm), **means}
    return totals


def check_finite(loss: float, grad_norm: float) -> None:
    """Raise NotFinite before an optimiser step that would write NaN / infinite values into the weights (a
    diverged loss, an overflowing gradient): clipping does not help, a NaN norm scales every gradient to NaN."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise NotFinite(
            f"the loss/gradient is not finite (loss {loss}, gradient norm {grad_norm}); the update was not applied"
        )


def weights_finite(params: list[torch.nn.Parameter], ranks: Single | None = None) -> bool:
    """Whether every trained weight is finite after an update (on every rank: each checks its own shards)."""
    with torch.no_grad():
        bad = any(not bool(torch.isfinite(p.to_local() if is_dtensor(p) else p).all()) for p in params)
    return not (ranks or Single()).any(bad)


def owned(samples: list[Sample], ranks: Single, share: bool = False) -> list[int]:
    """The indices of `samples` (the whole step's) that this rank computes: all of them in one process, else its
    share of about equal tokens (:func:`mhgpo.model.distributed.shares`); with `share` (``optim.share_prefix``) the
    samples of one prompt stay on one rank, which computes the prompt once."""
    if ranks.world == 1:
        return list(range(len(samples)))
    units: dict[Any, list[int]] = {}
    for i, s in enumerate(samples):
        units.setdefault((tuple(s.prompt_ids), s.agent, s.temperature) if share else i, []).append(i)
    cut = list(units.values())
    tokens = [len(samples[u[0]].prompt_ids) + sum(len(samples[i].output_ids) for i in u) for u in cut]
    return sorted(i for u in shares(tokens, ranks.world)[ranks.rank] for i in cut[u])


def pad_rows(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """The 1-D ``rows`` as one (b, width) tensor: each cut at ``width`` or zero-padded to it."""
    out = torch.zeros(len(rows), width, dtype=rows[0].dtype if rows else torch.float32)  # (b, T)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r[:width]
    return out


def _advantages(batch: list[Sample], width: int, dtype: torch.dtype) -> torch.Tensor:
    """(b,) when every sample has one advantage, else (b, T) with per-sample ones broadcast to their tokens."""
    if all(isinstance(s.advantage, (int, float)) for s in batch):
        return torch.tensor([float(s.advantage) for s in batch], dtype=dtype)  # (b,)
    rows = []
    for s in batch:
        per_token = s.advantage if isinstance(s.advantage, (list, tuple)) else [s.advantage] * len(s.output_ids)
        rows.append(torch.tensor(per_token, dtype=dtype))  # (|o|,)
    return pad_rows(rows, width)  # (b, T)


def reference_segments(samples: list[Sample]) -> list[list[int]]:
    """The indices of `samples` grouped by (temperature, prompt), in order of first appearance: the reference pass's
    unit (:meth:`Policy.reference_logprobs`)."""
    return packing.segments([s.prompt_ids for s in samples], [s.temperature for s in samples])


def segment_key(samples: list[Sample]) -> tuple:
    """What a segment's reference log-probs are a function of: its temperature, its prompt and its outputs in
    order (the segment's samples share the first two)."""
    first = samples[0]
    return (first.temperature, tuple(first.prompt_ids), tuple(tuple(s.output_ids) for s in samples))


def micro_batches(
    samples: list[Sample], max_tokens: int, by_agent: bool = False, share: bool = True
) -> list[list[int]]:
    """Indices of samples cut into micro-batches (:func:`mhgpo.model.packing.micro_batches`): the same temperature together,
    and the same agent with `by_agent`; samples with identical prompts share a segment when `share` (the prompt
    counted once); rows × longest segment ≤ max_tokens, a larger group split, a longer single sample in a batch of
    its own."""
    keys = [(s.agent if by_agent else "", s.temperature) for s in samples]
    return packing.micro_batches(
        [s.prompt_ids for s in samples], [len(s.output_ids) for s in samples], max_tokens, keys, share
    )


def _lr_lambda(cfg: OptimConfig, total_steps: int):
    """The lr multiplier of update ``step`` (0-based): ``(step + 1) / (warmup_steps + 1)`` during the warm-up, so the
    first update runs at a fraction of the lr and update ``warmup_steps`` is the first at full lr; then 1, or a
    cosine from 1 to 0 over the remaining updates."""

    def f(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.schedule == "cosine":
            span = max(total_steps - cfg.warmup_steps, 1)
            progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
            return 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    return f


def peak_memory_mb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
