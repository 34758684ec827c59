"""The reference pass beside the rollouts (`rollout.pipeline` where the engine samples outside the trainer's model:
`generation.engine=vllm_server`, or `vllm` in the process): the reference log-probs of a step's outputs, worked out
in a thread while the engine generates the next batches, rather than in the update.

The reference pass computes one segment at a time (:meth:`mhgpo.rl.policy.Policy.reference_logprobs`: the samples
of one prompt and temperature, in micro-batches cut from them alone), so a segment's log-probs are a function of the
segment. As an agent call's generations come back (`mhgpo.model.generation.generate_in_chunks`), every prompt of the
call whose samples are all in makes a segment (of the samples the sampler may train: IS trains its fork samples
alone), and a worker thread computes it (:meth:`ReferenceAhead.on_call`). The
update then takes a segment from here where the step's trained samples hold exactly that segment (its outputs, in
order), and computes the others as it would have (a sample left untrained, a question that failed, a prompt met in
two calls): the same numbers either way, so the run is the run without it, bit for bit.

The worker uses the trainer's model (under LoRA with its adapter off): only while the rollouts run, with nothing else
using that model, and never beside an update (so not at `rollout.max_staleness: 1`, whose trees grow during the
update). :meth:`ReferenceAhead.results` waits for what is queued; :meth:`ReferenceAhead.close` drops it and waits for
the segment under way.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Hashable

import torch

from mhgpo.model.generation import Generation, OnChunk
from mhgpo.rl.policy import Sample, segment_key


class ReferenceAhead:
    """A worker thread computing the reference log-probs of whole segments as they come. ``compute(samples)``: one
    segment's (:meth:`mhgpo.rl.policy.Policy.reference_segment`); ``temperature(agent)``: the agent's sampling
    temperature (the samples' `temperature`); ``trained(agent)``: whether the agent's samples can be trained (a
    frozen role's are not worked out)."""

    def __init__(
        self,
        compute: Callable[[list[Sample]], list[torch.Tensor]],
        temperature: Callable[[str], float],
        trained: Callable[[str], bool] = lambda agent: True,
    ) -> None:
        self.compute, self.temperature, self.trained = compute, temperature, trained
        self.known: dict[Hashable, list[torch.Tensor]] = {}
        self.samples = 0  # the samples worked out
        self.error: BaseException | None = None  # what stopped the worker (the update then computes the rest)
        self._jobs: queue.Queue[list[Sample] | None] = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="mhgpo-reference-ahead", daemon=True)
        self._thread.start()

    def on_call(self, agent: str, prompts: list[list[int]], may_train: list[bool] | None = None) -> OnChunk | None:
        """The chunk callback of one call of `agent` on `prompts` (None for an agent that is not trained): each
        prompt's segment, its samples that `may_train` (default: all), is queued once all of them are in."""
        if not self.trained(agent):
            return None
        temperature = float(self.temperature(agent))
        members: dict[tuple[int, ...], list[int]] = {}  # a prompt's indices in the call, in order
        for i, prompt in enumerate(prompts):
            if may_train is None or may_train[i]:
                members.setdefault(tuple(prompt), []).append(i)
        done: dict[int, Generation] = {}

        def on_chunk(indices: list[int], generations: list[Generation]) -> None:
            done.update(zip(indices, generations))
            for i in indices:
                segment = members.get(tuple(prompts[i]))
                if segment is None or any(j not in done for j in segment):
                    continue
                del members[tuple(prompts[i])]
                samples = [
                    Sample(list(done[j].prompt_ids), list(done[j].output_ids), [], 0.0, agent, temperature)
                    for j in segment
                    if done[j].output_ids  # (the update leaves empty outputs out)
                ]
                if samples:
                    self._jobs.put(samples)

        return on_chunk

    def results(self) -> dict[Hashable, list[torch.Tensor]]:
        """What was worked out, by :func:`mhgpo.rl.policy.segment_key`, once the queued segments are done."""
        self._stop()
        return self.known

    def close(self) -> None:
        """Drop the queued segments and wait for the one under way (the model is free again on return)."""
        self._closed = True
        self._stop()

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    def _run(self) -> None:
        while True:
            samples = self._jobs.get()
            if samples is None:
                return
            if self._closed or self.error is not None:
                continue
            try:
                self.known[segment_key(samples)] = self.compute(samples)
                self.samples += len(samples)
            except BaseException as e:  # the update computes what is left, and meets the error there if it lasts
                self.error = e
