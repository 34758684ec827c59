"""Trained runs as models, on the tiny model: a 2-step LoRA run and a 2-step full fine-tuning run loaded from their
run directory and checkpoints, exported (merged, and as a PEFT adapter), evaluated three ways with the same results,
used as the initial weights of a new run (chains, moved folders, the reference policy), and refused with one line
when the run directory is empty, belongs to another base model or holds a damaged file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY_SPECIAL_TOKENS
from helpers import hand_samples, training_setup
from helpers import make_config as _make_config
from safetensors.torch import load_file

from mhgpo.cli.main import main
from mhgpo.config import TrainConfig, load_config
from mhgpo.model.logprobs import output_logprobs
from mhgpo.model.pretrained import CHATML_TEMPLATE, encode_chat
from mhgpo.model.trained import load_model
from mhgpo.rl.policy import Sample
from mhgpo.rl.trainer import Trainer
from mhgpo.run.pipeline import resume, train


def make_config(*args: object, **extra: object):
    """The trainer tests' config in fp32: the comparisons below are exact to 1e-5."""
    return _make_config(*args, **{"precision": "fp32", **extra})


SMALL_SEARCH = [
    "search.rewriter.max_new_tokens=8",
    "search.reranker.max_new_tokens=4",
    "search.answerer.max_new_tokens=4",
    "search.max_answer_words=1",
]
TOL = 1e-5
PAD = TINY_SPECIAL_TOKENS.index("<|pad|>")  # the tiny tokenizer's pad id
LAYER_MODULES = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]


@dataclass
class TrainedRun:
    kind: str  # lora | full
    path: Path
    trainer: Trainer


def _train(tiny_model_dir: Path, world: Path, out: Path, **extra: object) -> TrainedRun:
    trainer = train(make_config(tiny_model_dir, world, out, steps=2, **extra), progress=False)
    return TrainedRun("full" if extra.get("lora.enabled") == "false" else "lora", out, trainer)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_dir, world) -> TrainedRun:
    return _train(tiny_model_dir, world, tmp_path_factory.mktemp("runs") / "lora")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_model_dir, world) -> TrainedRun:
    return _train(tiny_model_dir, world, tmp_path_factory.mktemp("runs") / "full", **{"lora.enabled": "false"})


@pytest.fixture(params=["lora", "full"])
def run(request) -> TrainedRun:
    return request.getfixturevalue(f"{request.param}_run")


@pytest.fixture(scope="module")
def samples(tiny_model_dir) -> list[Sample]:
    """Fixed prompts and outputs of several agents, whose log-probs every way of loading a model must agree on."""
    return hand_samples(load_model(str(tiny_model_dir), device="cpu"))


def logprobs(model: torch.nn.Module, samples: list[Sample]) -> torch.Tensor:
    """The log-probs of every sample's output tokens, concatenated (1-D, float32)."""
    with torch.no_grad():
        logp, mask = output_logprobs(
            model, [s.prompt_ids for s in samples], [s.output_ids for s in samples], pad_id=PAD
        )
    return logp[mask.bool()]


def trained_logprobs(r: TrainedRun, samples: list[Sample]) -> torch.Tensor:
    """Log-probs under the trainer's own final model (LoRA unmerged, or the fully fine-tuned weights)."""
    return logprobs(r.trainer.setup.policy.model, samples)


def assert_close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> None:
    assert a.shape == b.shape and float((a - b).abs().max()) <= tol, float((a - b).abs().max())


@pytest.fixture
def cli(capsys, cache_dir):  # noqa: F811 - the fixture imported above
    """`cli(*args)` runs `mhgpo *args` in this process; returns (exit status, stdout, stderr)."""

    def call(*args: object) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return code, out, err

    return call


# ------------------------------------------------------------------------------------------------- loading


def test_a_run_and_its_checkpoints_load_the_trained_weights(run, samples, tiny_model_dir) -> None:
    trained = trained_logprobs(run, samples)
    base = logprobs(load_model(str(tiny_model_dir), device="cpu").model, samples)
    assert float((trained - base).abs().max()) > 1e-2  # the run has moved away from its base
    latest = load_model(run.path, device="cpu")
    assert latest.name == f"{run.kind}/step_2" and latest.trained.last.step == 2
    assert latest.trained.base == str(tiny_model_dir) and not hasattr(latest.model, "peft_config")
    assert_close(logprobs(latest.model, samples), trained)
    assert_close(logprobs(load_model(run.path / "checkpoints" / "step_2", device="cpu").model, samples), trained)
    step1 = load_model(run.path / "checkpoints" / "step_1", device="cpu")
    assert step1.trained.last.step == 1
    assert float((logprobs(step1.model, samples) - trained).abs().max()) > 1e-3


