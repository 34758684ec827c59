"""Shared-prefix packing: the samples of a micro-batch that share a prompt are computed as one sequence.

At a fork the G samples of a group share one prompt (hundreds of tokens) and differ only in their outputs (tens).
A *segment* holds that prompt once, followed by the outputs of every sample that has exactly this prompt:

    tokens     [ p_0 ... p_{P-1} | o1_0 ... o1_{m1-2} | o2_0 ... o2_{m2-2} | ... ]
    positions  [ 0   ...   P-1   | P    ... P+m1-2    | P    ... P+m2-2    | ... ]

A 4-D attention mask lets each token of output j attend to the prompt and to the earlier tokens of output j, never to
a sibling's, and the position ids restart after the prompt for every output, so each output token sees exactly what
it sees in a row `prompt + output_j` of its own. The last token of an output predicts nothing and is left out; the
prompt's last position predicts the first token of every output. The prompt's activations are computed once, and in
the backward pass its gradient receives the sum of the G outputs' contributions, once.

Rows are right-padded to the longest; a padding position attends to itself only. The mask is boolean (True: attend)
for PyTorch's scaled-dot-product attention and additive (0 / the float32 minimum) for the eager implementation;
other attention implementations take no custom mask, and a custom mask would drop a sliding window, so there (and with
``optim.share_prefix=false``) every sample keeps a row of its own with a 2-D padding mask (the same layout with one
output per segment).

One forward pass over the packed rows, rather than a prompt pass whose key/value cache is expanded for the outputs:
the same pass serves the update, the reference and the critic, and gradient checkpointing recomputes a layer exactly
as it ran (a cache would be appended to again by the recomputation). The one exception: the prefix that every prompt
of a micro-batch starts with (:func:`shared_prefix_length`; an agent's instructions, when the micro-batch is one
agent's) is run once on its own and the packed rows attend to its keys and values, where it is at least
:data:`MIN_SHARED_PREFIX` tokens long and no layer is recomputed (`mhgpo.model.logprobs.output_hidden_states`).

:func:`micro_batches` cuts a step's samples into micro-batches of segments whose padded size (rows × longest row)
stays within a token budget: a group stays whole when its segment fits, and a larger one is split into segments that
each repeat the prompt.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

SHARED_MASK_ATTENTION = ("sdpa", "eager")  # attention implementations that take a custom 4-D mask
MIN_SHARED_PREFIX = 16  # prompt tokens shared by a whole batch below which the prefix is not run on its own


@dataclass
class Packed:
    """Model inputs for a packed batch and where each output token's predicting state sits.

    input_ids (R, L) long; position_ids (R, L) long; attention_mask (R, 1, L, L) bool or float32 when shared, else
    (R, L) long; rows, cols (N,) long: the row and column whose hidden state predicts output token n, N the total
    number of output tokens in sample order (sample 0's tokens first)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor


def segments(prompts: Sequence[Sequence[int]], keys: Sequence[Hashable] | None = None) -> list[list[int]]:
    """Indices of samples grouped by identical prompt (and identical key), in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault((keys[i] if keys is not None else None, tuple(prompt)), []).append(i)
    return list(groups.values())


def shared_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix shared by every prompt (an agent's instructions), shorter than the shortest
    prompt (so that every prompt keeps at least its last token to run with the rest of the batch)."""
    first, limit = prompts[0], min(len(p) for p in prompts) - 1
    n = 0
    while n < limit and all(p[n] == first[n] for p in prompts):
        n += 1
    return n


def segment_length(prompt_len: int, output_lens: Sequence[int]) -> int:
    """Tokens of a segment: the prompt and every output but its last token."""
    return prompt_len + sum(max(m - 1, 0) for m in output_lens)


def mask_style(model_config: object) -> str | None:
    """``"bool"`` or ``"additive"``: the 4-D mask the model's attention implementation takes; None: no custom mask
    (samples are not shared)."""
    impl = getattr(model_config, "_attn_implementation", None) or "eager"
    sliding = getattr(model_config, "sliding_window", None) or "sliding_attention" in (
        getattr(model_config, "layer_types", None) or ()
    )
    if impl not in SHARED_MASK_ATTENTION or sliding:
        return None
    return "bool" if impl == "sdpa" else "additive"


def pack(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], pad_id: int, style: str | None) -> Packed:
    """The packed inputs of ``prompts`` / ``outputs``: samples with identical prompts share a segment when ``style``
    is ``"bool"`` or ``"additive"`` (the form of the 4-D mask); with ``style=None``, or when no two samples share a
    prompt (nothing to save), each sample is its own row with a 2-D padding mask."""
    groups = segments(prompts) if style is not None else []
    if all(len(g) == 1 for g in groups):
        style, groups = None, [[i] for i in range(len(prompts))]
    lengths = [segment_length(len(prompts[g[0]]), [len(outputs[i]) for i in g]) for g in groups]
    n_rows, width = len(groups), max(lengths)
    input_ids = torch.full((n_rows, width), pad_id, dtype=torch.long)  # (R, L)
    position_ids = torch.zeros((n_rows, width), dtype=torch.long)  # (R, L)
    # owner[r, c]: -1 for a prompt position, j >= 0 for a position of the segment's j-th output, -2 for padding
    owner = torch.full((n_rows, width), -2, dtype=torch.long)  # (R, L)
    where: list[tuple[int, list[int]]] = [(0, [])] * len(prompts)  # per sample: its row and predicting columns
    for r, group in enumerate(groups):
        prompt = list(prompts[group[0]])
        p = len(prompt)
        input_ids[r, :p] = torch.tensor(prompt, dtype=torch.long)
        position_ids[r, :p] = torch.arange(p)
        owner[r, :p] = -1
        start = p
        for j, i in enumerate(group):
            body = list(outputs[i][:-1])  # the last output token is an input to nothing
            n = len(body)
            input_ids[r, start : start + n] = torch.tensor(body, dtype=torch.long)
            position_ids[r, start : start + n] = torch.arange(p, p + n)
            owner[r, start : start + n] = j
            where[i] = (r, [p - 1] + list(range(start, start + n)) if outputs[i] else [])
            start += n
    rows = torch.tensor([r for r, cols in where for _ in cols], dtype=torch.long)  # (N,)
    cols = torch.tensor([c for _, cols in where for c in cols], dtype=torch.long)  # (N,)
    if style is None:
        return Packed(input_ids, position_ids, (owner != -2).long(), rows, cols)
    return Packed(input_ids, position_ids, _segment_mask(owner, style), rows, cols)


