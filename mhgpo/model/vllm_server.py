"""Sampling on vLLM servers: :class:`ServerGenerator`, the :class:`~mhgpo.model.generation.Generator` of
``generation.engine=vllm_server`` (docs/vllm.md, "A generation server").

One or more vLLM OpenAI-compatible servers (``generation.server_urls``; `mhgpo serve-generation` starts one with what
mhgpo needs) sample the agents' outputs on their own devices while the trainer trains on its own. Token ids go in
(``/v1/completions`` with ``prompt`` as token ids) and token ids come out (``return_tokens_as_token_ids``) with the
log-prob of each sampled token (``logprobs=0``); the server computes them as the in-process engine does
(:mod:`mhgpo.model.vllm_processors`, ``--logprobs-mode processed_logits``). A call's prompts are cut into one
contiguous share per server, sent at once.

The trained LoRA adapters reach the servers under versioned names, ``AGENT-v{version}`` (``shared-v{version}`` for
an adapter every agent shares), loaded at run time (``/v1/load_lora_adapter``; the server runs with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``) from a folder the servers can read. A generation asks for the adapter of
its version by name and holds it until its answer is in: an adapter is unloaded (``/v1/unload_lora_adapter``) only
once it is no longer the current one and no generation uses it any more, so that rollouts sampled while the trainer
hands over the next version finish on the weights they started on.

Full fine-tuning hands over every weight instead (:meth:`ServerGenerator.load_weights`): the trainer writes them
(safetensors, Hugging Face names) to a folder of their version under the folder the servers read, and each server
reloads its model's weights from there in place (vLLM's ``reload_weights`` through ``/collective_rpc``, a route a
server has only in vLLM's development mode, ``VLLM_SERVER_DEV_MODE=1``: `mhgpo serve-generation --full-weights`),
then empties its prefix cache (its cached keys and values are the old weights'). vLLM's weight-transfer engines
(NCCL, CUDA IPC) need GPUs on both sides; this path needs only a shared folder. The weights change in place, so no
generation may run across a hand-over: full fine-tuning on a server is synchronous (``rollout.max_staleness=0``) and
one process (`mhgpo.config.train.check_engine_weights`).

A server that cannot be reached, that answers with an error or with something that is not a completion of what was
asked, or that does not answer within ``generation.server_timeout`` raises a
:class:`~mhgpo.errors.ServiceError` naming its URL: the run stops with its last completed step saved.
"""

from __future__ import annotations

import functools
import secrets
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mhgpo.config.eval import check_server_urls
from mhgpo.errors import InputError, ServiceError
from mhgpo.model.generation import Generation, OnChunk, SamplingParams
from mhgpo.model.vllm_engine import Held, RequestSeeds, adapter_digest

HINT = "is it running? (mhgpo serve-generation starts one)"
MAX_IN_FLIGHT = 64  # requests in flight at once from one call (a seeded call sends one per prompt)


def adapter_name(agent: str | None, version: int) -> str:
    """The versioned name an adapter is served under: ``AGENT-v{version}``, ``shared-v{version}`` for every agent's
    (the run's tag after it, :class:`ServerGenerator`)."""
    return f"{agent or 'shared'}-v{version}"


def _token_id(token: Any, url: str) -> int:
    """The id in a ``token_id:N`` token of an answer (``return_tokens_as_token_ids``)."""
    if not isinstance(token, str) or not token.startswith("token_id:"):
        raise ServiceError(f"generation server {url}: malformed answer: token {token!r} is not 'token_id:N'")
    try:
        return int(token[len("token_id:") :])
    except ValueError:
        raise ServiceError(f"generation server {url}: malformed answer: token {token!r} is not 'token_id:N'") from None


def _waited(method: Any) -> Any:
    """A method of :class:`ServerGenerator` whose calls count in :meth:`ServerGenerator.waited_seconds`."""

    @functools.wraps(method)
    def counted(self: ServerGenerator, *args: Any, **kwargs: Any) -> Any:
        with self._waiting():
            return method(self, *args, **kwargs)

    return counted


