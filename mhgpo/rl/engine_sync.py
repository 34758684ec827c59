"""A separate sampling engine (``generation.engine=vllm``) kept on the trained policy (docs/vllm.md).

After every update the engine gets the new weights (:func:`sync`), labelled with the trainer's update count: under
LoRA each trained adapter is saved in PEFT format to a scratch folder and handed over as a new ``LoRARequest`` (one
per agent under ``lora.per_role``); under full fine-tuning the weights are loaded into the engine's model. Under
several ranks every rank hands them to its own engine, whole (:func:`trainer_weights`: under FSDP gathered from the
shards). Then :func:`check_sync` measures, on each rank, and :func:`verdict` judges (a pure function, so that the
verdicts of several ranks can be combined, :func:`stop_if_any`):

- what the engine holds, as it reports it (:func:`stale`): the update count of its weights, and digests of the
  adapters its worker loaded (of the files they were loaded from) or of its own tensors that keep the trainer's
  layout (the embeddings, the norms), against the same digests of the trainer's weights. This catches a skipped or
  lost hand-over in every precision, however small the update;
- a few of the step's outputs scored by the engine and by the trainer (:func:`gap_figures`): the mean and largest
  per-token log-prob gap, a k3 estimate of the KL between them and the mean of exp(gap); a mean gap above the
  tolerance means the engine computes something else than the trainer (a wrong layout, a wrong scale), and a value
  that is not finite stops the run at once. Under several ranks each rank scores its share of those outputs on its
  own engine; the step logs the figures pooled over the ranks' tokens (:func:`pooled`).

The engine's log-probs of what it sampled are the project's, ``log_softmax(logits / T)`` before top-p, at any
temperature: with ``optim.old_logprobs=trainer`` (the default) the trainer recomputes them before the update and the
engine's are kept beside them for the truncated importance weight (`optim.engine_is_cap`, :func:`old_logprobs`); with
``engine`` the ratio divides by the engine's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mhgpo.errors import RunError
from mhgpo.model import sharding
from mhgpo.model.distributed import Single
from mhgpo.rl.policy import LORA_ADAPTER, Policy, Sample, owned

# the sync check's largest mean per-token log-prob gap, by resolved precision: float32 on both sides agree to about
# 1e-5; bfloat16 (the engine's kernels, the trainer's autocast) by about 0.03 (the demo's rollouts, default model)
DEFAULT_TOLERANCE = {"fp32": 1e-3, "bf16-mixed": 0.1, "bf16": 0.1}
PER_ROLE_ADAPTERS = 8  # the engine's LoRA slots under lora.per_role: a team has a handful of agents
GAP = "engine/logprob_gap"  # the sync check's figures: GAP_mean, GAP_max, KL_K3, MULT_PROB_ERROR
KL_K3, MULT_PROB_ERROR = "engine/kl_k3", "engine/mult_prob_error"


class EngineOutOfSync(RunError):
    """The engine does not hold the trained weights, or its log-probs of the step's outputs differ from the
    trainer's beyond `generation.sync_tolerance`."""


class EngineGapNotFinite(RunError):
    """The engine's or the trainer's log-probs of the step's outputs are NaN or infinite."""


@dataclass
class SyncCheck:
    """What the sync check of one rank measured: ``figures`` (:func:`gap_figures`; empty when no output was
    scored), ``tokens`` scored and how many of them had a log-prob that is not finite on the engine's side and on
    the trainer's (``not_finite``), ``stale``, why the engine does not hold the trainer's weights (None: it holds
    them, :func:`stale`), and the scored log-probs themselves (N,), the engine's and the trainer's."""

    figures: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    not_finite: tuple[int, int] = (0, 0)
    stale: str | None = None
    engine_lp: np.ndarray = field(default_factory=lambda: np.zeros(0))
    trainer_lp: np.ndarray = field(default_factory=lambda: np.zeros(0))