def _segment_mask(owner: torch.Tensor, style: str) -> torch.Tensor:
    """owner (R, L) -> the (R, 1, L, L) mask: query q attends to key k <= q when k is a prompt position or both are
    positions of the same output; a padding position attends to itself only."""
    width = owner.shape[1]
    causal = torch.ones((width, width), dtype=torch.bool).tril()  # (L, L)
    q, k = owner[:, :, None], owner[:, None, :]  # (R, L, 1) (R, 1, L)
    allowed = causal & (((k == -1) & (q != -2)) | ((q == k) & (q >= 0)))  # (R, L, L)
    allowed |= torch.eye(width, dtype=torch.bool) & (q == -2)  # (R, L, L) padding sees itself
    allowed = allowed[:, None]  # (R, 1, L, L)
    if style == "bool":
        return allowed
    additive = torch.zeros(allowed.shape, dtype=torch.float32)  # (R, 1, L, L)
    return additive.masked_fill_(~allowed, torch.finfo(torch.float32).min)


MICRO_BATCH_COST = 128  # what a micro-batch costs beyond its padded tokens, in tokens (the cut weighs it)


def micro_batches(
    prompts: Sequence[Sequence[int]],
    output_lens: Sequence[int],
    max_tokens: int,
    keys: Sequence[Hashable] | None = None,
    share: bool = True,
    least_padding: bool = True,
) -> list[list[int]]:
    """Sample indices cut into micro-batches: samples with the same key only (the same temperature, or the same
    agent), each micro-batch's segments padded to its longest within ``max_tokens`` (rows × longest), a segment that
    would not fit alone split into segments that each repeat the prompt (a single sample longer than the budget gets a
    micro-batch of its own). ``share=False``: one sample per segment. Segments are packed shortest first, and cut
    into runs of about one length: with ``least_padding`` the cut of the sorted segments with the fewest padded
    tokens, each micro-batch counted ``MICRO_BATCH_COST`` tokens more (:func:`least_padded_cut`); without it, each
    micro-batch filled in turn until the next segment would not fit (a short segment then pads to a long one)."""
    keys = list(keys) if keys is not None else [None] * len(prompts)
    groups = segments(prompts, keys) if share else [[i] for i in range(len(prompts))]
    pieces: list[tuple[Hashable, int, int, list[int]]] = []  # (key, segment length, group, sample indices)
    for g, group in enumerate(groups):
        p = len(prompts[group[0]])
        piece: list[int] = []
        for i in group:
            if piece and segment_length(p, [output_lens[j] for j in piece + [i]]) > max_tokens:
                pieces.append((keys[group[0]], segment_length(p, [output_lens[j] for j in piece]), g, piece))
                piece = []
            piece.append(i)
        pieces.append((keys[group[0]], segment_length(p, [output_lens[j] for j in piece]), g, piece))
    order = sorted(range(len(pieces)), key=lambda n: (repr(pieces[n][0]), pieces[n][1], n))
    batches: list[list[int]] = []
    if least_padding:
        start = 0
        for end in range(1, len(order) + 1):  # each key's run of the sorted pieces is cut on its own
            if end == len(order) or pieces[order[end]][0] != pieces[order[start]][0]:
                run = order[start:end]
                cuts = least_padded_cut([pieces[n][1] for n in run], [pieces[n][2] for n in run], max_tokens)
                batches += [run[lo:hi] for lo, hi in cuts]
                start = end
        return [[i for n in batch for i in pieces[n][3]] for batch in batches]
    current: list[int] = []  # piece numbers
    for n in order:
        if current:
            longest = max(pieces[m][1] for m in current + [n])
            # two pieces of one split group never share a micro-batch (they would pack into one segment)
            if (
                pieces[current[0]][0] != pieces[n][0]
                or longest * (len(current) + 1) > max_tokens
                or any(pieces[m][2] == pieces[n][2] for m in current)
            ):
                batches.append(current)
                current = []
        current.append(n)
    if current:
        batches.append(current)
    return [[i for n in batch for i in pieces[n][3]] for batch in batches]


