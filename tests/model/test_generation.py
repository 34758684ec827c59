"""HFGenerator on the tiny model: batching, padding, EOS handling, log-probs, seeding."""

from __future__ import annotations

import random
from contextlib import nullcontext

import pytest
import torch

from mhgpo.model.generation import Generation, HFGenerator, SamplingParams
from mhgpo.model.logprobs import output_logprobs
from mhgpo.model.pretrained import encode_chat, stop_token_ids


@pytest.fixture(scope="module")
def prompts(tiny_lm) -> list[list[int]]:
    """Prompts of very different lengths, in no particular order: chat prompts and random ids."""
    tok = tiny_lm.tokenizer
    chats = [
        encode_chat(tok, [{"role": "user", "content": q}])
        for q in ("Who wrote Dune?", "What is the capital of France, and which river flows through it?", "hi")
    ]
    rng = random.Random(7)
    vocab = len(tok)
    noise = [[rng.randrange(4, vocab) for _ in range(n)] for n in (1, 23, 5, 40, 2)]
    return [chats[0], noise[0], noise[3], chats[1], noise[1], chats[2], noise[2], noise[4]]


def _generate(lm, prompts: list[list[int]], params: SamplingParams, batch_size: int, seed: int = 0) -> list[Generation]:
    torch.manual_seed(seed)
    return HFGenerator(lm.model, lm.tokenizer, batch_size=batch_size).generate(prompts, params)


def test_greedy_batched_equals_one_at_a_time(tiny_lm, prompts) -> None:
    """The same tokens and log-probs (1e-5) in one batch, in batches of 3 and alone; rows that finish early are
    dropped from the batch while the others decode."""
    from mhgpo.model.logprobs import backbone_and_head

    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    rows: list[int] = []
    embed = backbone_and_head(tiny_lm.model)[0].embed_tokens
    handle = embed.register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[0]))
    try:
        batched = _generate(tiny_lm, prompts, params, batch_size=16)
    finally:
        handle.remove()
    early = sum(len(g.output_ids) < params.max_new_tokens for g in batched)
    assert early >= len(prompts) // 4  # enough rows finish early to be dropped ...
    assert rows[-1] < len(prompts)  # ... and they are
    for size in (1, 3):
        other = _generate(tiny_lm, prompts, params, batch_size=size)
        for a, b in zip(batched, other, strict=True):
            assert a.output_ids == b.output_ids
            assert a.finished == b.finished and a.text == b.text
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5, rel=0)
    assert [g.prompt_ids for g in batched] == prompts
    assert len({tuple(g.output_ids) for g in batched}) >= 3  # the prompts do lead to different outputs


def test_a_shared_prefix_is_prefilled_once_with_the_same_outputs(tiny_lm) -> None:
    from mhgpo.model.generation import MIN_SHARED_PREFIX, shared_prefix_length

    rng = random.Random(3)
    vocab = len(tiny_lm.tokenizer)
    head = [rng.randrange(4, vocab) for _ in range(30)]  # an instruction every prompt starts with
    prompts = [head + [rng.randrange(4, vocab) for _ in range(n)] for n in (1, 9, 4, 17)]
    shared = shared_prefix_length(prompts)
    assert shared >= MIN_SHARED_PREFIX
    assert shared == 30
    assert shared_prefix_length([prompts[0], prompts[0]]) == len(prompts[0]) - 1
    lengths: list[int] = []
    hook = tiny_lm.model.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        params = SamplingParams(max_new_tokens=12, temperature=0.0)
        batched = _generate(tiny_lm, prompts, params, batch_size=8)
        prefills = lengths[:2]
        alone = [g for p in prompts for g in _generate(tiny_lm, [p], params, batch_size=1)]
    finally:
        hook.remove()
    # the prefix once, then the rests together (their last tokens go with the first decoding step)
    assert prefills == [shared, max(len(p) for p in prompts) - shared - 1]
    for a, b in zip(batched, alone, strict=True):
        assert a.output_ids == b.output_ids and a.text == b.text and a.finished == b.finished
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5, rel=0)
    assert len({tuple(g.output_ids) for g in batched}) >= 2  # the rests lead to different outputs


def test_left_padding_does_not_change_a_short_prompt(tiny_lm, prompts) -> None:
    short, long = prompts[1], prompts[2]
    assert len(short) == 1 and len(long) == 40
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    [alone] = _generate(tiny_lm, [short], params, batch_size=1)
    padded, _ = _generate(tiny_lm, [short, long], params, batch_size=2)
    assert padded.output_ids == alone.output_ids
    assert padded.logprobs == pytest.approx(alone.logprobs, abs=1e-5, rel=0)