def tolerance(cfg: Any) -> float:
    """`generation.sync_tolerance`, or the default for the engine's dtype."""
    given = cfg.generation.sync_tolerance
    return given if given is not None else DEFAULT_TOLERANCE[cfg.precision]


def _adapter_names(policy: Policy) -> tuple[str, ...]:
    return policy.roles or (LORA_ADAPTER,)


def trainer_weights(policy: Policy) -> dict[str, Any]:
    """What the engine is handed of the policy, by the names of its ``state_dict``: under LoRA the adapters' tensors,
    else every tensor; whole tensors: under FSDP each sharded one is gathered from the ranks' shards
    (:func:`mhgpo.model.sharding.full`, a collective: every rank calls this at the same point)."""
    state = policy.model.state_dict()
    if policy.lora:
        state = {name: t for name, t in state.items() if "lora_" in name}
    return {name: sharding.full(t.detach()) for name, t in state.items()}


def sync(engine: Any, policy: Policy, scratch: Path, version: int, weights: dict[str, Any] | None = None) -> None:
    """Hand the policy's current weights, those of its update ``version`` (the trainer's update count), to
    ``engine``: its LoRA adapters (saved to ``scratch``, one per agent under `lora.per_role`), or all its weights.
    ``weights``: :func:`trainer_weights`, if already taken (else taken here: every rank calls this together)."""
    weights = trainer_weights(policy) if weights is None else weights
    if not policy.lora:
        engine.load_weights(weights.items(), version)
        return
    names = _adapter_names(policy)
    # a server's adapters: a folder per version under the folder the servers read (an adapter of an older version
    # may still be in use while this one is handed over); the in-process engine's: one folder, written again
    served = getattr(engine, "adapter_dir", None)
    folder = Path(served) / f"adapters-v{version}{getattr(engine, 'suffix', '')}" if served else scratch / "adapters"
    # (embeddings are no LoRA target here: `save_embedding_layers=False` skips peft's look for the base's config)
    policy.model.save_pretrained(
        str(folder), selected_adapters=list(names), save_embedding_layers=False, state_dict=weights
    )
    folders = {name: folder / (name if name != LORA_ADAPTER else "") for name in names}
    engine.set_adapters({(name if policy.roles else None): folder for name, folder in folders.items()}, version)


def stale(engine: Any, policy: Policy, version: int, weights: dict[str, Any] | None = None) -> str | None:
    """Why ``engine`` does not hold the weights of the policy's update ``version`` (None: it holds them), from what
    the engine reports (:meth:`~mhgpo.model.vllm_engine.VLLMGenerator.held`): the update count of its last
    hand-over; under LoRA, the digest of each adapter its worker loaded against the trainer's adapter; under full
    weights, the digest of each of its own tensors that keep the trainer's layout (embeddings, norms) against the
    trainer's, cast to the engine's dtype. ``weights``: :func:`trainer_weights`, if already taken."""
    import torch
    from peft import get_peft_model_state_dict

    from mhgpo.model.vllm_engine import tensor_digest

    state = trainer_weights(policy) if weights is None else weights
    if not policy.lora:
        embed = policy.model.get_input_embeddings().weight.data_ptr()  # (whole on every rank under FSDP)
        kept = {n: tuple(t.shape) for n, t in state.items() if t.ndim == 1 or t.data_ptr() == embed}
        held = engine.held(kept)
    else:
        held = engine.held()
    if held.version != version:
        return f"it holds the weights of update {held.version}, the trainer those of update {version}"
    if not policy.lora:  # (a server reports none of its tensors: its weights are judged by the scored outputs)
        for name, digest in sorted(held.tensors.items()):
            if tensor_digest([(name, state[name].detach().to(getattr(torch, engine.dtype)))]) != digest:
                return f"its {name} differs from the trainer's"
        return None
    for name in _adapter_names(policy):
        agent = name if policy.roles else None
        mine = get_peft_model_state_dict(policy.model, state_dict=state, adapter_name=name, save_embedding_layers=False)
        if agent not in held.adapters:
            return f"its worker has not loaded the adapter of {agent or 'the agents'}"
        if held.adapters[agent] != tensor_digest(mine.items()):
            return f"the adapter it loaded for {agent or 'the agents'} differs from the trainer's"
    return None


