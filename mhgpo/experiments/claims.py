"""The paper's comparisons as tables: each table is one claim of the paper, its rows (rows of
`experiments/rows.yaml`), the row every other is set against, and the paper's direction for each comparison (`>`,
`≥`, `≈`, `<`, `≤` on validation F1, or on LLM calls per question for a cost claim).

A table's row is a row's name, or `ROW~OTHER`: ROW trained for as many steps as OTHER reached under its budget on
the same seed (and no budget), so that what a row learns per step is set apart from how many steps it fits.
The `oracles` table is not a claim of the paper but where a team's headroom is: each seed's warm-started team
validated with per-role oracles (`mhgpo eval --oracle`).
"""

from __future__ import annotations

import dataclasses

ROLES = ("rewriter", "reranker", "answerer")
# The observed directions each of the paper's directions agrees with (≈: within noise).
AGREES = {">": {">"}, "<": {"<"}, "≥": {">", "≈"}, "≤": {"<", "≈"}, "≈": {"≈"}}
METRICS = {"val_f1": "val F1", "llm_calls": "LLM calls / question"}
STEPS_OF = "~"  # ROW~OTHER: ROW for OTHER's steps


@dataclasses.dataclass(frozen=True)
class Claim:
    """The paper's direction of `row` against `than` on `metric` (`val_f1`, or `llm_calls` per question)."""

    row: str
    direction: str  # > ≥ ≈ < ≤
    than: str
    paper: str  # the claim in words
    metric: str = "val_f1"


@dataclasses.dataclass(frozen=True)
class Table:
    name: str
    title: str  # what the table asks, one sentence
    reference: str  # the row every other row's paired differences are taken against
    rows: tuple[str, ...]
    claims: tuple[Claim, ...]
    columns: tuple[tuple[str, str], ...] = ()  # (header, training metric): more columns, per question drawn


def steps_of(row: str, other: str) -> str:
    """The table row that trains `row` for the steps `other` reached under its budget."""
    return f"{row}{STEPS_OF}{other}"


def split_key(key: str) -> tuple[str, str | None]:
    """(row, the row whose steps it takes or None) of a table row."""
    row, sep, other = key.partition(STEPS_OF)
    return row, (other if sep else None)


MHGPO_ROWS = ("warm_rr", "warm_fof", "warm_is", "warm_fof_os")  # MHGPO with each sampler, from the warm start
RERANKER_RECIPE = "warm_rr_reranker_30min"
RECIPE_CONTROL = "warm_rr_30min"  # every role for the recipe's minutes: the budget's share of its gain
# every role for the recipe's steps: a Reranker-only step trains a third of the samples, so it fits more steps
CONTROL_AT_RECIPE_STEPS = steps_of(RECIPE_CONTROL, RERANKER_RECIPE)
MAPPO_AT_RR_STEPS = steps_of("warm_mappo", "warm_rr")
MAPPO_AT_IS_STEPS = steps_of("warm_mappo", "warm_is")  # the demo's sampler
# the roles table's rows that fitted a quarter more steps than every role (`warm_fof`) or more in the same budget (on
# the synthetic world or HotpotQA; a step that trains fewer samples is cheaper): each also for warm_fof's steps
ROLES_MATCHED = (
    "warm_fof_only_rewriter",
    "warm_fof_only_reranker",
    "warm_fof_only_answerer",
    "warm_fof_freeze_reranker",
)
# (prompt, agent, turn) groups drop the singletons that MHGPO's groups keep, and fitted more steps than warm_rr
AT_GROUPS_AT_RR_STEPS = steps_of("warm_rr_groups_prompt_agent_turn", "warm_rr")

ROLE_ROWS = (
    "warm_fof",
    *(f"warm_fof_{kind}_{r}" for kind in ("only", "freeze") for r in ROLES),
    *(steps_of(r, "warm_fof") for r in ROLES_MATCHED),
)


def _role_claim(row: str) -> Claim:
    """`warm_fof` ≥ `row` (one role alone or frozen), or at equal steps for `row~warm_fof`."""
    name, other = split_key(row)
    kind, role = name.removeprefix("warm_fof_").split("_")
    paper = f"all roles ≥ {role} {'alone' if kind == 'only' else 'frozen'}"
    return Claim("warm_fof", "≥", row, f"(not the paper's) {paper} at equal steps" if other else paper)