def test_outputs_stop_at_eos(tiny_lm, prompts) -> None:
    eos = set(stop_token_ids(tiny_lm.tokenizer, tiny_lm.model))
    params = SamplingParams(max_new_tokens=30, temperature=1.0, top_p=1.0)
    generations = _generate(tiny_lm, prompts * 4, params, batch_size=8, seed=3)
    finished = [g for g in generations if g.finished]
    assert finished and len(finished) < len(generations)  # both cases happen
    for g in generations:
        assert len(g.output_ids) == len(g.logprobs) >= 1
        assert not eos & set(g.output_ids[:-1])
        if g.finished:
            assert g.output_ids[-1] in eos
        else:
            assert len(g.output_ids) == params.max_new_tokens and g.output_ids[-1] not in eos
        assert g.text == tiny_lm.tokenizer.decode(g.output_ids, skip_special_tokens=True).strip()
        assert "<|im_end|>" not in g.text and "<|pad|>" not in g.text
        assert all(lp <= 0.0 for lp in g.logprobs)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 0.9), (0.7, 0.8), (1.3, 1.0), (0.0, 0.9)])
def test_generation_logprobs_match_output_logprobs(tiny_lm, prompts, temperature: float, top_p: float) -> None:
    params = SamplingParams(max_new_tokens=20, temperature=temperature, top_p=top_p)
    generations = _generate(tiny_lm, prompts, params, batch_size=4, seed=11)
    with torch.no_grad():
        logp, mask = output_logprobs(
            tiny_lm.model,
            [g.prompt_ids for g in generations],
            [g.output_ids for g in generations],
            temperature=params.logprob_temperature,
            pad_id=tiny_lm.tokenizer.pad_token_id,
        )
    for row, g in enumerate(generations):
        assert int(mask[row].sum()) == len(g.output_ids)
        expected = logp[row, : len(g.output_ids)].tolist()
        assert g.logprobs == pytest.approx(expected, abs=1e-4, rel=0)


def test_same_seed_same_samples(tiny_lm, prompts) -> None:
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.95)
    first = _generate(tiny_lm, prompts, params, batch_size=4, seed=5)
    again = _generate(tiny_lm, prompts, params, batch_size=4, seed=5)
    other = _generate(tiny_lm, prompts, params, batch_size=4, seed=6)
    assert [g.output_ids for g in first] == [g.output_ids for g in again]
    assert [g.logprobs for g in first] == [g.logprobs for g in again]
    assert [g.output_ids for g in first] != [g.output_ids for g in other]


def test_max_new_tokens_respected(tiny_lm, prompts) -> None:
    params = SamplingParams(max_new_tokens=3, temperature=1.0, top_p=1.0)
    generations = _generate(tiny_lm, prompts * 2, params, batch_size=16, seed=2)
    assert all(1 <= len(g.output_ids) <= 3 for g in generations)
    assert any(len(g.output_ids) == 3 and not g.finished for g in generations)
    one = _generate(tiny_lm, prompts[:2], SamplingParams(max_new_tokens=1, temperature=0.0), batch_size=2)
    assert [len(g.output_ids) for g in one] == [1, 1]


def test_training_mode_restored(tiny_lm, prompts) -> None:
    model = tiny_lm.model
    model.train()
    try:
        _generate(tiny_lm, prompts[:2], SamplingParams(max_new_tokens=2), batch_size=2)
        assert model.training
    finally:
        model.eval()
    _generate(tiny_lm, prompts[:2], SamplingParams(max_new_tokens=2), batch_size=2)
    assert not model.training


def test_bad_inputs_are_rejected(tiny_lm) -> None:
    with pytest.raises(ValueError):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-0.1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    generator = HFGenerator(tiny_lm.model, tiny_lm.tokenizer)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generator.generate([[5, 6], []], SamplingParams())
    assert generator.generate([], SamplingParams()) == []


def test_lora_wrapped_model_generates_with_matching_logprobs(tiny_model_dir, prompts) -> None:
    from peft import LoraConfig, get_peft_model

    from mhgpo.model.trained import load_model

    lm = load_model(str(tiny_model_dir), device="cpu")
    torch.manual_seed(0)
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.5, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    model = get_peft_model(lm.model, config)
    model.train()  # dropout is active in training mode: generation must switch it off
    torch.manual_seed(4)
    generations = HFGenerator(model, lm.tokenizer, batch_size=3).generate(prompts, SamplingParams(max_new_tokens=12))
    assert model.training
    model.eval()
    with torch.no_grad():
        logp, _ = output_logprobs(model, [g.prompt_ids for g in generations], [g.output_ids for g in generations])
    for row, g in enumerate(generations):
        assert g.logprobs == pytest.approx(logp[row, : len(g.output_ids)].tolist(), abs=1e-4, rel=0)


