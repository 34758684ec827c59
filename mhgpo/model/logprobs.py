"""Training-time log-probabilities of output tokens given their prompts, differentiable.

:func:`output_logprobs` runs the model backbone once over right-padded rows (samples that share a prompt share one
row and one computation of the prompt: :mod:`mhgpo.model.packing`), keeps
only the hidden states at the positions that predict output tokens, and applies the LM head and the
log-softmax to those in chunks of positions; each chunk is checkpointed when gradients are needed, so
the full-vocabulary logits of a chunk are recomputed in the backward pass rather than kept. No
full-vocabulary log-softmax is ever taken over prompt positions.

`mhgpo.rl.reference.output_logprobs_reference` is the slow, obviously correct version used to test it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from mhgpo.model.packing import MIN_SHARED_PREFIX, mask_style, pack, shared_prefix_length
from mhgpo.model.precision import module_device


def causal_lm(model: Any) -> Any:
    """The transformers causal LM inside ``model`` (a peft wrapper is looked through; adapters stay active,
    since peft injects its layers into the wrapped modules)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def backbone_and_head(model: Any) -> tuple[Any, Any]:
    """The decoder stack (returning final, normalised hidden states) and the LM head of ``model``."""
    lm = causal_lm(model)
    head = lm.get_output_embeddings()
    backbone = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    if backbone is None or backbone is lm:
        prefix = getattr(lm, "base_model_prefix", "")
        backbone = getattr(lm, prefix, None) if prefix else None
    if head is None or backbone is None or backbone is lm:
        raise TypeError(f"cannot split {type(lm).__name__} into a backbone and an LM head")
    return backbone, head


def _soft_cap(lm: Any) -> float | None:
    cap = getattr(getattr(lm, "config", None), "final_logit_softcapping", None)
    return float(cap) if cap else None


def check_pairs(prompts: list[list[int]], outputs: list[list[int]], temperature: float) -> None:
    if len(prompts) != len(outputs):
        raise ValueError(f"{len(prompts)} prompts but {len(outputs)} outputs")
    if temperature <= 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty: the first output token would have no context")


def _scaled_logits(hidden: torch.Tensor, head: Any, temperature: float, cap: float | None) -> torch.Tensor:
    """``head(hidden)`` soft-capped where the model caps, over ``temperature``: hidden (N, H) -> (N, V) float32."""
    logits = head(hidden).float()  # (N, V)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap  # (N, V)
    return logits / temperature  # (N, V)


def _token_logprobs(
    hidden: torch.Tensor, targets: torch.Tensor, head: Any, temperature: float, cap: float | None
) -> torch.Tensor:
    """``log_softmax(head(hidden) / T)`` at ``targets``: hidden (N, H), targets (N,) -> (N,) float32."""
    logits = _scaled_logits(hidden, head, temperature, cap)  # (N, V)
    picked = logits.gather(1, targets.unsqueeze(1)).squeeze(1)  # (N,)
    return picked - torch.logsumexp(logits, dim=-1)  # (N,)


