"""The sync check's arithmetic without vLLM (mhgpo/rl/engine_sync.py): the agents taken in turn at their
temperatures, the gap figures, the verdict, a failed check on any rank, and the engine's log-probs kept as the old
ones (the engine itself: tests/system/test_vllm.py)."""

from __future__ import annotations

import pytest

from mhgpo.errors import RunError
from mhgpo.rl.policy import Sample


def _sample(agent: str, output: list[int], temperature: float = 1.0) -> Sample:
    return Sample([1, 2], output, [-1.0] * len(output), 0.5, agent, temperature)


def test_the_check_takes_the_agents_in_turn_each_at_its_temperature() -> None:
    from mhgpo.rl.engine_sync import checked

    samples = [
        _sample("rewriter", [3]),
        _sample("rewriter", [4], 0.7),
        _sample("answerer", []),
        _sample("answerer", [5], 1.3),
        _sample("reranker", [6, 7]),
    ]
    picked = checked(samples, 3)
    assert [(s.agent, s.output_ids, s.temperature) for s in picked] == [
        ("rewriter", [3], 1.0),
        ("answerer", [5], 1.3),
        ("reranker", [6, 7], 1.0),
    ]
    assert [(s.output_ids, s.temperature) for s in checked(samples, 10)] == [
        ([3], 1.0),
        ([5], 1.3),
        ([6, 7], 1.0),
        ([4], 0.7),
    ]


def test_the_gap_figures_by_hand() -> None:
    import numpy as np

    from mhgpo.rl.engine_sync import gap_figures

    engine = np.array([-1.0, -2.0, -0.5, -3.0])
    trainer = np.array([-1.0, -2.1, -0.3, -3.0])  # d = trainer - engine: 0, -0.1, 0.2, 0
    d = np.array([0.0, -0.1, 0.2, 0.0])
    figures = gap_figures(engine, trainer)
    assert figures == pytest.approx(
        {
            "engine/logprob_gap_mean": 0.075,
            "engine/logprob_gap_max": 0.2,
            "engine/kl_k3": float(np.mean(np.exp(d) - d - 1)),
            "engine/mult_prob_error": float(np.mean(np.exp(np.abs(d)))),
        },
        rel=1e-12,
        abs=1e-15,
    )
    assert figures["engine/kl_k3"] == pytest.approx((np.exp(-0.1) + 0.1 - 1 + np.exp(0.2) - 0.2 - 1) / 4, rel=1e-12)
    same = gap_figures(engine, engine.copy())
    assert same == {
        "engine/logprob_gap_mean": 0.0,
        "engine/logprob_gap_max": 0.0,
        "engine/kl_k3": 0.0,
        "engine/mult_prob_error": 1.0,
    }
    assert gap_figures(np.zeros(0), np.zeros(0)) == {}
    nan = gap_figures(np.array([-1.0, float("nan")]), np.array([-1.0, -2.0]))
    assert all(np.isnan(v) for v in nan.values())  # NaN passes no comparison: the verdict counts it instead


