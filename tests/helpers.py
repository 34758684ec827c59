"""Helpers shared by the test modules (the shared fixtures are in conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

from mhgpo.config import TrainConfig, load_config

REPO = Path(__file__).resolve().parents[1]
VOLATILE = ("seconds/", "memory/")  # wall-clock and memory: the only metrics that may differ between runs


def write_echo_world(folder: Path, seed: int, n_train: int, n_dev: int) -> Path:
    """A synthetic world in `folder`, plus `train_echo.jsonl`: its train questions answered "assistant" (what the
    tiny model mostly says, so the leaves' F1 differs within groups and advantages are non-zero)."""
    from mhgpo.data.synth_files import write_world

    paths = write_world(folder, seed=seed, n_train=n_train, n_dev=n_dev)
    rows = [json.loads(line) for line in paths["train"].read_text(encoding="utf-8").splitlines()]
    for row in rows:
        row["answer"] = "assistant"
    (folder / "train_echo.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return folder


def train_overrides(model_dir: Path, world: Path, out: Path, **extra: object) -> list[str]:
    settings: dict[str, object] = {
        "model": model_dir,
        "data": f"hotpotqa:{world / 'train_echo.jsonl'}",
        "val_data": f"hotpotqa:{world / 'dev.jsonl'}",
        "retrieval.corpus": world / "corpus.jsonl",
        "output_dir": out,
        "sampler": "rr",
        "steps": 4,
        "questions_per_step": 2,
        "group_size": 2,
        "eval_every": 2,
        "val_limit": 2,
        "save_every": 1,
        "keep_checkpoints": 2,
        "search.rewriter.max_new_tokens": 8,
        "search.reranker.max_new_tokens": 4,
        "search.answerer.max_new_tokens": 4,
        "search.max_answer_words": 1,
        "optim.lr": 0.01,
        "lora.r": 4,
    }
    settings.update(extra)
    return [f"{k}={v}" for k, v in settings.items()]


def make_config(model_dir: Path, world: Path, out: Path, **extra: object) -> TrainConfig:
    return load_config(TrainConfig, None, train_overrides(model_dir, world, out, **extra))


def comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def training_setup(cfg: TrainConfig, with_val: bool = False):
    """The `TrainingSetup` of `cfg`, settled and built by the composition root (`mhgpo.run.setup`)."""
    from mhgpo.run.setup import build_training, settle

    return build_training(settle(cfg), with_val=with_val)


def trainer_for(cfg: TrainConfig, run_dir: Path | None = None, progress: bool = False):
    """A `Trainer` of `cfg` (settled and built by the composition root) writing into `run_dir` (default: the
    config's `output_dir`)."""
    from mhgpo.rl.trainer import Trainer
    from mhgpo.run.setup import build_training, settle

    job = settle(cfg)
    return Trainer(job.cfg, build_training(job), Path(run_dir or job.cfg.output_dir), progress=progress)
