"""The table of experiment rows (mhgpo/config/rows.py, `experiments/rows.yaml`: the paper's rows and the demo
recipe's): what each row changes, `--scale demo`, the rows validated without RL, and the table's errors (the rows
trained from the command line: tests/cli/test_baselines.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import mhgpo_main

from mhgpo.config import EvalConfig, TrainConfig, critic_lr, demo_config_path, load_config, to_dict
from mhgpo.config.rows import load_rows
from mhgpo.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
ROWS_FILE = ROOT / "experiments" / "rows.yaml"
TABLE = load_rows(ROWS_FILE)
RECIPE = {"warm_start.enabled": True, "search.reranker_penalty": 0.0}  # the demo's recipe (docs/learning.md)
ROLES = ("rewriter", "reranker", "answerer")

# Every row: what it changes with respect to the base (configs/paper_hotpotqa.yaml, MHGPO-RR), and nothing else.
ROWS: dict[str, dict[str, object]] = {
    "untrained": {},
    "untrained_llm": {"system": "llm", "algo": "grpo", "sampler": "fof"},
    "mhgpo_rr": {},
    "mhgpo_is": {"sampler": "is"},
    "mhgpo_fof": {"sampler": "fof"},
    "mhgpo_fof_os": {"sampler": "fof_os"},
    "mappo": {"algo": "mappo", "sampler": "chains"},
    "llm_grpo": {"system": "llm", "algo": "grpo", "sampler": "fof"},
    "llm_ppo": {"system": "llm", "algo": "ppo", "sampler": "chains"},
    **{f"fof_only_{r}": {"sampler": "fof", "train_roles": [r]} for r in ROLES},
    **{f"fof_freeze_{r}": {"sampler": "fof", "frozen_roles": [r]} for r in ROLES},
    **{f"rr_aggr_{a}": {"reward.aggr": a} for a in ("max", "min", "rand")},
    **{f"fof_os_aggr_{a}": {"sampler": "fof_os", "reward.aggr": a} for a in ("max", "min", "rand")},
    "fof_final_only": {"sampler": "fof", "reward.penalties": False},
    "rr_final_only": {"reward.penalties": False},
    "mappo_final_only": {"algo": "mappo", "sampler": "chains", "reward.penalties": False},
    **{f"fof_g{g}": {"sampler": "fof", "group_size": g} for g in (3, 5, 6)},
    "rr_per_role": {"lora.enabled": True, "lora.per_role": True},
    "rr_filter": {"filter_zero_variance": True},
    "warm": RECIPE,
    "warm_llm": {**RECIPE, "system": "llm", "algo": "grpo", "sampler": "fof"},
    "warm_rr": RECIPE,
    **{f"warm_{s}": {**RECIPE, "sampler": s} for s in ("fof", "is", "fof_os")},
    "warm_mappo": {**RECIPE, "algo": "mappo", "sampler": "chains"},
    "warm_grpo": {**RECIPE, "system": "llm", "algo": "grpo", "sampler": "fof"},
    **{f"warm_rr_aggr_{a}": {**RECIPE, "reward.aggr": a} for a in ("max", "min", "rand")},
    **{f"warm_fof_os_aggr_{a}": {**RECIPE, "sampler": "fof_os", "reward.aggr": a} for a in ("max", "min", "rand")},
    "warm_rr_final_only": {**RECIPE, "reward.penalties": False},
    "warm_mappo_final_only": {**RECIPE, "algo": "mappo", "sampler": "chains", "reward.penalties": False},
    **{f"warm_fof_only_{r}": {**RECIPE, "sampler": "fof", "train_roles": [r]} for r in ROLES},
    **{f"warm_fof_freeze_{r}": {**RECIPE, "sampler": "fof", "frozen_roles": [r]} for r in ROLES},
    "warm_rr_groups_agent": {**RECIPE, "advantage": "agent"},
    "warm_rr_groups_prompt_agent_turn": {**RECIPE, "advantage": "prompt_agent_turn"},
    "warm_rr_reranker_30min": {**RECIPE, "budget_minutes": 30.0, "train_roles": ["reranker"]},
    "warm_rr_30min": {**RECIPE, "budget_minutes": 30.0},
    "warm_rr_per_role": {**RECIPE, "lora.enabled": True, "lora.per_role": True},
    "warm_rr_filter": {**RECIPE, "filter_zero_variance": True},
    "warm_is_top_p1": {**RECIPE, "sampler": "is", **{f"search.{r}.top_p": 1.0 for r in ROLES}},
    "warm_is_entropy": {**RECIPE, "sampler": "is", "optim.entropy_coef": 0.003},
}
NOT_TRAINED = {"untrained", "untrained_llm", "warm", "warm_llm"}  # validated without RL


def flat(tree: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def base(scale: str | None = None) -> dict[str, object]:
    """The base config (at `scale`) as the rows' configs are compared with it."""
    return flat(to_dict(TABLE.config("mhgpo_rr", scale)))