def _token_logprobs_entropy(
    hidden: torch.Tensor, targets: torch.Tensor, head: Any, temperature: float, cap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_token_logprobs` and the entropy of each position's whole distribution ``softmax(head(hidden) / T)``,
    ``logsumexp(z) - sum(softmax(z) * z)``: two (N,) float32."""
    logits = _scaled_logits(hidden, head, temperature, cap)  # (N, V)
    lse = torch.logsumexp(logits, dim=-1)  # (N,)
    picked = logits.gather(1, targets.unsqueeze(1)).squeeze(1)  # (N,)
    return picked - lse, lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # (N,) (N,)


def output_hidden_states(
    backbone: Any,
    prompts: list[list[int]],
    outputs: list[list[int]],
    pad_id: int,
    device: torch.device,
    share: bool = True,
) -> torch.Tensor:
    """The decoder's final hidden state at every position that predicts an output token: (N, H), N the total
    number of output tokens, in row-major order (sample 0's tokens first). The state at prompt position
    ``len(prompt) - 1`` predicts output token 0, the state at output token t - 1 predicts token t (the log-probs and
    the critic's values both read it). One forward over the packed rows (:mod:`mhgpo.model.packing`): with ``share`` (and an
    attention implementation that takes a custom mask), samples with identical prompts share one computation of the
    prompt, else every sample is a right-padded ``prompt + output`` row. With ``share``, the prefix every prompt of
    the batch starts with (an agent's instructions: most of a Rewriter's prompt) is run once before, and the rows
    attend to its keys and values (:func:`_instructions`): the same function, up to float rounding."""
    n_prefix = _instructions(backbone, prompts) if share else 0
    if n_prefix:
        head = prompts[0][:n_prefix]
        prompts = [p[n_prefix:] for p in prompts]
    packed = pack(prompts, outputs, pad_id, mask_style(backbone.config) if share else None)
    mask, positions, past = packed.attention_mask, packed.position_ids, None  # (R, 1, L, L) or (R, L); (R, L)
    if n_prefix:
        past = expanded_cache(prefix_keys_values(backbone, head, device), mask.shape[0])
        mask = _with_prefix(mask, n_prefix)
        positions = positions + n_prefix
    out = backbone(
        input_ids=packed.input_ids.to(device),  # (R, L)
        attention_mask=mask.to(device),  # (R, 1, L, P + L) or (R, P + L), P = n_prefix (0: none)
        position_ids=positions.to(device),  # (R, L)
        use_cache=past is not None,
        **({cache_argument(backbone): past} if past is not None else {}),
    )
    hidden = out.last_hidden_state  # (R, L, H)
    return hidden[packed.rows.to(device), packed.cols.to(device)]  # (N, H)


def cache_argument(module: Any) -> str:
    """The name under which ``module``'s forward takes a KV cache: ``cache`` (newer transformers), else
    ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def _instructions(backbone: Any, prompts: list[list[int]]) -> int:
    """The length of the prefix every prompt of the batch starts with (an agent's instructions, when the batch is one
    agent's), run once on its own (:func:`output_hidden_states`); 0 when it is shorter than
    :data:`MIN_SHARED_PREFIX`, for one prompt, and on a model with gradient checkpointing on (a layer recomputed in
    the backward pass would append to the prefix's cache again), whether it trains or not: the passes without
    gradients (the reference, the old log-probs) compute as the update does, so that, the weights equal, their
    log-probs are the update's bit for bit (a KL of exactly 0, not a rounding that Adam would turn into a step)."""
    if len({tuple(p) for p in prompts}) < 2 or any(
        getattr(m, "gradient_checkpointing", False) for m in backbone.modules()
    ):
        return 0  # (in eval passes too: the reference's and the old log-probs' sums then round as the update's)
    n = shared_prefix_length(prompts)
    return n if n >= MIN_SHARED_PREFIX else 0


def prefix_keys_values(backbone: Any, prefix: list[int], device: torch.device) -> list[tuple[Any, Any]]:
    """Each layer's keys and values of ``prefix`` run alone (one row; with gradients where they are taken, so that
    every row later attending to them sends its share back through them): the shared instructions of a training
    micro-batch and of a generation batch's prefill."""
    ids = torch.tensor([prefix], dtype=torch.long, device=device)  # (1, P)
    return [(layer.keys, layer.values) for layer in backbone(input_ids=ids, use_cache=True).past_key_values.layers]


def expanded_cache(head: list[tuple[Any, Any]], rows: int) -> Any:
    """A key/value cache holding ``head`` (:func:`prefix_keys_values`) for each of ``rows`` rows."""
    from transformers.cache_utils import DynamicCache

    past = DynamicCache()
    for layer, (k, v) in enumerate(head):
        past.update(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1), layer)
    return past


def _with_prefix(mask: torch.Tensor, n_prefix: int) -> torch.Tensor:
    """``mask`` (R, L) or (R, 1, L, L) with ``n_prefix`` key columns in front that every position attends to."""
    if mask.ndim == 2:
        return torch.cat([torch.ones((mask.shape[0], n_prefix), dtype=mask.dtype), mask], dim=1)  # (R, P + L)
    rows, _, width, _ = mask.shape
    seen = torch.ones if mask.dtype == torch.bool else torch.zeros  # (bool: True attends; additive: 0 attends)
    return torch.cat([seen((rows, 1, width, n_prefix), dtype=mask.dtype), mask], dim=3)  # (R, 1, L, P + L)


def output_logprobs(
    model: Any,
    prompts: list[list[int]],
    outputs: list[list[int]],
    temperature: float = 1.0,
    chunk_size: int = 512,
    pad_id: int = 0,
    share: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of each output token given its prompt and the preceding output tokens.

    Returns ``(logp, mask)``, both (B, T_out) with ``T_out = max(len(o) for o in outputs)``: ``logp`` is
    float32, differentiable w.r.t. the model parameters, 0 where ``mask`` is False; ``mask`` is bool.
    ``chunk_size`` bounds the number of positions whose full-vocabulary logits exist at once; ``share``: samples
    with identical prompts share the prompt's computation (:func:`output_hidden_states`).
    """
    logp, mask, _ = _output_terms(model, prompts, outputs, temperature, chunk_size, pad_id, share, entropy=False)
    return logp, mask


def output_logprobs_entropy(
    model: Any,
    prompts: list[list[int]],
    outputs: list[list[int]],
    temperature: float = 1.0,
    chunk_size: int = 512,
    pad_id: int = 0,
    share: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`output_logprobs` and, from the same forward, the entropy of the policy's whole next-token distribution
    at each output position (at ``temperature``, before any top-p): ``(logp, mask, entropy)``, the third (B, T_out)
    float32, differentiable, 0 where ``mask`` is False (the entropy term of `optim.entropy_coef`)."""
    logp, mask, entropy = _output_terms(model, prompts, outputs, temperature, chunk_size, pad_id, share, entropy=True)
    assert entropy is not None
    return logp, mask, entropy


def _output_terms(
    model: Any,
    prompts: list[list[int]],
    outputs: list[list[int]],
    temperature: float,
    chunk_size: int,
    pad_id: int,
    share: bool,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    check_pairs(prompts, outputs, temperature)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    device = module_device(model)
    batch = len(prompts)
    t_out = max((len(o) for o in outputs), default=0)
    mask = torch.zeros((batch, t_out), dtype=torch.bool, device=device)  # (B, T_out)
    for row, out in enumerate(outputs):
        mask[row, : len(out)] = True
    if batch == 0 or t_out == 0:
        zeros = torch.zeros((batch, t_out), dtype=torch.float32, device=device)  # (B, T_out)
        return zeros, mask, zeros.clone() if entropy else None

    backbone, head = backbone_and_head(model)
    cap = _soft_cap(causal_lm(model))
    picked_hidden = output_hidden_states(backbone, prompts, outputs, pad_id, device, share)  # (N, H)
    targets = torch.tensor([t for out in outputs for t in out], dtype=torch.long, device=device)  # (N,)

    needs_grad = torch.is_grad_enabled() and picked_hidden.requires_grad
    terms = _token_logprobs_entropy if entropy else _token_logprobs
    pieces = []
    for start in range(0, targets.shape[0], chunk_size):
        h = picked_hidden[start : start + chunk_size]  # (n, H)
        t = targets[start : start + chunk_size]  # (n,)
        if needs_grad:
            pieces.append(checkpoint(terms, h, t, head, temperature, cap, use_reentrant=False))  # (n,) or two
        else:
            pieces.append(terms(h, t, head, temperature, cap))  # (n,) or two

    def scattered(flat: torch.Tensor) -> torch.Tensor:  # (N,) -> (B, T_out), row-major order matches `rows`
        return torch.zeros((batch, t_out), dtype=torch.float32, device=device).masked_scatter(mask, flat)

    if not entropy:
        return scattered(torch.cat(pieces)), mask, None
    return scattered(torch.cat([p[0] for p in pieces])), mask, scattered(torch.cat([p[1] for p in pieces]))