# The sampler whose aggregated rewards reach the loss at this scale: under RR only the prefix singletons upstream of a
# fork carry one, and at 4 questions a step their pools (role, fork agent) seldom fill a group of 4, so RR trained no
# aggregated sample in any of its steps here and its max and min rows repeat mean's (rand only shifts the random
# stream); FoF(os) aggregates every prefix node. RR's rows (`warm_rr_aggr_*`) stay rows, for larger batches.
AGGREGATED_SAMPLERS = (("warm_fof_os", "FoF(os)"),)
AGGREGATORS = ("max", "min", "rand")


def _aggregator_rows(sampler: str, steps_from: str | None = None) -> tuple[str, ...]:
    """`sampler`'s row with each other aggregator, or for `steps_from`'s steps: an aggregator leaves a step's cost
    as it is, yet CPU time a step varied by 10–20% between sessions on machines named alike (the same first step's
    rollouts), which costs a step in a 10-minute budget, so each also runs for the mean's steps."""
    rows = tuple(f"{sampler}_aggr_{a}" for a in AGGREGATORS)
    return tuple(steps_of(r, steps_from) for r in rows) if steps_from else rows


def _rl_beats(rows: tuple[str, ...], than: str, paper: str) -> tuple[Claim, ...]:
    return tuple(Claim(r, ">", than, paper) for r in rows)


TABLES = {
    t.name: t
    for t in (
        Table(
            "algorithms",
            "Does RL improve on the warm start, and does MHGPO (with each sampler) beat MAPPO and single-agent GRPO?",
            "warm_mappo",
            ("untrained", "warm", *MHGPO_ROWS, "warm_mappo", "warm_llm", "warm_grpo"),
            (
                *_rl_beats(MHGPO_ROWS, "warm", "RL improves on its starting point"),
                Claim("warm_grpo", ">", "warm_llm", "RL improves on its starting point (single agent)"),
                *_rl_beats(MHGPO_ROWS, "warm_mappo", "MHGPO > MAPPO"),
                *_rl_beats(MHGPO_ROWS, "warm_grpo", "the trained team > single-agent GRPO"),
                Claim("warm_fof", "≈", "warm_is", "FoF ≈ IS in quality ..."),
                Claim("warm_fof", "<", "warm_is", "... at lower cost", "llm_calls"),
            ),
        ),
        Table(
            "aggregators",
            "Does backward reward propagation aggregate best with the mean, against max, min and rand (under "
            "MHGPO-FoF(os))?",
            "warm_fof_os",
            tuple(r for s, _ in AGGREGATED_SAMPLERS for r in (s, *_aggregator_rows(s), *_aggregator_rows(s, s))),
            tuple(
                Claim(s, "≥", row, f"mean aggr ≥ {a} ({name})" + (" at equal steps" if other else ""))
                for s, name in AGGREGATED_SAMPLERS
                for other in (None, s)
                for a, row in zip(AGGREGATORS, _aggregator_rows(s, other))
            ),
            (("aggregated samples / question", "aggregated_samples"),),
        ),
        Table(
            "reward",
            "Does the composite reward (final + agent-specific penalties) beat the final reward alone?",
            "warm_rr",
            ("warm_rr", "warm_rr_final_only", "warm_mappo", "warm_mappo_final_only"),
            (
                Claim("warm_rr", ">", "warm_rr_final_only", "composite > final-only (MHGPO-RR)"),
                Claim("warm_mappo", ">", "warm_mappo_final_only", "composite > final-only (MAPPO)"),
            ),
        ),
        Table(
            "roles",
            "Does training every role (MHGPO-FoF) beat training one role alone or freezing one?",
            "warm_fof",
            ROLE_ROWS,
            tuple(_role_claim(r) for r in ROLE_ROWS[1:]),
        ),
        Table(
            "groups",
            "Do MHGPO's heterogeneous advantage groups beat two peer systems' schemes on MHGPO-RR's rollouts: "
            "agent-wise normalisation (`advantage=agent`, as Dr.MAS) and (prompt, agent, turn) groups "
            "(`advantage=prompt_agent_turn`, as AT-GRPO)? (not the paper's)",
            "warm_rr",
            ("warm_rr", "warm_rr_groups_agent", "warm_rr_groups_prompt_agent_turn", AT_GROUPS_AT_RR_STEPS),
            (
                Claim("warm_rr", "≥", "warm_rr_groups_agent", "(not the paper's) MHGPO groups ≥ agent-wise"),
                Claim(
                    "warm_rr",
                    "≥",
                    "warm_rr_groups_prompt_agent_turn",
                    "(not the paper's) MHGPO groups ≥ (prompt, agent, turn)",
                ),
                Claim(
                    "warm_rr",
                    "≥",
                    AT_GROUPS_AT_RR_STEPS,
                    "(not the paper's) MHGPO groups ≥ (prompt, agent, turn) at equal steps",
                ),
            ),
        ),
        Table(
            "recipes",
            "Does RL aimed at the role the oracles find the headroom in (MHGPO-RR training the Reranker alone for "
            "30 CPU minutes) beat the warm start, and every role trained for 10 or 30 minutes or as many steps? "
            "(not the paper's)",
            "warm",
            ("warm", "warm_rr", RERANKER_RECIPE, RECIPE_CONTROL, CONTROL_AT_RECIPE_STEPS),
            (
                Claim(
                    RERANKER_RECIPE,
                    ">",
                    "warm",
                    "(not the paper's) RL aimed at the Reranker improves on the warm start",
                ),
                Claim(RERANKER_RECIPE, ">", "warm_rr", "(not the paper's) ... and on 10 minutes of every role"),
                Claim(
                    RERANKER_RECIPE, ">", RECIPE_CONTROL, "(not the paper's) ... and on as many minutes of every role"
                ),
                Claim(
                    RERANKER_RECIPE,
                    ">",
                    CONTROL_AT_RECIPE_STEPS,
                    "(not the paper's) ... and on as many steps of every role",
                ),
            ),
        ),
        Table(
            "steps",
            "Do MHGPO-RR and MHGPO-IS beat MAPPO at equal steps (MAPPO trained for as many steps as each sampler "
            "fitted in its budget), which sets what a step learns apart from how many steps the budget holds? "
            "(not the paper's)",
            "warm_rr",
            ("warm", "warm_rr", "warm_is", "warm_mappo", MAPPO_AT_RR_STEPS, MAPPO_AT_IS_STEPS),
            (
                Claim("warm_rr", ">", "warm_mappo", "MHGPO > MAPPO (equal time)"),
                Claim("warm_rr", ">", MAPPO_AT_RR_STEPS, "(not the paper's) MHGPO > MAPPO at equal steps"),
                Claim("warm_is", ">", "warm_mappo", "MHGPO > MAPPO (equal time)"),
                Claim("warm_is", ">", MAPPO_AT_IS_STEPS, "(not the paper's) MHGPO > MAPPO at equal steps"),
            ),
        ),
    )
}

