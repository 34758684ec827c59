"""The workflow abstraction: the team written in docs/python-api.md is a working team, and the default trace keeps
what JSON can hold."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fakes import GOOD, FakeGenerator, SolverJudge, decode, encode

from mhgpo.data.records import Example
from mhgpo.rl.rollout import run_rollouts
from mhgpo.rl.tree import RolloutSpec
from mhgpo.team.loader import load_workflow_class
from mhgpo.team.workflow import State

REPO = Path(__file__).resolve().parents[2]


def test_the_documented_example_is_a_working_team(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = (REPO / "docs" / "python-api.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(code.splitlines()) <= 40
    (tmp_path / "draft_and_edit.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    cls = load_workflow_class("draft_and_edit.py:DraftAndEdit")
    outputs = ["It is Paris, I think.", "Rome?", "Paris", "the city of Paris in France"]

    def agent_of(text: str) -> str:
        return "editor" if "Draft:" in text else "drafter"

    gen = FakeGenerator(agent_of, lambda agent, k, text: outputs[k])
    batch = run_rollouts(
        [Example("q", "Which city?", ("Paris",)), Example("r", "Which city?", ("Paris",))],
        cls(),
        gen,
        encode,
        RolloutSpec(greedy=True),
        np.random.default_rng(0),
    )
    assert [(n.agent, n.output) for n in batch.llm_nodes()] == [
        ("drafter", outputs[0]),
        ("drafter", outputs[1]),
        ("editor", outputs[2]),
        ("editor", outputs[3]),
    ]
    assert "Draft: It is Paris, I think." in decode(gen.calls[1].prompts[0])
    assert [n.penalty for n in batch.llm_nodes()] == [0.0, 0.0, 0.0, -0.5]
    assert [leaf.terminal for leaf in batch.leaves()] == [1.0, 0.0]  # exact match, not F1: no partial credit
    assert "mhgpo.train(" in code and "mhgpo.evaluate(" in code


def test_the_default_trace_keeps_what_json_can_hold() -> None:
    from mhgpo.data.records import Passage

    state = State(GOOD[0]).with_values(
        attempts=("x", "y"),
        n=2,
        info={"a": [1, 2]},
        documents=(Passage("p", "T", "text"),),
        mixed=["ok", Passage("q", "U", "")],
    )
    assert SolverJudge().trace(state) == {"attempts": ("x", "y"), "n": 2, "info": {"a": [1, 2]}}
