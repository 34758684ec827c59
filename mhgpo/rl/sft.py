"""Supervised warm start (`mhgpo sft`): every role of the team is fine-tuned on its own gold outputs.

Gold traces come from the workflow's `demonstration(state, agent)`. Each training question is walked through the
workflow breadth-first with the gold output of each agent in place of a sample (tools run as usual, batched), so a
role is trained on exactly the prompts it sees during RL, built from the previous roles' gold outputs. A chain
stops where the data gives no demonstration (for the default team: an Answerer whose documents do not contain the
answer). The loss is the cross-entropy of the output tokens only, averaged as the RL objective averages (tokens
within a demonstration, demonstrations within a role, roles: `mhgpo.rl.losses.token_weights`), one optimiser step per
`batch_size` demonstrations, accumulated over packed micro-batches.

The run directory has the layout of `mhgpo train` (`config.yaml`, `metrics.jsonl`, `checkpoints/step_N/`), so
`--model DIR` starts an RL run (or an evaluation) from the warm-started team, and `mhgpo sft --resume DIR`
continues it. Besides the per-role loss, every `eval_every` steps (and at the end) it logs each role's format
accuracy on held-out demonstrations (greedy outputs that the workflow accepts without a penalty, and outputs
equal to the gold one) and the team's validation Acc / EM / F1.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mhgpo.config import SFTConfig
from mhgpo.config.eval import MAX_PROMPT_TOKENS
from mhgpo.data.metrics import normalize_answer, score
from mhgpo.data.records import Example
from mhgpo.model.generation import Generator, SamplingParams
from mhgpo.rl.losses import token_weights
from mhgpo.rl.policy import Sample, check_finite, micro_batches
from mhgpo.rl.trainer import Trainer, TrainingSetup
from mhgpo.team.loader import WorkflowError, failure
from mhgpo.team.workflow import State, Workflow


@dataclass
class Demonstration:
    """One gold LLM call: the agent's prompt (token ids) and its gold output (token ids, ending with the stop id)."""

    state: State
    agent: str
    prompt_ids: list[int]
    target_ids: list[int]
    target: str


def collect_demonstrations(
    examples: list[Example],
    workflow: Workflow,
    encode: Callable[[list[dict[str, str]]], list[int]],
    encode_target: Callable[[str], list[int]],
    max_rounds: int = 64,
    max_prompt_tokens: int = MAX_PROMPT_TOKENS,
) -> tuple[list[Demonstration], dict[str, int]]:
    """Walk every example through `workflow` with gold outputs; returns the demonstrations (in breadth-first
    order) and, per agent, how many chains stopped at it for want of a demonstration (`skipped/<agent>`). A
    workflow method that raises stops it with a `WorkflowError` naming file, class, method and question. A prompt
    longer than `max_prompt_tokens` stops its chain there too (counted in `skipped/<agent>`, and one warning names
    how many and the first question)."""
    demos: list[Demonstration] = []
    skipped: dict[str, int] = {}
    too_long: list[tuple[str, str, int]] = []  # (question id, agent, prompt tokens)
    live = [_checked(workflow, "init_state", e, None, workflow.init_state, e) for e in examples]
    for _ in range(max_rounds):
        if not live:
            break
        pending: dict[str, list[State]] = {}
        for state in live:
            step = _checked(workflow, "next_agent", state.example, None, workflow.next_agent, state)
            if step is not None:
                pending.setdefault(step, []).append(state)
        live = []
        for step, states in pending.items():
            if workflow.is_tool(step):
                try:
                    results = workflow.call_tools(step, states)
                except Exception:  # again one state at a time: the error names its question
                    results = [
                        r
                        for state in states
                        for r in _checked(
                            workflow, "call_tools", state.example, step, workflow.call_tools, step, [state]
                        )
                    ]
                live.extend(r.state for r in results)
                continue
            for state in states:
                target = _checked(workflow, "demonstration", state.example, step, workflow.demonstration, state, step)
                if target is None:
                    skipped[f"skipped/{step}"] = skipped.get(f"skipped/{step}", 0) + 1
                    continue
                messages = _checked(workflow, "build_prompt", state.example, step, workflow.build_prompt, state, step)
                prompt = encode(messages)
                if len(prompt) > max_prompt_tokens:
                    too_long.append((state.example.id, step, len(prompt)))
                    skipped[f"skipped/{step}"] = skipped.get(f"skipped/{step}", 0) + 1
                    continue
                demos.append(Demonstration(state, step, prompt, encode_target(target), target))
                live.append(_checked(workflow, "apply", state.example, step, workflow.apply, state, step, target).state)
    if too_long:
        qid, agent, n = too_long[0]
        print(
            f"mhgpo: warning: {len(too_long)} demonstration(s) left out: their prompts are longer than "
            f"max_prompt_tokens={max_prompt_tokens} (the first: question {qid}, agent {agent}, {n} tokens)",
            file=sys.stderr,
            flush=True,
        )
    return demos, skipped


