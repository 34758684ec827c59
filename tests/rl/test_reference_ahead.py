"""The reference pass beside the rollouts (`mhgpo/rl/reference_ahead.py`): a segment's reference log-probs are a
function of the segment alone, so those worked out while the rollouts generate are the update's own, bit for bit;
the update takes a segment worked out ahead only where the step holds exactly that segment; and a run on a
generation server (a stand-in, tests/fake_vllm_server.py) with the overlap is the run without it."""

from __future__ import annotations

import threading
import zlib
from pathlib import Path

import pytest
import torch
from fake_vllm_server import FakeVLLMServer
from helpers import fresh_model, hand_samples, make_config, trainer_for
from safetensors.torch import load_file

from mhgpo.config import LoraConfig, OptimConfig
from mhgpo.model.generation import Generation
from mhgpo.rl.policy import Policy, Sample, reference_segments, segment_key
from mhgpo.rl.reference_ahead import ReferenceAhead
from mhgpo.runtime.runlog import read_metrics


def forked(loaded) -> list[Sample]:
    """Samples of three agents, two temperatures: each hand sample's prompt (made its own) with three outputs (a
    fork of G = 3), of different lengths, so that a step-wide cut would pad them against other prompts'."""
    out = []
    for k, s in enumerate(hand_samples(loaded)):
        prompt = [*s.prompt_ids, 10 + k]
        for g in range(3):
            output = s.output_ids[: max(1, len(s.output_ids) - 2 * g)]
            out.append(Sample(prompt, output, [0.0] * len(output), 0.5 - g, s.agent, 1.0 if k % 2 else 0.7))
    return out


@pytest.fixture
def policy(tiny_model_dir: Path) -> tuple[Policy, list[Sample]]:
    loaded = fresh_model(tiny_model_dir)
    torch.manual_seed(0)
    optim = OptimConfig(lr=1e-2, kl_beta=0.05, micro_batch_tokens=96)  # (segments split into several micro-batches)
    policy = Policy(loaded.model, loaded.tokenizer.pad_token_id, optim, LoraConfig(r=4), 10, precision="fp32")
    samples = forked(loaded)
    policy.update(samples)  # the adapter off zero: the reference is not the policy
    return policy, samples


def test_a_samples_reference_depends_on_its_segment_alone(policy) -> None:
    policy, samples = policy
    whole = policy.reference_logprobs(samples)
    segments = reference_segments(samples)
    assert len(segments) == len(samples) // 3 and all(len(seg) == 3 for seg in segments)
    for seg in segments:
        alone = policy.reference_logprobs([samples[i] for i in seg])
        assert all(torch.equal(whole[i], a) for i, a in zip(seg, alone))
        assert all(torch.equal(whole[i], a) for i, a in zip(seg, policy.reference_segment([samples[i] for i in seg])))
    # and they are the reference's: the same samples one at a time, to float32 rounding
    for i in (0, 4, 8):
        assert torch.allclose(whole[i], policy.reference_logprobs([samples[i]])[0], atol=1e-5, rtol=0)
    assert policy.known_reference == 0


def test_the_pass_takes_a_known_segment_only_where_the_step_holds_exactly_it(policy) -> None:
    policy, samples = policy
    first, second = reference_segments(samples)[:2]
    marked = [torch.full((len(samples[i].output_ids),), -7.0) for i in first]
    partial = [torch.full((len(samples[i].output_ids),), -9.0) for i in second[:2]]
    known = {
        segment_key([samples[i] for i in first]): marked,
        segment_key([samples[i] for i in second[:2]]): partial,  # a segment the step holds with one more output
    }
    plain = policy.reference_logprobs(samples)
    got = policy.reference_logprobs(samples, known)
    assert policy.known_reference == 3
    assert all(torch.equal(got[i], m) for i, m in zip(first, marked))
    assert all(torch.equal(got[i], plain[i]) for i in range(len(samples)) if i not in first)
    # the update counts the share taken
    assert policy.update(samples, known)["reference/ahead"] == pytest.approx(3 / len(samples), abs=1e-12)
    assert policy.update(samples)["reference/ahead"] == 0.0


def generations(samples: list[Sample]) -> list[Generation]:
    return [Generation(s.prompt_ids, s.output_ids, [0.0] * len(s.output_ids), "", True) for s in samples]


def test_segments_are_worked_out_once_all_their_outputs_are_in_and_equal_the_updates(policy) -> None:
    policy, samples = policy
    agent = "answerer"
    mine = [s for s in samples if s.agent == agent and s.temperature == 1.0]
    assert len(mine) == 6  # two prompts of this agent, three outputs each
    seen: list[int] = []

    def compute(segment: list[Sample]) -> list[torch.Tensor]:
        seen.append(len(segment))
        return policy.reference_segment(segment)

    ahead = ReferenceAhead(compute, lambda a: 1.0)
    on_chunk = ahead.on_call(agent, [s.prompt_ids for s in mine])
    gens = generations(mine)
    on_chunk([0, 3], [gens[0], gens[3]])  # one output of each prompt: no segment is complete
    on_chunk([4, 1], [gens[4], gens[1]])
    on_chunk([2], [gens[2]])  # the first prompt's three are in
    on_chunk([5], [gens[5]])
    known = ahead.results()
    assert seen == [3, 3] and ahead.samples == 6 and ahead.error is None
    assert set(known) == {segment_key(mine[:3]), segment_key(mine[3:])}
    want = policy.reference_logprobs(mine)
    assert all(torch.equal(a, b) for a, b in zip(known[segment_key(mine[:3])] + known[segment_key(mine[3:])], want))


