"""The shipped config files load into the typed config, and say what they claim."""

from pathlib import Path

from mhgpo.config import TrainConfig, demo_config_path, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_demo_config_is_the_packaged_one():
    assert (ROOT / "configs" / "demo.yaml").read_text() == demo_config_path().read_text()
    cfg = load_config(TrainConfig, demo_config_path())
    assert cfg.model == "smollm2-135m" and cfg.sampler == "rr" and cfg.lora.enabled
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
    assert cfg.model == "smollm2-135m" and cfg.algo == "mhgpo" and cfg.sampler == "rr" and cfg.lora.enabled
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