# ------------------------------------------------------------------------------------------------- export


@pytest.fixture
def exported(run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / f"{run.kind}-model"
    code = main(["export", str(run.path), "--out", str(out)])
    assert code == 0
    return out


def test_export_writes_a_plain_model_folder_with_a_card(run, exported, tiny_model_dir, cli) -> None:
    assert sorted(p.name for p in exported.iterdir()) == [
        "README.md",
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "mhgpo_team.yaml",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert not list(exported.parent.glob(".*tmp*"))
    import yaml

    tree = yaml.safe_load((run.path / "config.yaml").read_text())
    team = yaml.safe_load((exported / "mhgpo_team.yaml").read_text())
    assert team == {k: tree[k] for k in ("system", "team", "search", "max_prompt_tokens")}
    config = json.loads((exported / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    generation = json.loads((exported / "generation_config.json").read_text())
    assert generation == {
        "bos_token_id": 1,
        "eos_token_id": [2],
        "pad_token_id": PAD,  # no decoding settings
        "transformers_version": generation["transformers_version"],
    }
    assert (exported / "chat_template.jinja").read_text() == CHATML_TEMPLATE
    assert json.loads((exported / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    card = (exported / "README.md").read_text()
    val = [r for r in map(json.loads, (run.path / "metrics.jsonl").read_text().splitlines()) if "val/f1" in r][-1]
    assert f"| base model | `{tiny_model_dir}` |" in card
    assert f"| run | `{run.kind}`, checkpoint step 2 |" in card
    assert "MHGPO-RR on system `mas`, 2 steps × 2 questions, G=2" in card
    assert ("LoRA r=4" in card) == (run.kind == "lora") and ("full fine-tuning" in card) == (run.kind == "full")
    assert ("LoRA merged into the base weights" in card) == (run.kind == "lora")
    assert f"F1 {val['val/f1']:.1f}, EM {val['val/em']:.1f}, Acc {val['val/acc']:.1f} at step 2" in card
    before = {p.name: p.stat().st_mtime_ns for p in exported.iterdir()}
    code, stdout, stderr = cli("export", run.path, "--out", exported)  # never over an existing folder
    assert (code, stdout, stderr.strip()) == (2, "", f"mhgpo: error: {exported}: already exists; pick another --out")
    assert {p.name: p.stat().st_mtime_ns for p in exported.iterdir()} == before


def test_exported_weights_differ_from_the_base_in_exactly_the_trained_modules(run, exported, tiny_model_dir) -> None:
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    mine = load_file(str(exported / "model.safetensors"))
    assert mine.keys() == base.keys() and all(mine[k].dtype == torch.float32 for k in mine)
    changed = {k for k in base if not torch.equal(base[k], mine[k])}
    if run.kind == "lora":
        assert changed == {f"model.layers.{i}.{m}.weight" for i in range(2) for m in LAYER_MODULES}
    else:
        assert changed == set(base)


def test_a_bfloat16_export_is_the_float32_export_rounded(run, exported, tmp_path) -> None:
    out = tmp_path / "bf16"
    assert main(["export", str(run.path), "--out", str(out), "--dtype", "bfloat16"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    half, full = load_file(str(out / "model.safetensors")), load_file(str(exported / "model.safetensors"))
    assert half.keys() == full.keys() and all(t.dtype == torch.bfloat16 for t in half.values())
    assert [k for k, value in full.items() if not torch.equal(half[k], value.to(torch.bfloat16))] == []  # rounded once


NO_MHGPO = r"""
import json, sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name == "mhgpo" or name.startswith("mhgpo."):
            raise ImportError("mhgpo is blocked")
sys.meta_path.insert(0, Blocker())
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, messages, output = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
tok = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder).eval()
text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
prompt = tok(text, add_special_tokens=False)["input_ids"]
with torch.no_grad():
    logits = model(torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1).gather(1, torch.tensor(output)[:, None])[:, 0]
    greedy = model.generate(torch.tensor([prompt]), max_new_tokens=12)[0, len(prompt):].tolist()
print(json.dumps({"prompt": prompt, "logprobs": logp.tolist(), "greedy": greedy,
                  "mhgpo": [m for m in sys.modules if m.startswith("mhgpo")]}))
"""


def test_transformers_alone_loads_the_export_and_agrees_with_the_run(run, exported, samples, tmp_path) -> None:
    from mhgpo.model.generation import HFGenerator, SamplingParams

    loaded = load_model(run.path, device="cpu")
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Who wrote Dune?"}]
    output = samples[3].output_ids
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        [sys.executable, "-c", NO_MHGPO, str(exported), json.dumps(messages), json.dumps(output)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["mhgpo"] == []
    prompt = encode_chat(loaded.tokenizer, messages)
    assert got["prompt"] == prompt
    mine = logprobs(loaded.model, [Sample(prompt, output, [], 0.0, "answerer")])
    assert_close(torch.tensor(got["logprobs"]), mine)
    [greedy] = HFGenerator(loaded.model, loaded.tokenizer).generate([prompt], SamplingParams(12, temperature=0.0))
    assert got["greedy"] == greedy.output_ids


def test_eval_of_the_run_of_the_export_and_of_transformers_loading_agree(run, exported, world, cli, tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mhgpo.config import EvalConfig
    from mhgpo.model.generation import HFGenerator
    from mhgpo.rl.evaluation import evaluate_examples
    from mhgpo.team.build import build_workflow, load_examples

    data = f"hotpotqa:{world / 'dev.jsonl'}"
    # fp32 like the direct evaluation below (`auto` may be bf16-mixed, whose rounding differs by CPU)
    args = ["--data", data, "--corpus", world / "corpus.jsonl", "--limit", 4, *SMALL_SEARCH, "precision=fp32"]
    assert cli("eval", "--model", run.path, "--output-dir", tmp_path / "run", *args)[0] == 0
    assert cli("eval", "--model", exported, "--output-dir", tmp_path / "export", *args)[0] == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert (metrics["model"], metrics["step"]) == (str(run.path), 2)
    assert metrics["checkpoint"] == str(run.path / "checkpoints" / "step_2")
    from mhgpo.run.report import load_run, results_table

    assert results_table([load_run(tmp_path / "run")])[1][0][0] == f"run / eval ({run.kind} step 2)"
    assert "checkpoint" not in json.loads((tmp_path / "export" / "metrics.json").read_text())

    tok = AutoTokenizer.from_pretrained(exported)
    model = AutoModelForCausalLM.from_pretrained(exported).eval()

    def encode(messages):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]

    cfg = load_config(EvalConfig, None, [f"retrieval.corpus={world / 'corpus.jsonl'}", *SMALL_SEARCH])
    workflow = build_workflow("mas", data, cfg.retrieval, cfg.search)
    direct = evaluate_examples(load_examples(data, 4), workflow, HFGenerator(model, tok), encode, progress=False)
    rows = {
        name: [json.loads(line) for line in (tmp_path / name / "predictions.jsonl").read_text().splitlines()]
        for name in ("run", "export")
    }
    for name, predictions in rows.items():
        assert [p["trace"] for p in predictions] == [p["trace"] for p in direct.predictions], name
        assert [p["prediction"] for p in predictions] == [p["prediction"] for p in direct.predictions], name


def test_lora_only_export_loads_with_peft(lora_run, full_run, samples, tiny_model_dir, tmp_path, cli) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "adapter"
    code, stdout, _ = cli("export", lora_run.path, "--out", out, "--lora-only")
    assert code == 0 and "PEFT adapter" in stdout
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_model_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out).eval()
    assert_close(logprobs(model, samples), trained_logprobs(lora_run, samples))

    code, stdout, stderr = cli("export", full_run.path, "--out", tmp_path / "none", "--lora-only")
    assert (code, stdout) == (2, "") and "full fine-tuning" in stderr and len(stderr.splitlines()) == 1
    assert not (tmp_path / "none").exists()


@pytest.mark.slow
def test_the_default_gguf_model_exports_to_a_plain_folder_with_tied_embeddings(
    tmp_path, monkeypatch, default_lm
) -> None:
    """transformers flags a model read from a GGUF file as quantized and will not save it; the export will."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import mhgpo.run.export

    seen = []

    def spy(spec, device=None, dtype=None):  # the export loads the default model in float32: the session's load
        assert (spec, device, dtype) == ("smollm2-135m", "cpu", torch.float32)
        seen.append(default_lm)
        return seen[-1]

    monkeypatch.setattr(mhgpo.run.export, "load_model", spy)
    out = mhgpo.run.export.export("smollm2-135m", tmp_path / "smol")
    [gguf] = seen
    assert getattr(gguf.model, "is_quantized", False)  # what save_pretrained refuses
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(str(out / "model.safetensors"))  # stored once, tied on loading
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = encode_chat(gguf.tokenizer, messages)
    assert (
        tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)[
            "input_ids"
        ]
        == prompt
    )
    output = gguf.tokenizer("The capital of France is Paris.", add_special_tokens=False)["input_ids"]
    sample = [Sample(prompt, output, [], 0.0, "answerer")]
    assert_close(logprobs(model, sample), logprobs(gguf.model, sample))
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in (out / "README.md").read_text()


# ------------------------------------------------------------------------------------- training from a run


def _reference_and_policy(cfg: TrainConfig, samples: list[Sample]) -> tuple[Any, torch.Tensor, torch.Tensor]:
    policy = training_setup(cfg).policy
    trainable = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    reference = torch.cat(policy.reference_logprobs(samples))
    assert {n for n, p in policy.model.named_parameters() if p.requires_grad} == trainable  # unchanged by it
    if cfg.lora.enabled:
        assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    return policy, reference, logprobs(policy.model, samples)


@pytest.mark.parametrize("new_lora", [True, False])
def test_a_new_run_starts_from_the_trained_weights_with_the_chosen_reference(
    run, new_lora, samples, tiny_model_dir, world, tmp_path
) -> None:
    trained = trained_logprobs(run, samples)
    base = logprobs(load_model(str(tiny_model_dir), device="cpu").model, samples)
    lora = {} if new_lora else {"lora.enabled": "false"}
    _, ref, current = _reference_and_policy(make_config(run.path, world, tmp_path / "a", **lora), samples)
    assert_close(current, trained)
    assert_close(ref, trained)  # reference=init: the loaded weights
    policy, ref, current = _reference_and_policy(
        make_config(run.path, world, tmp_path / "b", reference="base", **lora), samples
    )
    assert_close(current, trained)
    assert_close(ref, base)
    # LoRA on LoRA: the run's adapter, negated, gives the base; otherwise a frozen base model of its own
    assert (policy.reference_adapters == ["reference0"]) == (new_lora and run.kind == "lora")
    assert (policy.ref_model is None) == (new_lora and run.kind == "lora")


def test_a_chain_of_runs_loads_recursively_and_moves_as_a_folder(
    lora_run, samples, tiny_model_dir, world, tmp_path, monkeypatch
) -> None:
    home = tmp_path / "project"
    shutil.copytree(lora_run.path, home / "runs" / "warm")
    monkeypatch.chdir(home)
    second = train(
        make_config(
            tiny_model_dir,
            world,
            Path("runs/rl"),
            model="runs/warm",
            reference="base",
            steps=1,
            **{"lora.enabled": "false"},
        ),
        progress=False,
    )
    assert load_config(TrainConfig, home / "runs" / "rl" / "config.yaml").model == "warm"
    expected = logprobs(second.setup.policy.model, samples)
    assert float((expected - trained_logprobs(lora_run, samples)).abs().max()) > 1e-3

    shutil.move(home / "runs", tmp_path / "moved")
    monkeypatch.chdir(tmp_path)
    loaded = load_model("moved/rl", device="cpu")
    assert [s.run_dir.name for s in loaded.trained.stages] == ["warm", "rl"]
    assert loaded.trained.base == str(tiny_model_dir)
    assert_close(logprobs(loaded.model, samples), expected)
    assert resume(Path("moved/rl"), ["steps=2"], progress=False).step == 2


def test_ask_and_eval_retrieval_take_a_checkpoint(lora_run, world, cli, tmp_path) -> None:
    ckpt = lora_run.path / "checkpoints" / "step_1"
    code, stdout, stderr = cli(
        "ask", "Who founded the harbour company?", "--model", ckpt, "--corpus", world / "corpus.jsonl", *SMALL_SEARCH
    )
    assert code == 0, stderr
    assert "answerer" in stdout and "answer" in stdout
    code, _, stderr = cli(
        "eval-retrieval",
        "--data",
        f"hotpotqa:{world / 'dev.jsonl'}",
        "--corpus",
        world / "corpus.jsonl",
        "--query",
        "rewriter",
        "--model",
        ckpt,
        "--limit",
        2,
        "--output-dir",
        tmp_path / "recall",
        *SMALL_SEARCH[:1],
    )
    assert code == 0, stderr
    assert json.loads((tmp_path / "recall" / "metrics.json").read_text())["query"] == "rewriter"


# ------------------------------------------------------------------------------------------------- errors


def _other_base(tiny_model_dir: Path, folder: Path) -> Path:
    """The tiny model's architecture with a wider MLP: a base model the runs do not fit."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.intermediate_size = 48
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return folder


def _bad_input(case: str, run: TrainedRun, tiny_model_dir: Path, tmp: Path) -> Path:
    if case == "empty directory":
        (tmp / "empty").mkdir()
        return tmp / "empty"
    copy = tmp / "copy"
    shutil.copytree(run.path, copy)
    if case == "no checkpoint":
        shutil.rmtree(copy / "checkpoints")
    elif case == "another base model":
        text = (
            (copy / "config.yaml")
            .read_text()
            .replace(f"model: {tiny_model_dir}", f"model: {_other_base(tiny_model_dir, tmp / 'other')}")
        )
        (copy / "config.yaml").write_text(text)
    elif case == "truncated":
        weights = copy / "checkpoints" / "step_2" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif case == "loop":
        (copy / "config.yaml").write_text(
            (copy / "config.yaml").read_text().replace(f"model: {tiny_model_dir}", f"model: {copy}")
        )
    return copy


ERRORS = {
    "empty directory": r"the directory has no config\.json .*no config\.yaml or checkpoints/ \(not a run directory\)",
    "no checkpoint": r"copy: no checkpoint to load \(checkpoints/step_N/model\.safetensors\)",
    "another base model": r"step_2/model\.safetensors: tensor '.*mlp.*' has shape \[.*\] where the base model "
    r"'.*other' \(from .*copy/config\.yaml\) has \[.*\]: the checkpoint was trained from "
    r"another base model",
    "truncated": r"step_2/model\.safetensors: not a readable safetensors file, truncated or damaged",
    "loop": r"copy/config\.yaml: its model '.*copy' leads back to itself",
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_run_directories_give_one_line_and_exit_2(case, run, tiny_model_dir, world, cli, tmp_path) -> None:
    import re

    spec = _bad_input(case, run, tiny_model_dir, tmp_path)
    for args in (
        [
            "eval",
            "--model",
            spec,
            "--data",
            f"hotpotqa:{world / 'dev.jsonl'}",
            "--corpus",
            world / "corpus.jsonl",
            "--output-dir",
            tmp_path / "out",
        ],
        ["export", spec, "--out", tmp_path / "out"],
    ):
        code, stdout, stderr = cli(*args)
        assert (code, stdout) == (2, ""), stderr
        assert len(stderr.strip().splitlines()) == 1 and stderr.startswith("mhgpo: error: "), stderr
        assert re.search(ERRORS[case], stderr), stderr
        assert not (tmp_path / "out").exists()


def test_eval_of_a_run_uses_the_team_settings_it_was_trained_with(lora_run, world, cli, tmp_path) -> None:
    import yaml

    copy = shutil.copytree(lora_run.path, tmp_path / "run")
    tree = yaml.safe_load((copy / "config.yaml").read_text())
    tree["search"]["snippet_words"] = 11
    (copy / "config.yaml").write_text(yaml.safe_dump(tree))
    args = ["--data", f"hotpotqa:{world / 'dev.jsonl'}", "--corpus", world / "corpus.jsonl", "--limit", 1]
    assert main(["export", str(copy), "--out", str(tmp_path / "export")]) == 0
    cases = [("as-trained", copy, [], 11), ("overridden", copy, ["search.snippet_words=13"], 13)]
    for name, model, extra, words in [*cases, ("export", tmp_path / "export", [], 11)]:
        code, stdout, stderr = cli("eval", "--model", model, "--output-dir", tmp_path / name, *args, *extra)
        assert code == 0, stderr
        assert "the team as trained: system, team, search, max_prompt_tokens from" in " ".join(stdout.split())
        saved = yaml.safe_load((tmp_path / name / "eval_config.yaml").read_text())
        assert saved["search"]["snippet_words"] == words
        assert {k: v for k, v in saved["search"].items() if k != "snippet_words"} == {
            k: v for k, v in tree["search"].items() if k != "snippet_words"
        }
    code, stdout, stderr = cli("ask", "Who founded the harbour company?", "--model", copy, *args[2:4])
    assert code == 0 and "the team as trained" in stdout and "answerer" in stdout, stderr
    out = tmp_path / "recall"
    code, stdout, stderr = cli("eval-retrieval", *args, "--query", "rewriter", "--model", copy, "--output-dir", out)
    assert code == 0 and "the Rewriter as trained: search, max_prompt_tokens from" in " ".join(stdout.split()), stderr
    assert yaml.safe_load((out / "eval_retrieval_config.yaml").read_text())["search"]["snippet_words"] == 11