class ServerGenerator:
    """:class:`~mhgpo.model.generation.Generator` over the vLLM servers at ``urls`` (base URLs, ``http://HOST:PORT``),
    each serving the run's initial weights; ``eos_ids`` end a generation. ``timeout``: seconds one request may take
    (connecting, then each wait for the answer). ``lora``: the trained weights reach the servers as LoRA adapters
    (:meth:`set_adapters`); ``adapter_dir``: the folder the adapters are written to, which every server reads."""

    def __init__(
        self,
        urls: list[str],
        tokenizer: Any,
        eos_ids: list[int],
        *,
        timeout: float = 600.0,
        vocab_size: int | None = None,
        adapter_dir: Path | None = None,
        session: Any = None,
        tag: str | None = None,
    ) -> None:
        import requests

        if not urls:
            raise InputError("generation.server_urls: generation.engine=vllm_server needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.tokenizer, self.eos_ids, self.timeout = tokenizer, list(eos_ids), float(timeout)
        self.vocab_size = vocab_size
        self.adapter_dir = adapter_dir
        self.session = session or requests.Session()
        if session is None:  # a connection per request in flight (a seeded call sends one request per prompt)
            from requests.adapters import HTTPAdapter

            adapter = HTTPAdapter(pool_maxsize=MAX_IN_FLIGHT)
            self.session.mount("http://", adapter)
            self.session.mount("https://", adapter)
        self.seeds = RequestSeeds()  # the rollouts' per-request seeds (:meth:`seeded`)
        self.dtype = "server"  # (the sync check compares no tensors of a server)
        self.version: int | None = None  # the trainer's update count of the adapters last handed over
        self.adapters: dict[str | None, str] = {}  # agent (None: every agent) -> its served name, the current ones
        self._folders: dict[str, Path] = {}  # a served adapter's name -> the folder it was loaded from
        self._digests: dict[str, str] = {}  # a served adapter's name -> the digest of that folder's adapter
        self._in_use: Counter[str] = Counter()  # a served adapter's name -> generations using it now
        self._lock = threading.Lock()
        self.unloaded: list[str] = []  # names unloaded so far, in order (what the tests and the logs read)
        self._weights: Path | None = None  # full fine-tuning: the folder of the weights the servers hold
        # after every adapter's name: this run's tag (a server outlives runs: a later run, or a resumed one, names its
        # versions anew) and, under several ranks, the rank's (the ranks share the servers)
        self.suffix = "" if tag == "" else f"-{tag or secrets.token_hex(3)}"
        self._pins = threading.local()  # a thread's pinned adapters (:meth:`pinned`)
        self._active, self._since, self._busy = 0, 0.0, 0.0  # requests in flight; since when; busy seconds so far
        self._waits = threading.local()  # a thread's seconds in hand-overs and scoring (:meth:`waited_seconds`)
        based = {url: self._base_model(url) for url in self.urls}
        self.models = {url: name for url, (name, _) in based.items()}
        self.roots = {url: root for url, (_, root) in based.items()}  # the folders the servers' weights came from

    # ------------------------------------------------------------------------------------------------ HTTP

    def _request(self, method: str, url: str, path: str, body: dict[str, Any] | None = None, parse: bool = True) -> Any:
        """One request's JSON answer (``parse=False``: its text; vLLM answers a LoRA load or unload in plain text);
        a :class:`ServiceError` naming ``url`` when it cannot be had."""
        import requests

        try:
            answer = self.session.request(method, url + path, json=body, timeout=(self.timeout, self.timeout))
        except requests.Timeout:
            raise ServiceError(
                f"generation server {url}: no answer to {path} within generation.server_timeout={self.timeout:g} s"
            ) from None
        except requests.ConnectionError as e:
            raise ServiceError(f"generation server {url}: cannot connect ({type(e).__name__}); {HINT}") from None
        except requests.RequestException as e:
            raise ServiceError(f"generation server {url}: {path} failed ({type(e).__name__}: {e})") from None
        if answer.status_code != 200:
            text = " ".join(answer.text.split())[:200]
            raise ServiceError(f"generation server {url}: {path} answered HTTP {answer.status_code}: {text}")
        if not parse or not answer.content:
            return answer.text
        try:
            return answer.json()
        except ValueError:
            raise ServiceError(f"generation server {url}: malformed answer to {path}: not JSON") from None

    def _base_model(self, url: str) -> tuple[str, str]:
        """The name of the model ``url`` serves (the first of ``/v1/models`` without a parent: not an adapter) and
        the folder it was loaded from (its ``root``)."""
        listed = self._request("GET", url, "/v1/models")
        try:
            models = [m for m in listed["data"] if not m.get("parent")]
            return str(models[0]["id"]), str(models[0].get("root") or "")
        except (TypeError, KeyError, IndexError, AttributeError):
            raise ServiceError(f"generation server {url}: malformed answer to /v1/models: no model listed") from None

    def _each(self, work: list[tuple[str, Any]], call: Any, on_done: Any = None) -> list[Any]:
        """``call(url, item)`` for each ``(url, item)`` of ``work``, at once (a thread per item, up to
        :data:`MAX_IN_FLIGHT`); the results in order, the first error raised. ``on_done(k, result)``: called in
        this thread on each item's result as it comes, in the order they come."""
        if len(work) == 1:
            done = [call(*work[0])]
            if on_done is not None:
                on_done(0, done[0])
            return done
        with ThreadPoolExecutor(min(len(work), MAX_IN_FLIGHT)) as pool:
            futures = {pool.submit(call, *pair): k for k, pair in enumerate(work)}
            if on_done is not None:
                for future in as_completed(futures):
                    if future.exception() is None:
                        on_done(futures[future], future.result())
            return [f.result() for f in futures]

    # ------------------------------------------------------------------------------------------- sampling

    def pin(self) -> tuple[dict[str | None, str], int | None]:
        """The current adapters' names and version, held (none is unloaded) until :meth:`pinned` given them ends."""
        with self._lock:
            names, version = dict(self.adapters), self.version
            for name in names.values():
                self._in_use[name] += 1
        return names, version

    @contextmanager
    def pinned(self, pin: tuple[dict[str | None, str], int | None] | None = None) -> Iterator[int | None]:
        """Within it, this thread's generations use the adapters of ``pin`` (:meth:`pin`, taken maybe by another
        thread; None: the current ones, taken now), whatever is handed over meanwhile, and hold them (none is
        unloaded before it ends): a rollout batch's trees are sampled by one version. Yields that version (None:
        none handed over yet)."""
        names, version = pin if pin is not None else self.pin()
        self._pins.names = names
        try:
            yield version
        finally:
            self._pins.names = None
            for name in names.values():
                self._release(name)

    def busy_seconds(self) -> float:
        """Seconds so far during which at least one request was in flight to the servers."""
        with self._lock:
            return self._busy + (time.perf_counter() - self._since if self._active else 0.0)

    def waited_seconds(self) -> float:
        """Seconds this thread has spent so far in calls to the servers other than generation: the hand-overs
        (:meth:`set_adapters`, :meth:`load_weights`) and scoring (:meth:`score`, the sync check). One step off-policy
        the trainer's hand-over queues behind the next step's generation on the servers: this counts that wait."""
        return getattr(self._waits, "seconds", 0.0)

    @contextmanager
    def _waiting(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self._waits.seconds = self.waited_seconds() + time.perf_counter() - started

    def _started(self) -> None:
        with self._lock:
            if self._active == 0:
                self._since = time.perf_counter()
            self._active += 1

    def _ended(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._busy += time.perf_counter() - self._since

    def _acquire(self, agent: str | None) -> str | None:
        pins = getattr(self._pins, "names", None)
        with self._lock:
            current = pins if pins is not None else self.adapters
            name = current.get(agent, current.get(None))
            if name is not None:
                self._in_use[name] += 1
            return name

    def _release(self, name: str | None) -> None:
        if name is None:
            return
        with self._lock:
            self._in_use[name] -= 1
            done = self._in_use[name] <= 0 and name not in self.adapters.values()
            if self._in_use[name] <= 0:
                del self._in_use[name]
        if done:
            self._unload(name)

    def in_use(self) -> dict[str, int]:
        """The served adapters' names that generations use now, with how many."""
        with self._lock:
            return dict(self._in_use)

    def seeded(self, key: Any) -> Any:
        """Within it, this thread's generations sample with per-request seeds from the stream of ``key``
        (:class:`~mhgpo.model.vllm_engine.RequestSeeds`), as the in-process engine does; outside it, each server
        draws from its process's generator."""
        return self.seeds.seeded(key)

    reports_chunks = True  # generate takes on_chunk (mhgpo.model.generation.generate_in_chunks)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, on_chunk: OnChunk | None = None
    ) -> list[Generation]:
        """Complete every prompt once; results in the order of ``prompts``. The prompts are shared among the servers
        in contiguous parts, each sent at once; inside :meth:`seeded` (and not greedy) each prompt is a request of
        its own with its own ``seed`` (the completions API takes one seed a request), all sent at once.
        ``on_chunk(indices, generations)`` is called in this thread on each request's answer as it comes (its
        prompts' indices in ``prompts``): the rollout's pipeline (``rollout.pipeline``) works on them meanwhile."""
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty")
        if not prompts:
            return []
        seeds = self.seeds.take(len(prompts))
        name = self._acquire(params.agent)
        self._started()
        try:
            parts, where, start = [], [], 0
            for k, url in enumerate(self.urls):
                size = len(prompts) // len(self.urls) + (k < len(prompts) % len(self.urls))
                if size:
                    if seeds is None or params.greedy:
                        parts.append((url, (prompts[start : start + size], None)))
                        where.append(list(range(start, start + size)))
                    else:
                        parts += [(url, ([prompts[i]], seeds[i])) for i in range(start, start + size)]
                        where += [[i] for i in range(start, start + size)]
                start += size
            done = self._each(
                parts,
                lambda url, part: self._complete(url, part[0], params, name, part[1]),
                None if on_chunk is None else lambda k, generations: on_chunk(where[k], generations),
            )
        finally:
            self._ended()
            self._release(name)
        return [g for part in done for g in part]

    def _complete(
        self, url: str, prompts: list[list[int]], params: SamplingParams, name: str | None, seed: int | None = None
    ) -> list[Generation]:
        body = {
            "model": name or self.models[url],
            "prompt": [list(map(int, p)) for p in prompts],
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": 1.0 if params.greedy else params.top_p,
            "n": 1,
            "logprobs": 0,
            "stop_token_ids": self.eos_ids,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": True,
        }
        if seed is not None:
            body["seed"] = seed
        answer = self._request("POST", url, "/v1/completions", body)
        try:
            choices = sorted(answer["choices"], key=lambda c: int(c["index"]))
        except (TypeError, KeyError, ValueError):
            raise ServiceError(f"generation server {url}: malformed answer to /v1/completions: no choices") from None
        if [int(c["index"]) for c in choices] != list(range(len(prompts))):
            raise ServiceError(
                f"generation server {url}: malformed answer to /v1/completions: {len(choices)} choices for "
                f"{len(prompts)} prompts"
            )
        return [self._generation(url, prompt, choice, params) for prompt, choice in zip(prompts, choices)]

    def _generation(self, url: str, prompt: list[int], choice: Any, params: SamplingParams) -> Generation:
        bad = f"generation server {url}: malformed answer to /v1/completions"
        try:
            tokens, logprobs = choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]
        except (TypeError, KeyError):
            raise ServiceError(f"{bad}: a choice without its tokens' log-probs") from None
        if not isinstance(tokens, list) or not isinstance(logprobs, list) or len(tokens) != len(logprobs):
            raise ServiceError(f"{bad}: the tokens and their log-probs differ in number")
        ids = [_token_id(t, url) for t in tokens]
        if len(ids) > params.max_new_tokens:
            raise ServiceError(f"{bad}: {len(ids)} tokens, more than the {params.max_new_tokens} asked for")
        if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in ids):
            raise ServiceError(f"{bad}: a token id outside the vocabulary (0..{self.vocab_size - 1})")
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in logprobs):
            raise ServiceError(f"{bad}: a log-prob that is not a number")
        return Generation(
            prompt_ids=list(prompt),
            output_ids=ids,
            logprobs=[float(x) for x in logprobs],
            text=self.tokenizer.decode(ids, skip_special_tokens=True).strip(),
            finished=bool(ids) and ids[-1] in self.eos_ids,
        )

    @_waited
    def score(
        self, prompts: list[list[int]], outputs: list[list[int]], agent: str | None = None, temperature: float = 1.0
    ) -> list[list[float]]:
        """The servers' log-probs of each output's tokens after its prompt, as ``agent``, at ``temperature``
        (``log_softmax(logits / T)``, as :meth:`generate` reports them; 0: greedy's): the sync check's engine side,
        as :meth:`mhgpo.model.vllm_engine.VLLMGenerator.score` takes it in process. One request per position, on the
        first server, holding the adapter it scores with: every output that long, each a token long after its prompt
        and the output's tokens before, top-p 1, the log-probs of the position's tokens asked for
        (``logprob_token_ids``: every row's, each row reading its own)."""
        url = self.urls[0]
        bad = f"generation server {url}: malformed answer to /v1/completions"
        scored: list[list[float]] = [[] for _ in outputs]
        name = self._acquire(agent)
        try:
            for t in range(max((len(o) for o in outputs), default=0)):
                rows = [i for i, o in enumerate(outputs) if len(o) > t]
                body = {
                    "model": name or self.models[url],
                    "prompt": [[int(x) for x in list(prompts[i]) + list(outputs[i][:t])] for i in rows],
                    "max_tokens": 1,
                    "temperature": temperature,
                    "top_p": 1.0,
                    "logprobs": 1,
                    "logprob_token_ids": sorted({int(outputs[i][t]) for i in rows}),
                    "return_tokens_as_token_ids": True,
                }
                answer = self._request("POST", url, "/v1/completions", body)
                try:
                    choices = sorted(answer["choices"], key=lambda c: int(c["index"]))
                    tops = [c["logprobs"]["top_logprobs"][0] for c in choices]
                except (TypeError, KeyError, IndexError, ValueError):
                    raise ServiceError(f"{bad}: no log-probs of the tokens asked for") from None
                if len(tops) != len(rows):
                    raise ServiceError(f"{bad}: {len(tops)} choices for {len(rows)} prompts")
                for i, top in zip(rows, tops):
                    value = top.get(f"token_id:{int(outputs[i][t])}") if isinstance(top, dict) else None
                    if not isinstance(value, (int, float)) or isinstance(value, bool):
                        raise ServiceError(f"{bad}: no log-prob of token {int(outputs[i][t])}")
                    scored[i].append(float(value))
        finally:
            self._release(name)
        return scored

    # ----------------------------------------------------------------------------------------- weight sync

    @_waited
    def set_adapters(self, folders: dict[str | None, str | Path], version: int) -> None:
        """Serve the LoRA adapters saved (PEFT format) in ``folders``, by agent (None: every agent), the weights of
        the trainer's update ``version``, under their versioned names (:func:`adapter_name`), loaded on every
        server; then they are the current ones, and the previous ones are unloaded as soon as no generation uses
        them (:meth:`_release`)."""
        new = {agent: adapter_name(agent, version) + self.suffix for agent in folders}
        for agent, folder in folders.items():
            name = new[agent]
            self._folders[name], self._digests[name] = Path(folder), adapter_digest(folder)
            body = {"lora_name": name, "lora_path": str(Path(folder).resolve())}
            self._each(
                [(url, body) for url in self.urls],
                lambda url, b: self._request("POST", url, "/v1/load_lora_adapter", b, parse=False),
            )
        with self._lock:
            old = [n for n in self.adapters.values() if n not in new.values()]
            self.adapters, self.version = new, version
            idle = [n for n in old if self._in_use[n] <= 0]
        for name in idle:
            self._unload(name)

    def load_weights(self, named: Iterable[tuple[str, Any]], version: int) -> None:
        """Full fine-tuning's hand-over: the weights ``named`` (Hugging Face names, as ``model.state_dict()`` gives
        them), those of the trainer's update ``version``, written to ``adapter_dir/weights-v{version}`` and reloaded
        in place by every server from there, each server's prefix cache emptied after; the previous version's folder
        is removed. Call it while no generation runs (the weights change under it). A server that does not take
        full weights (not in development mode) raises a :class:`ServiceError` that says how to start one that does."""
        from safetensors.torch import save_file

        if self.adapter_dir is None:
            raise InputError("generation.adapter_dir: full fine-tuning on a server needs a folder the servers read")
        folder = Path(self.adapter_dir) / f"weights-v{version}{self.suffix}"
        folder.mkdir(parents=True, exist_ok=True)
        kept, seen = {}, set()
        for name, tensor in named:  # a tensor shared by two names (tied embeddings) is written once, as vLLM loads it
            tensor = tensor.detach()
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            kept[name] = tensor.contiguous().cpu()
        save_file(kept, str(folder / "model.safetensors"))
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(folder.resolve())}}
        with self._waiting():
            self._each([(url, body) for url in self.urls], self._reload)
        previous, self._weights = self._weights, folder
        self.version = version
        if previous is not None and previous != folder:
            shutil.rmtree(previous, ignore_errors=True)

    def _reload(self, url: str, body: dict[str, Any]) -> None:
        try:
            self._request("POST", url, "/collective_rpc", body)
        except ServiceError as e:
            if "HTTP 404" in str(e):
                raise ServiceError(
                    f"generation server {url}: it takes no full weights (no /collective_rpc); start it with mhgpo "
                    f"serve-generation --full-weights (vLLM's development mode), or train LoRA adapters "
                    f"(lora.enabled=true)"
                ) from None
            raise
        self._request("POST", url, "/reset_prefix_cache", parse=False)

    def _unload(self, name: str) -> None:
        self._each(
            [(url, {"lora_name": name}) for url in self.urls],
            lambda url, b: self._request("POST", url, "/v1/unload_lora_adapter", b, parse=False),
        )
        self.unloaded.append(name)
        folder = self._folders.pop(name, None)
        self._digests.pop(name, None)
        if folder is not None and self.adapter_dir is not None and folder.is_relative_to(self.adapter_dir):
            shutil.rmtree(folder, ignore_errors=True)
            parent = folder.parent  # (one folder per version: gone with its last adapter)
            if parent != self.adapter_dir and parent.is_relative_to(self.adapter_dir) and not any(parent.iterdir()):
                parent.rmdir()

    def held(self, shapes: dict[str, tuple[int, ...]] | None = None) -> Held:
        """What the servers hold (:class:`~mhgpo.model.vllm_engine.Held`), as the first one lists it now: the
        version of the current adapters that it lists as served, each with the digest of the file it was loaded
        from (the path the server lists)."""
        url = self.urls[0]
        listed = self._request("GET", url, "/v1/models")
        try:
            served = {str(m["id"]): str(m.get("root") or "") for m in listed["data"] if m.get("parent")}
        except (TypeError, KeyError, AttributeError):
            raise ServiceError(f"generation server {url}: malformed answer to /v1/models") from None
        held = Held(self.version)
        for agent, name in self.adapters.items():
            if name in served:
                root = served[name]
                held.adapters[agent] = adapter_digest(root) if root and Path(root).is_dir() else self._digests[name]
        return held

    def close(self) -> None:
        """Unload the run's adapters from the servers (the servers keep running), or, after full fine-tuning, give
        them back the weights they were started on (the folder each lists as its model's root); nothing raised."""
        for name in list(self.adapters.values()):
            try:
                self._unload(name)
            except ServiceError:
                pass
        self.adapters = {}
        if self._weights is not None:
            for url in [u for u in self.urls if self.roots[u]]:
                body = {"method": "reload_weights", "kwargs": {"weights_path": self.roots[url]}}
                try:
                    self._reload(url, body)
                except ServiceError:
                    pass
            shutil.rmtree(self._weights, ignore_errors=True)
            self._weights = None


