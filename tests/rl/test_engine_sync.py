"""The sync check's arithmetic without vLLM (mhgpo/rl/engine_sync.py): the agents taken in turn at their
temperatures, the gap figures, the verdict, a failed check on any rank, and the engine's log-probs kept as the old
ones (the engine itself: tests/system/test_vllm.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
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
    served = verdict(SyncCheck(not_finite=(0, 2), tokens=5), 1e-3, 3, last, engine="vllm_server")
    assert str(served).startswith("generation.engine=vllm_server: after the update of step 3 the log-probs")
    gap = SyncCheck({"engine/logprob_gap_mean": 1.16}, tokens=40)
    assert str(verdict(gap, 0.1, 1, "it has no checkpoint yet", engine="vllm_server", model="runs/warm")) == (
        "generation.engine=vllm_server: after the update of step 1 the engine's log-probs of the step's outputs "
        "differ from the trainer's by 1.16 per token (generation.sync_tolerance=0.1): the engine does not sample "
        "from the trained weights (is the server serving the run's model? mhgpo serve-generation --model "
        "runs/warm); the run stops; it has no checkpoint yet"
    )
    assert "serve-generation" not in str(verdict(gap, 0.1, 1, "", engine="vllm", model="runs/warm"))
    old = SyncCheck({"engine/logprob_gap_mean": 0.0}, tokens=40, stale="it holds the weights of update 2, the "
                    "trainer those of update 3")  # fmt: skip
    assert str(verdict(old, 1e-3, 3, last)) == (
        "generation.engine=vllm: after the update of step 3 the engine does not hold the trained weights (it holds "
        "the weights of update 2, the trainer those of update 3); the run stops; its last checkpoint is step_2"
    )


class TwoRanks:
    """Rank `rank` of two, without a process group: `gather` puts this rank's object beside `theirs`, what the
    other rank sends; `any` is true when either is."""

    world = 2

    def __init__(self, rank: int, theirs: object = None, their_flag: bool = False) -> None:
        self.rank, self.theirs, self.their_flag = rank, theirs, their_flag
        self.is_main = rank == 0

    def gather(self, obj: object) -> list:
        return [obj, self.theirs] if self.rank == 0 else [self.theirs, obj]

    def any(self, flag: bool) -> bool:
        return bool(flag) or self.their_flag

    def share(self, items: list) -> list:
        from mhgpo.model.distributed import share_bounds

        return list(items)[slice(*share_bounds(len(items), 2, self.rank))]


def test_a_failed_check_on_any_rank_stops_every_rank_with_the_first_failing_ranks_line() -> None:
    from mhgpo.model.distributed import Single
    from mhgpo.rl.engine_sync import EngineGapNotFinite, EngineOutOfSync, SyncCheck, stop_if_any, verdict

    last = "its last checkpoint is step_2"
    stop_if_any(None, Single())
    mine = verdict(SyncCheck({"engine/logprob_gap_mean": 0.5}, tokens=4), 0.1, 3, "x")
    with pytest.raises(EngineOutOfSync) as stop:
        stop_if_any(mine, Single())
    assert stop.value is mine
    stale = SyncCheck(stale="it holds the weights of update 2, the trainer those of update 3")
    theirs = verdict(stale, 0.1, 3, last, rank=1)
    assert str(theirs) == (
        "generation.engine=vllm: after the update of step 3, on rank 1, the engine does not hold the trained weights "
        "(it holds the weights of update 2, the trainer those of update 3); the run stops; its last checkpoint is "
        "step_2"
    )
    stop_if_any(None, TwoRanks(0))  # both in sync
    told = [type(theirs).__name__, str(theirs)]
    with pytest.raises(EngineOutOfSync) as stop:  # rank 0 passed, rank 1 failed: rank 0 says rank 1's line
        stop_if_any(None, TwoRanks(0, told, their_flag=True))
    assert str(stop.value) == str(theirs)
    nan = verdict(SyncCheck(not_finite=(1, 0), tokens=5), 0.1, 3, last, rank=0)
    assert str(nan).startswith("generation.engine=vllm: after the update of step 3, on rank 0, the log-probs")
    with pytest.raises(EngineGapNotFinite) as stop:  # both failed: the first rank's line, on every rank
        stop_if_any(theirs, TwoRanks(1, [type(nan).__name__, str(nan)], their_flag=True))
    assert str(stop.value) == str(nan)
    with pytest.raises(EngineOutOfSync) as stop:
        stop_if_any(theirs, TwoRanks(1, None))  # only this rank failed: its own error
    assert stop.value is theirs


def test_the_figures_are_pooled_over_the_ranks_tokens() -> None:
    import numpy as np

    from mhgpo.rl.engine_sync import SyncCheck, gap_figures, pooled

    mine = SyncCheck(engine_lp=np.array([-1.0, -2.0]), trainer_lp=np.array([-1.0, -2.1]))
    theirs = [np.array([-0.5, -3.0]), np.array([-0.3, -3.0])]
    figures = pooled(mine, TwoRanks(0, theirs))
    assert figures == gap_figures(np.array([-1.0, -2.0, -0.5, -3.0]), np.array([-1.0, -2.1, -0.3, -3.0]))
    assert figures["engine/logprob_gap_mean"] == pytest.approx(0.075, rel=1e-12)
    assert pooled(SyncCheck(), TwoRanks(1, [np.zeros(0), np.zeros(0)])) == {}  # no rank scored a token


def test_the_engines_log_probs_are_kept_and_their_gap_is_not_finite_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from mhgpo.rl.engine_sync import EngineGapNotFinite, old_logprobs

    class Recomputes:
        cfg = SimpleNamespace(share_prefix=False)

        def __init__(self, rows: list[list[float]]) -> None:
            self.rows, self.asked = rows, []

        def current_logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
            self.asked.append(samples)
            return [torch.tensor(r) for r in self.rows]

    samples = [_sample("rewriter", [3]), _sample("answerer", [5, 6], 0.7), _sample("reranker", [])]
    assert old_logprobs(None, samples, "engine") == {}  # at any temperature: the engine's are the project's
    assert [s.old_logprobs for s in samples] == [[-1.0], [-1.0, -1.0], []]
    stats = old_logprobs(Recomputes([[-1.5], [-1.0, -0.7]]), samples, "trainer")
    k = np.exp([-0.5, 0.0, 0.3])  # each token's trainer / sampler ratio
    assert stats == {
        "engine/old_logprob_gap": pytest.approx((0.5 + 0.0 + 0.3) / 3, rel=1e-6),
        "engine/is_ess": pytest.approx(k.sum() ** 2 / (3 * (k**2).sum()), rel=1e-6),
    }
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
    with pytest.raises(EngineGapNotFinite, match=r"^generation\.engine=vllm_server: the log-probs of the step's"):
        old_logprobs(Recomputes([[float("nan")], [-1.0]]), fresh, "trainer", engine="vllm_server")

    # two ranks: each recomputes the samples its update takes (by tokens: rank 0 the longest) and gets the others'
    step = [_sample("rewriter", [3]), _sample("answerer", [5, 6], 0.7), _sample("reranker", [7])]
    policy = Recomputes([[-1.0, -0.7]])
    theirs = [[0, 2], [[-1.5], [-1.25]]]  # what rank 1 recomputed
    stats = old_logprobs(policy, step, "trainer", TwoRanks(0, theirs))
    assert [s.output_ids for s in policy.asked[0]] == [[5, 6]]
    assert [s.old_logprobs for s in step] == [[-1.5], pytest.approx([-1.0, -0.7]), [-1.25]]
    assert [s.engine_logprobs for s in step] == [[-1.0], [-1.0, -1.0], [-1.0]]
    k = np.exp([-0.5, 0.0, 0.3, -0.25])
    assert stats == {
        "engine/old_logprob_gap": pytest.approx((0.5 + 0.0 + 0.3 + 0.25) / 4, rel=1e-6),
        "engine/is_ess": pytest.approx(k.sum() ** 2 / (4 * (k**2).sum()), rel=1e-6),
    }
