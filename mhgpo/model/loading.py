"""Loading a model to generate with: the model, a generator over it and the prompt encoder."""

from __future__ import annotations


def load_generator(model: str, gen_batch_size: int, seed: int, precision: str = "fp32",
                   reason: str = "set in the config"):
    """The loaded model, a generator over it and the prompt encoder; ``precision`` is a resolved one, announced
    (with ``reason``) once the model has loaded."""
    import torch

    from mhgpo.model.generation import HFGenerator
    from mhgpo.model.pretrained import encode_chat
    from mhgpo.model.trained import load_model
    from mhgpo.model.precision import announce, weight_dtype

    torch.manual_seed(seed)
    loaded = load_model(model, dtype=weight_dtype(precision, trainable=False))
    announce(precision, reason)
    generator = HFGenerator(loaded.model, loaded.tokenizer, batch_size=gen_batch_size, precision=precision,
                            select=loaded.select)
    return loaded, generator, (lambda messages: encode_chat(loaded.tokenizer, messages))
