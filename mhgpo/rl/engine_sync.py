"""A separate sampling engine (``generation.engine=vllm``) kept on the trained policy (docs/vllm.md).

After every update the engine gets the new weights (:func:`sync`): under LoRA each trained adapter is saved in PEFT
format to a scratch folder and handed over as a new ``LoRARequest`` (one per agent under ``lora.per_role``); under
full fine-tuning the weights are loaded into the engine's model. The engine then scores a few of the step's
outputs and the trainer scores them too (:func:`sync_gap`): a mean per-token gap above the tolerance means the
engine does not sample from the policy being trained, and the run stops (:class:`EngineOutOfSync`).

The engine's own log-probs of what it sampled are those of the raw logits (temperature 1): with
``optim.old_logprobs=trainer`` (the default) the trainer recomputes them before the update (:func:`old_logprobs`);
with ``engine`` the ratio divides by the engine's, which needs every sampling agent at temperature 1.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from mhgpo.errors import InputError, RunError
from mhgpo.rl.policy import LORA_ADAPTER, Policy, Sample

# the sync check's largest mean per-token log-prob gap, by resolved precision: float32 on both sides agree to about
# 1e-5; bfloat16 (the engine's kernels, the trainer's autocast) by about 0.03 (the demo's rollouts, default model)
DEFAULT_TOLERANCE = {"fp32": 1e-3, "bf16-mixed": 0.1, "bf16": 0.1}
PER_ROLE_ADAPTERS = 8  # the engine's LoRA slots under lora.per_role: a team has a handful of agents


class EngineOutOfSync(RunError):
    """The engine's log-probs of the step's outputs differ from the trainer's beyond `generation.sync_tolerance`."""


def tolerance(cfg: Any) -> float:
    """`generation.sync_tolerance`, or the default for the engine's dtype."""
    given = cfg.generation.sync_tolerance
    return given if given is not None else DEFAULT_TOLERANCE[cfg.precision]


def sync(engine: Any, policy: Policy, scratch: Path) -> None:
    """Hand the policy's current weights to ``engine``: its LoRA adapters (saved to ``scratch``, one per agent under
    `lora.per_role`), or all its weights."""
    if not policy.lora:
        engine.load_weights(policy.model.state_dict().items())
        return
    names = policy.roles or (LORA_ADAPTER,)
    # (embeddings are no LoRA target here: `save_embedding_layers=False` skips peft's look for the base's config)
    policy.model.save_pretrained(str(scratch / "adapters"), selected_adapters=list(names), save_embedding_layers=False)
    folders = {name: scratch / "adapters" / (name if name != LORA_ADAPTER else "") for name in names}
    engine.set_adapters({(name if policy.roles else None): folder for name, folder in folders.items()})


def checked(samples: list[Sample], count: int) -> list[Sample]:
    """Up to ``count`` of ``samples`` with an output, the agents in turn, each scored at temperature 1."""
    by_agent: dict[str, list[Sample]] = {}
    for s in samples:
        if s.output_ids:
            by_agent.setdefault(s.agent, []).append(s)
    picked: list[Sample] = []
    while len(picked) < count and any(by_agent.values()):
        for agent in list(by_agent):
            if by_agent[agent] and len(picked) < count:
                s = by_agent[agent].pop(0)
                picked.append(Sample(s.prompt_ids, s.output_ids, [], 0.0, s.agent, temperature=1.0))
    return picked


def sync_gap(engine: Any, policy: Policy, samples: list[Sample], count: int) -> float | None:
    """The mean |engine - trainer| log-prob gap per token over up to ``count`` of ``samples`` (None: none to check),
    both at temperature 1, each as its agent (pooled over the samples' tokens: a stable figure in bfloat16 too)."""
    picked = checked(samples, count)
    if not picked:
        return None
    trainer = policy.current_logprobs(picked)
    gaps: list[np.ndarray] = []
    for agent in dict.fromkeys(s.agent for s in picked):
        rows = [i for i, s in enumerate(picked) if s.agent == agent]
        scored = engine.score(
            [picked[i].prompt_ids for i in rows], [picked[i].output_ids for i in rows], agent if policy.roles else None
        )
        for i, engine_lp in zip(rows, scored):
            gaps.append(np.abs(np.asarray(engine_lp) - trainer[i].numpy()))
    return float(np.concatenate(gaps).mean())


def check_sync(gap: float | None, limit: float, step: int, last_checkpoint: str) -> None:
    """Stop the run (:class:`EngineOutOfSync`) when the sync ``gap`` after ``step``'s update exceeds ``limit``."""
    if gap is not None and gap > limit:
        raise EngineOutOfSync(
            f"generation.engine=vllm: after the update of step {step} the engine's log-probs of the step's outputs "
            f"differ from the trainer's by {gap:.3g} per token (generation.sync_tolerance={limit:g}): the engine "
            f"does not sample from the trained weights; the run stops; {last_checkpoint}"
        )


def sync_after_update(setup: Any, cfg: Any, samples: list[Sample], step: int, run_dir: Path) -> dict[str, float]:
    """After `step`'s update: the new weights handed to the engine (`setup.generator`), then checked on a few of the
    step's outputs (`generation.sync_check`); a gap beyond the tolerance stops the run (the last checkpoint kept).
    Returns the step's sync metrics."""
    from mhgpo.model.checkpoint import list_checkpoints

    t = time.perf_counter()
    sync(setup.generator, setup.policy, setup.engine_scratch)
    out = {"seconds/engine_sync": time.perf_counter() - t}
    check = cfg.generation.sync_check
    gap = sync_gap(setup.generator, setup.policy, samples, check) if check else None
    if gap is not None:
        out["engine/sync_logprob_gap"] = gap
    kept = list_checkpoints(run_dir)
    check_sync(
        gap, tolerance(cfg), step, f"its last checkpoint is {kept[-1].name}" if kept else "it has no checkpoint yet"
    )
    return out


def old_logprobs(policy: Policy, samples: list[Sample], mode: str) -> dict[str, float]:
    """Set the samples' old log-probs as `optim.old_logprobs` asks: ``trainer`` recomputes them with the policy
    (returns the mean per-token gap to the engine's, at temperature 1 only); ``engine`` keeps the engine's, which
    are the project's only at temperature 1 (an :class:`InputError` otherwise)."""
    with_output = [s for s in samples if s.output_ids]
    if mode == "engine":
        hot = sorted({s.temperature for s in with_output if s.temperature != 1.0})
        if hot:
            raise InputError(
                f"optim.old_logprobs=engine: vLLM reports the log-probs of the raw logits, which are "
                f"the policy's only at temperature 1; an agent samples at temperature {hot[0]:g} "
                f"(use optim.old_logprobs=trainer)"
            )
        return {}
    recomputed = policy.current_logprobs(with_output) if with_output else []
    gaps = []
    for s, lp in zip(with_output, recomputed):
        if s.temperature == 1.0:
            gaps.append(float(np.mean(np.abs(np.asarray(s.old_logprobs) - lp.numpy()))))
        s.old_logprobs = [float(x) for x in lp]
    return {"engine/old_logprob_gap": float(np.mean(gaps))} if gaps else {}