def test_the_table_holds_exactly_the_rows_and_the_readme_names_each() -> None:
    assert set(TABLE.rows) == set(ROWS)
    assert {name for name, row in TABLE.rows.items() if not row.train} == NOT_TRAINED
    readme = (ROOT / "experiments" / "README.md").read_text(encoding="utf-8")
    assert all(f"`{name}`" in readme for name in ROWS)
    assert TABLE.base == ROOT / "experiments" / ".." / "configs" / "paper_hotpotqa.yaml"  # the one paper config


def test_the_base_is_the_papers_setting() -> None:
    cfg = TABLE.config("mhgpo_rr")
    assert (cfg.model, cfg.algo, cfg.sampler, cfg.system) == ("meta-llama/Llama-3.1-8B-Instruct", "mhgpo", "rr", "mas")
    assert cfg.optim.lr == 5e-7 and cfg.critic.lr is None and critic_lr(cfg.critic, cfg.optim) == 1e-6
    assert not cfg.lora.enabled and cfg.precision == "auto"  # bf16-mixed on a GPU: float32 master weights
    assert (cfg.group_size, cfg.questions_per_step, cfg.rr_probs) == (4, 512, [0.7, 0.1, 0.2])
    assert (cfg.optim.clip_eps, cfg.optim.kl_beta, cfg.search.rewriter.top_p) == (0.2, 0.001, 0.9)
    assert (cfg.critic.gamma, cfg.critic.lam, cfg.critic.warmup_steps) == (1.0, 0.95, 5)
    assert cfg.steps == 90447 // cfg.questions_per_step == 176  # one epoch of HotpotQA train, as the paper counts
    assert cfg.rr_regroup == "fork"  # the paper's §3.2: prefix singletons pooled with those that forked alike
    assert cfg.search.answerer.max_new_tokens > 3 * cfg.search.max_answer_words // 2  # the penalty can fire
    assert (cfg.eval_every, cfg.val_limit) == (5, 500)  # validation on 500 dev questions every 5 steps (Figure 3)
    assert cfg.optim.gradient_checkpointing  # an 8B model's activations at 16k tokens per micro-batch
    assert (cfg.warm_start.enabled, cfg.warm_start.steps, cfg.budget_minutes) == (False, 100, None)
    assert flat(to_dict(cfg)) == {**flat(to_dict(load_config(TrainConfig, TABLE.base))), "output_dir": "runs/mhgpo_rr"}


@pytest.mark.parametrize("scale", [None, "demo"])
@pytest.mark.parametrize("name", list(ROWS))
def test_each_row_changes_only_its_switches(name: str, scale: str | None) -> None:
    start, cfg = base(scale), flat(to_dict(TABLE.config(name, scale)))
    changed = {k: cfg[k] for k in cfg if cfg[k] != start[k] and k != "output_dir"}
    switches = {k: v for k, v in ROWS[name].items() if start[k] != v}  # (the demo scale has LoRA on already)
    assert changed == switches
    assert cfg["output_dir"] == f"runs/{name}" + (f"-{scale}" if scale else "")


