"""Throughput of sampling and cost of training-time log-probs on the default model.

Prints new tokens/s of :class:`mhgpo.model.generation.HFGenerator` for batch sizes 1, 4 and 16 on 16 prompts
of about 200 tokens (32 new tokens each), then the wall time and peak resident memory of
:func:`mhgpo.model.logprobs.output_logprobs` forward + backward on 8 sequences of 256 tokens, next to a plain
full-logits forward + backward for comparison.

    python benchmarks/bench_generation.py [--model smollm2-135m] [--skip-full]

With ``--engine hf,vllm`` it times instead the rollouts of the first step of `mhgpo demo` (its config, without the
warm start) with each engine (``generation.engine``): seconds, prompt tokens/s and new tokens/s (the prompt
tokens of every LLM call, shared prefixes counted each time), the engine's start, and for vLLM the trainer's
recomputation of the old log-probs (``optim.old_logprobs=trainer``). vLLM needs ``bash scripts/setup.sh --vllm``.

    python benchmarks/bench_generation.py --engine hf,vllm [--steps 1] [kv_cache_gb=2 ...]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
import torch

from mhgpo.model.generation import HFGenerator, SamplingParams
from mhgpo.model.logprobs import output_logprobs
from mhgpo.model.pretrained import DEFAULT_MODEL, encode_chat
from mhgpo.model.trained import load_model

PASSAGE = (
    "The Berlin Wall was a guarded concrete barrier that encircled West Berlin from 1961 to 1989, "
    "separating it from East Berlin and East Germany. Construction began on 13 August 1961. "
    "The fall of the wall on 9 November 1989 paved the way for German reunification in October 1990. "
)


class PeakRSS:
    """Samples the resident set size of this process every few milliseconds while active."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.process = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval)

    def __enter__(self) -> PeakRSS:
        self.peak = self.process.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)


def make_prompts(tokenizer: Any, count: int = 16, target: int = 200) -> list[list[int]]:
    """``count`` chat prompts of about ``target`` tokens each (lengths vary a little)."""
    prompts = []
    for i in range(count):
        text = PASSAGE * 8
        question = f"Question {i}: in which year did the wall fall, and what happened {i} months later?"
        ids = encode_chat(tokenizer, [{"role": "user", "content": text + question}])
        while len(ids) > target + (i % 5) * 4:
            text = text[: int(len(text) * 0.95)]
            ids = encode_chat(tokenizer, [{"role": "user", "content": text + question}])
        prompts.append(ids)
    return prompts


def bench_generation(lm: Any, prompts: list[list[int]], batch_sizes: tuple[int, ...]) -> None:
    params = SamplingParams(max_new_tokens=32, temperature=1.0, top_p=0.9)
    HFGenerator(lm.model, lm.tokenizer, batch_size=4).generate(prompts[:4], SamplingParams(max_new_tokens=4))
    mean_len = sum(map(len, prompts)) / len(prompts)
    print(f"generation: {len(prompts)} prompts of {mean_len:.0f} tokens on average, max_new_tokens=32")
    for size in batch_sizes:
        torch.manual_seed(0)
        generator = HFGenerator(lm.model, lm.tokenizer, batch_size=size)
        start = time.perf_counter()
        generations = generator.generate(prompts, params)
        elapsed = time.perf_counter() - start
        new = sum(len(g.output_ids) for g in generations)
        print(f"  batch_size={size:>2}: {new:4d} new tokens in {elapsed:6.2f} s = {new / elapsed:7.1f} tokens/s")


