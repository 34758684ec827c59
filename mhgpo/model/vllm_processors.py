"""The two vLLM logits processors that make the log-probs vLLM reports the project's, ``log_softmax(logits / T)`` at
the token, before top-p, at every temperature (docs/vllm.md, "What goes in and out"); the engine runs with
``logprobs_mode="processed_logits"``. Module-level classes, so that a vLLM server loads them by name
(``--logits-processors mhgpo.model.vllm_processors:LogSoftmax ...``, as `mhgpo serve-generation` starts it) as the
in-process engine does by class.

vLLM's sampler takes the logits through (1) the processors that may change the argmax, (2) the temperature, (3) the
argmax-invariant processors, (4) top-k / top-p, which set the dropped tokens to -inf, and reports the logits as they
are then (``processed_logits``; greedy rows skip 2 to 4). Its ``raw_logprobs`` are the temperature-1 ones; its
``processed_logprobs`` are renormalised over the tokens top-p kept, which puts the log of their mass into every
ratio. A log-softmax at (3) turns the logits into ``log_softmax(logits / T)``, which top-p only masks: the sampled
token's value is the project's log-prob, and the draw is the same (a log-softmax shifts each row by one constant).
Greedy rows get theirs from the log-softmax at (1), where the temperature is 1.

Importing this module without vLLM gives plain classes (nothing here runs then)."""

from __future__ import annotations

from typing import Any

try:
    from vllm.v1.sample.logits_processor import LogitsProcessor as _Base
except ImportError:  # (no vLLM: the module still imports; the classes are only used by a vLLM engine)
    _Base = object

NAMES = ("mhgpo.model.vllm_processors:LogSoftmax", "mhgpo.model.vllm_processors:LogSoftmaxAtTemperature")


class LogSoftmax(_Base):  # type: ignore[misc,valid-type]
    """Logits to log-probs, a row at a time; argmax-invariant, but run before the temperature (see above)."""

    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: Any) -> None:
        pass

    def apply(self, logits: Any) -> Any:
        return logits.log_softmax(dim=-1)  # (B, V)


class LogSoftmaxAtTemperature(LogSoftmax):
    """The same, after the temperature and before top-k / top-p."""

    def is_argmax_invariant(self) -> bool:
        return True
