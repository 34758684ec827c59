"""A run and its export are the same model: `--model RUN` (or `RUN/checkpoints/step_N`) and `--model EXPORT` (the
folder `mhgpo export RUN` writes) load bit-identical weights under every precision, and so decode the same tokens,
whether loaded for evaluation (`eval`, `ask`) or as the start of a new run. Runs are written by hand on the tiny
model, with updates far larger than bfloat16's resolution, so that rounding where they are merged shows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from mhgpo.config import EvalConfig, LoraConfig
from mhgpo.errors import InputError
from mhgpo.model.generation import SamplingParams
from mhgpo.model.lora import peft_lora_config
from mhgpo.model.precision import weight_dtype
from mhgpo.model.trained import initial_weights, load_model
from mhgpo.run.export import export
from mhgpo.run.setup import load_generator as load_team_generator

LORA = {"enabled": True, "r": 4, "alpha": 8}
QUESTIONS = ["Who wrote the novel Dune?", "What is the capital of France?", "Which river flows through Cairo?"]
PRECISIONS = ["fp32", "bf16-mixed"]
AGENTS = ("answerer", "reranker", "rewriter")


def lora_tensors(model_dir: Path, adapters: tuple[str, ...] = ("default",), seed: int = 0) -> dict[str, torch.Tensor]:
    """A LoRA checkpoint's tensors (named as training saves them) with large random values: B·A·alpha/r moves the
    weights by about 0.3, far more than bfloat16's rounding of them."""
    from peft import get_peft_model

    base = load_model(str(model_dir), device="cpu").model
    config = LoraConfig(**LORA)
    wrapped = get_peft_model(base, peft_lora_config(config, base), adapter_name=adapters[0])
    for name in adapters[1:]:
        wrapped.add_adapter(name, peft_lora_config(config, base))
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=gen) * 0.3 for n, p in wrapped.named_parameters() if ".lora_" in n}


