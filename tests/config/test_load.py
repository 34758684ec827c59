"""Typed configs: YAML dumps, key=value overrides, and errors that name the key."""

import pytest

from mhgpo.config import EvalConfig, dump_config, load_config
from mhgpo.errors import InputError


def test_defaults_and_overrides():
    cfg = load_config(EvalConfig, None, ["limit=5", "search.top_k=7", "search.answerer.max_new_tokens=9", "model=x"])
    assert cfg.limit == 5 and cfg.search.top_k == 7 and cfg.search.answerer.max_new_tokens == 9 and cfg.model == "x"
    assert cfg.search.rewriter.max_new_tokens == 48  # untouched defaults stay


def test_a_partial_section_keeps_its_fields_own_defaults():
    """A section whose default differs from its class's defaults keeps them when one key is overridden."""
    from mhgpo.config import SFTConfig, TrainConfig

    cfg = load_config(EvalConfig, None, ["search.reranker.top_p=0.95"])
    assert (cfg.search.reranker.top_p, cfg.search.reranker.max_new_tokens) == (0.95, 16)  # not AgentSampling's 48
    sft = load_config(SFTConfig, None, ["optim.gradient_checkpointing=false"])
    assert (sft.optim.lr, sft.optim.kl_beta, sft.optim.gradient_checkpointing) == (5e-4, 0.0, False)
    train = load_config(TrainConfig, None, ["search.answerer.temperature=0.7"])
    assert train.search.answerer.max_new_tokens == 24 and train.search.rewriter.max_new_tokens == 48


def test_unknown_key_named():
    with pytest.raises(InputError, match=r"unknown config key search\.topk"):
        load_config(EvalConfig, None, ["search.topk=3"])


def test_bad_value_named():
    with pytest.raises(InputError, match=r"search\.top_k: expected an integer, got 'three'"):
        load_config(EvalConfig, None, ["search.top_k=three"])
    with pytest.raises(InputError, match=r"limit: expected an integer"):
        load_config(EvalConfig, None, ["limit=1.5"])


def test_override_without_equals():
    with pytest.raises(InputError, match="key=value"):
        load_config(EvalConfig, None, ["limit"])


def test_yaml_roundtrip(tmp_path):
    cfg = load_config(EvalConfig, None, ["limit=3", "search.snippet_words=11"])
    path = tmp_path / "c.yaml"
    dump_config(cfg, path)
    assert load_config(EvalConfig, path) == cfg


def test_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("limit: 3\nsearch:\n  top_k: [\n")
    with pytest.raises(InputError, match=r"bad\.yaml:\d+: invalid YAML"):
        load_config(EvalConfig, bad)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("limmit: 3\n")
    with pytest.raises(InputError, match=r"unknown\.yaml: unknown config key limmit"):
        load_config(EvalConfig, unknown)
    with pytest.raises(InputError, match="config file not found"):
        load_config(EvalConfig, tmp_path / "missing.yaml")


def test_critic_lr_defaults_to_twice_the_actors():
    from mhgpo.config import TrainConfig, critic_lr

    cfg = load_config(TrainConfig, None, ["algo=mappo", "optim.lr=5e-7"])
    assert cfg.critic.lr is None and critic_lr(cfg.critic, cfg.optim) == 1e-6  # the paper's pair
    cfg = load_config(TrainConfig, None, ["algo=mappo", "optim.lr=1e-4", "critic.lr=3e-5"])
    assert critic_lr(cfg.critic, cfg.optim) == 3e-5
    with pytest.raises(InputError, match=r"critic\.lr: must be positive"):
        load_config(TrainConfig, None, ["critic.lr=0"])


def test_warm_up_starts_below_the_lr_and_reaches_it():
    from mhgpo.config import OptimConfig, TrainConfig
    from mhgpo.rl.policy import _lr_lambda

    assert [_lr_lambda(OptimConfig(warmup_steps=0), 10)(t) for t in range(2)] == [1.0, 1.0]
    assert [_lr_lambda(OptimConfig(warmup_steps=1), 10)(t) for t in range(3)] == [0.5, 1.0, 1.0]
    assert [_lr_lambda(OptimConfig(warmup_steps=3), 10)(t) for t in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    cosine = _lr_lambda(OptimConfig(warmup_steps=2, schedule="cosine"), 6)
    assert [round(cosine(t), 6) for t in range(7)] == [
        round(1 / 3, 6),
        round(2 / 3, 6),
        1.0,
        0.853553,
        0.5,
        0.146447,
        0.0,
    ]
    with pytest.raises(InputError, match=r"optim\.warmup_steps: must be >= 0"):
        load_config(TrainConfig, None, ["optim.warmup_steps=-1"])


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
    with pytest.raises(InputError, match=r"^advantage: expected mhgpo, agent or prompt_agent_turn, got 'dr'"):
        load_config(TrainConfig, None, ["advantage=dr"])
    with pytest.raises(InputError, match=r"^advantage: mappo's advantages come from its critic"):
        load_config(TrainConfig, None, ["algo=mappo", "advantage=agent"])
