"""The sampler table (mhgpo/config/samplers.py): the config's choices, who trains with what, and a new sampler as one
entry that the rollout engine runs."""

from __future__ import annotations

from collections import Counter

import pytest
from fakes import (
    rollout,
)


def test_a_new_sampler_is_one_table_entry(monkeypatch):
    """The rollout engine reads the sampler table: an entry it has never seen (IS's fork at every agent with FoF(os)'s
    over-sampling, every sample trained) runs with no other change."""
    from mhgpo.config import samplers

    entry = samplers.Sampler("is_os", forks="every", oversample_terminal=True, team_only=True)
    monkeypatch.setitem(samplers.SAMPLERS, "is_os", entry)
    batch, _, _ = rollout("is_os", n_questions=2)
    llm = batch.llm_nodes()
    # Per question: 3 chains (one forked at each agent). Forked at the rewriter: 4 rewriter, 4 reranker, 16 answerer
    # calls; at the reranker: 1 + 4 + 16; at the answerer: 1 + 1 + 4 (no over-sampling before a fork).
    assert Counter(n.question_index for n in llm) == {0: 51, 1: 51}
    assert batch.stats["samples"] == float(sum(n.trained for n in llm))
    over = [n for n in llm if n.group_key[0] == "os"]
    assert len(over) == 2 * 32 and Counter(Counter(n.group_id for n in over).values()) == {4: 16}


def test_sampler_table_gives_the_config_choices_and_who_trains_with_what():
    from mhgpo.config import samplers
    from mhgpo.config.tables import ALGORITHMS

    assert samplers.train_samplers() == ("is", "fof", "rr", "fof_os", "chains")
    assert samplers.group_samplers() == ("is", "fof", "rr", "fof_os")
    trains = {a: [n for n, s in samplers.SAMPLERS.items() if samplers.trains_with(e, s)] for a, e in ALGORITHMS.items()}
    assert trains == {
        "mhgpo": ["is", "fof", "rr", "fof_os"],
        "grpo": ["is", "fof"],
        "mappo": ["chains"],
        "ppo": ["chains"],
    }
    with pytest.raises(ValueError, match="unknown sampler 'x'"):
        samplers.sampler("x")
