"""int8 products for the frozen base in generation, against float32: the same greedy validation twice.

Every LoRA layer's frozen linear and the LM head are swapped, while the generator runs only, for PyTorch's
dynamically quantised linear (x86/fbgemm engine: int8 weights per output channel, activations quantised per
tensor at run time); the adapters stay as they are beside it. Each mode runs `mhgpo eval` in a process of its
own, and the script prints both tables' F1, CPU seconds and how many answers changed, for better or worse.

    python benchmarks/bench_int8.py --model RUN_DIR [--data synthetic] [--limit 100] [--out DIR] [key=value ...]

docs/benchmarks.md (Without bfloat16) has its figures: not adopted (F1 51.3 -> 46.3 on 100 synthetic questions).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any


def int8_twins(model: Any) -> list[tuple[Any, str, Any, Any]]:
    """``(owner, attribute, float module, int8 module)`` for every frozen base linear of a LoRA layer and the LM
    head of ``model``."""
    import torch
    import torch.ao.nn.quantized.dynamic as quantized
    from torch.ao.quantization import per_channel_dynamic_qconfig

    def twin(linear: torch.nn.Linear) -> Any:
        linear.qconfig = per_channel_dynamic_qconfig
        try:
            return quantized.Linear.from_float(linear)
        finally:
            del linear.qconfig

    pairs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch 2.13 marks quantised tensors deprecated
        for module in model.modules():
            base = getattr(module, "base_layer", None)
            if isinstance(base, torch.nn.Linear):
                pairs.append((module, "base_layer", base, twin(base)))
        head = model.get_output_embeddings()
        owner = next(m for m in model.modules() if getattr(m, "lm_head", None) is head)
        pairs.append((owner, "lm_head", head, twin(head)))
    return pairs


def run_eval(argv: list[str]) -> int:
    """`mhgpo eval ARGV` with the generator's base in int8 (the child process of one mode)."""
    from mhgpo.cli.main import main
    from mhgpo.model import generation

    twins: dict[int, list] = {}
    plain = generation.HFGenerator.generate

    def generate(self: Any, prompts: Any, params: Any, on_chunk: Any = None) -> Any:
        pairs = twins.setdefault(id(self.model), int8_twins(self.model))  # the base is frozen: made once
        for owner, name, _, q in pairs:
            setattr(owner, name, q)
        try:
            return plain(self, prompts, params, on_chunk)
        finally:
            for owner, name, f, _ in pairs:
                setattr(owner, name, f)

    generation.HFGenerator.generate = generate
    return main(["eval", *argv])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child-int8":
        sys.exit(run_eval(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a run folder, model name or path (as mhgpo eval --model)")
    parser.add_argument("--data", default="synthetic")
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--out", default=None, help="where both evaluations write (default: a temporary folder)")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. precision=fp32")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_int8_"))
    results = {}
    for mode in ("fp32", "int8"):
        folder = out / mode
        argv = ["--model", args.model, "--data", args.data, "--limit", str(args.limit), "--output-dir", str(folder)]
        command = (
            [sys.executable, "-m", "mhgpo", "eval"] if mode == "fp32" else [sys.executable, __file__, "--child-int8"]
        )
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([*command, *argv, *args.overrides], check=True, env=os.environ.copy())
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        with (folder / "predictions.jsonl").open() as f:
            rows = {r["id"]: r for r in map(json.loads, f)}
        results[mode] = (rows, cpu)
    (plain, cpu_plain), (int8, cpu_int8) = results["fp32"], results["int8"]
    changed = [k for k in plain if plain[k]["prediction"] != int8[k]["prediction"]]
    better = sum(int8[k]["f1"] > plain[k]["f1"] for k in plain)
    worse = sum(int8[k]["f1"] < plain[k]["f1"] for k in plain)
    for mode, (rows, cpu) in results.items():
        f1 = 100 * sum(r["f1"] for r in rows.values()) / len(rows)
        print(f"{mode}: F1 {f1:.1f} on {len(rows)} questions, {cpu:.0f} CPU s")
    print(f"answers changed {len(changed)}, better {better}, worse {worse}; CPU {cpu_plain / cpu_int8:.2f}x")
    print(f"predictions under {out}")


if __name__ == "__main__":
    main()