def test_the_verdict_of_a_check() -> None:
    from mhgpo.rl.engine_sync import EngineGapNotFinite, EngineOutOfSync, SyncCheck, verdict

    last = "its last checkpoint is step_2"
    ok = SyncCheck({"engine/logprob_gap_mean": 9e-4}, tokens=40)
    assert verdict(ok, 1e-3, 3, last) is None and verdict(SyncCheck(), 1e-3, 3, last) is None
    far = verdict(SyncCheck({"engine/logprob_gap_mean": 0.25}, tokens=40), 1e-3, 3, last)
    assert isinstance(far, EngineOutOfSync) and isinstance(far, RunError)
    assert str(far) == (
        "generation.engine=vllm: after the update of step 3 the engine's log-probs of the step's outputs differ "
        "from the trainer's by 0.25 per token (generation.sync_tolerance=0.001): the engine does not sample from "
        "the trained weights; the run stops; its last checkpoint is step_2"
    )
    nan = SyncCheck({"engine/logprob_gap_mean": float("nan")}, tokens=40, not_finite=(1, 0))
    error = verdict(nan, 1e-3, 3, last)
    assert isinstance(error, EngineGapNotFinite) and isinstance(error, RunError)
    assert str(error) == (
        "generation.engine=vllm: after the update of step 3 the log-probs of the step's outputs are not finite "
        "(NaN or infinite at 1 of 40 tokens on the engine's side, 0 on the trainer's); the run stops; its last "
        "checkpoint is step_2"
    )
    assert isinstance(verdict(SyncCheck(not_finite=(0, 2), tokens=5), 1e-3, 3, last), EngineGapNotFinite)
    old = SyncCheck({"engine/logprob_gap_mean": 0.0}, tokens=40, stale="it holds the weights of update 2, the "
                    "trainer those of update 3")  # fmt: skip
    assert str(verdict(old, 1e-3, 3, last)) == (
        "generation.engine=vllm: after the update of step 3 the engine does not hold the trained weights (it holds "
        "the weights of update 2, the trainer those of update 3); the run stops; its last checkpoint is step_2"
    )


def test_a_failed_check_on_any_rank_stops_every_rank() -> None:
    from mhgpo.model.distributed import Single
    from mhgpo.rl.engine_sync import EngineOutOfSync, SyncCheck, stop_if_any, verdict

    class Elsewhere(Single):  # a rank whose own check passed, another's failed
        def any(self, flag: bool) -> bool:
            return True

    stop_if_any(None, Single(), 3, "")
    mine = verdict(SyncCheck({"engine/logprob_gap_mean": 0.5}, tokens=4), 0.1, 3, "x")
    with pytest.raises(EngineOutOfSync) as stop:
        stop_if_any(mine, Single(), 3, "x")
    assert stop.value is mine
    with pytest.raises(EngineOutOfSync, match=r"^generation\.engine=vllm: after the update of step 3 the sync "
                       r"check failed on another rank; the run stops; it has no checkpoint yet$"):  # fmt: skip
        stop_if_any(None, Elsewhere(), 3, "it has no checkpoint yet")


def test_the_engines_log_probs_are_kept_and_their_gap_is_not_finite_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from mhgpo.rl.engine_sync import EngineGapNotFinite, old_logprobs

    class Recomputes:
        def __init__(self, rows: list[list[float]]) -> None:
            self.rows = rows

        def current_logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
            return [torch.tensor(r) for r in self.rows]

    samples = [_sample("rewriter", [3]), _sample("answerer", [5, 6], 0.7), _sample("reranker", [])]
    assert old_logprobs(None, samples, "engine") == {}  # at any temperature: the engine's are the project's
    assert [s.old_logprobs for s in samples] == [[-1.0], [-1.0, -1.0], []]
    stats = old_logprobs(Recomputes([[-1.5], [-1.0, -0.7]]), samples, "trainer")
    assert stats == {"engine/old_logprob_gap": pytest.approx((0.5 + 0.0 + 0.3) / 3, rel=1e-6)}
    assert samples[0].old_logprobs == [-1.5] and samples[0].engine_logprobs == [-1.0]
    assert samples[1].engine_logprobs == [-1.0, -1.0] and samples[1].old_logprobs == pytest.approx([-1.0, -0.7])
    fresh = [_sample("rewriter", [3]), _sample("answerer", [5])]
    with pytest.raises(
        EngineGapNotFinite,
        match=r"^generation\.engine=vllm: the log-probs of the step's outputs are not finite \(NaN or infinite at "
        r"0 of 2 tokens on the engine's side, 1 on the trainer's\); the run stops before the update$",
    ):
        old_logprobs(Recomputes([[float("nan")], [-1.0]]), fresh, "trainer")
    assert fresh[0].old_logprobs == [-1.0]  # left as they were