def forked(prompts: list[list[int]]) -> list[list[int]]:
    """Forked groups: three prompts asked four, three and two times, with lone prompts between their copies."""
    return [prompts[0]] * 4 + [prompts[1]] + [prompts[3]] * 3 + [prompts[2], prompts[0]] + [prompts[7]] * 2


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_repeated_prompt_is_prefilled_once_with_the_same_results(
    tiny_lm, prompts, monkeypatch, temperature: float
) -> None:
    """Rows that repeat a prompt get copies of one prefill: the same tokens (greedy, and sampled with one seed) and
    log-probs within 1e-5 of generate's own prefill of the padded batch; the prefill runs each distinct prompt once
    (a one-token prompt has nothing to prefill: its token goes with the first decoding step)."""
    import mhgpo.model.generation as generation
    from mhgpo.model.logprobs import backbone_and_head

    batch = forked(prompts)
    params = SamplingParams(max_new_tokens=16, temperature=temperature, top_p=0.9)
    seen: list[tuple[int, int]] = []
    embed = backbone_and_head(tiny_lm.model)[0].embed_tokens
    handle = embed.register_forward_hook(lambda mod, args, out: seen.append(tuple(args[0].shape)))
    try:
        shared = _generate(tiny_lm, batch, params, batch_size=16)
    finally:
        handle.remove()
    first = next(i for i, (rows, _) in enumerate(seen) if rows == len(batch))  # the first decoding step
    distinct = {tuple(p) for p in batch if len(p) > 1}
    assert sum(rows for rows, _ in seen[:first]) == len(distinct) == 4
    decoding = seen[first:]  # then the rows decode, one token a step, finished rows dropped as they go
    assert all(cols == 1 for _, cols in decoding)
    assert all(a[0] >= b[0] for a, b in zip(decoding, decoding[1:]))
    monkeypatch.setattr(generation, "prefill", lambda *args: None)
    plain = _generate(tiny_lm, batch, params, batch_size=16)
    for a, b in zip(shared, plain, strict=True):
        assert a.output_ids == b.output_ids and a.finished == b.finished
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5, rel=0)
    assert len({tuple(g.output_ids) for g in shared[:4]}) > (1 if temperature else 0)


def test_the_prefill_holds_what_a_padded_batch_computes(tiny_lm, prompts) -> None:
    """`prefill` of a batch laid out [shared prefix | padding | rest]: the keys and values of every real column but
    the last equal those of one forward over the padded batch (1e-5); padding columns are zero; one prompt: None."""
    from mhgpo.model.generation import prefill
    from mhgpo.model.logprobs import backbone_and_head

    head = prompts[3][:20]
    batch = [head + p for p in (prompts[0], prompts[1], prompts[2], prompts[0], prompts[4])]
    width = max(len(p) for p in batch)
    ids = torch.zeros((len(batch), width - 1), dtype=torch.long)  # (B, W-1)
    mask = torch.zeros((len(batch), width - 1), dtype=torch.long)
    for row, p in enumerate(batch):  # no shared prefix taken: every row left-padded whole
        ids[row, width - len(p) :] = torch.tensor(p[:-1])
        mask[row, width - len(p) :] = 1
    with torch.no_grad():
        expected = backbone_and_head(tiny_lm.model)[0](
            input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True
        ).past_key_values
        assert prefill(tiny_lm.model, batch[:1], 20, width) is None
        cache = prefill(tiny_lm.model, batch, 20, width)
    assert cache.get_seq_length() == width - 1
    for got, want in zip(cache.layers, expected.layers, strict=True):
        for row, p in enumerate(batch):
            start = width - len(p)  # where the row starts in the padded batch
            for mine, theirs in (
                (slice(0, 20), slice(start, start + 20)),  # the prefix
                (slice(start + 20, width - 1), slice(start + 20, width - 1)),
            ):  # the rest
                assert torch.allclose(got.keys[row, :, mine], want.keys[row, :, theirs], atol=1e-5, rtol=0)
                assert torch.allclose(got.values[row, :, mine], want.values[row, :, theirs], atol=1e-5, rtol=0)
            pad = slice(20, start + 20)  # [prefix | padding | rest]: the padding follows the prefix
            assert not got.keys[row, :, pad].any() and not got.values[row, :, pad].any()


