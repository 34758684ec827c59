"""The data specs read from the Hugging Face hub (mhgpo/data/hub.py): failing fast offline or unreachable, the
hub's rows parsed into each layout, and a bad row named by its repository and index."""

from __future__ import annotations

import sys
import time
import types

import pytest
from helpers import musique_record

from mhgpo.data import hub
from mhgpo.data.spec import load_data
from mhgpo.errors import InputError


@pytest.mark.parametrize("name", ["hotpotqa", "2wiki", "musique"])
def test_hub_specs_fail_fast_offline(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    with pytest.raises(InputError) as err:
        load_data(name)
    assert time.perf_counter() - started < 1.0
    assert str(err.value) == (
        f"{name}: the Hugging Face hub cannot be reached from this machine; pass a local file "
        f"instead, e.g. {hub.HUB_SOURCES[name].local_example}"
    )


def test_hub_unreachable_is_detected_within_the_probe_time(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in hub.OFFLINE_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    started = time.perf_counter()
    assert hub.hub_reachable(timeout=1.0) is False
    assert time.perf_counter() - started < 1.5


@pytest.fixture
def fake_datasets(monkeypatch: pytest.MonkeyPatch) -> list:
    """A stand-in `datasets` module; the hub counts as reachable. Returns the list of load_dataset calls."""
    calls: list = []
    rows = {
        "hotpotqa/hotpot_qa": [
            {
                "id": "h1",
                "question": "Q?",
                "answer": "A",
                "type": "bridge",
                "level": "hard",
                "supporting_facts": {"title": ["T2"], "sent_id": [0]},
                "context": {"title": ["T1", "T2"], "sentences": [["One."], ["Two.", " Three."]]},
            }
        ],
        "framolfese/2WikiMultihopQA": [
            {
                "_id": "w1",
                "question": "Q?",
                "answer": "B",
                "type": "comparison",
                "supporting_facts": {"title": ["T1"], "sent_id": [3]},
                "context": {"title": ["T1"], "content": [["Four."]]},
            }
        ],
        "dgslibisey/MuSiQue": [musique_record("m1"), musique_record("m2", answerable=False)],
        "bad/repo": [{"_id": "ok", "question": "Q?", "answer": "A"}, {"_id": "x", "question": "Q?"}],
    }

    def load_dataset(repo: str, *args: str, split: str) -> list:
        calls.append((repo, *args, split))
        return rows[repo]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setattr(hub, "hub_offline", lambda: False)
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=hub.PROBE_SECONDS: True)
    return calls


def test_hub_specs_parse_the_hub_rows(fake_datasets: list) -> None:
    (h,) = load_data("hotpotqa")
    assert (h.id, h.answers, h.supporting_titles, h.supporting_context) == ("h1", ("A",), ("T2",), ((1,),))
    assert h.context == (("T1", "One."), ("T2", "Two. Three."))
    (w,) = load_data("2wiki")
    assert (w.id, w.context, w.supporting_context) == ("w1", (("T1", "Four."),), ((0,),))
    assert [m.id for m in load_data("musique")] == ["m1"]
    assert fake_datasets == [
        ("hotpotqa/hotpot_qa", "distractor", "validation"),
        ("framolfese/2WikiMultihopQA", "validation"),
        ("dgslibisey/MuSiQue", "validation"),
    ]


def test_hub_bad_row_names_the_repository_row(fake_datasets: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        hub.HUB_SOURCES,
        "hotpotqa",
        hub.HubSource("bad/repo", None, "validation", hub.hotpot_example, "hotpotqa:x.json"),
    )
    with pytest.raises(InputError, match=r"^bad/repo\[1\]: missing key 'answer'$"):
        load_data("hotpotqa")
