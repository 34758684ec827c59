"""output_logprobs against the slow reference: values, gradients, masks, temperature, LoRA."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from mhgpo.model.logprobs import output_logprobs, output_logprobs_entropy
from mhgpo.model.trained import load_model
from mhgpo.rl.reference import output_entropy_reference, output_logprobs_reference


@pytest.fixture()
def model(tiny_model_dir: Path):
    """A private copy of the tiny model (these tests accumulate gradients and wrap it)."""
    return load_model(str(tiny_model_dir), device="cpu").model


@pytest.fixture(scope="module")
def batch() -> tuple[list[list[int]], list[list[int]]]:
    """Ragged prompts and outputs, one output empty."""
    rng = random.Random(1)
    prompt_lengths = [7, 1, 19, 4, 12]
    output_lengths = [5, 9, 1, 0, 13]
    prompts = [[rng.randrange(4, 400) for _ in range(n)] for n in prompt_lengths]
    outputs = [[rng.randrange(0, 400) for _ in range(n)] for n in output_lengths]
    return prompts, outputs


@pytest.mark.parametrize(("chunk_size", "pad_id"), [(512, 0), (1, 3), (5, 399)])
def test_matches_reference(model, batch, chunk_size: int, pad_id: int) -> None:
    prompts, outputs = batch
    with torch.no_grad():
        logp, mask = output_logprobs(model, prompts, outputs, chunk_size=chunk_size, pad_id=pad_id)
        ref, ref_mask = output_logprobs_reference(model, prompts, outputs)
    assert logp.shape == mask.shape == (5, 13)
    assert logp.dtype == torch.float32 and mask.dtype == torch.bool
    assert torch.equal(mask, ref_mask)
    torch.testing.assert_close(logp, ref, atol=1e-5, rtol=0)
    assert (logp[mask] < 0).all()


def test_mask_for_ragged_outputs(model, batch) -> None:
    prompts, outputs = batch
    with torch.no_grad():
        logp, mask = output_logprobs(model, prompts, outputs)
    assert mask.sum(dim=1).tolist() == [len(o) for o in outputs]
    for row, out in enumerate(outputs):
        assert mask[row, : len(out)].all() and not mask[row, len(out) :].any()
    assert (logp[~mask] == 0).all()
    assert not mask[3].any()  # the empty output


def test_gradients_match_reference(model, batch) -> None:
    prompts, outputs = batch
    weights = torch.linspace(0.5, 1.5, 13)  # (T_out,) a non-uniform loss
    logp, mask = output_logprobs(model, prompts, outputs, chunk_size=4)
    assert logp.requires_grad
    (logp * weights * mask).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ref, _ = output_logprobs_reference(model, prompts, outputs)
    (ref * weights * mask).sum().backward()
    for name, p in model.named_parameters():
        assert grads[name].abs().sum() > 0, name
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_prefix_every_prompt_starts_with_is_run_once_with_the_same_log_probs_and_gradients(
    model, attention: str
) -> None:
    """An agent's instructions begin every prompt of its micro-batch: they are run once, on their own (a forward of
    one row of their length first), and the rows, some sharing a prompt, attend to their keys and values; the
    log-probs and every gradient are those of the slow reference (each sample a row of its own) within fp32
    rounding. Under gradient checkpointing, and below MIN_SHARED_PREFIX tokens, the batch runs in one forward."""
    from mhgpo.model.modules import enable_gradient_checkpointing
    from mhgpo.model.packing import MIN_SHARED_PREFIX

    model.config._attn_implementation = attention
    rng = random.Random(2)
    instructions = [rng.randrange(4, 400) for _ in range(40)]
    rests = [[rng.randrange(4, 400) for _ in range(n)] for n in (3, 11, 1, 6)]
    prompts = [instructions + rests[k] for k in (0, 1, 1, 2, 3)]  # two samples share a whole prompt
    outputs = [[rng.randrange(0, 400) for _ in range(n)] for n in (4, 7, 2, 0, 9)]
    calls: list[tuple[int, ...]] = []
    backbone = model.get_decoder()
    hook = backbone.register_forward_pre_hook(
        lambda mod, args, kw: calls.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    weights = torch.linspace(0.5, 1.5, 9)  # (T_out,)
    try:
        logp, mask = output_logprobs(model, prompts, outputs, chunk_size=4)
        (logp * weights * mask).sum().backward()
        assert calls[0] == (1, 40) and len(calls) == 2 and calls[1][1] < 40  # the rows without the prefix
        grads = {name: q.grad.clone() for name, q in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        ref, ref_mask = output_logprobs_reference(model, prompts, outputs)
        (ref * weights * ref_mask).sum().backward()
        assert torch.equal(mask, ref_mask)
        torch.testing.assert_close(logp.detach(), ref.detach(), atol=1e-5, rtol=0)
        for name, q in model.named_parameters():
            assert grads[name].abs().sum() > 0, name
            torch.testing.assert_close(grads[name], q.grad, atol=1e-5, rtol=1e-4, msg=name)
        calls.clear()
        with torch.no_grad():
            short = [p[40 - MIN_SHARED_PREFIX + 1 :] for p in prompts]  # a shared prefix of MIN_SHARED_PREFIX - 1
            output_logprobs(model, short, outputs)
            assert len(calls) == 1
        enable_gradient_checkpointing(model)
        model.train()
        calls.clear()
        checkpointed, _ = output_logprobs(model, prompts, outputs)
        assert len(calls) == 1  # (one forward; the backward's recomputation comes later)
        torch.testing.assert_close(checkpointed.detach(), ref.detach(), atol=1e-5, rtol=0)
        model.eval()  # a pass without gradients (the reference's) computes as the update it goes with: in one
        with torch.no_grad():
            evaluated, _ = output_logprobs(model, prompts, outputs)
        assert len(calls) == 2 and torch.equal(evaluated, checkpointed.detach())
    finally:
        hook.remove()


def test_temperature_applied(model, batch) -> None:
    prompts, outputs = batch
    with torch.no_grad():
        cold, mask = output_logprobs(model, prompts, outputs, temperature=0.5, chunk_size=3)
        ref, _ = output_logprobs_reference(model, prompts, outputs, temperature=0.5)
        warm, _ = output_logprobs(model, prompts, outputs, temperature=1.0)
    torch.testing.assert_close(cold, ref, atol=1e-5, rtol=0)
    assert (cold[mask] - warm[mask]).abs().min() > 1e-3
    with torch.no_grad():  # by hand for one token: log_softmax(logits / T) at the target
        ids = torch.tensor([prompts[0] + outputs[0][:1]])  # (1, L)
        logits = model(input_ids=ids).logits[0, len(prompts[0]) - 1]  # (V,)
        expected = torch.log_softmax(logits / 0.5, dim=-1)[outputs[0][0]]
    assert cold[0, 0].item() == pytest.approx(expected.item(), abs=1e-5)


def test_only_output_positions_reach_the_lm_head(model, batch) -> None:
    prompts, outputs = batch
    rows: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[0]))
    try:
        with torch.no_grad():
            output_logprobs(model, prompts, outputs, chunk_size=8)
    finally:
        hook.remove()
    assert sum(rows) == sum(len(o) for o in outputs) == 28
    assert max(rows) == 8


def test_lora_wrapped_model(model, batch) -> None:
    from peft import LoraConfig, get_peft_model

    prompts, outputs = batch
    with torch.no_grad():
        base, _ = output_logprobs(model, prompts, outputs)
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        ref, mask = output_logprobs_reference(peft_model, prompts, outputs)
    assert (ref[mask] - base[mask]).abs().max() > 1e-3  # the adapters change the model
    logp, lora_mask = output_logprobs(peft_model, prompts, outputs, chunk_size=5)
    assert torch.equal(mask, lora_mask)
    torch.testing.assert_close(logp.detach(), ref, atol=1e-5, rtol=0)
    logp.sum().backward()
    trained = {n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert all(g is not None and g.abs().sum() > 0 for g in trained.values())
    assert any("lm_head" in n for n in trained)
    with peft_model.disable_adapter(), torch.no_grad():
        plain, _ = output_logprobs(peft_model, prompts, outputs)
    torch.testing.assert_close(plain, base, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("chunk_size", "temperature"), [(512, 1.0), (3, 0.7)])
def test_entropy_matches_reference_values_and_gradients(model, batch, chunk_size: int, temperature: float) -> None:
    """The entropy of the whole next-token distribution at each output position, from the same forward as the
    log-probs (which stay those of output_logprobs bit for bit), against a full softmax per sample; its gradient
    through the checkpointed chunks against the reference's."""
    prompts, outputs = batch
    weights = torch.linspace(0.5, 1.5, 13)  # (T_out,) a non-uniform loss
    logp, mask, entropy = output_logprobs_entropy(model, prompts, outputs, temperature, chunk_size=chunk_size)
    with torch.no_grad():
        plain, plain_mask = output_logprobs(model, prompts, outputs, temperature, chunk_size=chunk_size)
    assert torch.equal(logp.detach(), plain) and torch.equal(mask, plain_mask)
    assert entropy.shape == (5, 13) and entropy.requires_grad
    assert (entropy[~mask] == 0).all() and (entropy[mask] > 0).all()
    assert (entropy[mask] < torch.log(torch.tensor(float(model.config.vocab_size)))).all()
    (entropy * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ref = output_entropy_reference(model, prompts, outputs, temperature)
    torch.testing.assert_close(entropy.detach(), ref.detach(), atol=1e-5, rtol=0)
    (ref * weights).sum().backward()
    for name, p in model.named_parameters():
        assert grads[name].abs().sum() > 0, name
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)
    with torch.no_grad():  # by hand for one position: -sum p log p of softmax(logits / T)
        ids = torch.tensor([prompts[2] + outputs[2]])  # (1, L)
        p = torch.softmax(model(input_ids=ids).logits[0, len(prompts[2]) - 1] / temperature, dim=-1)  # (V,)
    assert entropy[2, 0].item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-5)


def test_bad_inputs(model) -> None:
    with pytest.raises(ValueError, match="2 prompts but 1 outputs"):
        output_logprobs(model, [[1], [2]], [[3]])
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        output_logprobs(model, [[]], [[3]])
    with pytest.raises(ValueError, match="temperature"):
        output_logprobs(model, [[1]], [[3]], temperature=0.0)
    logp, mask = output_logprobs(model, [[1, 2]], [[]])
    assert logp.shape == mask.shape == (1, 0)
