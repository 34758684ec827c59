"""On-policy pipelining inside a step (`rollout.pipeline`): the tool calls and the rewards of a generation batch's
outputs, worked out in a thread while the engine generates the next batches.

The rollout (`mhgpo.rl.rollout.run_rollouts`) stays what it is: the same generation calls, with the same prompts in
the same batches and the same random numbers, and the same workflow calls in the same order. What changes is when a
tool call and a finished branch's reward are made: as each batch of an agent's call comes back from the engine
(`mhgpo.model.generation.generate_in_chunks`), a worker thread parses its outputs (`apply`), asks each new state
what comes next (`next_agent`) and runs the tool it names (`call_tools`, one call for the batch's states waiting on
each tool) or, for a finished branch, `final_answer`, `reward` and `trace`. The rollout then takes these results
where it would have called the workflow itself, if the state it holds equals the one the worker started from;
else (or where nothing was worked out ahead) it calls the workflow as it does without the pipeline.

So the results are those of a rollout without it, bit for bit, for any workflow whose methods are functions of the
state (the `Workflow` contract; a tool that answers each state as it would in a larger batch, as retrieval does). A
failure keeps its form: a tool's `ServiceError` stops the batch where its call would have been made, and the
error of one question's tool call, or of its reward, is recorded against that question with the same message. The
workflow's `call_tools`, `final_answer`, `reward` and `trace` then run in the worker thread, while the rollout calls
the other methods in its own: they must not share unguarded mutable state (pure methods, and the retrievers, which
hold a lock, do not).

It pays where the tools or the rewards wait (a retrieval service over HTTP, a remote judge) while the engine
computes, or where the engine is remote and the trainer's process is free meanwhile. In-process decoding on a CPU
with an in-process retriever (BM25) only trades cores between the two.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from mhgpo.errors import ServiceError
from mhgpo.model.generation import Generation
from mhgpo.team.workflow import State, StepResult, Workflow


@dataclass
class Failed:
    """A workflow call that raised in the worker: the rollout records it as the question's failure."""

    exc: BaseException


@dataclass
class Worked:
    """What the worker made of one generation: the state `apply` gave, what `next_agent` named for it, and the
    tool's raw result for that state (a value, a `Failed`, or the tool batch's `ServiceError`), or the finish's
    (final answer, reward, trace), each a value or a `Failed`."""

    state: State
    next_name: str | None
    tool_result: Any = None
    service_error: ServiceError | None = None
    finish: tuple[Any, Any, Any] | None = None


@dataclass
class _Job:
    items: list[tuple[Any, State, str, str]]  # (key, branch state before the agent's call, agent, output text)
    future: Future = field(default_factory=Future)