def release_freed_memory() -> None:
    """Give freed heap memory back to the OS (glibc), so that RSS peaks of successive runs are comparable."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):
            pass


def measure(label: str, fn: Callable[[], None]) -> None:
    release_freed_memory()
    with PeakRSS() as peak:
        base = peak.peak
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
    print(f"  {label}: {elapsed:6.2f} s, peak RSS {peak.peak / 2**20:7.0f} MiB (+{(peak.peak - base) / 2**20:.0f} MiB)")


def bench_logprobs(lm: Any, skip_full: bool, batch: int = 8, length: int = 256, output_len: int = 128) -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = lm.model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, length), generator=gen)  # (B, L)
    prompts = [row[: length - output_len].tolist() for row in ids]
    outputs = [row[length - output_len :].tolist() for row in ids]
    model = lm.model
    model.train()
    print(f"training log-probs: {batch} sequences of {length} tokens ({output_len} output tokens each)")

    def chunked() -> None:
        logp, mask = output_logprobs(model, prompts, outputs, pad_id=lm.tokenizer.pad_token_id)
        (logp * mask).sum().backward()
        model.zero_grad(set_to_none=True)

    def full() -> None:
        logits = model(input_ids=ids).logits.float()  # (B, L, V)
        logp = torch.log_softmax(logits, dim=-1)[:, length - output_len - 1 : -1]  # (B, T, V)
        picked = logp.gather(2, ids[:, length - output_len :].unsqueeze(-1))  # (B, T, 1)
        picked.sum().backward()
        model.zero_grad(set_to_none=True)

    chunked()  # warm-up
    measure("output_logprobs forward+backward", chunked)
    if not skip_full:
        measure("full-logits forward+backward (comparison)", full)
    model.eval()


def bench_engines(engines: list[str], steps: int, overrides: list[str]) -> None:
    """The demo's first ``steps`` steps of rollouts with each engine, the same questions for each."""
    import tempfile

    from mhgpo.config import TrainConfig, demo_config_path, load_config
    from mhgpo.run.setup import build_trainer, settle

    for engine in engines:
        out = tempfile.mkdtemp(prefix="bench-generation-")
        cfg = load_config(
            TrainConfig,
            demo_config_path(),
            [
                "warm_start.enabled=false",
                "eval_every=0",
                f"output_dir={out}",
                f"generation.engine={engine}",
                *overrides,
            ],
        )
        start = time.perf_counter()
        trainer = build_trainer(settle(cfg), progress=False)
        trainer._engine_ready()  # the first adapters handed over (vLLM): not part of the rollouts
        ready = time.perf_counter() - start
        seconds = prompt = new = calls = recompute = 0.0
        gaps: list[float] = []
        for _ in range(steps):
            t = time.perf_counter()
            batch, _, _ = trainer._rollout(trainer._next_questions(cfg.questions_per_step))
            seconds += time.perf_counter() - t
            nodes = batch.llm_nodes()
            calls += len(nodes)
            prompt += sum(len(n.prompt_ids) for n in nodes)
            new += sum(len(n.output_ids) for n in nodes)
            if engine == "vllm":
                from mhgpo.rl.engine_sync import old_logprobs
                from mhgpo.rl.policy import Sample

                sampling = trainer.setup.workflow.sampling
                samples = [
                    Sample(n.prompt_ids, n.output_ids, list(n.logprobs), 0.0, n.agent, sampling(n.agent).temperature)
                    for n in nodes
                    if n.trained
                ]
                t = time.perf_counter()
                gaps.append(old_logprobs(trainer.setup.policy, samples, "trainer")["engine/old_logprob_gap"])
                recompute += time.perf_counter() - t
        extra = (
            f", old log-probs recomputed by the trainer in {recompute:.1f} s (mean per-token gap to the "
            f"engine's {max(gaps):.2g})"
            if engine == "vllm"
            else ""
        )
        print(
            f"engine {engine} (precision {cfg.precision}): started in {ready:.1f} s; {steps} step(s) of demo "
            f"rollouts, {calls:.0f} LLM calls: {seconds:.1f} s, {prompt:.0f} prompt tokens "
            f"({prompt / seconds:.0f}/s), "
            f"{new:.0f} new tokens ({new / seconds:.1f}/s){extra}",
            flush=True,
        )
        del trainer
        release_freed_memory()


def main() -> None:
    from mhgpo.model.allocator import keep_freed_memory

    keep_freed_memory()  # as the mhgpo command does
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--skip-full", action="store_true", help="skip the full-logits comparison")
    parser.add_argument("--engine", help="comma-separated engines (hf, vllm): time the demo's rollouts with each")
    parser.add_argument("--steps", type=int, default=1, help="with --engine: the demo steps rolled out")
    parser.add_argument("overrides", nargs="*", help="with --engine: config overrides (key=value)")
    args = parser.parse_args()
    if args.engine:
        bench_engines(args.engine.split(","), args.steps, [f"model={args.model}", *args.overrides])
        return
    start = time.perf_counter()
    lm = load_model(args.model)
    print(
        f"model {lm.name} on {lm.device} ({lm.dtype}), loaded in {time.perf_counter() - start:.1f} s, "
        f"{torch.get_num_threads()} threads"
    )
    bench_logprobs(lm, args.skip_full)
    bench_generation(lm, make_prompts(lm.tokenizer), (1, 4, 16))


if __name__ == "__main__":
    main()
