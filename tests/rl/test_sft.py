"""The supervised warm start (`mhgpo sft`): gold traces walked through the real team, the loss and its
micro-batch invariance, the run directory it writes, learning, and exact resume; on a small synthetic world and
the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mhgpo.config import RetrievalConfig, SearchConfig, SFTConfig, TrainConfig, load_config
from mhgpo.config.eval import AgentSampling
from mhgpo.data.formats import load_hotpotqa
from mhgpo.errors import InputError
from mhgpo.model.pretrained import encode_chat
from mhgpo.model.trained import load_model
from mhgpo.rl.losses import token_weights
from mhgpo.rl.policy import Policy, Sample
from mhgpo.rl.sft import collect_demonstrations, over_budget, sft_loss, sft_update, target_encoder
from mhgpo.run.warm_start import resume_sft, run_sft
from mhgpo.runtime.runlog import read_metrics
from mhgpo.team.build import build_workflow
from mhgpo.team.search_system import ANSWERER, RERANKER, REWRITER, format_ids, format_queries, gold_ids, grounded

VOLATILE = ("seconds/", "memory/")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mhgpo.data.synth_files import write_world

    mp = pytest.MonkeyPatch()
    mp.setenv("MHGPO_CACHE", str(tmp_path_factory.mktemp("cache")))
    folder = tmp_path_factory.mktemp("world")
    write_world(folder, seed=0, n_train=30, n_dev=8)
    yield folder
    mp.undo()


def sft_config(model_dir: Path, world: Path, out: Path, **extra: object) -> SFTConfig:
    settings: dict[str, object] = {
        "model": model_dir,
        "data": f"hotpotqa:{world / 'train.jsonl'}",
        "val_data": f"hotpotqa:{world / 'dev.jsonl'}",
        "retrieval.corpus": world / "corpus.jsonl",
        "output_dir": out,
        "steps": 3,
        "batch_size": 6,
        "val_limit": 2,
        "format_limit": 2,
        "search.rewriter.max_new_tokens": 6,
        "search.reranker.max_new_tokens": 4,
        "search.answerer.max_new_tokens": 4,
        "search.snippet_words": 8,
        "search.max_candidates": 4,
        "optim.lr": 0.01,
        "lora.r": 4,
    }
    settings.update(extra)
    return load_config(SFTConfig, None, [f"{k}={v}" for k, v in settings.items()])


def test_demonstrations_are_the_teams_prompts_with_gold_outputs(tiny_lm, world: Path) -> None:
    examples = load_hotpotqa(world / "train.jsonl")
    workflow = build_workflow("mas", "hotpotqa:x", RetrievalConfig(corpus=str(world / "corpus.jsonl")), SearchConfig())
    encode = lambda m: encode_chat(tiny_lm.tokenizer, m)  # noqa: E731
    to_ids = target_encoder(tiny_lm.tokenizer)
    demos, skipped = collect_demonstrations(examples, workflow, encode, to_ids)
    by_agent = {a: [d for d in demos if d.agent == a] for a in (REWRITER, RERANKER, ANSWERER)}
    assert len(by_agent[REWRITER]) == len(by_agent[RERANKER]) == len(examples)
    assert len(by_agent[ANSWERER]) + skipped.get(f"skipped/{ANSWERER}", 0) == len(examples)
    end = tiny_lm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for d in demos:
        assert d.target_ids[-1] == end
        assert tiny_lm.tokenizer.decode(d.target_ids, skip_special_tokens=True) == d.target
        assert d.prompt_ids == encode(workflow.build_prompt(d.state, d.agent))  # the prompt RL would build
        example = d.state.example
        if d.agent == REWRITER:
            assert d.target == format_queries(example.decomposition)  # the world knows the hops
            assert "queries" not in d.state
        elif d.agent == RERANKER:
            candidates = d.state.get("candidates")
            assert d.state.get("queries") == example.decomposition  # retrieved with the gold queries
            assert d.target == format_ids(gold_ids(candidates, example.supporting_titles))
        else:
            shown = [d.state.get("candidates")[i] for i in d.state.get("selected")]
            assert {p.title for p in shown} <= set(example.supporting_titles)
            assert d.target == example.answers[0] and grounded(d.target, example.question, shown)
    assert any(d.target != "None" for d in by_agent[RERANKER]) and by_agent[ANSWERER]
    # the demonstrations longer than their agent's max_new_tokens (sampling would cut them), per agent
    lengths = sorted(len(d.target_ids) for d in by_agent[REWRITER])
    for budget in (lengths[-1], lengths[-1] - 1, lengths[0] - 1):  # a budget equal to the longest holds it
        workflow.config = SearchConfig(rewriter=AgentSampling(max_new_tokens=budget))
        n = sum(length > budget for length in lengths)
        assert over_budget(demos, workflow) == ({REWRITER: (n, lengths[-1], budget)} if n else {})
    assert n == len(lengths)


def _samples(tiny_lm) -> list[Sample]:
    tok = tiny_lm.tokenizer
    to_ids = target_encoder(tok)
    rows = [
        ("rewriter", "Who wrote Dune?", "### Dune author ###"),
        ("reranker", "Which river?", "0, 2"),
        ("answerer", "Capital of France?", "Paris"),
        ("answerer", "Largest planet?", "Jupiter, the largest"),
        ("rewriter", "When did the wall fall?", "### Berlin Wall; 1989 ###"),
    ]
    return [Sample(encode_chat(tok, [{"role": "user", "content": q}]), to_ids(t), [], 0.0, a) for a, q, t in rows]


def test_sft_loss_is_the_role_averaged_cross_entropy_and_ignores_the_micro_batch_cut(
    tiny_model_dir: Path, tiny_lm
) -> None:
    from mhgpo.config import LoraConfig, OptimConfig

    samples = _samples(tiny_lm)
    results = []
    for tokens in (10_000, 40):  # one micro-batch, then one or two samples each
        loaded = load_model(str(tiny_model_dir), device="cpu")
        optim = OptimConfig(lr=1e-3, kl_beta=0.0, micro_batch_tokens=tokens, gradient_checkpointing=False)
        policy = Policy(
            loaded.model, loaded.tokenizer.pad_token_id, optim, LoraConfig(enabled=False), 1, keep_reference=False
        )
        assert policy.ref_model is None
        before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
        metrics = sft_update(policy, samples)
        results.append((metrics, {n: p.grad.detach().clone() for n, p in policy.model.named_parameters()}))
        if tokens == 10_000:  # the loss by hand: token mean, sample mean per role, role mean
            with torch.no_grad():
                for n, p in policy.model.named_parameters():
                    p.copy_(before[n])
                nll = {}
                for s in samples:
                    logp, mask = policy.logprobs([s])
                    nll.setdefault(s.agent, []).append(-float(logp[0].sum()) / len(s.output_ids))
                expected = sum(sum(v) / len(v) for v in nll.values()) / len(nll)
                assert metrics["loss"] == pytest.approx(expected, rel=1e-6)
                for agent, values in nll.items():
                    assert metrics[f"sft/{agent}/nll"] == pytest.approx(sum(values) / len(values), rel=1e-6)
    (m1, d1), (m2, d2) = results
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-6)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
    for name in d1:
        torch.testing.assert_close(d1[name], d2[name], rtol=1e-5, atol=1e-7)


def test_sft_loss_under_token_weighting_is_each_roles_token_mean(tiny_model_dir: Path, tiny_lm) -> None:
    from mhgpo.config import LoraConfig, OptimConfig

    samples = _samples(tiny_lm)
    loaded = load_model(str(tiny_model_dir), device="cpu")
    optim = OptimConfig(lr=1e-3, kl_beta=0.0, micro_batch_tokens=40, gradient_checkpointing=False)
    policy = Policy(
        loaded.model, loaded.tokenizer.pad_token_id, optim, LoraConfig(enabled=False), 1, keep_reference=False
    )
    nll: dict[str, list[float]] = {}
    with torch.no_grad():
        for s in samples:
            logp, _ = policy.logprobs([s])
            nll.setdefault(s.agent, []).extend((-logp[0, : len(s.output_ids)]).tolist())
    metrics = sft_update(policy, samples, "token")
    assert metrics["loss"] == pytest.approx(sum(sum(v) / len(v) for v in nll.values()) / len(nll), rel=1e-6)


def test_token_weighting_weighs_each_roles_tokens_alike() -> None:
    """`token`: every token of a role weighs the same (an output by its length), each role 1 / n_roles in all;
    `output`: the RL objective's weights. Where two gold outputs share a beginning ("0" and "0, 3"), the token that
    ends the short one outweighs the one that goes on under `output`, not under `token`."""
    from mhgpo.rl.sft import sft_weights

    def sample(agent: str, n: int) -> Sample:
        return Sample([1], list(range(n)), [], 0.0, agent)

    samples = [sample("reranker", 2), sample("reranker", 2), *[sample("reranker", 4)] * 3, sample("answerer", 3)]
    w = sft_weights(samples, "token")
    assert w.tolist() == pytest.approx([1 / 32] * 5 + [1 / 6])  # 16 Reranker tokens, 3 Answerer tokens
    lengths = torch.tensor([2.0, 2.0, 4.0, 4.0, 4.0, 3.0])
    assert float((w * lengths)[:5].sum()) == pytest.approx(0.5) and float(w[5] * 3) == pytest.approx(0.5)
    assert torch.equal(sft_weights(samples), token_weights([s.agent for s in samples], [2, 2, 4, 4, 4, 3]))
    # after the shared "0": the stop token of the two "0" (samples 0, 1) against the "," of the three "0, 3"
    out = sft_weights(samples, "output")
    assert float(out[:2].sum()) > float(out[2:5].sum()) and float(w[:2].sum()) < float(w[2:5].sum())
    assert sft_weights([sample("a", 0), sample("b", 2)], "token").tolist() == [0.0, 0.5]  # a role without tokens
    with pytest.raises(ValueError, match="unknown weighting"):
        sft_weights(samples, "sample")


def test_sft_loss_weights_masked_tokens_zero() -> None:
    logp = torch.tensor([[-1.0, -2.0, -50.0], [-3.0, -99.0, -99.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    w = token_weights(["a", "b"], [2, 1])
    assert float(sft_loss(logp, mask, w)) == pytest.approx(0.5 * (1.5 + 3.0))


def test_sft_run_directory_learning_and_start_for_rl(
    tiny_model_dir: Path, world: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "sft"
    trainer = run_sft(
        sft_config(
            tiny_model_dir, world, out, steps=12, limit=4, batch_size=6, **{"optim.lr": 1e-2, "lora.enabled": "false"}
        ),
        progress=False,
    )
    assert trainer.step == 12
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 13))
    for agent in (REWRITER, RERANKER, ANSWERER):  # four questions, seen again and again: learned
        nll = [r[f"sft/{agent}/nll"] for r in rows if f"sft/{agent}/nll" in r]
        assert nll[-1] < 0.7 * nll[0], (agent, nll)
    final = rows[-1]
    for agent in (REWRITER, RERANKER, ANSWERER):
        assert 0.0 <= final[f"sft/{agent}/format_ok"] <= 1.0 and f"sft/{agent}/exact" in final
    assert {"val/f1", "val/em", "val/acc"} <= set(final) and "val/f1" not in rows[0]
    assert (out / "checkpoints" / "step_12" / "model.safetensors").is_file()
    counts = json.loads((out / "demonstrations.json").read_text())
    assert counts["questions"] == 4 and counts["demonstrations"]["rewriter"] == 4
    # every gold sub-query list is longer than this config's 6 Rewriter tokens: counted, and said once an agent
    assert counts["over_budget"] == {
        a: n for a, (n, _, _) in over_budget(trainer.demos, trainer.setup.workflow).items()
    }
    assert counts["over_budget"]["rewriter"] == 4
    warned = [line for line in capsys.readouterr().err.splitlines() if "demonstrations are longer" in line]
    assert len(warned) == len(counts["over_budget"])
    assert "mhgpo: warning: 4 of 4 rewriter demonstrations are longer than its max_new_tokens=6" in warned[0]
    assert load_config(SFTConfig, out / "config.yaml").steps == 12


def test_sft_resume_continues_exactly(tiny_model_dir: Path, world: Path, tmp_path: Path) -> None:
    full = tmp_path / "full"
    run_sft(sft_config(tiny_model_dir, world, full, steps=4, save_every=1, val_limit=0), progress=False)
    part = tmp_path / "part"
    run_sft(sft_config(tiny_model_dir, world, part, steps=2, save_every=1, val_limit=0), progress=False)
    assert resume_sft(part, ["steps=4"], progress=False).step == 4

    def comparable(d: Path) -> list[dict]:  # the 2-step run also evaluated its last step, step 2
        return [
            {k: v for k, v in r.items() if not k.startswith(VOLATILE) and not k.endswith(("format_ok", "exact", "/f1"))}
            for r in read_metrics(d)
        ]

    assert comparable(part) == comparable(full)
    from safetensors.torch import load_file

    a = load_file(str(full / "checkpoints" / "step_4" / "model.safetensors"))
    b = load_file(str(part / "checkpoints" / "step_4" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sft_config_errors_name_the_key(tiny_model_dir: Path, world: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="batch_size"):
        sft_config(tiny_model_dir, world, tmp_path / "x", batch_size=0)
    with pytest.raises(InputError, match="loss_weighting: expected output or token, got .sample."):
        sft_config(tiny_model_dir, world, tmp_path / "z", loss_weighting="sample")
    with pytest.raises(InputError, match="warm_start.loss_weighting: expected output or token"):
        load_config(TrainConfig, None, ["warm_start.loss_weighting=tokens"])
    with pytest.raises(InputError, match="roles: unknown role 'planner'"):
        run_sft(sft_config(tiny_model_dir, world, tmp_path / "y", roles="[planner]"), progress=False)


def test_balanced_batches_hold_the_roles_in_equal_shares_and_cover_each_role(
    tiny_model_dir: Path, world: Path, tmp_path: Path
) -> None:
    from mhgpo.rl.sft import SFTTrainer
    from mhgpo.run.setup import build_sft, settle

    cfg = sft_config(tiny_model_dir, world, tmp_path / "b", batch_size=6, limit=5, balance_roles="true", val_limit=0)
    job = settle(cfg)
    setup, demos, held, _ = build_sft(job)
    trainer = SFTTrainer(job.cfg, setup, tmp_path / "b", demos, held, progress=False)
    per_role = {r: sum(d.agent == r for d in demos) for r in (REWRITER, RERANKER, ANSWERER)}
    drawn: dict[str, list[int]] = {r: [] for r in per_role}
    for _ in range(5):
        batch = trainer._next_demos()
        assert [d.agent for d in batch] == [REWRITER, RERANKER, ANSWERER] * 2
        for d in batch:
            drawn[d.agent].append(next(i for i, x in enumerate(demos) if x is d))
    for role, n in per_role.items():  # each pass over a role's demonstrations draws every one of them once
        first = drawn[role][:n]
        assert sorted(first) == sorted(i for i, d in enumerate(demos) if d.agent == role)
    trainer.position = 0
    again = trainer._next_demos()  # the order is a function of the position alone (resume)
    assert [id(d) for d in again] == [
        id(demos[i])
        for i in [
            drawn[REWRITER][0],
            drawn[RERANKER][0],
            drawn[ANSWERER][0],
            drawn[REWRITER][1],
            drawn[RERANKER][1],
            drawn[ANSWERER][1],
        ]
    ]
