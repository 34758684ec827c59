"""Typed configs (mhgpo/config/load.py): YAML dumps, key=value overrides and errors that name the key; and the
shipped config files, which load into the typed config and say what they claim."""

from pathlib import Path

import pytest

from mhgpo.config import EvalConfig, TrainConfig, demo_config_path, dump_config, load_config
from mhgpo.errors import InputError

ROOT = Path(__file__).resolve().parents[2]


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


# ---------------------------------------------------------------------------------------- the shipped config files


def test_demo_config_is_the_packaged_one():
    assert (ROOT / "configs" / "demo.yaml").read_text() == demo_config_path().read_text()
    cfg = load_config(TrainConfig, demo_config_path())
    assert cfg.model == "smollm2-135m" and cfg.sampler == "is" and cfg.lora.enabled
    assert cfg.rr_probs == [0.7, 0.1, 0.2] and cfg.group_size == 4


def test_paper_config_is_the_papers_setting():
    cfg = load_config(TrainConfig, ROOT / "configs" / "paper_hotpotqa.yaml")
    assert cfg.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert cfg.optim.lr == 5e-7 and cfg.group_size == 4 and cfg.questions_per_step == 512
    assert cfg.optim.clip_eps == 0.2 and cfg.optim.kl_beta == 0.001
    assert cfg.search.rewriter.top_p == 0.9 and cfg.search.rewriter.temperature == 1.0
    assert cfg.rr_probs == [0.7, 0.1, 0.2] and cfg.sampler == "rr" and not cfg.lora.enabled
    assert cfg.steps == 90447 // cfg.questions_per_step == 176  # one epoch over HotpotQA train, as the paper counts
    assert (cfg.eval_every, cfg.val_limit) == (5, 500)  # the paper's Figure 3: 500 dev questions every 5 steps
    assert cfg.rr_regroup == "fork" and cfg.precision == "auto"
    assert cfg.search.answerer.max_new_tokens > 3 * cfg.search.max_answer_words // 2  # the penalty can fire


def test_hotpotqa_cpu_config_trains_the_default_model_on_split_files():
    cfg = load_config(TrainConfig, ROOT / "configs" / "hotpotqa_cpu.yaml")
    assert cfg.model == "smollm2-135m" and cfg.algo == "mhgpo" and cfg.sampler == "is" and cfg.lora.enabled
    assert cfg.budget_minutes == 10 and cfg.warm_start.steps == 36  # the reproduction page's row warm_is
    assert (cfg.data, cfg.val_data) == ("hotpotqa:data/hotpotqa/train.jsonl", "hotpotqa:data/hotpotqa/val.jsonl")
    assert cfg.retrieval.corpus == "context" and cfg.reference == "init"
    assert "mhgpo data split --data hotpotqa:" in (ROOT / "configs" / "hotpotqa_cpu.yaml").read_text()
    demo = load_config(TrainConfig, ROOT / "mhgpo" / "config" / "demo.yaml")  # the demo's recipe
    assert cfg.search.reranker_penalty == demo.search.reranker_penalty == 0.0
    assert (cfg.optim.lr, cfg.warm_start.enabled) == (demo.optim.lr, demo.warm_start.enabled)


def test_accelerate_configs_launch_what_their_names_say():
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    folder = ROOT / "configs" / "accelerate"
    for name, kind, processes in (
        ("cpu_ddp", DistributedType.MULTI_GPU, 2),
        ("gpu_ddp", DistributedType.MULTI_GPU, 8),
        ("cpu_fsdp", DistributedType.FSDP, 2),
        ("gpu_fsdp", DistributedType.FSDP, 8),
    ):
        cfg = load_config_from_file(str(folder / f"{name}.yaml"))
        assert (cfg.distributed_type, cfg.num_processes) == (kind, processes), name
        assert cfg.mixed_precision == "no" and not cfg.use_cpu, name  # mhgpo picks its precision; torchrun starts ranks
        if kind == DistributedType.FSDP:
            assert cfg.fsdp_config["fsdp_version"] == 2, name
