"""On-policy pipelining inside a step (`rollout.pipeline`, mhgpo/rl/pipeline.py): the tool calls and rewards of each
generation batch run in a thread while the next batches generate. A rollout with it is the rollout without it (every
sampler, on the fakes; a training run on the tiny model in fp32, bit for bit), errors in the overlapped work end as
they do without it, and the overlap happens (told by the order of events, not by timing)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from fakes import EXAMPLES, FakeRetriever, G, RecordingSearch, encode, search_generator, search_system
from helpers import assert_same_run, make_config

from mhgpo.config import SearchConfig
from mhgpo.errors import ServiceError
from mhgpo.model.generation import Generation, HFGenerator, SamplingParams
from mhgpo.rl.pipeline import Prefetch
from mhgpo.rl.rollout import run_rollouts
from mhgpo.rl.tree import RolloutSpec
from mhgpo.team.loader import WorkflowError
from mhgpo.team.search_system import ANSWERER, RETRIEVER, REWRITER, SearchSystem

SAMPLERS = ["is", "fof", "fof_os", "rr", "chains", "none"]


class ChunkedGenerator:
    """The fakes' generator, reporting its batches of `batch_size` prompts as they finish (as `HFGenerator` does);
    `after_chunk(n)` is called once batch n has been handed on."""

    reports_chunks = True

    def __init__(self, batch_size: int = 2, after_chunk=None):
        self.inner = search_generator()
        self.batch_size = batch_size
        self.after_chunk = after_chunk
        self.chunks = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams, on_chunk=None) -> list[Generation]:
        out: list[Generation] = []
        for start in range(0, len(prompts), self.batch_size):
            indices = list(range(start, min(start + self.batch_size, len(prompts))))
            gens = self.inner.generate([prompts[i] for i in indices], params)
            out.extend(gens)
            if on_chunk is not None:
                on_chunk(indices, gens)
            if self.after_chunk is not None:
                self.after_chunk(self.chunks)
            self.chunks += 1
        return out


def _run(sampler: str, pipeline, system=None, on_error: str = "raise", n_questions: int = 3, **gen_kwargs):
    system = system or search_system()
    spec = RolloutSpec(sampler=sampler, group_size=G, rr_probs=(0.4, 0.3, 0.3))
    gen = ChunkedGenerator(**gen_kwargs)
    batch = run_rollouts(
        EXAMPLES[:n_questions],
        system,
        gen,
        encode,
        spec,
        np.random.default_rng(0),
        on_error=on_error,
        pipeline=pipeline,
    )
    return batch, system, gen


def _same_batches(a, b) -> None:
    assert a.nodes == b.nodes  # ids, parents, agents, token ids, log-probs, outputs, info, rewards, groups
    assert a.fork_agents == b.fork_agents and a.stats == b.stats
    assert [f.message() for f in a.failures] == [f.message() for f in b.failures]


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_a_pipelined_rollout_is_the_rollout_without_it(sampler: str) -> None:
    plain, plain_system, _ = _run(sampler, False)
    piped, piped_system, _ = _run(sampler, True)
    _same_batches(piped, plain)
    assert any(n.terminal for n in piped.nodes) and any(n.agent == RETRIEVER for n in piped.nodes)
    # without the pipeline the round's one batched tool call; with it, one per generation batch of 2
    assert all(n == len([1 for m in plain.nodes if m.agent == RETRIEVER]) for _, n in plain_system.tool_calls)
    assert len(piped_system.tool_calls) > len(plain_system.tool_calls)


def test_the_tool_call_of_a_batch_overlaps_the_generation_of_the_next() -> None:
    """Batch 0's retrieval starts before batch 1 is generated, and ends after it: the generator waits for the tool
    to start, and the tool for the generator to finish its next batch (a deadlock, caught by the time-outs, if the
    work did not overlap)."""
    events: list[str] = []
    started, next_done = threading.Event(), threading.Event()

    class SlowRetriever(FakeRetriever):
        def search_batch(self, queries, k):
            events.append(f"retrieve {len(self.calls)}: start")
            if not self.calls:
                started.set()
                assert next_done.wait(30), "batch 1 was not generated while batch 0's retrieval ran"
            events.append(f"retrieve {len(self.calls)}: end")
            return super().search_batch(queries, k)

    def after_chunk(n: int) -> None:
        events.append(f"generated batch {n}")
        if n == 0:
            assert started.wait(30), "batch 0's retrieval did not start while batch 1 waited to be generated"
        elif n == 1:
            next_done.set()

    system = search_system()
    system.retriever = SlowRetriever()
    _run("fof", True, system=system, n_questions=2, after_chunk=after_chunk)
    order = ["generated batch 0", "retrieve 0: start", "generated batch 1", "retrieve 0: end"]
    assert [events.index(e) for e in order] == sorted(events.index(e) for e in order), events


def test_the_overlapped_work_is_reported_as_it_runs() -> None:
    events: list[tuple[str, str, int]] = []
    system = search_system()
    _run("fof", Prefetch(system, on_event=lambda *e: events.append(e)), system=system)
    assert ("start", RETRIEVER, 2) in events and ("end", "reward", 1) in events


class DownRetriever(FakeRetriever):
    def search_batch(self, queries, k):
        raise ServiceError("retrieval service http://127.0.0.1:9/retrieve: cannot connect after 4 tries")


def test_a_service_error_in_the_overlapped_work_ends_the_rollout_as_without_it() -> None:
    messages = []
    for pipeline in (False, True):
        system = search_system()
        system.retriever = DownRetriever()
        with pytest.raises(ServiceError) as caught:
            _run("rr", pipeline, system=system, on_error="skip")
        messages.append(str(caught.value))
    assert messages[0] == messages[1] == "retrieval service http://127.0.0.1:9/retrieve: cannot connect after 4 tries"


class Failing(SearchSystem):
    """Its retrieval fails on a batch that holds the second question, its reward on the third question."""

    def call_tools(self, tool, states):
        if any(s.example.id == EXAMPLES[1].id for s in states):
            raise ValueError("no index for this question")
        return super().call_tools(tool, states)

    def reward(self, state, example):
        if example.id == EXAMPLES[2].id:
            raise ZeroDivisionError("no gold answer")
        return super().reward(state, example)


def test_a_questions_failure_in_the_overlapped_work_is_recorded_as_without_it() -> None:
    plain, _, _ = _run("is", False, system=Failing(FakeRetriever(), SearchConfig()), on_error="skip")
    system, events = Failing(FakeRetriever(), SearchConfig()), []
    piped, _, _ = _run("is", Prefetch(system, lambda *e: events.append(e)), system=system, on_error="skip")
    assert ("start", RETRIEVER, 2) in events and ("start", "reward", 1) in events  # worked out ahead
    assert [(f.question_id, f.method) for f in plain.failures] == [
        (EXAMPLES[1].id, "call_tools"),
        (EXAMPLES[2].id, "reward"),
    ]
    _same_batches(piped, plain)
    messages = []
    for pipeline in (False, True):
        with pytest.raises(WorkflowError) as caught:
            _run("is", pipeline, system=Failing(FakeRetriever(), SearchConfig()))
        messages.append(str(caught.value))
    assert messages[0] == messages[1] and "call_tools" in messages[0]


def test_a_state_that_differs_from_the_workers_is_worked_out_again() -> None:
    """A workflow whose `apply` is not a function of its input (here: a counter) gets no result worked out from
    another state: the rollout calls the tool itself, on the state it holds."""

    class Counting(RecordingSearch):
        applied = 0

        def apply(self, state, agent, output):
            Counting.applied += 1
            res = super().apply(state, agent, output)
            return type(res)(res.state.with_values(n=Counting.applied), res.penalty, res.info)

    system = Counting(FakeRetriever(), SearchConfig())
    system.tool_calls = []
    piped, _, _ = _run("fof", True, system=system)
    retrieved = [n for n in piped.nodes if n.agent == RETRIEVER]
    assert retrieved and system.tool_calls[-1] == (RETRIEVER, len(retrieved))  # the rollout's own call, all of them
    assert all(n.terminal is not None for n in piped.nodes if n.agent == ANSWERER)


# ------------------------------------------------------------------------------------------- on the tiny model


def test_hf_generator_reports_its_batches_and_generates_the_same(tiny_lm) -> None:
    generator = HFGenerator(tiny_lm.model, tiny_lm.tokenizer, batch_size=2)
    ids = tiny_lm.tokenizer
    prompts = [ids(text)["input_ids"] for text in ["Who wrote", "What is the capital of", "Paris", "a b c d e", "x"]]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.9)
    torch.manual_seed(3)
    plain = generator.generate(prompts, params)
    chunks: list[tuple[list[int], list[Generation]]] = []
    torch.manual_seed(3)
    reported = generator.generate(prompts, params, on_chunk=lambda i, g: chunks.append((list(i), list(g))))
    assert reported == plain
    assert [len(i) for i, _ in chunks] == [2, 2, 1]
    assert sorted(i for indices, _ in chunks for i in indices) == list(range(5))
    assert all(plain[i] == g for indices, gens in chunks for i, g in zip(indices, gens))


def test_a_pipelined_training_run_is_the_run_without_it_bit_for_bit(
    tiny_model_dir: Path, world: Path, tmp_path: Path
) -> None:
    """Two MHGPO-IS steps of the tiny model in fp32, generation batches of 3 (several per agent call): the same
    metrics (but timings), rollout records and weights with the pipeline as without it."""
    from mhgpo.run.pipeline import train

    settings = dict(sampler="is", steps=2, eval_every=0, gen_batch_size=3, precision="fp32")
    runs = {}
    for pipeline in ("false", "true"):
        out = tmp_path / pipeline
        train(make_config(tiny_model_dir, world, out, **settings, **{"rollout.pipeline": pipeline}), progress=False)
        runs[pipeline] = out
    assert_same_run(runs["true"], runs["false"])


def test_work_queued_when_the_rollout_stops_is_dropped() -> None:
    calls: list[int] = []
    started, hold = threading.Event(), threading.Event()

    class Held(SearchSystem):
        def call_tools(self, tool, states):
            calls.append(len(states))
            started.set()
            assert hold.wait(30)
            return super().call_tools(tool, states)

    system = Held(FakeRetriever(), SearchConfig())
    prefetch = Prefetch(system)
    state = system.init_state(EXAMPLES[0])
    gen = Generation([1], [2], [-0.1], "### a query ###", True)

    for n in range(3):
        prefetch.submit([((1, n), state, REWRITER, gen)])
    assert started.wait(30)
    prefetch.close()
    hold.set()
    prefetch._thread.join(30)
    assert calls == [1]  # the first job was under way; the two queued were dropped


def test_a_pipelined_evaluation_is_the_evaluation_without_it() -> None:
    from mhgpo.rl.evaluation import evaluate_examples

    results = [
        evaluate_examples(
            EXAMPLES, search_system(), ChunkedGenerator(), encode, batch_size=2, progress=False, pipeline=pipeline
        )
        for pipeline in (False, True)
    ]
    assert results[0].predictions == results[1].predictions and results[0].predictions
