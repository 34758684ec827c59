"""Helpers shared by the test modules (the shared fixtures are in conftest.py; the fakes that rollouts run on without a
model are in fakes.py)."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mhgpo.cli.main import main
from mhgpo.config import TrainConfig, load_config
from mhgpo.data.records import Passage
from mhgpo.model.logprobs import output_logprobs
from mhgpo.rl.policy import Sample
from mhgpo.runtime.runlog import read_metrics

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


# --------------------------------------------------------------------------------------------------- runs compared


def assert_same_run(
    run: Path, reference: Path, upto: int | None = None, unlogged: dict[int, str] | None = None
) -> None:
    """`run` logged, recorded and saved what `reference` did (in its first `upto` steps); `unlogged`: {step: key
    prefix} of what `run` did not log at that step (a validation that failed)."""
    got, want = comparable(read_metrics(run)), comparable(read_metrics(reference))
    want = [w for w in want if upto is None or w["step"] <= upto]
    cut = unlogged or {}
    want = [{k: v for k, v in w.items() if not (w["step"] in cut and k.startswith(cut[w["step"]]))} for w in want]
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        diff = {k: (g.get(k), w.get(k)) for k in set(g) | set(w) if g.get(k) != w.get(k)}
        assert diff == {}, f"step {w['step']} differs: {diff}"
    for w in want:
        name = f"step_{w['step']:06d}.jsonl"
        assert (run / "rollouts" / name).read_bytes() == (reference / "rollouts" / name).read_bytes(), name
    from safetensors.torch import load_file

    final = f"checkpoints/step_{want[-1]['step']}/model.safetensors"
    a, b = load_file(str(run / final)), load_file(str(reference / final))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------------------ MAPPO runs


@pytest.fixture(scope="module")
def mappo_world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small synthetic world whose train answers are "assistant" (what the tiny model says), so rewards vary: the
    world of the MAPPO runs, imported as `world` (module scope)."""
    return write_echo_world(tmp_path_factory.mktemp("world"), seed=0, n_train=20, n_dev=4)


def mappo_config(model_dir: Path, world: Path, out: Path, **extra: object) -> TrainConfig:
    settings: dict[str, object] = {
        "model": model_dir,
        "algo": "mappo",
        "data": f"hotpotqa:{world / 'train_echo.jsonl'}",
        "val_data": f"hotpotqa:{world / 'dev.jsonl'}",
        "retrieval.corpus": world / "corpus.jsonl",
        "output_dir": out,
        "steps": 3,
        "questions_per_step": 2,
        "group_size": 2,
        "eval_every": 0,
        "save_every": 1,
        "keep_checkpoints": 3,
        "search.rewriter.max_new_tokens": 8,
        "search.reranker.max_new_tokens": 4,
        "search.answerer.max_new_tokens": 4,
        "search.max_answer_words": 1,
        "optim.lr": 0.01,
        "lora.r": 4,
        "critic.lr": 0.01,
        "critic.warmup_steps": 1,
    }
    settings.update(extra)
    return load_config(TrainConfig, None, [f"{k}={v}" for k, v in settings.items()])


# ------------------------------------------------------------------------------- the command line, in this process


def cli(capsys, *args: object) -> tuple[int, str, str]:
    """`mhgpo ARGS` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def mhgpo_main(*args: object) -> int:
    """`mhgpo ARGS` in this process: its exit status."""
    return main([str(a) for a in args])


def assert_one_line_error(rc: int, err: str, pattern: str) -> None:
    import re

    assert rc == 2, err
    assert "Traceback" not in err
    # less the progress bars and the announced precision (printed once the model has loaded)
    lines = [
        line
        for line in err.strip().splitlines()
        if line.strip() and "%|" not in line and not line.startswith("mhgpo: precision ")
    ]
    assert len(lines) == 1 and lines[0].startswith("mhgpo: error: "), err
    assert re.search(pattern, lines[0]), lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    """The bytes of every file under `folder`, by relative path."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------------------------ two ranks through accelerate


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    out: Path,
    tiny_model_dir,
    world,
    *extra: str,
    resume: bool = False,
    config: str = "cpu_ddp.yaml",
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """`accelerate launch --config_file configs/accelerate/cpu_ddp.yaml -m mhgpo train ...` (2 ranks, gloo);
    `config`: another of configs/accelerate (cpu_fsdp.yaml); `env`: more environment variables."""
    args = (
        ["--resume", str(out), *extra]
        if resume
        else [
            *train_overrides(
                tiny_model_dir,
                world,
                out,
                questions_per_step=4,
                steps=4,
                eval_every=2,
                val_limit=4,
                save_every=1,
                keep_checkpoints=4,
            ),
            *extra,
        ]
    )
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "configs" / "accelerate" / config),
        "--main_process_port",
        str(free_port()),
        "-m",
        "mhgpo",
        "train",
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    return subprocess.Popen(
        cmd, env=env, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )  # its own process group, as a terminal's foreground job


