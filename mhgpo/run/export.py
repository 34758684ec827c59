"""`mhgpo export`: a trained team as a plain Hugging Face model folder, or its LoRA adapter as a PEFT folder.

The merged folder holds `config.json`, `model.safetensors` (LoRA merged into the base weights; tied embeddings stay
tied), `generation_config.json` (token ids only: no sampling settings that would change how the model decodes when
it is loaded back), the tokenizer with the chat template the agents use, a `README.md` model card and
`mhgpo_team.yaml` (the run's team settings: `mhgpo eval --model DIR` evaluates the team as the run did). It loads with
`AutoModelForCausalLM.from_pretrained` without mhgpo. A model read from a GGUF file is flagged as quantized by
transformers, which then refuses to save it: the export builds a plain model from the config without the
quantization entry and loads the merged weights into it. `lora_only` writes `adapter_config.json` and
`adapter_model.safetensors` (with the tokenizer and the card), for `peft.PeftModel.from_pretrained(base, DIR)`.

Weights are loaded and merged in float32 on the CPU, then rounded once to the chosen dtype, by the same function
that loads a run for `--model RUN` (:func:`mhgpo.model.trained.merged_model`): loaded with the same dtype, a run and
its (float32) export hold the same weights bit for bit. A team with one adapter per agent (`lora.per_role`) has no
single merged model: its export holds the shared weights in `base/` and each agent's adapter in `<agent>/`, and
`--model` loads that folder as a team, as it loads the run. The folder is written under a temporary name beside
`out` and renamed when complete; the temporary folder of an export that was killed is removed by the next export
to the same `out`.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml

from mhgpo.config.tables import algo_label
from mhgpo.errors import InputError
from mhgpo.io import atomic_write_text, remove_stale_temps, temp_path, usual_permissions
from mhgpo.model.pretrained import SHARED_FOLDER, TRAINED_KINDS, LoadedModel, resolve_model, stop_token_ids
from mhgpo.model.trained import RUN_CONFIG, TrainedSpec, load_model, read_weights, resolve_trained, with_adapter
from mhgpo.run.evaluate import TEAM_FILE, team_settings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}  # what the packaged default derives from


def export(spec: str, out: Path, dtype: str = "float32", lora_only: bool = False) -> Path:
    """Write the model `spec` names (a run, a checkpoint, or any model) into the new folder `out`; return it."""
    if dtype not in DTYPES:
        raise InputError(f"--dtype: expected {' or '.join(DTYPES)}, got {dtype!r}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"{out}: already exists; pick another --out")
    source = resolve_model(spec)
    trained = resolve_trained(Path(source.location), source.kind) if source.kind in TRAINED_KINDS else None
    remove_stale_temps(out, "export")
    tmp = temp_path(out)
    tmp.mkdir(parents=True)
    try:
        if lora_only:
            loaded = _write_adapter(spec, trained, tmp, DTYPES[dtype])
        else:
            loaded = _write_merged(spec, tmp, out, DTYPES[dtype])
        _save_tokenizer(loaded.tokenizer, tmp)
        atomic_write_text(tmp / "README.md", model_card(spec, out.name, trained, dtype, lora_only))
        if trained is not None and not lora_only:  # `--model out` evaluates the team as the run does
            atomic_write_text(tmp / TEAM_FILE, yaml.safe_dump(team_settings(trained.last.config), sort_keys=False))
        for f in tmp.rglob("*"):  # some writers make 0600 files; give the usual permissions
            if f.is_file():
                usual_permissions(f)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def plain_model(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A model of the same architecture built from `model`'s config without its quantization entry, holding
    `model`'s weights (assigned, not copied: parameters are created empty)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with init_empty_weights():  # parameters on the meta device; buffers (rotary frequencies) real
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict({k: v.to(dtype) for k, v in model.state_dict().items()}, strict=True, assign=True)
    plain.tie_weights()
    return plain.eval()


def _write_merged(spec: str, folder: Path, out: Path, dtype: torch.dtype) -> LoadedModel:
    """The merged model in `folder`, loaded exactly as `--model spec` loads it (:func:`mhgpo.model.trained.load_model`:
    merged in float32 on the CPU, rounded once to `dtype`). A team with one adapter per agent (`lora.per_role`) has
    no single model: the shared weights go to `folder/base/` (a plain model, with the tokenizer) and each agent's
    adapter, unmerged, to `folder/<agent>/` (PEFT), which `--model out` loads as the run loads."""
    loaded = load_model(spec, device="cpu", dtype=dtype)
    if loaded.select is None:
        _save_plain(loaded, loaded.model, folder, dtype)
        return loaded
    model = loaded.model
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.data = param.data.to(dtype)
    for config in model.peft_config.values():
        config.base_model_name_or_path = os.path.abspath(out / SHARED_FOLDER)
    # no adapter is named `default`: each goes to the sub-folder named after it (adapters hold no embedding layers)
    model.save_pretrained(folder, save_embedding_layers=False)
    base = folder / SHARED_FOLDER
    _save_plain(loaded, model.unload(), base, dtype)
    _save_tokenizer(loaded.tokenizer, base)
    return loaded


def _save_plain(loaded: LoadedModel, merged: torch.nn.Module, folder: Path, dtype: torch.dtype) -> None:
    from transformers import GenerationConfig

    model = plain_model(merged, dtype)
    tok = loaded.tokenizer
    bos = tok.bos_token_id if tok.bos_token_id is not None else merged.generation_config.bos_token_id
    model.generation_config = GenerationConfig(  # token ids only: decoding settings stay the caller's
        bos_token_id=bos, eos_token_id=stop_token_ids(tok, merged), pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(folder)


def _write_adapter(spec: str, trained: TrainedSpec | None, folder: Path, dtype: torch.dtype) -> LoadedModel:
    if trained is None:
        raise InputError(f"--lora-only: {spec} is not a run directory or checkpoint (it has no adapter)")
    stage = trained.last
    if not stage.lora.enabled:
        raise InputError(
            f"--lora-only: {stage.run_dir} was trained with full fine-tuning (lora.enabled: false in its "
            f"{RUN_CONFIG}), so it has no adapter; export it without --lora-only"
        )
    if len(trained.stages) > 1:
        raise InputError(
            f"--lora-only: the adapter of {stage.run_dir} applies on top of "
            f"{trained.stages[-2].run_dir}'s weights, not on a base model; export it without --lora-only"
        )
    loaded = load_model(trained.base, device="cpu", dtype=torch.float32)
    wrapped = with_adapter(loaded.model, stage, read_weights(stage), trained.base).to(dtype)
    for config in wrapped.peft_config.values():  # one adapter, or one per agent (saved in sub-folders by name)
        config.base_model_name_or_path = _base_location(trained.base)
    wrapped.save_pretrained(folder)
    return loaded


def _base_location(base: str) -> str:
    """The base model as a path or hub id for `adapter_config.json` (a GGUF base: its folder)."""
    source = resolve_model(base)
    return source.location if source.kind == "hub" else os.path.abspath(source.location)


def _save_tokenizer(tokenizer: Any, folder: Path) -> None:
    """The tokenizer with the chat template the agents render with (set by `mhgpo.model.pretrained.prepare_tokenizer`); its
    class is written as PreTrainedTokenizerFast, the name every transformers version reads."""
    tokenizer.save_pretrained(folder)
    path = folder / "tokenizer_config.json"
    settings = json.loads(path.read_text(encoding="utf-8"))
    if settings.get("tokenizer_class") == "TokenizersBackend":
        settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):  # where it was read from, not what it is
        settings.pop(key, None)
    atomic_write_text(path, json.dumps(settings, indent=2, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------------------------- model card


def _last_validation(stage: Any) -> dict[str, Any] | None:
    from mhgpo.runtime.runlog import read_metrics

    rows = [r for r in read_metrics(stage.run_dir) if "val/f1" in r and r.get("step", 0) <= stage.step]
    return rows[-1] if rows else None


def _stage_rows(trained: TrainedSpec) -> list[str]:
    rows = []
    for stage in trained.stages:
        c = stage.config
        label = algo_label(str(c.get("algo", "?")), c.get("sampler"))
        lora = (
            f"LoRA r={stage.lora.r}, alpha={stage.lora.alpha} ({', '.join(stage.lora.target_modules)})"
            if stage.lora.enabled
            else "full fine-tuning"
        )
        size = ""
        if "questions_per_step" in c:
            size = f" × {c['questions_per_step']} questions, G={c.get('group_size', '?')}"
        val = _last_validation(stage)
        scores = (
            (
                f"F1 {val['val/f1']:.1f}, EM {val['val/em']:.1f}, Acc {val['val/acc']:.1f} at step {val['step']} "
                f"({c.get('val_limit', '?')} questions of {c.get('val_data', '?')})"
            )
            if val
            else "none logged"
        )
        system = c.get("system", "?")
        rows += [
            f"| run | `{stage.run_dir.name}`, checkpoint step {stage.step} |",
            f"| algorithm | {label} on system `{system}`, {stage.step} steps{size}; {lora} |",
            f"| data | `{c.get('data', '?')}` |",
            f"| last validation | {scores} |",
        ]
    return rows


def model_card(spec: str, name: str, trained: TrainedSpec | None, dtype: str, lora_only: bool) -> str:
    """A short README.md: what the model is, how it was trained (one block per run of the chain), how to load it."""
    base = trained.base if trained else spec
    source = resolve_model(base)
    hub_id = DEFAULT_HUB_IDS.get(base.lower()) or (base if source.kind == "hub" else None)
    front = ["---", "library_name: peft" if lora_only else "library_name: transformers"]
    if hub_id:
        front.append(f"base_model: {hub_id}")
    front += ["tags:", "- mhgpo", "- multi-agent", "- reinforcement-learning", "---", ""]
    origin = f" (de-quantised from the GGUF file `{source.gguf_file}`)" if source.kind == "gguf" else ""
    what = "The LoRA adapter of a model" if lora_only else "A model"
    lines = [
        f"# {name}",
        "",
        f"{what} trained with mhgpo: LLM agents that share one model (by default a Rewriter, "
        "a Reranker and an Answerer around a retriever), trained end to end from the reward of the final answer.",
        "",
        "| | |",
        "|---|---|",
        f"| base model | `{base}`{origin} |",
    ]
    lines += _stage_rows(trained) if trained else ["| training | none (the base model as it is) |"]
    per_agent = trained is not None and trained.last.lora.per_role
    merged = (
        not lora_only
        and trained is not None
        and any(stage.lora.enabled for stage in trained.stages if not stage.lora.per_role)
    )
    if per_agent:
        lines += [
            "| agents | one adapter per agent (`lora.per_role`), so no single merged model: "
            + (
                "one sub-folder per agent, each adapter"
                if lora_only
                else f"the shared weights in `{SHARED_FOLDER}/`, each agent's adapter (unmerged) in the sub-folder named "
                "after it"
            )
            + " |"
        ]
    lines += [f"| weights | {dtype}" + (", LoRA merged into the base weights" if merged else "") + " |", ""]
    lines += [
        "## Use",
        "",
        "The agents' prompts are chat messages rendered with the tokenizer's chat template (plain "
        "ChatML, no default system message); decode greedily for evaluation.",
        "",
    ]
    if not lora_only:
        lines += ["```bash", f"mhgpo eval --model {name} --data hotpotqa:PATH", "```", ""]
    if per_agent and not lora_only:
        lines += [
            "```python",
            "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f'base = AutoModelForCausalLM.from_pretrained("{name}/{SHARED_FOLDER}")',
            f'model = PeftModel.from_pretrained(base, "{name}/AGENT")  # e.g. answerer',
            f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
            "```",
            "",
        ]
    elif lora_only:
        lines += [
            "```python",
            "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM",
            "",
            "base = AutoModelForCausalLM.from_pretrained(BASE)  # the base model above",
            f'model = PeftModel.from_pretrained(base, "{name}")',
            "```",
            "",
        ]
    else:
        lines += [
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f'model = AutoModelForCausalLM.from_pretrained("{name}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
            "```",
            "",
        ]
    return "\n".join(front + lines)
