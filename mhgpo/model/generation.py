"""Batched sampling from the shared causal LM, with the log-probability of every generated token.

:class:`HFGenerator` decodes a batch of token-id prompts on a preallocated (static) KV cache, which grows without
copying itself at every step. The prompts of a batch are laid out ``[shared prefix | padding | rest of the prompt]``
and prefilled by :func:`prefill`: the prefix every prompt starts with (an agent's instructions) is run once, then each
distinct rest once (the G samples at a fork share one), in buckets of rests of about one length, so that the prefill
costs about what the real tokens cost however the lengths differ; positions are counted over real tokens, so each
row computes what it computes alone. Decoding (:meth:`HFGenerator._decode`) drops finished rows from the batch and
its cache as it goes. The log-probs are those of the policy at the sampling temperature, ``log_softmax(logits / T)``
of the *raw* logits (before top-p), at the chosen token, taken step by step, so at most one step of full-vocabulary
log-probs is alive at a time.

Decoding is mhgpo's own loop over the model's forward, not ``model.generate``: greedy is greedy, sampling is from
``softmax(logits / T)`` truncated by top-p only, and the recorded log-probs are the ones the trainer recomputes. The
model's own ``generation_config`` (a checkpoint's ``generation_config.json`` may set a repetition penalty, a
temperature, top-k, ``do_sample``...) is never read. Under ``precision=bf16-mixed`` generation runs under bfloat16
autocast, as the trainer's forwards do.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from peft.helpers import disable_input_dtype_casting
from transformers import LogitsProcessor
from transformers.cache_utils import DynamicCache, StaticLayer

from mhgpo.model.logprobs import backbone_and_head, cache_argument, causal_lm, expanded_cache, prefix_keys_values
from mhgpo.model.packing import MIN_SHARED_PREFIX, shared_prefix_length
from mhgpo.model.precision import autocast
from mhgpo.model.pretrained import stop_token_ids


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: ``temperature == 0.0`` means greedy decoding."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 0.9
    agent: str | None = None  # whose call it is (a model with one adapter per agent generates with that agent's)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        """The temperature the log-probs are taken at (1.0 for greedy decoding)."""
        return 1.0 if self.greedy else self.temperature


@dataclass
class Generation:
    """One sampled completion of one prompt."""

    prompt_ids: list[int]
    output_ids: list[int]  # generated ids, no padding; includes the EOS token if one was generated
    logprobs: list[float]  # one per output id: log_softmax(logits / T) at the chosen id, before top-p
    text: str  # decoded output without special tokens, stripped
    finished: bool  # True if it ended with EOS, False if cut at max_new_tokens


class Generator(Protocol):
    """Anything that completes token-id prompts."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]: ...


# what a generator that reports its batches as they finish calls with each: the indices of its prompts in the call's
# list, and their generations
OnChunk = Callable[[list[int], list[Generation]], None]


def generate_in_chunks(
    generator: Generator, prompts: list[list[int]], params: SamplingParams, on_chunk: OnChunk
) -> list[Generation]:
    """``generator.generate(prompts, params)``, with ``on_chunk`` called on each batch as it finishes where the
    generator reports its batches (``reports_chunks``: :class:`HFGenerator`, the vLLM engines), else once on the
    whole call. The generations, their batches and the random numbers drawn are those of a plain ``generate``."""
    if getattr(generator, "reports_chunks", False):
        return generator.generate(prompts, params, on_chunk=on_chunk)  # type: ignore[call-arg]
    generations = generator.generate(prompts, params)
    on_chunk(list(range(len(generations))), generations)
    return generations


