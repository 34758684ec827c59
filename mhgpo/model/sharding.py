"""FSDP: the actor's decoder layers sharded across the ranks of a data-parallel run (torch's FSDP2,
``torch.distributed.fsdp.fully_shard``).

Under ``accelerate launch`` with ``distributed_type: FSDP`` (the launcher sets ``ACCELERATE_USE_FSDP=true``;
`configs/accelerate/cpu_fsdp.yaml`, `gpu_fsdp.yaml`) the trainer shards the actor (:func:`shard_model`): each decoder
layer, then the decoder stack (the backbone that mhgpo's log-prob, value and prefill passes call directly) as the
root; the input embedding (and so an LM head tied to it) and an untied LM head stay whole on every rank
(replicated), because mhgpo calls the backbone and the LM head as two modules. Everything else of data parallelism
(`mhgpo/model/distributed.py`) is unchanged; what differs:

- Passes whose number differs between ranks (the rollouts' decoding, validation, the reference's log-probs; a
  frozen reference copy under full fine-tuning is sharded too) run on the whole model: :func:`gathered`
  all-gathers every sharded layer before them and reshards after, so no collective runs inside them.
- The update's forward / backward passes reduce-scatter each layer's gradient: every rank runs the same number of
  micro-batches (the shorter ranks add zero-weight ones) and the gradients are summed, not averaged
  (:func:`sum_gradients`: divide factor 1, reduced with plain sums, which gloo supports). The replicated weights'
  gradients are summed by :meth:`mhgpo.model.distributed.Ranks.sum_grads` as under plain data parallelism, and
  :func:`clip_grad_norm` clips by the norm over all of them (sharded and replicated).
- Checkpoints hold the full tensors (:func:`full`, a collective: every rank calls it), as a run of one process writes
  them; loading places each rank's shard (:func:`placed`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

ENV = "ACCELERATE_USE_FSDP"  # set by `accelerate launch` from a config with distributed_type: FSDP
RAM_EFFICIENT = "FSDP_CPU_RAM_EFFICIENT_LOADING"  # set by `accelerate launch` under FSDP ("true" unless told not to)


def requested() -> bool:
    """Whether the launcher asked for FSDP."""
    return os.environ.get(ENV, "").lower() in ("1", "true")


def load_whole() -> None:
    """Every rank loads the whole model, which :func:`shard_model` then shards: under FSDP, `accelerate launch`
    asks by default for its "CPU-RAM-efficient" loading, where transformers (5.19, for one) leaves the weights of
    every rank but 0 at zero, to be broadcast from rank 0 by accelerate's own FSDP preparation, which mhgpo does
    not use; that loading is turned off."""
    if requested():
        os.environ[RAM_EFFICIENT] = "false"


def _fsdp_modules(model: torch.nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: torch.nn.Module | None) -> bool:
    return model is not None and bool(_fsdp_modules(model))


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def shard_model(model: torch.nn.Module, device: torch.device, world: int) -> None:
    """Shard `model` (a causal LM, peft-wrapped or not) in place over the `world` ranks of the default process
    group: each decoder layer, then the decoder stack as the root, its input embedding left out (replicated)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from mhgpo.model.logprobs import backbone_and_head

    backbone, _ = backbone_and_head(model)
    layers = getattr(backbone, "layers", None)
    if layers is None:
        raise TypeError(f"FSDP: {type(backbone).__name__} has no `layers` (decoder layers) to shard")
    mesh = init_device_mesh(device.type, (world,))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    embedding = backbone.get_input_embeddings()
    fully_shard(backbone, mesh=mesh, ignored_params=set(embedding.parameters()))
    for m in _fsdp_modules(model):
        sum_gradients(m)


def sum_gradients(module: Any) -> None:
    """Reduce-scatter the sum of the ranks' gradients (mhgpo's loss is a sum over the step with step-wide weights):
    divide factor 1, and plain SUM reductions (the divide factor's PREMUL_SUM is NCCL's only; gloo refuses it)."""
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)


@contextmanager
def gathered(model: torch.nn.Module | None) -> Iterator[None]:
    """The whole `model` on every rank inside (no collective in its forward passes, which may then differ in
    number between ranks); resharded on exit. Every rank enters and leaves together. A no-op if not sharded, and
    inside another `gathered` of the same model (the outer one reshards: an inner exit must not, or collectives
    would come back into the outer block's passes)."""
    modules = _fsdp_modules(model) if model is not None else []
    if not modules or id(model) in _GATHERED:
        yield
        return
    _GATHERED.add(id(model))
    try:
        for m in modules:
            m.set_reshard_after_forward(False)
            m.unshard()
        yield
    finally:
        _GATHERED.discard(id(model))
        for m in modules:
            m.reshard()
            m.set_reshard_after_forward(True)


_GATHERED: set[int] = set()  # id() of the models inside a `gathered` block


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded one (a collective: every rank calls it, in the same order), else `t`."""
    return t.full_tensor() if is_dtensor(t) else t


def placed(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`value` (a whole tensor) as `like` holds it: this rank's shard if `like` is sharded, else `value`."""
    if not is_dtensor(like):
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(like.device, like.dtype), like.device_mesh, like.placements, src_data_rank=None)


def clip_grad_norm(params: Sequence[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over parameters that may be sharded and replicated at once: the total
    norm of every gradient (a sharded gradient's norm is the norm of its whole tensor), then each scaled."""
    with_grad = [p for p in params if p.grad is not None]
    sharded = [p for p in with_grad if is_dtensor(p.grad)]
    if not sharded:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    plain = [p for p in with_grad if not is_dtensor(p.grad)]
    norms = [full(torch.nn.utils.get_total_norm([p.grad for p in sharded]))]
    if plain:
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in plain]))
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))  # as clip_grad_norm_ scales
    for p in with_grad:
        p.grad.mul_(coef)
    return total
