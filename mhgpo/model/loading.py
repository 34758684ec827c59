"""Loading a model to generate with: the model, a generator over it and the prompt encoder."""

from __future__ import annotations

from typing import Any


def load_generator(
    model: str,
    gen_batch_size: int,
    seed: int,
    precision: str = "fp32",
    reason: str = "set in the config",
    generation: Any = None,
):
    """The loaded model, a generator over it and the prompt encoder; ``precision`` is a resolved one, announced
    (with ``reason``) once the model has loaded. ``generation``: a `generation:` section; with ``engine: vllm`` the
    generator is a vLLM engine on the model's weights (a run with one adapter per agent is refused)."""
    import torch

    from mhgpo.model.generation import HFGenerator
    from mhgpo.model.precision import announce, weight_dtype
    from mhgpo.model.pretrained import encode_chat
    from mhgpo.model.trained import load_model

    vllm = generation is not None and generation.engine == "vllm"
    if vllm:
        from mhgpo.model.vllm_engine import require_vllm

        require_vllm()  # before the model loads
    torch.manual_seed(seed)
    loaded = load_model(model, dtype=weight_dtype(precision, trainable=False))
    announce(precision, reason)
    if vllm:
        from mhgpo.errors import InputError
        from mhgpo.model.vllm_engine import build_engine

        if loaded.select is not None:
            raise InputError(
                f"generation.engine=vllm: {model} has one LoRA adapter per agent (lora.per_role); "
                f"evaluate it with generation.engine=hf"
            )
        generator: Any = build_engine(model, loaded, generation, precision, seed)
    else:
        generator = HFGenerator(
            loaded.model, loaded.tokenizer, batch_size=gen_batch_size, precision=precision, select=loaded.select
        )
    return loaded, generator, (lambda messages: encode_chat(loaded.tokenizer, messages))