class _Nucleus(LogitsProcessor):
    """Sampling's warper (a transformers logits processor): ``logits / T``, then top-p as transformers'
    ``TopPLogitsWarper`` keeps it (a token stays when the probability of the tokens ranked above it is below p; the
    most probable always stays), found among the k most probable tokens, k growing until every row's nucleus ends
    inside them, instead of a sort of the whole vocabulary at every step (a tenth of the rollouts' CPU time at 49k
    tokens). :meth:`sample` draws from the kept tokens only: the same distribution as a draw over the whole
    vocabulary's warped scores, with a uniform per vocabulary entry instead of an exponential (the exponentials
    were another 7% of the rollouts; the uniforms cost a sixth of that)."""

    FIRST_K = 64

    def __init__(self, temperature: float, top_p: float) -> None:
        self.temperature, self.top_p = temperature, top_p

    def kept(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The nucleus of each row of the warped ``scores`` (B, V): (ids (B, k), their scores, -inf where a row's
        nucleus is narrower than k)."""
        probs = scores.float().softmax(dim=-1)  # (B, V)
        vocab, k = scores.shape[-1], min(self.FIRST_K, scores.shape[-1])
        while True:
            top, ids = probs.topk(k, dim=-1)  # (B, k), descending
            above = top.cumsum(dim=-1) - top  # (B, k): the mass ranked above each
            if k == vocab or bool((above[:, -1] >= self.top_p).all()):
                break
            k = min(vocab, k * 8)
        return ids, torch.where(above < self.top_p, scores.gather(1, ids), float("-inf"))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores / self.temperature  # (B, V)
        if self.top_p >= 1.0:
            return scores
        ids, kept = self.kept(scores)  # (B, k) (B, k)
        return torch.full_like(scores, float("-inf")).scatter(1, ids, kept)

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """One token id per row of ``logits`` (B, V), drawn from ``softmax(logits / T)`` truncated to the nucleus."""
        scores = logits / self.temperature  # (B, V)
        if self.top_p >= 1.0:
            return torch.multinomial(scores.softmax(dim=-1), num_samples=1).squeeze(1)
        ids, kept = self.kept(scores)  # (B, k) (B, k)
        # an exponential race (the draw torch.multinomial makes), its random numbers indexed by token id: a rounding
        # difference that swaps two near-tied tokens in rank or moves the nucleus's edge changes no other token's
        # number. A uniform per vocabulary entry costs a sixth of an exponential; the logarithm is taken on k only
        uniform = torch.rand(scores.shape, device=scores.device).gather(1, ids)  # (B, k)
        race = kept - (-torch.log1p(-uniform)).clamp_min(1e-30).log()  # (B, k): -inf outside the nucleus
        return ids.gather(1, race.argmax(dim=1, keepdim=True)).squeeze(1)  # (B,)


def prefill(model: Any, prompts: list[list[int]], n_prefix: int, width: int) -> Any:
    """The key/value cache of every column but the last of the batch laid out ``[shared prefix | padding | rest of
    the prompt]`` in ``width`` columns (``n_prefix`` tokens shared by every prompt): the prefix is run once, then each
    distinct rest once, in buckets of rests of about the same length (:func:`prefill_buckets`) on the prefix's keys
    and values, and copied to the columns and rows that hold it. No row is padded beyond its bucket, so the work is
    about that of the real tokens, however the lengths differ. Positions count real tokens only, as decoding's do;
    columns left of a row's rest are padding (zeros, masked). None for one prompt (decoding's first step prefills
    it whole)."""
    if len(prompts) < 2 or width < 2:
        return None
    backbone, _ = backbone_and_head(model)
    device = next(model.parameters()).device
    rows_of: dict[tuple[int, ...], list[int]] = {}
    for row, p in enumerate(prompts):
        rows_of.setdefault(tuple(p[n_prefix:-1]), []).append(row)
    head = None
    if n_prefix:
        head = prefix_keys_values(backbone, prompts[0][:n_prefix], device)
    keys: list[torch.Tensor] = []  # per layer (B, heads, W-1, dim)
    values: list[torch.Tensor] = []

    def place(layer: int, k: torch.Tensor, v: torch.Tensor, rows: Any, cols: slice) -> None:
        if len(keys) <= layer:
            shape = (len(prompts), k.shape[-3], width - 1)  # (B, heads, W-1)
            keys.append(torch.zeros(shape + k.shape[-1:], dtype=k.dtype, device=device))
            values.append(torch.zeros(shape + v.shape[-1:], dtype=v.dtype, device=device))
        keys[layer][rows, :, cols] = k
        values[layer][rows, :, cols] = v

    if head is not None:
        for layer, (k, v) in enumerate(head):
            place(layer, k, v, slice(None), slice(0, n_prefix))
    distinct = sorted((r for r in rows_of if r), key=len)  # the rests to run (an empty one is all prefix)
    for lo, hi in prefill_buckets([len(r) for r in distinct]):
        rests = distinct[lo:hi]
        w = max(len(r) for r in rests)
        ids = torch.full((len(rests), w), 0, dtype=torch.long)  # (b, w), left-padded
        mask = torch.zeros((len(rests), w), dtype=torch.long)  # (b, w)
        for j, rest in enumerate(rests):
            ids[j, w - len(rest) :] = torch.tensor(rest, dtype=torch.long)
            mask[j, w - len(rest) :] = 1
        positions = n_prefix + (mask.cumsum(-1) - 1).clamp(min=0)  # (b, w)
        past = None
        if head is not None:
            past = expanded_cache(head, len(rests))
            mask = torch.cat([torch.ones((len(rests), n_prefix), dtype=torch.long), mask], dim=1)  # (b, P + w)
        out = backbone(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            use_cache=True,
            **{cache_argument(backbone): past},
        ).past_key_values
        for j, rest in enumerate(rests):
            rows, n = rows_of[rest], len(rest)
            for layer, computed in enumerate(out.layers):
                place(
                    layer, computed.keys[j, :, -n:], computed.values[j, :, -n:], rows, slice(width - 1 - n, width - 1)
                )
    cache = DynamicCache()
    for layer, (k, v) in enumerate(zip(keys, values)):
        cache.update(k, v, layer)
    return cache


MAX_PREFILL_PADDING = 0.125  # a prefill bucket's padding, as a share of its real tokens, at most ...
MIN_PREFILL_TOKENS = 256  # ... unless the bucket is this small: short rests go together (small products are slow)
MAX_PREFILL_TOKENS = 1024  # a bucket's tokens, padding included, at most: the activations stay in the CPU's cache


def prefill_buckets(lengths: list[int]) -> list[tuple[int, int]]:
    """Cut ``lengths`` (ascending) into runs ``[lo, hi)`` prefilled together, each padded to its longest: a length
    joins the run while the run's padded size stays within ``1 + MAX_PREFILL_PADDING`` times its real tokens or
    within ``MIN_PREFILL_TOKENS``, and within ``MAX_PREFILL_TOKENS``."""
    runs: list[tuple[int, int]] = []
    lo, real = 0, 0
    for i, n in enumerate(lengths):
        padded = (i - lo + 1) * n
        if i > lo and (
            padded > MAX_PREFILL_TOKENS or padded > max((1 + MAX_PREFILL_PADDING) * (real + n), MIN_PREFILL_TOKENS)
        ):
            runs.append((lo, i))
            lo, real = i, 0
        real += n
    if lengths:
        runs.append((lo, len(lengths)))
    return runs


class _StaticLayer(StaticLayer):
    """A static cache layer that keeps its keys and its values each in the dtype a dynamic cache would: the dtype
    they first come in (the values may differ from the keys: float32 keys from the rotary embedding, bfloat16
    values from an autocast projection), widened as ``torch.cat`` would when a wider one comes (a float32 prefill,
    then bfloat16 decoding steps under autocast, stays float32)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.values = self.values.to(value_states.dtype)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = (
            torch.promote_types(self.keys.dtype, key_states.dtype),
            torch.promote_types(self.values.dtype, value_states.dtype),
        )
        self.keys, self.values = self.keys.to(keys), self.values.to(values)
        return super().update(key_states.to(keys), value_states.to(values), *args, **kwargs)