def _checked(workflow: Workflow, method: str, example: Example, agent: str | None, fn: Callable, *args: Any) -> Any:
    """`fn(*args)`, a method of `workflow` on a question; what it raises becomes a one-line `WorkflowError`."""
    try:
        return fn(*args)
    except Exception as e:
        raise WorkflowError(failure(workflow, method, example.id, agent, e).message()) from e


def target_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """Token ids of a gold output followed by the id that ends a generation (`<|im_end|>` when the vocabulary
    has it, else the EOS token), as the sampler records outputs."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if end is None or end == tokenizer.unk_token_id:
        end = tokenizer.eos_token_id

    def encode(text: str) -> list[int]:
        return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]] + [int(end)]

    return encode


def sft_loss(logp: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted cross-entropy of the output tokens: ``-sum_{i,t} mask * w_i * logp``.

    logp (B, T) log-probs of the gold tokens; mask (B, T); weights (B,) the step-wide token weights, so the
    micro-batches' losses add up to the step's whatever the cut.
    """
    return -(torch.where(mask, logp, torch.zeros((), dtype=logp.dtype)) * weights[:, None]).sum()  # ()


def format_accuracy(demos: list[Demonstration], workflow: Workflow, generator: Generator) -> dict[str, float]:
    """Greedy outputs on held-out demonstrations, per agent: `sft/<agent>/format_ok` (the workflow applies it with
    no penalty) and `sft/<agent>/exact` (equal to the gold output after answer normalisation); the final agent also
    gets `sft/<agent>/f1` against the gold answers."""
    out: dict[str, float] = {}
    for agent in dict.fromkeys(d.agent for d in demos):
        mine = [d for d in demos if d.agent == agent]
        params = SamplingParams(workflow.sampling(agent).max_new_tokens, 0.0, 1.0, agent)
        gens = generator.generate([d.prompt_ids for d in mine], params)
        ok = [
            _checked(workflow, "apply", d.state.example, agent, workflow.apply, d.state, agent, g.text).penalty == 0
            for d, g in zip(mine, gens)
        ]
        exact = [normalize_answer(g.text) == normalize_answer(d.target) for d, g in zip(mine, gens)]
        out[f"sft/{agent}/format_ok"] = float(np.mean(ok))
        out[f"sft/{agent}/exact"] = float(np.mean(exact))
        if agent == workflow.terminal_agent:
            f1 = [score(g.text, d.state.example.answers)["f1"] for d, g in zip(mine, gens)]
            out[f"sft/{agent}/f1"] = float(np.mean(f1))
    return out


def over_budget(demos: list[Demonstration], workflow: Workflow) -> dict[str, tuple[int, int, int]]:
    """Per agent, the demonstrations whose gold output (its stop token included) is longer than the agent's
    `max_new_tokens`: (how many, the longest, the budget). Sampling cuts such an output before its end, so a warm
    start that learns it teaches an output the agent cannot finish (a format break where the format closes)."""
    out: dict[str, tuple[int, int, int]] = {}
    for agent in dict.fromkeys(d.agent for d in demos):
        budget = workflow.sampling(agent).max_new_tokens
        longer = [len(d.target_ids) for d in demos if d.agent == agent and len(d.target_ids) > budget]
        if longer:
            out[agent] = (len(longer), max(longer), budget)
    return out


def warn_over_budget(demos: list[Demonstration], workflow: Workflow) -> dict[str, int]:
    """One warning line per agent with demonstrations longer than its budget (:func:`over_budget`); their counts."""
    found = over_budget(demos, workflow)
    for agent, (n, longest, budget) in found.items():
        total = sum(d.agent == agent for d in demos)
        print(
            f"mhgpo: warning: {n} of {total} {agent} demonstrations are longer than its max_new_tokens={budget} "
            f"(the longest {longest} tokens with its stop token): sampling cuts them before their end; raise the "
            f"{agent}'s max_new_tokens to at least {longest}",
            file=sys.stderr,
            flush=True,
        )
    return {agent: n for agent, (n, _, _) in found.items()}


def held_out(demos: list[Demonstration], per_agent: int) -> list[Demonstration]:
    """The first `per_agent` demonstrations of each agent."""
    counts: dict[str, int] = {}
    out = []
    for d in demos:
        if counts.get(d.agent, 0) < per_agent:
            counts[d.agent] = counts.get(d.agent, 0) + 1
            out.append(d)
    return out