def least_padded_cut(lengths: Sequence[int], groups: Sequence[int], max_tokens: int) -> list[tuple[int, int]]:
    """Runs ``[lo, hi)`` of ``lengths`` (ascending) with the fewest padded tokens in all (a run pads to its last
    length), each run counted ``MICRO_BATCH_COST`` tokens more: within ``max_tokens`` (a run of one may exceed it)
    and no two pieces of one group (``groups``) in a run. Exact, by dynamic programming over the run ends."""
    n = len(lengths)
    best = [0.0] + [float("inf")] * n  # best[j]: the least cost of the first j lengths
    start = [0] * (n + 1)
    for hi in range(1, n + 1):
        seen: set[int] = set()
        for lo in range(hi - 1, -1, -1):  # the run [lo, hi), longest lengths[hi - 1]
            if groups[lo] in seen or (hi - lo > 1 and (hi - lo) * lengths[hi - 1] > max_tokens):
                break
            seen.add(groups[lo])
            cost = best[lo] + (hi - lo) * lengths[hi - 1] + MICRO_BATCH_COST
            if cost < best[hi]:
                best[hi], start[hi] = cost, lo
    runs, hi = [], n
    while hi > 0:
        runs.append((start[hi], hi))
        hi = start[hi]
    return runs[::-1]