ORACLE_TABLE = "oracles"
ORACLE_TITLE = (
    "Where is the warm-started team's headroom: how much does each role add when it is replaced by its gold output? "
    "(not the paper's)"
)
# name: (the oracle roles, what they mean)
ORACLES = {
    "none": ((), "the warm-started team as it is"),
    "rewriter": (("rewriter",), "the Rewriter writes the gold queries"),
    "reranker": (("reranker",), "the Reranker keeps exactly the retrieved gold paragraphs"),
    "rewriter+reranker": (("rewriter", "reranker"), "both"),
    "context": (("context",), "the Answerer is shown the gold paragraphs (retrieval bypassed)"),
}
ORACLE_ROW = "warm"  # the team the oracles replace roles of


def oracle_key(name: str) -> str:
    return f"oracle:{name}"


def table_rows(names: list[str]) -> list[str]:
    """The rows of the named tables (the oracles' table: its warm start), each once, in table order."""
    rows: list[str] = []
    for name in names:
        for r in TABLES[name].rows if name in TABLES else (ORACLE_ROW,):
            if r not in rows:
                rows.append(r)
    return rows


def own_rows(table: Table) -> list[str]:
    """The rows `table` adds to the tables before it (a data set's part is shown where one of them ran)."""
    names = list(TABLES)
    earlier = {r for name in names[: names.index(table.name)] for r in TABLES[name].rows}
    return [r for r in table.rows if r not in earlier]
