"""Shared fixtures: a tiny Llama-architecture causal LM with a real ChatML tokenizer, built in-process.

Nothing is downloaded. The tokenizer is a byte-level BPE trained on a small in-memory text; the model
is randomly initialised with fixed seeds and then fitted for a few steps on ChatML dialogues, so that
it loads in well under a second, produces (nonsense) text and emits ``<|im_end|>`` now and then.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

_QA = [
    ("Who wrote the novel Dune?", "Frank Herbert"),
    ("What is the capital of France?", "Paris"),
    ("Which river flows through Cairo?", "the Nile"),
    ("When did the Berlin Wall fall?", "1989"),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci"),
    ("What is the largest planet?", "Jupiter"),
    ("Which element has the symbol Fe?", "iron"),
    ("Who discovered penicillin?", "Alexander Fleming"),
    ("In which country is Kyoto?", "Japan"),
    ("How many legs does a spider have?", "eight"),
]
_PROSE = (
    "Search the passages for the answer. The first agent rewrites the question into a query. "
    "The second agent selects the relevant passages. The third agent writes the final answer. "
    "Each document has a title and a text; the retriever returns the top passages for a query. "
)


def tiny_corpus() -> list[str]:
    """The ChatML dialogues and prose the tiny tokenizer and model are fitted on."""
    dialogues = [
        f"<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n"
        f"<|im_start|>assistant\nThe answer is {a}.<|im_end|>\n"
        for q, a in _QA
    ]
    return dialogues + [_PROSE * 2]


def build_tiny_model(
    folder: Path,
    seed: int = 0,
    train_steps: int = 60,
    hidden_size: int = 32,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 512,
) -> Path:
    """Build, briefly fit and save (``save_pretrained``) the tiny model and tokenizer into ``folder`` (vLLM's CPU
    attention wants heads of 32 dimensions or more: ``hidden_size=64, heads=2, kv_heads=1``)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from mhgpo.model.pretrained import CHATML_TEMPLATE

    texts = tiny_corpus()
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=TINY_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    plain = [t.replace("<|im_start|>", "").replace("<|im_end|>", "") for t in texts]
    bpe.train_from_iterator(plain, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for step in range(train_steps):
        seq = torch.tensor([ids[step % len(ids)]])  # (1, L)
        loss = model(input_ids=seq, labels=seq).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()

    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: runs the real default model")
    # The tiny models gain nothing from intra-op threads, and OpenMP threads spinning against other busy
    # processes slow them down by an order of magnitude. Subprocesses (CLI tests) inherit the variable.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Tests never download, and never write to the user's cache (subprocesses inherit both).
    os.environ["HF_HUB_OFFLINE"] = "1"
    if "MHGPO_CACHE" not in os.environ:
        import tempfile

        os.environ["MHGPO_CACHE"] = tempfile.mkdtemp(prefix="mhgpo-test-cache-")
    import torch

    torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the tiny model and tokenizer in the ``save_pretrained`` layout."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_lm(tiny_model_dir: Path):  # -> mhgpo.model.pretrained.LoadedModel
    """The tiny model loaded with :func:`mhgpo.model.trained.load_model` (CPU, float32), shared by the session:
    treat it as read-only; a test that trains or wraps a model loads its own copy from ``tiny_model_dir``."""
    from mhgpo.model.trained import load_model

    return load_model(str(tiny_model_dir), device="cpu")


@pytest.fixture(scope="session")
def default_lm():  # -> mhgpo.model.pretrained.LoadedModel
    """The embedded default model loaded once with :func:`mhgpo.model.trained.load_model` (CPU, float32) for the
    tests that read it: treat it as read-only. The GGUF file is de-quantised into the session's cache by the first
    load of the session (about 17 s on 2 cores); later loads, here or in a subprocess, read the copy (0.2 s)."""
    from mhgpo.model.pretrained import DEFAULT_MODEL
    from mhgpo.model.trained import load_model

    return load_model(DEFAULT_MODEL, device="cpu")


# --------------------------------------------------------------------- the shared world and reference run


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """The session's MHGPO_CACHE (indexes, the default world), offline."""
    mp = pytest.MonkeyPatch()
    folder = tmp_path_factory.mktemp("mhgpo-cache")
    mp.setenv("MHGPO_CACHE", str(folder))
    mp.setenv("HF_HUB_OFFLINE", "1")
    yield folder
    mp.undo()


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """A 40/10-question synthetic world, plus `train_echo.jsonl`: its train questions answered "assistant"."""
    from helpers import write_echo_world

    return write_echo_world(tmp_path_factory.mktemp("world"), seed=0, n_train=40, n_dev=10)


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, world: Path):
    """An uninterrupted 4-step MHGPO-RR run (checkpoint every step, keep 2, validation every 2 steps): the
    reference of the resume and fault tests, and the run the report and rollout-check tests read."""
    from helpers import make_config

    from mhgpo.run.pipeline import train

    out = tmp_path_factory.mktemp("runs") / "reference"
    cfg = make_config(tiny_model_dir, world, out)
    trainer = train(cfg, progress=False)
    return cfg, out, trainer


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, world: Path) -> Path:
    """A run of the reference config stopped after 2 of its 4 steps (checkpoints step_1 and step_2)."""
    from helpers import make_config

    from mhgpo.model.checkpoint import list_checkpoints
    from mhgpo.run.pipeline import train

    out = tmp_path_factory.mktemp("runs") / "two"
    train(make_config(tiny_model_dir, world, out, steps=2), progress=False)
    assert [p.name for p in list_checkpoints(out)] == ["step_1", "step_2"]
    return out


# ----------------------------------------------------------------------------------------- the command line


@pytest.fixture(scope="module")
def cli(cache_dir: Path):
    """`cli(*args)` runs `python -m mhgpo *args` from the repository root (as the README's commands do); `cwd=`
    another folder. Modules that run the command otherwise define a `cli` of their own."""
    import sys

    from helpers import REPO

    env = {
        **os.environ,
        "MHGPO_CACHE": str(cache_dir),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }

    def run(*args: object, cwd: Path = REPO) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "mhgpo", *map(str, args)],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    return run


# ------------------------------------------------------------------------------------------------ file systems


@pytest.fixture
def tmpfs(tmp_path: Path):
    """A real 2 MiB file system (tmpfs), to be filled up; skipped where it cannot be mounted (needs root; the
    patched-write tests cover a full disk elsewhere)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