def test_demo_scale_keeps_the_switches_and_takes_the_demo_size() -> None:
    scale = TABLE.scales["demo"]
    demo = flat(to_dict(load_config(TrainConfig, demo_config_path())))
    for name in ("mappo", "fof_freeze_reranker", "fof_os_aggr_rand", "llm_ppo", "fof_g3", "warm_rr_reranker_30min"):
        paper, got = flat(to_dict(TABLE.config(name))), flat(to_dict(TABLE.config(name, "demo")))
        for key, value in paper.items():
            if key == "output_dir":
                assert got[key] == f"runs/{name}-demo"
            elif key in ROWS[name]:
                assert got[key] == ROWS[name][key], key  # the row's switches win
            elif any(key == k or key.startswith(k + ".") for k in scale.keys):
                assert got[key] == demo[key], key
            else:
                assert got[key] == value, key  # every other key is the paper's
    cfg = TABLE.config("mappo", "demo")
    assert (cfg.model, cfg.steps, cfg.questions_per_step, cfg.lora.enabled) == ("smollm2-135m", 6, 4, True)
    assert (cfg.critic.lr, cfg.critic.warmup_steps, cfg.search.answerer.max_new_tokens) == (None, 1, 48)
    # the demo's own config is the recipe's row at the demo scale (its run folder aside)
    recipe = flat(to_dict(TABLE.config("warm_is", "demo")))
    assert {k: v for k, v in recipe.items() if recipe[k] != demo[k]} == {"output_dir": "runs/warm_is-demo"}


def test_labels_are_the_algorithms_or_the_rows_own() -> None:
    assert TABLE.label("warm_mappo") == "warm start + MAPPO" and TABLE.label("mhgpo_fof_os") == "MHGPO-FoF(os)"
    assert TABLE.label("warm_rr_reranker_30min") == "warm start + MHGPO-RR [budget_minutes=30, train_roles=[reranker]]"
    assert TABLE.label("llm_grpo") == "GRPO" and TABLE.label("untrained") == "untrained team"
    assert TABLE.label("warm_llm") == "the model alone, warm start"


@pytest.mark.parametrize("name", sorted(NOT_TRAINED))
def test_training_free_rows_are_validations(name: str) -> None:
    from mhgpo.cli.main import _eval_config, build_parser

    args = build_parser().parse_args(["eval", "--config", f"{ROWS_FILE}:{name}", "--scale", "demo", "limit=7"])
    cfg, note = _eval_config(args)
    train = TABLE.config(name, "demo")
    assert (
        note is None
        and isinstance(cfg, EvalConfig)
        and (cfg.data, cfg.limit, cfg.system) == (train.val_data, 7, train.system)
    )
    assert cfg.search == train.search and cfg.model == "smollm2-135m"


def test_table_errors_name_the_file_and_the_row(tmp_path, capsys) -> None:
    assert mhgpo_main("train", "--config", f"{ROWS_FILE}:no_such_row") == 2
    assert f"{ROWS_FILE}: no row 'no_such_row' (rows: untrained, untrained_llm," in capsys.readouterr().err
    assert mhgpo_main("train", "--config", ROWS_FILE) == 2
    assert f"{ROWS_FILE}: a table of rows; name one: --config {ROWS_FILE}:ROW" in capsys.readouterr().err
    assert mhgpo_main("train", "--config", f"{ROWS_FILE}:warm") == 2
    assert f"row warm is validated without RL: mhgpo eval --config {ROWS_FILE}:warm" in capsys.readouterr().err
    assert mhgpo_main("train", "--config", f"{ROWS_FILE}:mappo", "--scale", "huge") == 2
    assert "--scale: " in capsys.readouterr().err
    assert mhgpo_main("train", "--scale", "demo", "--steps", "1") == 2
    assert "--scale: only with a row of a table of rows" in capsys.readouterr().err
    bad = tmp_path / "rows.yaml"
    bad.write_text(f"base: {TABLE.base}\nrows:\n  fine: {{sampler: fof}}\n  typo: {{reward.agr: max}}\n")
    assert mhgpo_main("train", "--config", f"{bad}:typo") == 2
    assert f"{bad}: row typo: unknown config key reward.agr" in capsys.readouterr().err
    bad.write_text(f"base: {TABLE.base}\nrows:\n  Bad-Name: {{}}\n")
    with pytest.raises(InputError, match=r"row 'Bad-Name': a row's name is lower-case letters, digits and _"):
        load_rows(bad)
    bad.write_text(f"base: {TABLE.base}\nrow:\n  x: {{}}\n")
    with pytest.raises(InputError, match=r"unknown key 'row'"):
        load_rows(bad)