def checked(samples: list[Sample], count: int) -> list[Sample]:
    """Up to ``count`` of ``samples`` with an output, the agents in turn (each at its own temperature)."""
    by_agent: dict[str, list[Sample]] = {}
    for s in samples:
        if s.output_ids:
            by_agent.setdefault(s.agent, []).append(s)
    picked: list[Sample] = []
    while len(picked) < count and any(by_agent.values()):
        for agent in list(by_agent):
            if by_agent[agent] and len(picked) < count:
                s = by_agent[agent].pop(0)
                picked.append(Sample(s.prompt_ids, s.output_ids, [], 0.0, s.agent, temperature=s.temperature))
    return picked


def scored(engine: Any, policy: Policy, picked: list[Sample]) -> tuple[np.ndarray, np.ndarray]:
    """The log-probs (N,) of the tokens of the ``picked`` samples (:func:`checked`), each at its sample's
    temperature and as its agent: the engine's, then the trainer's, pooled over the samples' tokens. Every rank
    calls it together, with its own samples (none included: under FSDP the trainer's passes gather the model)."""
    trainer = policy.current_logprobs(picked)
    if not picked:
        return np.zeros(0), np.zeros(0)
    ours: list[np.ndarray] = [np.zeros(0)] * len(picked)
    for key in dict.fromkeys((s.agent, s.temperature) for s in picked):
        rows = [i for i, s in enumerate(picked) if (s.agent, s.temperature) == key]
        agent = key[0] if policy.roles else None
        for i, lp in zip(
            rows,
            engine.score([picked[i].prompt_ids for i in rows], [picked[i].output_ids for i in rows], agent, key[1]),
        ):
            ours[i] = np.asarray(lp, dtype=np.float64)
    return np.concatenate(ours), np.concatenate([t.double().numpy() for t in trainer])


def gap_figures(engine_lp: np.ndarray, trainer_lp: np.ndarray) -> dict[str, float]:
    """The mismatch of two sets of log-probs of the same tokens (N,), engine then trainer, pooled over the tokens:
    ``GAP_mean`` and ``GAP_max``, of ``|log p_engine - log p_trainer|``; ``engine/kl_k3``, the k3 estimate of
    ``KL(engine || trainer)`` on the engine's samples, mean of ``exp(d) - d - 1`` with ``d = log p_trainer -
    log p_engine``; ``engine/mult_prob_error``, mean of ``exp(|d|)`` (NeMo-RL's ``token_mult_prob_error``, 1 when
    equal). NaN where a log-prob is NaN; {} for no tokens."""
    if engine_lp.shape != trainer_lp.shape or engine_lp.ndim != 1:
        raise ValueError(f"expected two (N,) arrays, got {engine_lp.shape} and {trainer_lp.shape}")
    if engine_lp.size == 0:
        return {}
    d = trainer_lp - engine_lp  # (N,)
    gap = np.abs(d)  # (N,)
    with np.errstate(over="ignore", invalid="ignore"):
        return {
            f"{GAP}_mean": float(gap.mean()),
            f"{GAP}_max": float(gap.max()),
            KL_K3: float((np.expm1(d) - d).mean()),
            MULT_PROB_ERROR: float(np.exp(gap).mean()),
        }