def build_server_generator(
    *,
    spec: str,
    loaded: Any,
    generation: Any,
    lora_rank: int | None = None,
    scratch: Path | None = None,
    select: Any = None,
    ranks: Any = None,
    **_: Any,
) -> ServerGenerator:
    """The `vllm_server` engine (`mhgpo.config.tables.ENGINES`): a :class:`ServerGenerator` over the servers of
    `generation.server_urls`, which serve the model `spec` (`mhgpo serve-generation`). Training hands it the LoRA
    adapters (`lora_rank`), written under `generation.adapter_dir` (else `scratch`: the servers on this machine);
    under several `ranks` each rank's adapters are served under names of their own. A model with one adapter per
    agent (`select`, a `lora.per_role` run) is refused, as by the in-process engine."""
    if select is not None:
        raise InputError(
            f"generation.engine=vllm_server: {spec} has one LoRA adapter per agent (lora.per_role); evaluate it with "
            f"generation.engine=hf"
        )
    if lora_rank is None and ranks is not None and ranks.world > 1:
        raise InputError(
            "lora.enabled: full fine-tuning on a generation server runs in one process (the servers' weights are "
            "reloaded in place, one set for every rank); train LoRA adapters (lora.enabled=true) under several"
        )
    from mhgpo.model.pretrained import stop_token_ids

    folder = Path(generation.adapter_dir) if generation.adapter_dir else scratch
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    generator = ServerGenerator(
        check_server_urls(generation.server_urls),
        loaded.tokenizer,
        stop_token_ids(loaded.tokenizer, loaded.model),
        timeout=generation.server_timeout,
        vocab_size=len(loaded.tokenizer),
        adapter_dir=folder,
    )
    if ranks is not None and ranks.world > 1:
        generator.suffix += f"-r{ranks.rank}"
    return generator


SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def server_command(
    python: str,
    folder: str | Path,
    *,
    dtype: str,
    seed: int,
    host: str,
    port: int,
    lora_rank: int,
    adapters: int,
    name: str = "mhgpo",
) -> list[str]:
    """The command line of a vLLM OpenAI server that samples as mhgpo needs (`mhgpo serve-generation`): the model
    ``folder`` (the run's initial weights, :func:`mhgpo.model.vllm_files.engine_folder`) served as ``name`` in
    ``dtype``, the project's log-probs (``processed_logits`` and the two processors of
    :mod:`mhgpo.model.vllm_processors`), the prefix cache, eager mode, whole-prompt prefills (a chunked one kills a
    CPU engine on a seeded request), and LoRA adapters of rank up to ``lora_rank``,
    ``adapters`` of them at once (each agent's, of two versions while one is handed over)."""
    from mhgpo.model.vllm_engine import LORA_RANKS
    from mhgpo.model.vllm_processors import NAMES

    fits = [r for r in LORA_RANKS if r >= lora_rank]
    if not fits:
        raise InputError(f"--lora-rank: vLLM takes LoRA adapters of rank {LORA_RANKS[-1]} at most, got {lora_rank}")
    return [
        python,
        "-m",
        SERVER_MODULE,
        "--model",
        str(folder),
        "--served-model-name",
        name,
        "--dtype",
        dtype,
        "--seed",
        str(seed),
        "--host",
        host,
        "--port",
        str(port),
        "--enforce-eager",
        "--enable-prefix-caching",
        "--no-enable-chunked-prefill",  # (as the in-process engine: seeded requests, mhgpo.model.vllm_engine)
        "--logprobs-mode",
        "processed_logits",
        "--logits-processors",
        *NAMES,
        "--enable-lora",
        "--max-lora-rank",
        str(fits[0]),
        "--max-loras",
        str(adapters),
        "--max-cpu-loras",
        str(adapters),
    ]


def server_environment(kv_cache_gb: float, base: dict[str, str], full_weights: bool = False) -> dict[str, str]:
    """The environment of the server's process: ``base`` with runtime LoRA loading allowed and, on a CPU, the KV
    cache's size (``VLLM_CPU_KVCACHE_SPACE``, unless already set); ``full_weights``: vLLM's development mode too
    (``VLLM_SERVER_DEV_MODE=1``: the ``/collective_rpc`` route that reloads full fine-tuning's weights, and routes
    that run any of the workers' methods: serve it to the trainer's network only)."""
    env = dict(base)
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if full_weights:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gb))))
    return env


def wait_until_serving(process: Any, url: str, timeout: float, log: Path) -> None:
    """Wait until the server started as ``process`` answers ``url``'s ``/v1/models``, at most ``timeout`` seconds;
    a server that exits, or does not answer in time (then killed), raises a `ServiceError` naming ``log``."""
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServiceError(f"the generation server exited ({process.returncode}); its log: {log}")
        try:
            if requests.get(url + "/v1/models", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    process.kill()
    raise ServiceError(f"the generation server did not answer {url} within {timeout:.0f} s; its log: {log}")
