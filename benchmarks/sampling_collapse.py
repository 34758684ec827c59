"""Where a run's sampling stopped exploring: from its rollout files, and token by token from a model's greedy outputs.

`--run RUN --windows 1-12,49-60`: over each window of steps, per role, the advantage groups of two or more trained
samples (the rollout files' `group_id`), the share whose outputs are the same text, the share whose rewards are all
equal (no gradient), and the share with equal rewards but different outputs (samples that differ in ways the reward
does not see). A run logs the first two per step as `ROLE/identical_groups` and, through `ROLE/informative`, the
second; this reads runs of any age.

`--model MODEL --config RUN/config.yaml [--questions 48]`: the team of MODEL (a run, one of its checkpoints, a warm
start) answers the first training questions of that config greedily, one thread; per role, each output token's π
(under greedy decoding, the top token's, at temperature 1), the shares of tokens with π at or above 0.9 / 0.99 /
0.999, and what sampling would give at temperature 1: P(a sample is the greedy output) and P(a group of 4 samples
is all greedy output), at top-p 0.9 (a token whose π reaches 0.9 is the nucleus alone; below it the nucleus's mass
is taken as 0.9) and at top-p 1.

    python benchmarks/sampling_collapse.py --run RUN --windows 1-12,49-60,97-109
    python benchmarks/sampling_collapse.py --model RUN/checkpoints/step_N --config RUN/config.yaml

docs/learning.md ("Learning curves at length") has its figures for MHGPO-RR seed 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def windows_of(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.append((int(lo), int(hi or lo)))
    return out


def rollout_groups(run: Path, windows: list[tuple[int, int]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per window (``"lo-hi"``) and role: groups, identical, equal_rewards, equal_but_different (shares)."""
    from mhgpo.io import read_jsonl
    from mhgpo.run.report import load_run

    files = load_run(run).rollout_files  # rollouts/step_N.jsonl, in step order
    if not files:
        raise SystemExit(f"{run}: no rollout files (rollouts/step_*.jsonl)")
    out: dict[str, dict[str, dict[str, float]]] = {}
    for lo, hi in windows:
        counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        for path in files:
            if not lo <= int(path.stem[5:]) <= hi:
                continue
            groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
            for node in read_jsonl(path)[0]:
                if node.get("kind") == "llm" and node.get("trained") and node.get("group_id", -1) >= 0:
                    groups[(node["question_id"], node["group_id"])].append(node)
            for members in groups.values():
                if len(members) < 2:
                    continue
                c = counts[members[0]["agent"]]
                same = len({m["output"] for m in members}) == 1
                equal = max(m["reward"] for m in members) - min(m["reward"] for m in members) < 1e-9
                c[0] += 1
                c[1] += same
                c[2] += equal
                c[3] += equal and not same
        out[f"{lo}-{hi}"] = {
            agent: {
                "groups": c[0],
                "identical": c[1] / c[0],
                "equal_rewards": c[2] / c[0],
                "equal_but_different": c[3] / c[0],
            }
            for agent, c in sorted(counts.items())
        }
    return out


def greedy_sharpness(model: str, config: Path, questions: int, overrides: list[str]) -> dict[str, dict[str, float]]:
    """Per role: the π of each token of its greedy outputs on the first ``questions`` training questions."""
    import numpy as np
    import torch

    from mhgpo.config import TrainConfig, load_config
    from mhgpo.rl.rollout import run_rollouts
    from mhgpo.rl.trainer import Trainer
    from mhgpo.run.setup import build_training, settle

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            TrainConfig,
            config,
            [
                f"model={model}",
                "warm_start.enabled=false",
                "eval_every=0",
                "report_to=[]",
                f"output_dir={tmp}/run",
                "budget_minutes=null",
                *overrides,
            ],
        )
        job = settle(cfg)
        setup = build_training(job)
        spec = dataclasses.replace(Trainer(job.cfg, setup, job.run_dir, progress=False)._spec(), greedy=True)
        batch = run_rollouts(
            setup.train[:questions],
            setup.workflow,
            setup.generator,
            setup.encode,
            spec,
            np.random.default_rng(0),
            on_error="skip",
        )
    out = {}
    for agent in setup.workflow.agents:
        nodes = [n for n in batch.llm_nodes() if n.agent == agent and n.logprobs]
        if not nodes:
            continue
        pi = np.exp(np.concatenate([np.asarray(n.logprobs, dtype=np.float64) for n in nodes]))  # (tokens,)
        at_09 = np.array([np.prod([1.0 if p >= 0.9 else p / 0.9 for p in np.exp(n.logprobs)]) for n in nodes])
        at_10 = np.array([np.exp(np.sum(n.logprobs)) for n in nodes])
        out[agent] = {
            "outputs": len(nodes),
            "tokens": int(pi.size),
            "pi_mean": float(pi.mean()),
            "pi_at_least_0.9": float((pi >= 0.9).mean()),
            "pi_at_least_0.99": float((pi >= 0.99).mean()),
            "pi_at_least_0.999": float((pi >= 0.999).mean()),
            "greedy_sample_top_p_0.9": float(at_09.mean()),
            "group_of_4_greedy_top_p_0.9": float((at_09**4).mean()),
            "greedy_sample_top_p_1": float(at_10.mean()),
            "group_of_4_greedy_top_p_1": float((at_10**4).mean()),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, help="a run directory with rollout files")
    parser.add_argument("--windows", default="1-12", help="step windows, e.g. 1-12,49-60")
    parser.add_argument("--model", help="a run, checkpoint or model whose greedy outputs are read")
    parser.add_argument("--config", type=Path, help="the run config whose training questions and team to use")
    parser.add_argument("--questions", type=int, default=48)
    parser.add_argument("overrides", nargs="*", help="key=value overrides of --config")
    args = parser.parse_args()
    if args.run is None and args.model is None:
        parser.error("give --run RUN, or --model MODEL --config CONFIG, or both")
    result = {}
    if args.run is not None:
        result["rollouts"] = rollout_groups(args.run, windows_of(args.windows))
    if args.model is not None:
        if args.config is None:
            parser.error("--model needs --config (a run's config.yaml)")
        result["greedy"] = {
            "model": args.model,
            **greedy_sharpness(args.model, args.config, args.questions, args.overrides),
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
