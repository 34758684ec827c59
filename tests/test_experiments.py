"""The `experiments/` rows (one per row of the paper's tables), `--scale demo`, and the baselines through the CLI:
`train --algo mappo`, `train --system llm --algo grpo|ppo`, `eval --system llm|mas`, and their config errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from helpers import write_echo_world

from mhgpo.config import EvalConfig, TrainConfig, critic_lr, demo_config_path, load_config, to_dict
from mhgpo.config.experiments import SCALE_KEYS, scaled_tree
from mhgpo.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"

# Every training row: what it changes with respect to MHGPO-RR (experiments/mhgpo_rr.yaml), and nothing else.
ROWS: dict[str, dict[str, object]] = {
    "mhgpo_rr": {},
    "mhgpo_is": {"sampler": "is"},
    "mhgpo_fof": {"sampler": "fof"},
    "mhgpo_fof_os": {"sampler": "fof_os"},
    "mappo": {"algo": "mappo", "sampler": "chains"},
    "llm_grpo": {"system": "llm", "algo": "grpo", "sampler": "fof"},
    "llm_ppo": {"system": "llm", "algo": "ppo", "sampler": "chains"},
    **{f"fof_only_{r}": {"sampler": "fof", "train_roles": [r]} for r in ("rewriter", "reranker", "answerer")},
    **{f"fof_freeze_{r}": {"sampler": "fof", "frozen_roles": [r]} for r in ("rewriter", "reranker", "answerer")},
    **{f"rr_aggr_{a}": {"reward.aggr": a} for a in ("max", "min", "rand")},
    **{f"fof_os_aggr_{a}": {"sampler": "fof_os", "reward.aggr": a} for a in ("max", "min", "rand")},
    "fof_final_only": {"sampler": "fof", "reward.penalties": False},
    "rr_final_only": {"reward.penalties": False},
    "mappo_final_only": {"algo": "mappo", "sampler": "chains", "reward.penalties": False},
    **{f"fof_g{g}": {"sampler": "fof", "group_size": g} for g in (3, 5, 6)},
    "warm_mhgpo_rr": {"warm_start.enabled": True},
    "warm_mappo": {"warm_start.enabled": True, "algo": "mappo", "sampler": "chains"},
    "rr_per_role": {"lora.enabled": True, "lora.per_role": True},
    "rr_filter": {"filter_zero_variance": True},
    "warm_rr_no_reranker_penalty": {"warm_start.enabled": True, "search.reranker_penalty": 0.0},
    "warm_mappo_no_reranker_penalty": {
        "warm_start.enabled": True,
        "algo": "mappo",
        "sampler": "chains",
        "search.reranker_penalty": 0.0,
    },
}


def flat(tree: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def row(name: str) -> TrainConfig:
    return load_config(TrainConfig, EXPERIMENTS / f"{name}.yaml")


def test_the_folder_holds_exactly_the_rows() -> None:
    names = {p.stem for p in EXPERIMENTS.glob("*.yaml")}
    assert names == set(ROWS) | {"eval_llm", "eval_mas"}
    readme = (EXPERIMENTS / "README.md").read_text(encoding="utf-8")
    assert all(f"{name}.yaml" in readme for name in names)


def test_the_base_row_is_the_papers_setting() -> None:
    cfg = row("mhgpo_rr")
    assert (cfg.model, cfg.algo, cfg.sampler, cfg.system) == ("meta-llama/Llama-3.1-8B-Instruct", "mhgpo", "rr", "mas")
    assert cfg.optim.lr == 5e-7 and cfg.critic.lr is None and critic_lr(cfg.critic, cfg.optim) == 1e-6
    assert not cfg.lora.enabled and cfg.precision == "auto"  # bf16-mixed on a GPU: float32 master weights
    assert (cfg.group_size, cfg.questions_per_step, cfg.rr_probs) == (4, 512, [0.7, 0.1, 0.2])
    assert (cfg.optim.clip_eps, cfg.optim.kl_beta, cfg.search.rewriter.top_p) == (0.2, 0.001, 0.9)
    assert (cfg.critic.gamma, cfg.critic.lam) == (1.0, 0.95)
    assert cfg.steps == 90447 // cfg.questions_per_step == 176  # one epoch of HotpotQA train, as the paper counts
    assert cfg.rr_regroup == "fork"  # the paper's §3.2: prefix singletons pooled with those that forked alike
    assert cfg.search.answerer.max_new_tokens > 3 * cfg.search.max_answer_words // 2  # the penalty can fire
    assert (cfg.eval_every, cfg.val_limit) == (5, 500)  # validation on 500 questions every 5 steps (Figure 3)
    assert cfg.optim.gradient_checkpointing  # an 8B model's activations at 16k tokens per micro-batch


@pytest.mark.parametrize("name", sorted(ROWS))
def test_each_row_changes_only_its_switches(name: str) -> None:
    base, cfg = flat(to_dict(row("mhgpo_rr"))), flat(to_dict(row(name)))
    changed = {k: cfg[k] for k in cfg if cfg[k] != base[k] and k != "output_dir"}
    assert changed == ROWS[name]
    assert cfg["output_dir"] == f"runs/{name}"


@pytest.mark.parametrize("name", ["eval_llm", "eval_mas"])
def test_training_free_rows_are_eval_configs(name: str) -> None:
    cfg = load_config(EvalConfig, EXPERIMENTS / f"{name}.yaml")
    assert cfg.system == name.split("_")[1] and cfg.model == "meta-llama/Llama-3.1-8B-Instruct"
    with pytest.raises(InputError, match=r"eval_.*\.yaml: unknown config key"):
        load_config(TrainConfig, EXPERIMENTS / f"{name}.yaml")


@pytest.mark.parametrize("name", ["mappo", "fof_freeze_reranker", "fof_os_aggr_rand", "llm_ppo", "fof_g3"])
def test_demo_scale_keeps_the_switches_and_takes_the_demo_size(name: str) -> None:
    paper, demo = to_dict(row(name)), to_dict(load_config(TrainConfig, demo_config_path()))
    cfg = load_config(TrainConfig, None, [], base=scaled_tree(EXPERIMENTS / f"{name}.yaml", "demo"))
    got = flat(to_dict(cfg))
    for key, value in flat(paper).items():
        if key == "output_dir":
            assert got[key] == f"runs/{name}-demo"
        elif any(key == k or key.startswith(k + ".") for k in SCALE_KEYS):
            assert got[key] == flat(demo)[key], key
        else:
            assert got[key] == value, key  # the row's switches (and every other non-scale key) are kept
    assert (cfg.model, cfg.steps, cfg.questions_per_step, cfg.lora.enabled) == ("smollm2-135m", 6, 4, True)
    assert (cfg.critic.lr, cfg.critic.warmup_steps, cfg.search.answerer.max_new_tokens) == (None, 1, 48)


def test_config_errors_name_the_key() -> None:
    with pytest.raises(InputError, match=r"^algo: grpo is the single-agent baseline \(system=llm\)"):
        load_config(TrainConfig, None, ["algo=grpo"])
    with pytest.raises(InputError, match=r"^sampler: mappo learns from independent chains \(sampler=chains\)"):
        load_config(TrainConfig, None, ["algo=mappo", "sampler=rr"])
    with pytest.raises(InputError, match=r"^sampler: chains forms no groups"):
        load_config(TrainConfig, None, ["sampler=chains"])
    with pytest.raises(InputError, match=r"^sampler: grpo trains with is or fof, got 'rr'"):
        load_config(TrainConfig, None, ["system=llm", "algo=grpo", "sampler=rr"])
    with pytest.raises(InputError, match=r"^algo: expected mhgpo, grpo, mappo or ppo, got 'a2c'"):
        load_config(TrainConfig, None, ["algo=a2c"])
    with pytest.raises(InputError, match=r"^critic\.lam: must be in \[0, 1\]"):
        load_config(TrainConfig, None, ["algo=mappo", "critic.lam=1.5"])
    defaults = {
        (a, s): load_config(TrainConfig, None, [f"algo={a}", f"system={s}"]).sampler
        for a, s in (("mhgpo", "mas"), ("mhgpo", "llm"), ("grpo", "llm"), ("mappo", "mas"), ("ppo", "llm"))
    }
    assert defaults == {
        ("mhgpo", "mas"): "rr",
        ("mhgpo", "llm"): "fof",
        ("grpo", "llm"): "fof",
        ("mappo", "mas"): "chains",
        ("ppo", "llm"): "chains",
    }
    assert dataclasses.asdict(load_config(TrainConfig, None, ["algo=mappo", "group_size=1"]))["group_size"] == 1


# ------------------------------------------------------------------------------------------- the command line


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_echo_world(tmp_path_factory.mktemp("world"), seed=2, n_train=12, n_dev=3)


def small(world: Path, model_dir: Path, out: Path) -> list[str]:
    return [
        f"model={model_dir}",
        f"data=hotpotqa:{world / 'train_echo.jsonl'}",
        f"val_data=hotpotqa:{world / 'dev.jsonl'}",
        f"retrieval.corpus={world / 'corpus.jsonl'}",
        f"output_dir={out}",
        "steps=1",
        "questions_per_step=2",
        "group_size=2",
        "eval_every=1",
        "val_limit=2",
        "save_every=1",
        "lora.r=4",
        "search.rewriter.max_new_tokens=6",
        "search.reranker.max_new_tokens=4",
        "search.answerer.max_new_tokens=4",
    ]


def mhgpo_main(*args: object) -> int:
    from mhgpo.cli.main import main

    return main([str(a) for a in args])


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rollouts" / "step_000001.jsonl").read_text().splitlines()]


def test_train_mappo_and_single_agent_grpo_and_ppo(world, tiny_model_dir, tmp_path, capsys) -> None:
    run = tmp_path / "mappo"
    assert mhgpo_main("train", "--algo", "mappo", *small(world, tiny_model_dir, run)) == 0
    assert "finished 1 steps" in capsys.readouterr().out
    cfg = load_config(TrainConfig, run / "config.yaml")
    assert (cfg.algo, cfg.sampler) == ("mappo", "chains")
    assert (run / "checkpoints" / "step_1" / "critic.safetensors").is_file()
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert {"critic/loss", "critic/explained_variance", "val/f1"} <= set(metrics) and metrics["actor_updated"] == 1.0
    llm = [r for r in records(run) if r["kind"] == "llm"]
    assert len(llm) == 2 * 2 * 3 and len({r["group_id"] for r in llm}) == 12  # G chains per question

    for algo, sampler in (("grpo", "fof"), ("ppo", "chains")):
        run = tmp_path / algo
        assert mhgpo_main("train", "--system", "llm", "--algo", algo, *small(world, tiny_model_dir, run)) == 0
        cfg = load_config(TrainConfig, run / "config.yaml")
        assert (cfg.system, cfg.algo, cfg.sampler) == ("llm", algo, sampler)
        rows = records(run)
        assert {r["agent"] for r in rows} == {"llm"} and len(rows) == 4  # 2 questions x G answers, no retrieval
        if algo == "grpo":  # two groups, each the G = 2 answers to one question
            by_group: dict[int, list[str]] = {}
            for r in rows:
                by_group.setdefault(r["group_id"], []).append(r["question_id"])
            assert sorted(len(set(q)) for q in by_group.values()) == [1, 1]
            assert sorted(len(q) for q in by_group.values()) == [2, 2]


def test_train_a_row_at_demo_scale(world, tiny_model_dir, tmp_path) -> None:
    run = tmp_path / "row"
    config = EXPERIMENTS / "fof_freeze_reranker.yaml"
    assert mhgpo_main("train", "--config", config, "--scale", "demo", *small(world, tiny_model_dir, run)) == 0
    cfg = load_config(TrainConfig, run / "config.yaml")
    assert (cfg.sampler, cfg.frozen_roles, cfg.lora.enabled, cfg.optim.lr) == ("fof", ["reranker"], True, 1e-4)
    rows = [r for r in records(run) if r["kind"] == "llm"]
    assert {r["agent"] for r in rows if not r["trained"]} == {"reranker"}
    assert {r["agent"] for r in rows if r["trained"]} == {"rewriter", "answerer"}


def test_eval_the_model_alone_and_the_untrained_team(world, tiny_model_dir, tmp_path) -> None:
    for system in ("llm", "mas"):
        out = tmp_path / system
        assert (
            mhgpo_main(
                "eval",
                "--system",
                system,
                "--model",
                tiny_model_dir,
                "--data",
                f"hotpotqa:{world / 'dev.jsonl'}",
                "--corpus",
                world / "corpus.jsonl",
                "--output-dir",
                out,
                "search.answerer.max_new_tokens=4",
                "search.rewriter.max_new_tokens=6",
                "search.reranker.max_new_tokens=4",
            )
            == 0
        )
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["n"] == 3 and metrics["system"] == system
        steps = [
            [s["agent"] for s in json.loads(line)["trace"]["steps"]]
            for line in (out / "predictions.jsonl").read_text().splitlines()
        ]
        want = ["llm"] if system == "llm" else ["rewriter", "retriever", "reranker", "answerer"]
        assert steps == [want] * 3


def test_cli_rejects_bad_baseline_settings(capsys) -> None:
    assert mhgpo_main("train", "--algo", "grpo", "--steps", "1") == 2
    assert "mhgpo: error: algo: grpo is the single-agent baseline" in capsys.readouterr().err
    assert mhgpo_main("train", "--algo", "mappo", "--sampler", "rr") == 2
    assert "mhgpo: error: sampler: mappo learns from independent chains" in capsys.readouterr().err