def check_sync(
    engine: Any,
    policy: Policy,
    samples: list[Sample],
    count: int,
    version: int,
    ranks: Single | None = None,
    weights: dict[str, Any] | None = None,
) -> SyncCheck:
    """The sync check of one rank after the update ``version`` (the trainer's update count): what its engine holds
    (:func:`stale`; ``weights``: :func:`trainer_weights`, if already taken), and the gap figures of its share of up
    to ``count`` of the step's ``samples`` (0: none scored; ``ranks``: one process if None). Every rank calls it
    together."""
    picked = (ranks or Single()).share(checked(samples, count))
    engine_lp, trainer_lp = scored(engine, policy, picked)
    return SyncCheck(
        figures=gap_figures(engine_lp, trainer_lp),
        tokens=int(engine_lp.size),
        not_finite=(int((~np.isfinite(engine_lp)).sum()), int((~np.isfinite(trainer_lp)).sum())),
        stale=stale(engine, policy, version, weights),
        engine_lp=engine_lp,
        trainer_lp=trainer_lp,
    )


def pooled(check: SyncCheck, ranks: Single) -> dict[str, float]:
    """The gap figures (:func:`gap_figures`) over the tokens that every rank scored (its ``check``), in rank order:
    one process's figures, the same on every rank."""
    parts = ranks.gather([check.engine_lp, check.trainer_lp])
    return gap_figures(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))


def verdict(
    check: SyncCheck,
    limit: float,
    step: int,
    last_checkpoint: str,
    rank: int | None = None,
    engine: str = "vllm",
    model: str | None = None,
) -> RunError | None:
    """The error that stops the run after ``step``'s update (None: the engine is in sync), from one rank's
    ``check``: the engine does not hold the trained weights; a log-prob that is not finite; or a mean gap above
    ``limit``. ``rank``: the rank named in the line (None: one process); ``engine``: the `generation.engine` the
    line names (``vllm`` or ``vllm_server``); ``model``: the run's `model`, which a server's gap line names (a
    server started with another model samples from other weights from the first step on). Pure, so that the ranks'
    verdicts can be combined (:func:`stop_if_any`)."""
    on_rank = f", on rank {rank}," if rank is not None else ""
    head = f"generation.engine={engine}: after the update of step {step}{on_rank}"
    tail = f"the run stops; {last_checkpoint}"
    if check.stale is not None:
        return EngineOutOfSync(f"{head} the engine does not hold the trained weights ({check.stale}); {tail}")
    if any(check.not_finite):
        engine_side, trainer_side = check.not_finite
        return EngineGapNotFinite(
            f"{head} the log-probs of the step's outputs are not finite (NaN or infinite at {engine_side} of "
            f"{check.tokens} tokens on the engine's side, {trainer_side} on the trainer's); {tail}"
        )
    gap = check.figures.get(f"{GAP}_mean")
    served = ""
    if engine == "vllm_server" and model is not None:
        served = f" (is the server serving the run's model? mhgpo serve-generation --model {model})"
    if gap is not None and gap > limit:
        return EngineOutOfSync(
            f"{head} the engine's log-probs of the step's outputs differ from the trainer's by {gap:.3g} per token "
            f"(generation.sync_tolerance={limit:g}): the engine does not sample from the trained weights{served}; "
            f"{tail}"
        )
    return None


def stop_if_any(error: RunError | None, ranks: Single) -> None:
    """Stop every rank when the sync check failed on any of ``ranks`` (:class:`~mhgpo.model.distributed.Single` or
    ``Ranks``: every rank calls it with its verdict, ``error``): each raises the error of the first rank that failed
    (its own, if that rank is this one), so that rank 0 says in one line which rank failed and why."""
    if not ranks.any(error is not None):
        return
    told = ranks.gather(None if error is None else [type(error).__name__, str(error)])
    first = next(r for r, verdict_of in enumerate(told) if verdict_of)
    if first == ranks.rank and error is not None:
        raise error
    kind, line = told[first]
    raise {c.__name__: c for c in (EngineOutOfSync, EngineGapNotFinite)}.get(kind, EngineOutOfSync)(line)