# ------------------------------------------------------------------------------------------------ training by hand


DIALOGUES = [  # (agent, question, output, advantage, offset of the sampling log-probs)
    ("rewriter", "Who wrote the novel Dune?", "### Dune novel author ###", 1.0, 0.0),
    ("rewriter", "Who wrote the novel Dune?", "### Frank Herbert ###", -1.0, 0.3),
    ("reranker", "Which river flows through Cairo?", "Document0 Document2", 0.5, -0.3),
    ("answerer", "What is the capital of France?", "The answer is Paris.", 1.5, 0.0),
    ("answerer", "What is the capital of France?", "Jupiter", -0.7, 0.3),
    ("answerer", "What is the largest planet?", "The answer is Jupiter, the largest planet.", -1.2, 0.0),
]


def fresh_model(model_dir: Path):
    """The tiny model loaded afresh (CPU, float32): a copy of its own to train or wrap."""
    from mhgpo.model.trained import load_model

    return load_model(str(model_dir), device="cpu")


def hand_samples(loaded, offsets: bool = False) -> list[Sample]:
    """Samples of several agents and lengths, with their sampling log-probs taken from the model itself
    (plus a per-sample offset when `offsets`, so that some ratios leave the clip range)."""
    from mhgpo.model.pretrained import encode_chat

    tok = loaded.tokenizer
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for _, q, _, _, _ in DIALOGUES]
    outputs = [tok(o, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for _, _, o, _, _ in DIALOGUES]
    with torch.no_grad():
        logp, _ = output_logprobs(loaded.model, prompts, outputs, pad_id=tok.pad_token_id)  # (N, T)
    return [
        Sample(p, o, [float(x) + (off if offsets else 0.0) for x in logp[i, : len(o)]], adv, agent, 1.0)
        for i, (p, o, (agent, _, _, adv, off)) in enumerate(zip(prompts, outputs, DIALOGUES))
    ]


def param_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter of `model`, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def count_forward_calls(module: torch.nn.Module) -> list[int]:
    """A counter of `module`'s forward calls, a checkpoint's recomputation in the backward pass included (the
    counter wraps `forward` itself: module hooks do not run again when a checkpoint recomputes)."""
    calls = [0]
    forward = module.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    module.forward = counted
    return calls


def ragged(seed: int = 0):
    """Four prompts and outputs of random token ids and ragged lengths (a 1-token prompt, a 1-token output)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, 400) for _ in range(n)] for n in (7, 1, 12, 4)]
    outputs = [[rng.randrange(0, 400) for _ in range(n)] for n in (5, 9, 1, 3)]
    return prompts, outputs


def samples_of(prompts, outputs, rewards=(1.0, -0.5, 0.25, 0.0), agents=("a", "a", "b", "c")) -> list[Sample]:
    """Samples of the prompts and outputs (log-probs 0) with the rewards a critic learns from."""
    rows = zip(prompts, outputs, rewards, agents)
    return [Sample(p, o, [0.0] * len(o), 0.0, agent, reward=r) for p, o, r, agent in rows]


# --------------------------------------------------------------------------- data files in the benchmarks' layouts


def hotpot_record(qid: str = "q-1", **overrides: object) -> dict:
    """A small HotpotQA-layout record: 3 paragraphs (fewer than the usual 10), one title repeated."""
    record: dict = {
        "_id": qid,
        "question": "Which city hosts the museum founded by Ada Stone?",
        "answer": "Lisbon",
        "type": "bridge",
        "supporting_facts": [["Ada Stone", 0], ["Ada Stone", 1], ["Stone Museum", 0]],
        "context": [
            ["Ada Stone", [" Ada Stone was a painter.", " She founded the Stone Museum."]],
            ["Stone Museum", ["The Stone Museum is in Lisbon.", "It opened in 1901."]],
            ["Ada Stone", [" Ada Stone was born in 1850."]],
        ],
    }
    record.update(overrides)
    return record


def write_lines(path: Path, lines: list[str]) -> Path:
    """`lines` as the lines of a text file (each ends with a newline)."""
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_jsonl(path: Path, rows: list) -> Path:
    """`rows` as JSON Lines (a row that is a string is written as it is)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def twowiki_record(qid: str = "2w-1", **overrides: object) -> dict:
    """A 2WikiMultihopQA record of the later release (entity_ids, evidences_id, answer_id): a title repeated in
    `context` with the same text, and a supporting fact whose sentence index is past its paragraph's end."""
    record: dict = {
        "_id": qid,
        "type": "compositional",
        "question": "Where was the father of Carl Brant buried?",
        "context": [
            ["Carl Brant", ["Carl Brant (1870-1930) was a judge.", "His father was Otto Brant."]],
            ["Otto Brant", ["Otto Brant was a sailor.", "He was buried in Kiel."]],
            ["Kiel Harbour", ["Kiel Harbour is a port."]],
            ["Carl Brant", ["Carl Brant (1870-1930) was a judge.", "His father was Otto Brant."]],
        ],
        "supporting_facts": [["Carl Brant", 1], ["Otto Brant", 1], ["Otto Brant", 7]],
        "evidences": [["Carl Brant", "father", "Otto Brant"], ["Otto Brant", "place of burial", "Kiel"]],
        "answer": "Kiel",
        "entity_ids": "Q1_Q2",
        "evidences_id": [["Q1", "father", "Q2"], ["Q2", "place of burial", "Q3"]],
        "answer_id": "Q3",
    }
    record.update(overrides)
    return record


def musique_record(qid: str = "2hop__1_2", answerable: bool = True, **overrides: object) -> dict:
    """A MuSiQue record: two paragraphs share the title "Lumen Valley" (only one supports), aliases given."""
    record: dict = {
        "id": qid,
        "paragraphs": [
            {
                "idx": 0,
                "title": "Lumen Valley",
                "paragraph_text": "Lumen Valley is a wine region.",
                "is_supporting": False,
            },
            {
                "idx": 1,
                "title": "Ostrava Mills",
                "paragraph_text": "Ostrava Mills lies in Lumen Valley.",
                "is_supporting": True,
            },
            {
                "idx": 2,
                "title": "Lumen Valley",
                "paragraph_text": "The seat of Lumen Valley is Pella.",
                "is_supporting": True,
            },
        ],
        "question": "What is the seat of the region where Ostrava Mills lies?",
        "question_decomposition": [
            {"id": 1, "question": "Ostrava Mills >> located in", "answer": "Lumen Valley", "paragraph_support_idx": 1},
            {"id": 2, "question": "#1 >> seat", "answer": "Pella", "paragraph_support_idx": 2},
        ],
        "answer": "Pella",
        "answer_aliases": ["Pella town", "Pella"],
        "answerable": answerable,
    }
    record.update(overrides)
    return record


# ------------------------------------------------------------------------------------------------------- retrieval


# A small corpus that the retrievers' tests search.
CORPUS = [
    Passage("p0", "Ada Stone", "Ada Stone was a painter who founded the Stone Museum."),
    Passage("p1", "Stone Museum", "The Stone Museum is an art museum in Lisbon, opened in 1901."),
    Passage("p2", "Lisbon", "Lisbon is the capital of Portugal."),
    Passage("p3", "Marlow Finch", "Marlow Finch composed the Glass Harbor symphony."),
    Passage("p4", "Glass Harbor", "Glass Harbor is a symphony premiered in Oslo."),
    Passage("p5", "Oslo", "Oslo is the capital of Norway."),
    Passage("p6", "Zeppelin Quartz", "A rare mineral found only near Tromso."),
]


def long_prompts() -> list[list[int]]:
    """16 prompts of 700 token ids of the tiny model's vocabulary: 11,200 tokens in all, more than a vLLM engine
    step's prefill budget (4,096 tokens for the tiny model)."""
    import random

    rng = random.Random(0)
    return [[rng.randrange(5, 300) for _ in range(700)] for _ in range(16)]
