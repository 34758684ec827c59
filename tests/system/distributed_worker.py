"""One rank of the data-parallel tests (tests/system/test_distributed.py), also run as one process.

`python tests/system/distributed_worker.py CONFIG.json RECORDS.pkl OUT.pt [CONFIG.json RECORDS.pkl OUT.pt ...]`
(with WORLD_SIZE / RANK / MASTER_ADDR / MASTER_PORT set, as a launcher sets them) builds the trainer of each config
in turn, in one process per rank, replays the recorded rollout trees instead of sampling (each rank is given the
trees of its share of the step's questions) and runs one training step; it saves the step's metrics and the trained
weights afterwards.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

import mhgpo.rl.policy
from mhgpo.config import TrainConfig, load_config
from mhgpo.data.records import Example
from mhgpo.model.checkpoint import trainable_state
from mhgpo.model.distributed import current
from mhgpo.model.sharding import is_dtensor, is_sharded
from mhgpo.rl.trainer import Trainer
from mhgpo.rl.tree import RolloutBatch, merge_batches
from mhgpo.run.setup import build_training, settle

PLAIN_CUT = mhgpo.rl.policy.micro_batches  # the trainer's own cut, before a case replaces it


class Replay(Trainer):
    """A trainer that grows no trees: the recorded trees of the questions asked (one step's rollouts sampled once,
    as parts of consecutive questions) come back instead."""

    records: list[tuple[tuple[str, ...], RolloutBatch]] = []

    def _grow(self, questions: list[Example], rng: np.random.Generator) -> RolloutBatch:
        asked = tuple(q.id for q in questions)
        parts = [b for ids, b in self.records if set(ids) <= set(asked)]
        got = tuple(i for ids, b in self.records if set(ids) <= set(asked) for i in ids)
        if got != asked:
            raise AssertionError(f"no recorded trees for the questions {asked} (recorded: {got})")
        return merge_batches([copy.deepcopy(b) for b in parts])


def replay_step(cfg: TrainConfig, records: list[tuple[tuple[str, ...], RolloutBatch]]) -> dict[str, Any]:
    """One step of `cfg` on the recorded trees: its metrics and the trained weights (policy, and critic if any)."""
    job = settle(cfg, ranks=current())
    setup = build_training(job)
    trainer = Replay(job.cfg, setup, Path(cfg.output_dir), progress=False, ranks=job.ranks)
    trainer.records = records
    metrics = trainer.train_step()
    weights = {f"policy/{k}": v.clone() for k, v in trainable_state(setup.policy.model).items()}
    if setup.critic is not None:
        weights.update({f"critic/{k}": v.clone() for k, v in trainable_state(setup.critic.model).items()})
    groups = [(n.question_index, n.group_id) for n in trainer._last_batch.llm_nodes() if n.trained]
    return {
        "metrics": metrics,
        "weights": weights,
        "groups": groups,
        "rank": trainer.ranks.rank,
        "world": trainer.ranks.world,
        "sharded": is_sharded(setup.policy.model),
        "held": held(setup.policy.model),
        "held_reference": held(setup.policy.ref_model) if setup.policy.ref_model is not None else None,
    }


def held(model: torch.nn.Module) -> dict[str, float]:
    """The share of the decoder layers' and of the other weights that this rank holds (its shards, or whole)."""
    out = {"layers": [0, 0], "other": [0, 0]}
    for name, p in model.named_parameters():
        local = p.to_local() if is_dtensor(p) else p
        part = out["layers" if ".layers." in name else "other"]
        part[0] += local.numel()
        part[1] += p.numel()
    return {k: mine / total for k, (mine, total) in out.items()}


def cut_batches(out: str, singletons: bool) -> None:
    """This rank's update cuts its share as the trainer does, or (`singletons`) into one micro-batch per sample (the
    gradient does not depend on the cut); the number of micro-batches of its update goes to OUT.batchesRANK.json."""

    def cut(samples: list, *args: Any, **kwargs: Any) -> list[list[int]]:
        batches = [[i] for i in range(len(samples))] if singletons else PLAIN_CUT(samples, *args, **kwargs)
        Path(f"{out}.batches{os.environ['RANK']}.json").write_text(json.dumps(len(batches)))
        return batches

    mhgpo.rl.policy.micro_batches = cut


def main(*cases: str) -> int:
    """Each (CONFIG.json, RECORDS.pkl, OUT.pt) of `cases` in turn."""
    if not cases or len(cases) % 3:
        raise SystemExit("usage: distributed_worker.py CONFIG.json RECORDS.pkl OUT.pt [CONFIG RECORDS OUT ...]")
    for config, records, out in zip(cases[::3], cases[1::3], cases[2::3]):
        if "SINGLETON_BATCHES_ON_RANK" in os.environ:
            cut_batches(out, singletons=os.environ["RANK"] == os.environ["SINGLETON_BATCHES_ON_RANK"])
        cfg = load_config(TrainConfig, None, json.loads(Path(config).read_text()))
        with open(records, "rb") as f:
            recorded = pickle.load(f)
        torch.save(replay_step(cfg, recorded), out)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
