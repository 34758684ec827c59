"""The training config's own checks and defaults (mhgpo/config/train.py): the critic's learning rate, the sampler
filled by loading, regrouping and advantage schemes, the baselines' algorithms and samplers, and the generation
engine's keys (without vLLM)."""

from __future__ import annotations

import dataclasses

import pytest

from mhgpo.config import TrainConfig, dump_config, load_config
from mhgpo.errors import InputError


def test_critic_lr_defaults_to_twice_the_actors():
    from mhgpo.config import TrainConfig, critic_lr

    cfg = load_config(TrainConfig, None, ["algo=mappo", "optim.lr=5e-7"])
    assert cfg.critic.lr is None and critic_lr(cfg.critic, cfg.optim) == 1e-6  # the paper's pair
    cfg = load_config(TrainConfig, None, ["algo=mappo", "optim.lr=1e-4", "critic.lr=3e-5"])
    assert critic_lr(cfg.critic, cfg.optim) == 3e-5
    with pytest.raises(InputError, match=r"critic\.lr: must be positive"):
        load_config(TrainConfig, None, ["critic.lr=0"])


def test_bad_regrouping_keys_are_named():
    from mhgpo.config import TrainConfig

    with pytest.raises(InputError, match=r"^rr_regroup: expected fork, role, all, got 'agent'"):
        load_config(TrainConfig, None, ["rr_regroup=agent"])
    assert load_config(TrainConfig, None, []).rr_regroup == "fork"


def test_the_default_sampler_is_filled_by_loading_not_by_the_check(tmp_path):
    from mhgpo.config import TrainConfig

    assert load_config(TrainConfig).sampler == "rr"
    assert load_config(TrainConfig, overrides=["system=llm", "algo=grpo"]).sampler == "fof"
    assert load_config(TrainConfig, overrides=["algo=mappo"]).sampler == "chains"
    assert load_config(TrainConfig, overrides=["sampler=is"]).sampler == "is"
    bare = TrainConfig()
    assert bare.resolved().sampler == "rr" and bare.sampler is None  # a copy: the original stays as it was
    with pytest.raises(InputError, match="sampler"):
        bare.validate()  # checks only: an unfilled sampler is refused, not filled
    assert bare.sampler is None
    dump_config(load_config(TrainConfig), tmp_path / "c.yaml")
    assert "sampler: rr" in (tmp_path / "c.yaml").read_text()  # the dumped config names the sampler


def test_advantage_scheme_is_checked():
    from mhgpo.config import TrainConfig

    assert load_config(TrainConfig, None, []).advantage == "mhgpo"
    assert load_config(TrainConfig, None, ["advantage=prompt_agent_turn"]).advantage == "prompt_agent_turn"
    with pytest.raises(
        InputError, match=r"^advantage: expected mhgpo, mhgpo_mean, agent or prompt_agent_turn, got 'dr'"
    ):
        load_config(TrainConfig, None, ["advantage=dr"])
    with pytest.raises(InputError, match=r"^advantage: mappo's advantages come from its critic"):
        load_config(TrainConfig, None, ["algo=mappo", "advantage=agent"])


# ------------------------------------------------------------------------------------ the generation engine's keys


def test_the_keys_default_to_the_trainers_own_generation() -> None:
    cfg = load_config(TrainConfig, None)
    assert (cfg.generation.engine, cfg.optim.old_logprobs, cfg.generation.sync_tolerance) == ("hf", "trainer", None)
    cfg = load_config(
        TrainConfig, None, ["generation.engine=vllm", "optim.old_logprobs=engine", "generation.sync_tolerance=0.02"]
    )
    assert (cfg.generation.engine, cfg.optim.old_logprobs, cfg.generation.sync_tolerance) == ("vllm", "engine", 0.02)


@pytest.mark.parametrize(
    "override, message",
    [
        ("generation.engine=sglang", r"^generation\.engine: expected hf, vllm or vllm_server, got 'sglang'$"),
        ("optim.old_logprobs=critic", r"^optim\.old_logprobs: expected trainer or engine, got 'critic'$"),
        ("generation.sync_tolerance=0", r"^generation\.sync_tolerance: must be positive, got 0"),
        ("generation.kv_cache_gb=-1", r"^generation\.kv_cache_gb: must be positive"),
    ],
)
def test_bad_values_name_the_key(override: str, message: str) -> None:
    with pytest.raises(InputError, match=message):
        load_config(TrainConfig, None, [override])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optim.engine_is_cap=0.5"], r"^optim\.engine_is_cap: must be at least 1 \(null: no weight\), got 0\.5$"),
        (
            ["optim.engine_is_cap=2"],
            r"^optim\.engine_is_cap: weighs the mismatch between a separate engine and the trainer; "
            r"generation\.engine=hf samples with the trainer \(set it to null\)$",
        ),
        (
            ["optim.engine_is_cap=2", "generation.engine=vllm", "optim.old_logprobs=engine"],
            r"^optim\.engine_is_cap: the weight exp\(log p_trainer - log p_engine\) needs the trainer's old "
            r"log-probs; with optim\.old_logprobs=engine the ratio already divides by the engine's \(use "
            r"optim\.old_logprobs=trainer\)$",
        ),
    ],
)
def test_the_engine_importance_cap_is_checked(overrides: list[str], message: str) -> None:
    with pytest.raises(InputError, match=message):
        load_config(TrainConfig, None, overrides)


def test_the_engine_importance_cap_is_read() -> None:
    assert load_config(TrainConfig, None).optim.engine_is_cap is None
    cfg = load_config(TrainConfig, None, ["generation.engine=vllm", "optim.engine_is_cap=2"])
    assert (cfg.optim.engine_is_cap, cfg.optim.old_logprobs) == (2.0, "trainer")


# --------------------------------------------------------------------------------------------------- the baselines


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


def test_rollout_pipeline_is_on_where_it_pays_unless_set() -> None:
    from mhgpo.config import rollout_pipelined

    def pipelined(*overrides: str) -> bool:
        return rollout_pipelined(load_config(TrainConfig, None, list(overrides)))

    assert not pipelined()  # in-process decoding, in-process BM25: nothing waits
    assert pipelined("retrieval.retriever=http://127.0.0.1:8000/retrieve")
    assert pipelined("generation.engine=vllm_server", "generation.server_urls=[http://127.0.0.1:8001]")
    assert pipelined("rollout.pipeline=true") and not pipelined(
        "rollout.pipeline=false", "retrieval.retriever=http://127.0.0.1:8000/retrieve"
    )
    from mhgpo.config import EvalConfig, SFTConfig

    assert rollout_pipelined(load_config(EvalConfig, None, ["retrieval.retriever=http://127.0.0.1:8000/retrieve"]))
    assert not rollout_pipelined(load_config(EvalConfig, None, [])) and not rollout_pipelined(SFTConfig())
    with pytest.raises(InputError, match=r"^rollout\.pipeline: "):
        load_config(TrainConfig, None, ["rollout.pipeline=sometimes"])