def test_prefill_buckets_keep_padding_small() -> None:
    """Rests of about one length go together; a much longer one starts a bucket of its own, unless the bucket is
    still small; a bucket never passes MAX_PREFILL_TOKENS; every length is in exactly one bucket, in order."""
    from mhgpo.model.generation import MAX_PREFILL_PADDING, MAX_PREFILL_TOKENS, MIN_PREFILL_TOKENS, prefill_buckets

    assert prefill_buckets([]) == []
    assert prefill_buckets([3, 8, 16]) == [(0, 3)]  # small: one bucket whatever the padding
    assert prefill_buckets([100, 100, 105, 300, 310]) == [(0, 3), (3, 5)]
    lengths = sorted([17, 40, 41, 90, 95, 200, 210, 220, 400, 401, 1000] * 3)
    runs = prefill_buckets(lengths)
    assert [i for lo, hi in runs for i in range(lo, hi)] == list(range(len(lengths)))
    for lo, hi in runs:
        padded, real = (hi - lo) * lengths[hi - 1], sum(lengths[lo:hi])
        assert padded <= MAX_PREFILL_TOKENS or hi - lo == 1
        assert padded <= max((1 + MAX_PREFILL_PADDING) * real, MIN_PREFILL_TOKENS)
    assert prefill_buckets([5000, 5000]) == [(0, 1), (1, 2)]


# not bf16-mixed sampled: bfloat16 moves a logit by up to a rounding step (3e-2), which flips a draw whose two best
# tokens race that close (one or two rows of 32 here), and a row that then ends at another step shifts the random
# stream of every later draw. Sampling's random stream is checked in fp32, bfloat16's cache in greedy decoding
@pytest.mark.parametrize(("precision", "temperature"), [("fp32", 0.0), ("fp32", 1.0), ("bf16-mixed", 0.0)])
def test_the_static_cache_decodes_as_a_dynamic_one(
    tiny_lm, prompts, monkeypatch, precision: str, temperature: float
) -> None:
    """Decoding on the preallocated static cache (after a repeated prompt's prefill, or with nothing prefilled)
    gives the tokens and log-probs of a dynamic cache, in float32 and under bfloat16 autocast (whose keys and values
    may come in different dtypes)."""
    from transformers import DynamicCache, StaticCache

    import mhgpo.model.generation as generation

    batch = forked(prompts) + prompts
    noise = [prompts[i] for i in (1, 2, 4, 6, 7)]  # random ids: no shared prefix, no repeat
    params = SamplingParams(max_new_tokens=16, temperature=temperature, top_p=0.9)
    caches: list[tuple[bool, type]] = []  # (something was prefilled, the cache decoded on): one prompt alone is not

    def run() -> list[Generation]:
        torch.manual_seed(0)
        gen = HFGenerator(tiny_lm.model, tiny_lm.tokenizer, batch_size=5, precision=precision)
        original = gen._cache

        def recorded(prefilled, rows: int, length: int):
            cache = original(prefilled, rows, length)
            caches.append((prefilled is not None, type(cache)))
            return cache

        gen._cache = recorded  # type: ignore[method-assign]
        return gen.generate(batch, params) + gen.generate(noise, params) + gen.generate(prompts[2:3], params)

    static = run()
    assert {kind for kind, _ in caches} == {True, False} and {cache for _, cache in caches} == {StaticCache}

    def dynamic(self, prefilled, rows: int, length: int):  # the cache generate would build, prefilled or not
        if prefilled is None:
            return DynamicCache()
        if prefilled.layers[0].keys.shape[0] != rows:
            prefilled.batch_repeat_interleave(rows)
        return prefilled

    monkeypatch.setattr(generation.HFGenerator, "_cache", dynamic)
    plain = run()
    for a, b in zip(static, plain, strict=True):
        assert a.output_ids == b.output_ids and a.finished == b.finished
        if precision == "fp32":
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5, rel=0)
    if precision == "bf16-mixed":  # bfloat16 attention over the static cache's masked tail rounds apart: measured
        # mean 5e-4 ... 8e-4, max 2.5e-2 ... 3.8e-2 (one bfloat16 step of a logit of about 8 is 3e-2)
        gaps = [abs(x - y) for a, b in zip(static, plain) for x, y in zip(a.logprobs, b.logprobs)]
        assert sum(gaps) / len(gaps) < 2e-3 and max(gaps) < 6e-2
    assert len({tuple(g.output_ids) for g in static}) >= 3