class Prefetch:
    """A worker thread that works out the tool calls and rewards of generation batches as they come
    (:meth:`submit`), and the rollout's look-ups of them (:meth:`tool_result`, :meth:`finish`). ``on_event``: called
    with ("start" | "end", tool or "reward", number of states) around each piece of work (tests)."""

    def __init__(self, workflow: Workflow, on_event: Callable[[str, str, int], None] | None = None) -> None:
        self.workflow = workflow
        self.on_event = on_event
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._by_key: dict[Any, _Job] = {}
        self._calls = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="mhgpo-rollout-pipeline", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the worker: the work queued and not started is dropped, the work under way ends (it is not waited
        for; a rollout that stopped on an error makes no more calls of a service that may be down)."""
        self._closed = True
        self._jobs.put(None)

    # ------------------------------------------------------------------------------------- the rollout's side

    def call(self) -> int:
        """A number for the next agent call, which keys its generations: (call, index in the call's prompts)."""
        self._calls += 1
        return self._calls

    def submit(self, keyed: list[tuple[Any, State, str, Generation]]) -> None:
        """Queue the work of one generation batch: (key, the branch's state, agent, generation) each."""
        job = _Job([(key, state, agent, gen.text) for key, state, agent, gen in keyed])
        for key, *_ in keyed:
            self._by_key[key] = job
        self._jobs.put(job)

    def _worked(self, key: Any, state: State, name: str | None) -> Worked | None:
        """The worker's result for ``key`` if it started from ``state`` and named ``name`` next (waiting for it)."""
        job = self._by_key.pop(key, None)
        if job is None:
            return None
        done: dict[Any, Worked] = job.future.result()
        worked = done.get(key)
        if worked is None or worked.next_name != name or not _same(worked.state, state):
            return None
        return worked

    def tool_result(self, key: Any, state: State, tool: str) -> Worked | None:
        """The tool's result for a branch in ``state`` worked out ahead, or None; its batch's `ServiceError` is
        raised here, where the rollout's own call would have raised it."""
        worked = self._worked(key, state, tool)
        if worked is not None and worked.service_error is not None:
            raise worked.service_error
        return worked

    def finish(self, key: Any, state: State) -> tuple[Any, Any, Any] | None:
        """(final answer, reward, trace) of a finished branch in ``state`` worked out ahead (values or `Failed`),
        or None."""
        worked = self._worked(key, state, None)
        return worked.finish if worked is not None else None

    # ----------------------------------------------------------------------------------------- the worker

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if self._closed:
                job.future.set_result({})
                continue
            try:
                job.future.set_result(self._work(job.items))
            except BaseException:  # nothing worked out: the rollout calls the workflow itself, and meets the error
                job.future.set_result({})

    def _event(self, what: str, name: str, n: int) -> None:
        if self.on_event is not None:
            self.on_event(what, name, n)

    def _work(self, items: list[tuple[Any, State, str, str]]) -> dict[Any, Worked]:
        workflow = self.workflow
        done: dict[Any, Worked] = {}
        waiting: dict[str, list[Any]] = {}
        for key, state, agent, text in items:
            try:
                res = workflow.apply(state, agent, text)
                if not isinstance(res, StepResult) or not isinstance(res.state, State):
                    continue
                name = workflow.next_agent(res.state)
            except Exception:  # the rollout calls it again and records the failure
                continue
            if name is not None and not (isinstance(name, str) and workflow.is_tool(name)):
                continue
            done[key] = Worked(res.state, name)
            if name is None:
                self._event("start", "reward", 1)
                done[key].finish = self._finish(res.state)
                self._event("end", "reward", 1)
            else:
                waiting.setdefault(name, []).append(key)
        for tool, keys in waiting.items():
            self._event("start", tool, len(keys))
            self._call_tool(tool, [done[k] for k in keys])
            self._event("end", tool, len(keys))
        return done

    def _finish(self, state: State) -> tuple[Any, Any, Any]:
        workflow = self.workflow
        return (
            _attempt(workflow.final_answer, state),
            _attempt(lambda: float(workflow.reward(state, state.example))),
            _attempt(workflow.trace, state),
        )

    def _call_tool(self, tool: str, worked: list[Worked]) -> None:
        """One call of ``tool`` for the states of ``worked``; if it raises (but for a `ServiceError`), each state
        alone, as the rollout does."""
        workflow = self.workflow
        try:
            results = list(workflow.call_tools(tool, [w.state for w in worked]))
            if len(results) != len(worked):
                raise ValueError(f"returned {len(results)} results for {len(worked)} states")
        except ServiceError as e:
            for w in worked:
                w.service_error = e
            return
        except Exception:
            results = []
            for w in worked:
                res = _attempt(workflow.call_tools, tool, [w.state])
                results.append(res[0] if isinstance(res, list) and len(res) == 1 else res)
        for w, res in zip(worked, results):
            w.tool_result = res


def _attempt(fn: Callable, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as e:
        return Failed(e)


def _same(a: State, b: State) -> bool:
    """Whether two states hold the same question and values (False where they cannot be compared)."""
    if a is b:
        return True
    try:
        return bool(a.example == b.example and dict(a.values) == dict(b.values))
    except Exception:
        return False
