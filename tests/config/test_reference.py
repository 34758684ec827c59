"""The reference of every config key (mhgpo/config/reference.py, docs/config.md): the committed page is the
generator's output, every key of every config has its one-line meaning, the bounds it lists are the ones the
configs enforce, and a value outside a key's choices is refused naming the key. The shared base classes of the
configs and `carry_over`, which copies their keys from one config to another."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from mhgpo.config import (
    EvalConfig,
    OptimConfig,
    SFTConfig,
    TeamRunConfig,
    TrainConfig,
    TrainingRunConfig,
    carry_over,
    load_config,
    to_dict,
)
from mhgpo.config.reference import CONFIGS, Bound, config_classes, field_help, render, sections, valid_values
from mhgpo.errors import InputError

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_page_is_the_generators_output():
    assert (ROOT / "docs" / "config.md").read_text(encoding="utf-8") == render(), (
        "docs/config.md is stale: python -m mhgpo.config.reference > docs/config.md"
    )


def test_every_key_of_every_config_has_a_meaning():
    classes = config_classes()
    assert {TrainConfig, EvalConfig, SFTConfig, OptimConfig} <= set(classes)
    for cls in classes:
        helps = field_help(cls)
        for f in dataclasses.fields(cls):
            assert helps.get(f.name), f"{cls.__name__}.{f.name} has no help line"
            assert "\n" not in helps[f.name]


def _where() -> dict[type, tuple[type, str]]:
    """Each config class: the first entry point's config it stands in and its path there."""
    found: dict[type, tuple[type, str]] = {}
    for root, _ in CONFIGS:
        for path, obj in sections(root()):
            for klass in type(obj).__mro__:
                found.setdefault(klass, (root, path))
    return found


def _bounds() -> list[tuple[type, str, Bound]]:
    return [
        (cls, name, entry)
        for cls, keys in valid_values().items()
        for name, entries in keys.items()
        for entry in entries
        if isinstance(entry, Bound)
    ]


# A key whose bound holds only beside another key's value: that value
CONTEXT = {"engine_is_cap": ["generation.engine=vllm"], "max_topk": ["default_topk=1"]}


@pytest.mark.parametrize(("cls", "name", "bound"), _bounds(), ids=lambda v: getattr(v, "__name__", str(v)))
def test_each_listed_bound_is_the_one_validation_enforces(cls, name, bound):
    root, path = _where()[cls]
    key = f"{path}{name}"
    outside = []
    if bound.low is not None:
        outside.append(bound.low if bound.open_low else bound.low - 1)
    if bound.high is not None:
        outside.append(bound.high if bound.open_high else bound.high + 1)
    inside = [b for b, is_open in ((bound.low, bound.open_low), (bound.high, bound.open_high)) if not is_open]
    inside = [b for b in inside if b is not None] or [bound.low + 1]
    for value in outside:
        with pytest.raises(InputError, match=rf"\b{name}\b"):
            load_config(root, None, [*CONTEXT.get(name, []), f"{key}={value}"])
    for value in inside:
        cfg = load_config(root, None, [*CONTEXT.get(name, []), f"{key}={value}"])
        assert to_dict(cfg) is not None


def _choices() -> list[tuple[type, str]]:
    return [
        (cls, name)
        for cls, keys in valid_values().items()
        for name, entries in keys.items()
        if any(isinstance(e, tuple) for e in entries)
    ]


@pytest.mark.parametrize(("cls", "name"), _choices(), ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_value_outside_a_keys_choices_is_refused_naming_it(cls, name):
    root, path = _where()[cls]
    with pytest.raises(InputError, match=rf"^{re.escape(path + name)}: "):
        load_config(root, None, [f"{path}{name}=no-such-value"])


def test_the_reference_lists_each_config_and_section_once():
    page = render()
    for cls, _ in CONFIGS:
        assert page.count(f": `{cls.__name__}`\n") == 1
    for heading in ("retrieval", "search", "search.ROLE", "optim", "lora", "critic", "warm_start", "generation"):
        assert page.count(f"\n### {heading}\n") == 1
    row = "| `optim.lr` | float | `0.0001` (mhgpo train), `0.0005` (mhgpo sft) | > 0 | The learning rate (of the actor). |"
    assert row in page.splitlines()
    assert (
        "| `search.ROLE.max_new_tokens` | int | `48` (search.rewriter), `16` (search.reranker), `24` (search.answerer) |"
        in page
    )


# ------------------------------------------------------------------------------------- the shared base classes


def test_the_three_configs_share_their_keys_through_base_classes():
    shared = {f.name for f in dataclasses.fields(TeamRunConfig)}
    assert shared == {
        "model",
        "data",
        "system",
        "precision",
        "seed",
        "gen_batch_size",
        "max_prompt_tokens",
        "retrieval",
        "search",
        "team",
    }
    assert issubclass(EvalConfig, TeamRunConfig) and issubclass(TrainConfig, TrainingRunConfig)
    assert issubclass(SFTConfig, TrainingRunConfig) and issubclass(TrainingRunConfig, TeamRunConfig)
    assert (EvalConfig().data, TrainConfig().data, SFTConfig().data) == (
        "synthetic",
        "synthetic:train",
        "synthetic:train",
    )
    assert (TrainConfig().eval_batch_size, SFTConfig().eval_batch_size) == (32, 40)


def test_carry_over_copies_the_keys_of_the_deepest_shared_base():
    cfg = load_config(
        TrainConfig,
        None,
        ["seed=7", "precision=fp32", "search.top_k=5", "retrieval.batch_size=8", "max_rounds=9", "eval_batch_size=3"],
    )
    sft = carry_over(cfg, SFTConfig, steps=2)
    assert (sft.seed, sft.precision, sft.search.top_k, sft.retrieval.batch_size) == (7, "fp32", 5, 8)
    assert (sft.max_rounds, sft.eval_batch_size, sft.steps, sft.output_dir) == (9, 3, 2, "runs/sft")
    assert sft.search is not cfg.search and sft.retrieval is not cfg.retrieval  # copies
    ev = carry_over(cfg, EvalConfig, data="synthetic:dev")
    assert (ev.seed, ev.precision, ev.search.top_k, ev.data, ev.batch_size) == (7, "fp32", 5, "synthetic:dev", 32)
    again = carry_over(cfg, TrainConfig)
    assert to_dict(again) == to_dict(cfg) and again.optim is not cfg.optim


def test_a_dumped_config_lists_its_own_keys_before_its_sections():
    keys = list(to_dict(TrainConfig()))
    first_section = keys.index("retrieval")
    assert all(not isinstance(v, dict) for v in list(to_dict(TrainConfig()).values())[:first_section])
    assert keys[first_section:] == [
        "retrieval",
        "search",
        "team",
        "lora",
        "warm_start",
        "reward",
        "optim",
        "critic",
        "generation",
        "rollout",
    ]
    assert list(to_dict(TrainConfig())["search"])[-3:] == ["rewriter", "reranker", "answerer"]