def sync_after_update(
    setup: Any, cfg: Any, samples: list[Sample], step: int, run_dir: Path, ranks: Any
) -> dict[str, float]:
    """After `step`'s update: the new weights handed to the engine (`setup.generator`), then checked (what the engine
    holds, and a few of the step's outputs scored, `generation.sync_check`); a failed check on any of `ranks` stops
    the run (the last checkpoint kept). Returns the step's sync figures."""
    from mhgpo.model.checkpoint import list_checkpoints

    t = time.perf_counter()
    weights = trainer_weights(setup.policy)
    sync(setup.generator, setup.policy, setup.engine_scratch, step, weights)
    out = {"seconds/engine_sync": time.perf_counter() - t}
    t = time.perf_counter()
    check = check_sync(setup.generator, setup.policy, samples, cfg.generation.sync_check, step, ranks, weights)
    kept = list_checkpoints(run_dir)
    last = f"its last checkpoint is {kept[-1].name}" if kept else "it has no checkpoint yet"
    rank = ranks.rank if ranks.world > 1 else None
    stop_if_any(verdict(check, tolerance(cfg), step, last, rank, cfg.generation.engine, cfg.model), ranks)
    out.update(pooled(check, ranks), **{"seconds/engine_check": time.perf_counter() - t})
    return out


def old_logprobs(
    policy: Policy, samples: list[Sample], mode: str, ranks: Single | None = None, engine: str = "vllm"
) -> dict[str, float]:
    """Set the samples' old log-probs as `optim.old_logprobs` asks: ``engine`` keeps the engine's; ``trainer``
    recomputes them with the policy, keeps the engine's beside them (``engine_logprobs``, for `optim.engine_is_cap`)
    and returns their mean per-token gap to the engine's (``engine/old_logprob_gap``). Under several ``ranks`` each
    rank recomputes the samples its update will take (:func:`~mhgpo.rl.policy.owned`) and the ranks' rows are
    gathered, so that every rank holds them all. A log-prob that is not finite on either side stops the run
    (:class:`EngineGapNotFinite`, its line naming the `generation.engine`, ``engine``), before the update."""
    with_output = [s for s in samples if s.output_ids]
    for s in with_output:
        s.engine_logprobs = list(s.old_logprobs)
    if mode == "engine" or not with_output:
        return {}
    ranks = ranks or Single()
    mine = owned(with_output, ranks, policy.cfg.share_prefix)
    rows = policy.current_logprobs([with_output[i] for i in mine])
    recomputed: list[list[float]] = [[] for _ in with_output]
    for indices, values in ranks.gather([mine, [lp.tolist() for lp in rows]]):
        for i, lp in zip(indices, values):
            recomputed[i] = lp
    engine_lp = np.concatenate([np.asarray(s.old_logprobs, dtype=np.float64) for s in with_output])
    trainer_lp = np.concatenate([np.asarray(lp, dtype=np.float64) for lp in recomputed])
    bad = (int((~np.isfinite(engine_lp)).sum()), int((~np.isfinite(trainer_lp)).sum()))
    if any(bad):
        raise EngineGapNotFinite(
            f"generation.engine={engine}: the log-probs of the step's outputs are not finite (NaN or infinite at "
            f"{bad[0]} of {engine_lp.size} tokens on the engine's side, {bad[1]} on the trainer's); the run stops "
            f"before the update"
        )
    for s, lp in zip(with_output, recomputed):
        s.old_logprobs = [float(x) for x in lp]
    k = np.exp(np.clip(trainer_lp - engine_lp, -50.0, 50.0))  # (N,) each token's trainer / sampler ratio
    return {
        "engine/old_logprob_gap": float(np.abs(engine_lp - trainer_lp).mean()),
        "engine/is_ess": effective_sample_size(k),
    }


def effective_sample_size(weights: np.ndarray) -> float:
    """Kish's effective sample size of importance ``weights`` (N,), as a share of N: ``(sum w)^2 / (N sum w^2)``, 1
    when every weight is equal (the sampler is the trainer), near 1/N when one weight dominates; 1 for none."""
    if weights.size == 0:
        return 1.0
    total, squares = float(weights.sum()), float((weights**2).sum())
    return total * total / (weights.size * squares) if squares > 0 else 1.0