def test_the_nucleus_warper_keeps_what_transformers_top_p_keeps() -> None:
    """Temperature then top-p, found among the top k: the same scores (kept tokens and their values, -inf elsewhere)
    as transformers' TemperatureLogitsWarper then TopPLogitsWarper, on peaked rows and on flat rows whose nucleus
    needs k to grow past its first guess, for several p and T. (Where the mass above a token equals p to the last
    bit, as with exactly tied tokens, the two sums round apart and may keep one token more or less.)"""
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    from mhgpo.model.generation import _Nucleus

    gen = torch.Generator().manual_seed(0)
    vocab = 3000
    scores = torch.stack([torch.randn(vocab, generator=gen) * scale for scale in (0.05, 0.5, 2.0, 8.0)])  # (4, V)
    ids = torch.zeros((4, 1), dtype=torch.long)

    def reference(x: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
        out = TemperatureLogitsWarper(temperature)(ids, x.clone())
        return TopPLogitsWarper(top_p)(ids, out) if top_p < 1.0 else out

    grew = False
    for temperature in (0.7, 1.0, 1.3):
        for top_p in (0.3, 0.9, 0.99, 1.0):
            got = _Nucleus(temperature, top_p)(ids, scores.clone())
            torch.testing.assert_close(got, reference(scores, temperature, top_p), rtol=0, atol=0)
            kept = (got > float("-inf")).sum(dim=-1)  # (4,)
            grew |= bool((kept > _Nucleus.FIRST_K).any())
            if top_p < 1.0:
                assert bool((kept >= 1).all()) and bool((kept < vocab).any())
    assert grew  # the flat rows' nuclei are wider than the first guess of k


@pytest.mark.parametrize("top_p", [0.5, 0.9, 1.0])
def test_sampling_draws_from_the_warped_distribution_within_the_nucleus(top_p: float) -> None:
    """`_Nucleus.sample` draws only tokens the warper keeps, each as often as softmax of the kept scores says:
    40,000 draws of one row of 50 logits, every token's count within 5 standard deviations of its expectation."""
    from mhgpo.model.generation import _Nucleus

    gen = torch.Generator().manual_seed(0)
    row = torch.randn(50, generator=gen)  # (V,)
    warper = _Nucleus(0.8, top_p)
    probs = warper(None, row[None].clone()).softmax(dim=-1)[0]  # (V,): the target, zero outside the nucleus
    draws = 40_000
    torch.manual_seed(1)
    chosen = warper.sample(row.expand(draws, -1).clone())  # (N,)
    counts = torch.bincount(chosen, minlength=row.numel()).double()  # (V,)
    assert counts[probs == 0].sum() == 0
    sigma = (draws * probs * (1 - probs)).sqrt()
    assert bool(((counts - draws * probs).abs() <= 5 * sigma + 1e-9).all())
    if top_p < 1.0:
        assert 1 < int((probs > 0).sum()) < row.numel()  # the nucleus truncates, and keeps more than one token


def test_lora_input_casts_off_give_the_same_bf16_mixed_generations(tiny_model_dir, prompts, monkeypatch) -> None:
    """Under bf16-mixed, generation turns off peft's cast of a LoRA layer's input up to its float32 weights (the
    bfloat16 matmul casts it back): the same tokens and the same log-probs, bit for bit, as with the casts."""
    from peft import LoraConfig, get_peft_model

    import mhgpo.model.generation as generation
    from mhgpo.model.trained import load_model

    lm = load_model(str(tiny_model_dir), device="cpu", dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = get_peft_model(
        lm.model,
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False),
    )
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9)
    casts: list[bool] = []
    forward = type(model.base_model.model.model.layers[0].self_attn.q_proj).forward

    def recorded(self, x, *args, **kwargs):
        casts.append(self.cast_input_dtype_enabled)
        return forward(self, x, *args, **kwargs)

    monkeypatch.setattr(type(model.base_model.model.model.layers[0].self_attn.q_proj), "forward", recorded)
    runs = []
    for off in (True, False):
        if not off:
            monkeypatch.setattr(generation, "disable_input_dtype_casting", lambda model, active: nullcontext())
        torch.manual_seed(3)
        runs.append(HFGenerator(model, lm.tokenizer, batch_size=4, precision="bf16-mixed").generate(prompts, params))
    n = len(casts) // 2
    assert not any(casts[:n]) and all(casts[n:])  # off in the first run, on in the second
    for a, b in zip(*runs, strict=True):
        assert a.output_ids == b.output_ids and a.logprobs == b.logprobs