def test_a_frozen_agent_and_empty_outputs_are_left_to_the_update(policy) -> None:
    policy, samples = policy
    ahead = ReferenceAhead(policy.reference_segment, lambda a: 1.0, trained=lambda a: a != "frozen")
    assert ahead.on_call("frozen", [samples[0].prompt_ids]) is None
    s = samples[0]
    on_chunk = ahead.on_call(s.agent, [s.prompt_ids, s.prompt_ids])
    on_chunk([0, 1], generations([s, Sample(s.prompt_ids, [], [], 0.0, s.agent)]))
    on_chunk = ahead.on_call(s.agent, [s.prompt_ids] * 3, [True, False, True])  # (IS: a fork sample, another's)
    t = samples[1]
    on_chunk([0, 1, 2], generations([s, t, t]))
    known = ahead.results()
    only = Sample(s.prompt_ids, s.output_ids, [], 0.0, s.agent, 1.0)
    both = [only, Sample(s.prompt_ids, t.output_ids, [], 0.0, s.agent, 1.0)]
    # the segment without its empty output, and without the sample that cannot train: as the update holds them
    assert list(known) == [segment_key([only]), segment_key(both)]


def test_close_drops_the_queued_segments_and_waits_for_the_one_under_way(policy) -> None:
    policy, samples = policy
    started, release, done = threading.Event(), threading.Event(), []

    def compute(segment: list[Sample]) -> list[torch.Tensor]:
        started.set()
        release.wait(5)
        done.append(len(segment))
        return [torch.zeros(len(s.output_ids)) for s in segment]

    ahead = ReferenceAhead(compute, lambda a: 1.0)
    for s in samples[:3]:  # three prompts of one output each: three segments queued
        ahead.on_call(s.agent, [s.prompt_ids])([0], generations([s]))
    assert started.wait(5)
    threading.Timer(0.2, release.set).start()
    ahead.close()
    assert done == [1] and len(ahead.known) == 1  # the one under way ended before close returned; the rest dropped


def test_an_error_in_the_worker_leaves_the_rest_to_the_update(policy) -> None:
    policy, samples = policy

    def compute(segment: list[Sample]) -> list[torch.Tensor]:
        raise RuntimeError("out of memory")

    ahead = ReferenceAhead(compute, lambda a: 1.0)
    s = samples[0]
    ahead.on_call(s.agent, [s.prompt_ids])([0], generations([s]))
    assert ahead.results() == {} and isinstance(ahead.error, RuntimeError)


# ---------------------------------------------------------------------------------------------- a run on a server


def _tokens(vocab: int, answer: list[int]):
    """The stand-in server's completions: by the request's seed, the tiny world's answer ("assistant") or three
    other tokens, so that rewards differ within groups and the update moves the weights."""

    def tokens(prompt: list[int], body: dict) -> list[int]:
        h = zlib.crc32(repr((prompt[-1], body.get("seed"))).encode())
        return list(answer) if h % 3 == 0 else [(h >> k) % vocab for k in (0, 8, 16)]

    return tokens


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["is", "fof"])
def test_a_run_on_a_server_with_the_reference_pass_beside_the_rollouts_is_the_run_without_it(
    tiny_model_dir: Path, tmp_path: Path, sampler: str
) -> None:
    from helpers import write_echo_world
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    world = write_echo_world(tmp_path / "world", seed=0, n_train=12, n_dev=2)
    tokens = _tokens(len(tok), tok("assistant", add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
    runs = {}
    for pipeline in ("null", "false"):  # null: on with a server (the overlap with it); false: neither
        out = tmp_path / f"pipeline-{pipeline}"
        with FakeVLLMServer(vocab=len(tok), tokens=tokens) as server:
            cfg = make_config(
                tiny_model_dir,
                world,
                out,
                **{
                    "generation.engine": "vllm_server",
                    "generation.server_urls": f"[{server.url}]",
                    "generation.sync_check": 0,
                    "generation.server_timeout": 10,
                    "rollout.pipeline": pipeline,
                    "precision": "fp32",
                    "optim.kl_beta": 0.05,
                    "sampler": sampler,
                    "steps": 3,
                    "eval_every": 0,
                },
            )
            trainer_for(cfg, out).run()
        runs[pipeline] = read_metrics(out)
    on, off = runs["null"], runs["false"]
    assert [r["reference/ahead"] for r in off] == [0.0, 0.0, 0.0]
    # beside the rollouts: under IS every trained segment; under FoF those whose every sample is trained
    ahead = [r["reference/ahead"] for r in on]
    assert ahead == [1.0, 1.0, 1.0] if sampler == "is" else all(0.0 < a <= 1.0 for a in ahead), ahead
    assert all(r["grad_norm"] > 0 and r["kl"] > 0 for r in on[1:])  # (the reference is not the policy any more)
    volatile = ("seconds/", "memory/", "idle/", "reference/ahead")
    assert [{k: v for k, v in r.items() if not k.startswith(volatile)} for r in on] == [
        {k: v for k, v in r.items() if not k.startswith(volatile)} for r in off
    ]
    a, b = tmp_path / "pipeline-null", tmp_path / "pipeline-false"
    for step in (1, 2, 3):
        name = f"rollouts/step_{step:06d}.jsonl"
        assert (a / name).read_bytes() == (b / name).read_bytes()
    wa, wb = (load_file(str(run / "checkpoints/step_3/model.safetensors")) for run in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