class HFGenerator:
    """:class:`Generator` over a Hugging Face causal LM (plain or peft-wrapped) and its tokenizer; ``precision`` is a
    resolved one (:mod:`mhgpo.model.precision`): ``bf16-mixed`` decodes under bfloat16 autocast."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        batch_size: int = 16,
        precision: str = "fp32",
        select: Callable[[str | None], AbstractContextManager[None]] | None = None,
    ) -> None:
        """``select(agent)``: a context in which ``model`` acts as that agent (its own adapter, `lora.per_role`)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.precision = precision
        self.select = select
        self.eos_ids = stop_token_ids(tokenizer, model)
        if not self.eos_ids:
            raise ValueError("the tokenizer has no EOS token: generation could never finish")
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_ids[0]
        forward = inspect.signature(causal_lm(model).forward).parameters
        self._takes_cache_position = "cache_position" in forward  # transformers 4.x: the positions written
        self._last_logits = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}  # the LM head on one column
        self._cache_argument = cache_argument(causal_lm(model))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    reports_chunks = True  # generate takes on_chunk (generate_in_chunks)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, on_chunk: OnChunk | None = None
    ) -> list[Generation]:
        """Complete every prompt once; results come back in the order of ``prompts``. The prompts are decoded in
        batches of ``batch_size``, shortest first; ``on_chunk(indices, generations)`` is called after each batch (the
        batch's indices in ``prompts``), in the decoding's thread and modes: it should only hand them on."""
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty")
        order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
        results: list[Generation | None] = [None] * len(prompts)
        was_training = self.model.training
        self.model.eval()
        as_agent = self.select(params.agent) if self.select is not None else nullcontext()
        # Under autocast peft's cast of a LoRA layer's bfloat16 input up to its float32 weights is undone by the
        # bfloat16 matmul that follows: the same numbers without it, and two copies fewer per layer (4% of a rollout)
        casts_off = disable_input_dtype_casting(self.model, active=self.precision == "bf16-mixed")
        try:
            with as_agent, casts_off, torch.inference_mode(), autocast(self.precision, self.device):
                for start in range(0, len(order), self.batch_size):
                    chunk = order[start : start + self.batch_size]
                    generations = self._generate_batch([prompts[i] for i in chunk], params)
                    for i, generation in zip(chunk, generations):
                        results[i] = generation
                    if on_chunk is not None:
                        on_chunk(chunk, generations)
        finally:
            self.model.train(was_training)
        return [r for r in results if r is not None]

    def _cache(self, prefilled: Any, rows: int, length: int) -> Any:
        """A static KV cache of ``length`` positions for ``rows`` rows holding the keys and values of ``prefilled``
        (:func:`prefill`'s dynamic cache of ``rows`` rows; None: nothing prefilled).
        Preallocated, it grows without the per-step copy of the whole cache that a dynamic cache makes (at 400
        prompt tokens, half of a decoding step's time on a CPU). Each layer holds its keys and its values in the
        dtype they come in (under autocast the values are bfloat16, the keys float32 or bfloat16 with the model's
        own dtype), so the attention sees what it would see with a dynamic cache."""
        from transformers import StaticCache

        cache = StaticCache(config=causal_lm(self.model).config, max_cache_len=length)
        cache.layers = [
            _StaticLayer(max_cache_len=length) if type(layer) is StaticLayer else layer for layer in cache.layers
        ]
        for layer, filled in zip(cache.layers, prefilled.layers if prefilled is not None else []):
            keys, values = filled.keys, filled.values  # (B, heads, P, dim)
            layer.lazy_initialization(keys, values)
            layer.keys[:, :, : keys.shape[2]] = keys
            layer.values[:, :, : values.shape[2]] = values
            layer.cumulative_length.fill_(keys.shape[2])
        return cache

    def _decode(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: Any, filled: int, params: SamplingParams
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode the left-padded batch ``input_ids``, ``attention_mask`` (B, W) on ``cache`` (its first ``filled``
        columns computed): greedily, or by sampling from ``softmax(logits / T)`` truncated by top-p
        (:class:`_Nucleus`), until every row has given an EOS token or ``max_new_tokens``. Returns the new ids (B, S),
        the pad id after a row's EOS, and the log-prob of each, ``log_softmax(logits / T)`` of the raw logits at the
        chosen id. Rows that have finished are dropped from the batch and its cache once they are a quarter of it,
        so the steps after cost what the rows still running cost (each row computes what it computes alone)."""
        rows, width = input_ids.shape
        steps, device = params.max_new_tokens, input_ids.device
        new_ids = torch.full((rows, steps), self.pad_id, dtype=torch.long)  # (B, S)
        logprobs = torch.zeros((rows, steps), dtype=torch.float32)  # (B, S)
        eos = torch.tensor(self.eos_ids, dtype=torch.long, device=device)
        nucleus = None if params.greedy else _Nucleus(params.temperature, params.top_p)
        live = torch.arange(rows)  # the batch row each row of the cache holds
        done = torch.zeros(rows, dtype=torch.bool, device=device)  # (b,) finished rows still in the cache
        mask = torch.cat([attention_mask, attention_mask.new_zeros((rows, steps))], dim=1)  # (B, W + S)
        feed = input_ids[:, filled:]  # (B, W - filled): what the cache does not hold yet
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, filled:]  # (B, W - filled)
        for t in range(steps):
            end = width + t  # columns computed after this step's forward
            extra = (
                {"cache_position": torch.arange(end - feed.shape[1], end, device=device)}
                if self._takes_cache_position
                else {}
            )
            logits = self.model(
                input_ids=feed,
                attention_mask=mask[:, :end],
                position_ids=positions,
                use_cache=True,
                **{self._cache_argument: cache},
                **self._last_logits,
                **extra,
            ).logits
            logits = logits[:, -1].float()  # (b, V)
            logp = torch.log_softmax(logits / params.logprob_temperature, dim=-1)  # (b, V)
            if nucleus is None:
                chosen = logits.argmax(dim=-1)  # (b,)
            else:
                chosen = nucleus.sample(logits)  # (b,)
            running = ~done
            at = live[running.cpu()]
            new_ids[at, t] = chosen[running].cpu()
            logprobs[at, t] = logp.gather(1, chosen[:, None]).squeeze(1)[running].float().cpu()
            done = done | torch.isin(chosen, eos)
            if t + 1 == steps or bool(done.all()):
                break
            mask[:, end] = 1
            feed = chosen.masked_fill(done, self.pad_id)[:, None]  # (b, 1)
            positions = positions[:, -1:] + 1  # (b, 1)
            if int(done.sum()) * 4 >= done.numel():  # drop the finished rows
                keep = (~done).nonzero().squeeze(1)  # (b',)
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys.index_select(0, keep), layer.values.index_select(0, keep)
                    layer.batch_size = keep.numel()
                live, done, mask = live[keep.cpu()], done[keep], mask[keep]
                feed, positions = feed[keep], positions[keep]
        return new_ids, logprobs

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        n_prefix = shared_prefix_length(prompts) if len(prompts) > 1 else 0
        if n_prefix < MIN_SHARED_PREFIX:
            n_prefix = 0
        rests = [p[n_prefix:] for p in prompts]
        rest_width = max(len(r) for r in rests)
        width = n_prefix + rest_width
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # (B, P + R)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # (B, P + R)
        input_ids[:, :n_prefix] = torch.tensor(prompts[0][:n_prefix], dtype=torch.long)
        attention_mask[:, :n_prefix] = 1
        for row, rest in enumerate(rests):  # [shared prefix | padding | rest of the prompt]
            input_ids[row, width - len(rest) :] = torch.tensor(rest, dtype=torch.long)
            attention_mask[row, width - len(rest) :] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        prefilled = prefill(self.model, prompts, n_prefix, width)  # None for one prompt
        cache = self._cache(prefilled, len(prompts), width + params.max_new_tokens)
        filled = prefilled.get_seq_length() if prefilled is not None else 0
        new_ids, logprobs = self._decode(input_ids, attention_mask, cache, filled, params)  # (B, S) (B, S)
        eos = torch.tensor(self.eos_ids, dtype=torch.long)
        generations = []
        for row, prompt in enumerate(prompts):
            ids = new_ids[row]  # (S,)
            hits = torch.isin(ids, eos).nonzero()
            finished = bool(hits.numel())
            length = int(hits[0, 0]) + 1 if finished else ids.shape[0]
            output_ids = [int(t) for t in ids[:length]]
            text = self.tokenizer.decode(output_ids, skip_special_tokens=True).strip()
            generations.append(
                Generation(
                    prompt_ids=list(prompt),
                    output_ids=output_ids,
                    logprobs=[float(x) for x in logprobs[row, :length]],
                    text=text,
                    finished=finished,
                )
            )
        return generations


def build_hf_generator(
    *, model: Any, loaded: Any, batch_size: int, precision: str, select: Any = None, **_: Any
) -> HFGenerator:
    """The `hf` engine (`mhgpo.config.tables.ENGINES`): mhgpo's own decoding loop over `model` (the training model,
    or a model loaded to evaluate) with `loaded`'s tokenizer; `select(agent)` switches a per-agent adapter."""
    return HFGenerator(model, loaded.tokenizer, batch_size=batch_size, precision=precision, select=select)
