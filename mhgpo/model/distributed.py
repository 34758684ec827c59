"""Data parallelism: the ranks of a run started with `accelerate launch` and the few collectives training needs.

`current()` is :class:`Single` (one process, every collective the identity) unless the process was started by a
launcher that sets ``WORLD_SIZE`` > 1 (`accelerate launch`, `torchrun`); then accelerate's :class:`PartialState`
opens the process group (gloo on CPU, NCCL on CUDA, each rank on its own GPU) and :class:`Ranks` wraps it.

What the trainer does with them (docs/design.md, "Data parallelism"): each step's questions are cut into one
contiguous share per rank; every rank rolls its share out and the trees are gathered on every rank, so that the
bookkeeping of the step (groups, RR's singleton pools, rewards, advantages, the critic's whitening, the metrics) runs
on the whole step, identically everywhere; the forward and backward passes of the update are cut into one share of
the samples per rank (:func:`shares`), with the step-wide token weights, and the gradients are summed across ranks
(:meth:`Ranks.sum_grads`) before clipping, so the optimiser step equals one process's step on the same batch.
Under an FSDP launch the actor's decoder layers are sharded instead (:mod:`mhgpo.model.sharding`): FSDP sums their
gradients in the backward passes, and :meth:`Ranks.sum_grads` sums the rest.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import torch

T = TypeVar("T")

TIMEOUT_S = 1800  # a collective that waits longer (a rank died or hangs) ends the run, naming the waiting rank


class Single:
    """One process: rank 0 of 1; the collectives give back what they are given."""

    world = 1
    rank = 0
    is_main = True

    def gather(self, obj: T) -> list[T]:
        return [obj]

    def sum(self, values: Sequence[float]) -> list[float]:
        return [float(v) for v in values]

    def any(self, flag: bool) -> bool:
        return bool(flag)

    def sum_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        return None

    def barrier(self) -> None:
        return None

    def close(self, engine: Any = None) -> None:
        return None

    def share(self, items: Sequence[T]) -> list[T]:
        return list(items)


class Ranks(Single):
    """One rank of a process group opened by accelerate (``torch.distributed`` underneath)."""

    def __init__(self, timeout_s: int = TIMEOUT_S):
        from accelerate import PartialState

        cpu = not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
        self.state = PartialState(cpu=cpu, timeout=datetime.timedelta(seconds=timeout_s))
        self.world = int(self.state.num_processes)
        self.rank = int(self.state.process_index)
        self.is_main = self.rank == 0
        self.device = self.state.device
        self.comm_seconds = 0.0  # time spent in collectives (the rollouts' gather included: it waits for the slowest)

    def _timed(self, fn: Any, *args: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args)
        except (RuntimeError, OSError) as e:  # gloo / NCCL: a peer closed the connection, or the timeout passed
            from mhgpo.errors import RunError

            raise RunError(
                f"rank {self.rank} of {self.world}: another rank stopped answering "
                f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); the run stops"
            ) from e
        finally:
            self.comm_seconds += time.perf_counter() - t

    def gather(self, obj: T) -> list[T]:
        """Every rank's `obj`, in rank order, on every rank. It travels as JSON (:mod:`mhgpo.model.wire`): the
        byte lengths are gathered first, then the bytes, padded to the longest; decoding runs no code. A rank whose
        `obj` cannot be sent sends its error instead, so that every rank stops with it rather than wait."""
        from mhgpo.errors import RunError
        from mhgpo.model.wire import WireError, dumps, loads

        try:
            data = dumps(["ok", obj])
        except WireError as e:
            data = dumps(["error", f"rank {self.rank}: {e}"])
        device = self._collective_device()
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        sizes = [torch.zeros_like(size) for _ in range(self.world)]
        self._timed(torch.distributed.all_gather, sizes, size)
        lengths = [int(s.item()) for s in sizes]
        mine = torch.zeros(max(lengths), dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        mine = mine.to(device)
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        self._timed(torch.distributed.all_gather, parts, mine)
        out: list[Any] = []
        for part, n in zip(parts, lengths):
            try:
                status, value = loads(part[:n].cpu().numpy().tobytes())
            except (WireError, ValueError, TypeError) as e:
                raise RunError(f"rank {self.rank} of {self.world}: {e}") from None
            if status != "ok":
                raise RunError(f"{value}; the run stops")
            out.append(value)
        return out

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sums over the ranks (float64)."""
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._collective_device())
        self._timed(torch.distributed.all_reduce, t)
        return [float(v) for v in t.cpu()]

    def any(self, flag: bool) -> bool:
        return self.sum([1.0 if flag else 0.0])[0] > 0

    def sum_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Replace each parameter's gradient by its sum over the ranks, in one flat all-reduce; a parameter that no
        rank gave a gradient keeps none (AdamW then leaves it alone, as in one process)."""
        has = self.sum([1.0 if p.grad is not None else 0.0 for p in params])
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params]
        )  # (P,)
        self._timed(torch.distributed.all_reduce, flat)
        at = 0
        for p, h in zip(params, has):
            n = p.numel()
            p.grad = flat[at : at + n].view_as(p).to(p.dtype) if h > 0 else None
            at += n

    def barrier(self) -> None:
        self._timed(torch.distributed.barrier)

    def close(self, engine: Any = None) -> None:
        """Once every rank is done: end the process group, so that none of its threads outlives the interpreter
        (an exit with the group still open may abort in its teardown). ``engine``: this rank's separate engine
        (vLLM), closed first, once every rank is done: its teardown ends its own groups on the process group, and
        the process group with them."""
        self.barrier()
        if engine is not None:
            engine.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def share(self, items: Sequence[T]) -> list[T]:
        """This rank's contiguous share of `items` (the shares of all ranks, in rank order, are `items`)."""
        return list(items)[slice(*share_bounds(len(items), self.world, self.rank))]

    def _collective_device(self) -> torch.device:
        return self.device if torch.distributed.get_backend() == "nccl" else torch.device("cpu")


def share_bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of rank `rank`'s contiguous share of n items: the first n % world ranks get one more."""
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def shares(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Indices of the samples (their token counts `lengths`) cut into `world` shares of about equal tokens: longest
    first, each to the share with the fewest tokens so far (ties: the lower rank); indices ascending in a share."""
    load = [0] * world
    out: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        out[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in out]


_CURRENT: Single | None = None


def current() -> Single:
    """The ranks of this process (opened once): :class:`Ranks` under a launcher with more than one process."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = Ranks() if int(os.environ.get("WORLD_SIZE", "1")) > 1 else Single()
    return _CURRENT