class SFTTrainer(Trainer):
    """The supervised loop: `steps` optimiser steps of `batch_size` demonstrations each, in a seeded order that is
    reshuffled every pass over the data (per role with `balance_roles`); logging, validation, checkpoints, Ctrl-C
    and resume are the RL trainer's."""

    def __init__(
        self,
        cfg: SFTConfig,
        setup: TrainingSetup,
        run_dir: Path,
        demos: list[Demonstration],
        held: list[Demonstration],
        progress: bool = True,
        skipped: dict[str, int] | None = None,
    ):
        """`demos` train, `held` measure the format accuracy; `skipped`: per `skipped/<agent>`, the chains that
        stopped at that agent for want of a demonstration (`collect_demonstrations`)."""
        super().__init__(cfg, setup, run_dir, progress)  # type: ignore[arg-type]
        self.demos, self.held, self.skipped = demos, held, dict(skipped or {})
        roles = dict.fromkeys(d.agent for d in demos)  # in the team's order of first appearance
        self.by_role = [[d for d in demos if d.agent == r] for r in roles]

    def _next_demos(self) -> list[Demonstration]:
        """The next `batch_size` demonstrations. With `balance_roles`, the roles take turns (demonstration p of the
        run is of role p mod k), each role's demonstrations in their own seeded order reshuffled every pass over
        them, so every batch holds (almost) the same number of each role; else one seeded order over all of them."""
        out = []
        for _ in range(self.cfg.batch_size):
            if self.cfg.balance_roles:
                k = len(self.by_role)
                role, p = self.position % k, self.position // k
                pool = self.by_role[role]
                epoch, idx = divmod(p, len(pool))
                order = np.random.default_rng([self.cfg.seed, role, epoch]).permutation(len(pool))
            else:
                pool = self.demos
                epoch, idx = divmod(self.position, len(pool))
                order = np.random.default_rng([self.cfg.seed, epoch]).permutation(len(pool))
            out.append(pool[int(order[idx])])
            self.position += 1
        return out

    def collect(self) -> tuple[None, list[Sample], dict[str, float]]:
        batch = self._next_demos()
        samples = [Sample(d.prompt_ids, d.target_ids, [0.0] * len(d.target_ids), 0.0, d.agent) for d in batch]
        return None, samples, {"samples": float(len(samples))}

    def learn(self, samples: list[Sample], metrics: dict[str, float]) -> dict[str, float]:
        """One optimiser step (per-agent mean token NLL, grad norm); the held-out format accuracy when the step
        validates."""
        t0 = time.perf_counter()
        metrics.update(sft_update(self.setup.policy, samples, self.cfg.loss_weighting))
        metrics["seconds/train"] = time.perf_counter() - t0
        if self._evaluates_at(self.step + 1) and self.held:
            metrics.update(format_accuracy(self.held, self.setup.workflow, self.setup.generator))
        return metrics

    def _evaluates_at(self, step: int) -> bool:
        every = self.cfg.eval_every
        return (every > 0 and step % every == 0) or step == self.cfg.steps

    def _validates_at(self, step: int) -> bool:
        return bool(self.setup.val) and self._evaluates_at(step)

    def _saves_at(self, step: int) -> bool:
        every = self.cfg.save_every
        return (every > 0 and step % every == 0) or step == self.cfg.steps


def sft_weights(samples: list[Sample], weighting: str = "output") -> torch.Tensor:
    """(B,) per-token weights of one step's samples: `output`, the RL objective's (`token_weights`: each sample's
    token mean, its role's sample mean, the roles' mean); `token`, each role's tokens alike (``w_i = 1 / (n_roles *
    T_role)``, T_role the role's output tokens in the step), the roles' mean. Either way each role's weights add up
    to 1 / n_roles over its tokens."""
    agents, lengths = [s.agent for s in samples], [len(s.output_ids) for s in samples]
    if weighting == "output":
        return token_weights(agents, lengths)
    if weighting != "token":
        raise ValueError(f"unknown weighting {weighting!r}")
    tokens: dict[Any, int] = {}
    for agent, n in zip(agents, lengths):
        tokens[agent] = tokens.get(agent, 0) + n
    present = [a for a, n in tokens.items() if n > 0]
    return torch.tensor(
        [1.0 / (len(present) * tokens[a]) if tokens[a] > 0 else 0.0 for a in agents], dtype=torch.float32
    )


def sft_update(policy: Any, samples: list[Sample], weighting: str = "output") -> dict[str, float]:
    """One optimiser step of the weighted cross-entropy on `samples` (weighed as `weighting` says: `sft_weights`),
    accumulated over packed micro-batches."""
    weights = sft_weights(samples, weighting)  # (B,)
    nll: dict[str, list[float]] = {}
    policy.model.train()
    policy.optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for idx in micro_batches(
        samples, policy.cfg.micro_batch_tokens, by_agent=bool(policy.roles), share=policy.cfg.share_prefix
    ):
        mb = [samples[i] for i in idx]
        logp, mask = policy.logprobs(mb)  # (b, T) (b, T)
        loss = sft_loss(logp, mask, weights[idx].to(logp.device))
        loss.backward()
        total += float(loss.detach())
        with torch.no_grad():
            for row, s in enumerate(mb):
                n = int(mask[row].sum())
                nll.setdefault(s.agent, []).append(-float(logp[row, :n].sum()) / max(n, 1))
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.params, policy.cfg.max_grad_norm)
    check_finite(total, float(grad_norm))
    applied = policy.scheduler.get_last_lr()[0]  # this step's lr (the scheduler then moves to the next)
    policy.optimizer.step()
    policy.scheduler.step()
    out = {"loss": total, "grad_norm": float(grad_norm), "lr": applied}
    out.update({f"sft/{agent}/nll": float(np.mean(v)) for agent, v in nll.items()})
    out.update({f"sft/{agent}/samples": float(len(v)) for agent, v in nll.items()})
    return out