def full_tensors(model_dir: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A full fine-tuning checkpoint: every weight moved by noise that bfloat16 cannot hold exactly."""
    gen = torch.Generator().manual_seed(seed)
    base = load_model(str(model_dir), device="cpu").model
    return {n: p.detach() + torch.randn(p.shape, generator=gen) * 0.01 for n, p in base.named_parameters()}


def write_run(
    folder: Path, model: str, lora: dict, checkpoints: dict[int, dict[str, torch.Tensor]], **keys: object
) -> Path:
    """A run directory as `mhgpo train` leaves it, as far as loading it (and evaluating its team: `keys`) is
    concerned."""
    folder.mkdir(parents=True)
    tree = {"model": model, "lora": lora, **keys}
    (folder / "config.yaml").write_text(yaml.safe_dump(tree), encoding="utf-8")
    for step, tensors in checkpoints.items():
        (folder / "checkpoints" / f"step_{step}").mkdir(parents=True)
        save_file(tensors, str(folder / "checkpoints" / f"step_{step}" / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    """Run specs by case: a LoRA run (latest checkpoint), one of its earlier checkpoints, a full fine-tuning run,
    and a LoRA run started from the full one (a chain: full weights, then an adapter merged on top)."""
    root = tmp_path_factory.mktemp("identity")
    lora = write_run(
        root / "lora",
        str(tiny_model_dir),
        LORA,
        {1: lora_tensors(tiny_model_dir, seed=1), 2: lora_tensors(tiny_model_dir, seed=2)},
    )
    full = write_run(root / "full", str(tiny_model_dir), {"enabled": False}, {1: full_tensors(tiny_model_dir)})
    chain = write_run(root / "chain", "full", LORA, {1: lora_tensors(tiny_model_dir, seed=3)})
    roles = write_run(
        root / "roles",
        "full",
        {**LORA, "per_role": True},
        {1: lora_tensors(tiny_model_dir, adapters=AGENTS, seed=4)},
        search={"snippet_words": 21},
    )
    return {
        "lora": lora,
        "lora-step_1": lora / "checkpoints" / "step_1",
        "full": full,
        "lora-on-full": chain,
        "per-role-on-full": roles,
    }


@pytest.fixture(scope="module")
def exports(runs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    return {case: export(str(spec), root / case) for case, spec in runs.items()}


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module, dtype: torch.dtype) -> None:
    """The same parameters and buffers, bit for bit, with the model's own parameters stored in `dtype` (adapters
    that stay unmerged keep PEFT's float32)."""
    params_a, params_b = dict(a.named_parameters()), dict(b.named_parameters())
    assert params_a.keys() == params_b.keys()
    for name, p in params_a.items():
        assert p.dtype == params_b[name].dtype == (torch.float32 if ".lora_" in name else dtype), name
        assert torch.equal(p, params_b[name]), f"{name}: max |diff| {float((p - params_b[name]).detach().abs().max())}"
    buffers_a, buffers_b = dict(a.named_buffers()), dict(b.named_buffers())
    assert buffers_a.keys() == buffers_b.keys()
    for name, buf in buffers_a.items():
        assert buf.dtype == buffers_b[name].dtype and torch.equal(buf, buffers_b[name]), name


def load_generator(spec: str, gen_batch_size: int, seed: int, precision: str):
    """The model `spec` loaded to generate, as `mhgpo eval` loads it."""
    cfg = EvalConfig(model=spec, gen_batch_size=gen_batch_size, seed=seed, precision=precision)
    return load_team_generator(cfg, "set in the test")


def greedy(generator, encode, agent: str | None = None) -> list[list[int]]:
    prompts = [encode([{"role": "user", "content": q}]) for q in QUESTIONS]
    return [g.output_ids for g in generator.generate(prompts, SamplingParams(16, temperature=0.0, agent=agent))]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("case", ["lora", "lora-step_1", "full", "lora-on-full"])
def test_a_run_and_its_export_load_the_same_weights_and_decode_the_same(runs, exports, case, precision) -> None:
    run, run_gen, run_encode = load_generator(str(runs[case]), 4, 0, precision)
    exp, exp_gen, exp_encode = load_generator(str(exports[case]), 4, 0, precision)
    assert run.trained is not None and exp.trained is None
    assert_same_weights(run.model, exp.model, weight_dtype(precision, trainable=False))
    assert greedy(run_gen, run_encode) == greedy(exp_gen, exp_encode)


@pytest.mark.parametrize("case", ["lora", "lora-step_1", "full", "lora-on-full"])
def test_a_run_loaded_in_bfloat16_is_its_float32_weights_rounded_once(runs, case) -> None:
    loaded = load_model(runs[case], device="cpu", dtype=torch.float32)
    wide = {n: p.detach() for n, p in loaded.model.named_parameters()}
    untrained = {n: p.detach() for n, p in load_model(loaded.trained.base, device="cpu").model.named_parameters()}
    moved = [n for n, p in wide.items() if not torch.equal(p, untrained[n])]
    assert moved  # the checkpoint changed the weights, and by far more than bfloat16's rounding
    assert all(float((wide[n] - untrained[n]).abs().max()) > 1e-2 for n in moved)
    rounded = {n: p.to(torch.bfloat16) for n, p in wide.items()}
    narrow = load_model(runs[case], device="cpu", dtype=torch.bfloat16).model
    for name, p in narrow.named_parameters():
        assert torch.equal(p, rounded[name]), name


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("case", ["lora", "full"])
@pytest.mark.parametrize("new_lora", [True, False])
def test_a_new_run_starts_from_the_same_weights_from_a_run_or_its_export(
    runs, exports, case, precision, new_lora
) -> None:
    dtype = weight_dtype(precision, trainable=not new_lora)  # as the trainer stores its initial weights
    run, _ = initial_weights(str(runs[case]), "init", new_lora, device="cpu", dtype=dtype)
    exp, _ = initial_weights(str(exports[case]), "init", new_lora, device="cpu", dtype=dtype)
    assert_same_weights(run.model, exp.model, dtype)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_per_role_run_and_its_export_are_the_same_team(runs, exports, precision) -> None:
    """One adapter per agent cannot merge into one model: the export holds the shared weights (the full run
    beneath, rounded once) and each agent's adapter; `--model` loads both as the same team, agent by agent."""
    run_spec, exp_spec = runs["per-role-on-full"], exports["per-role-on-full"]
    assert sorted(p.name for p in exp_spec.iterdir() if p.is_dir()) == sorted(["base", *AGENTS])
    import yaml

    from mhgpo.run.evaluate import TEAM_FILE, team_settings, trained_team

    saved = team_settings(yaml.safe_load((Path(run_spec) / "config.yaml").read_text()))
    assert trained_team(str(exp_spec)) == (saved, exp_spec / TEAM_FILE) and saved == {"search": {"snippet_words": 21}}
    dtype = weight_dtype(precision, trainable=False)
    run, run_gen, run_encode = load_generator(str(run_spec), 4, 0, precision)
    exp, exp_gen, exp_encode = load_generator(str(exp_spec), 4, 0, precision)
    assert run.select is not None and exp.select is not None
    assert_same_weights(run.model, exp.model, dtype)
    decoded = {agent: greedy(run_gen, run_encode, agent) for agent in AGENTS}
    assert decoded == {agent: greedy(exp_gen, exp_encode, agent) for agent in AGENTS}
    assert decoded["answerer"] != decoded["rewriter"]  # each agent decodes with its own adapter
    beneath = load_model(str(runs["full"]), device="cpu", dtype=dtype).model
    assert_same_weights(load_model(str(exp_spec / "base"), device="cpu", dtype=dtype).model, beneath, dtype)
    for spec, where, shared in ((run_spec, run_spec, runs["full"]), (exp_spec, exp_spec, exp_spec / "base")):
        with pytest.raises(InputError, match="one adapter per agent") as refused:
            initial_weights(str(spec), "init", True, device="cpu", dtype=dtype)
        assert str(refused.value) == (
            f"{where}: one adapter per agent (lora.per_role), so no single set of weights "
            f"to start another run from; start from the model beneath the adapters "
            f"({shared})"
        )
