"""The command line end to end on the machine's accelerator, as a user runs it: a small model initialised at random
(the default model's architecture at tiny dimensions, with the default model's tokenizer) saved as a Hugging Face
folder, then `mhgpo train` (2 steps, a checkpoint each, validation at the last; `precision auto`), `mhgpo train
--resume` to a third step, `mhgpo eval` of the trained run, `mhgpo export` of it. For each command: its exit
status, seconds and the precision it announced; then whether the run holds every step. It complements
`gpu_check.py` (speed and memory of the training step at real shapes) with what that does not exercise: the run
folder, checkpoints and resume, evaluation and export on a GPU. Writes `--out/gpu_pipeline.json`.

    bash benchmarks/gpu_check.sh --script benchmarks/gpu_pipeline.py --wheels .gpu/wheels --tokenizer .gpu/tokenizer \\
        --out $OUT
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import TINY_TOKENS, load_tokenizer, model_config, random_model  # noqa: E402  (benchmarks/ is no package)

SETTINGS = [
    "questions_per_step=2",
    "group_size=2",
    "eval_every=2",
    "val_limit=4",
    "save_every=1",
    "report_to=[]",
    *TINY_TOKENS,
]


def save_model(folder: Path, tokenizer_dir: str | None) -> None:
    import torch

    tokenizer = load_tokenizer(tokenizer_dir)
    special = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    torch.manual_seed(0)
    model = random_model(model_config("smollm2-135m", len(tokenizer), special, tiny=True), "cpu", torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def run(name: str, argv: list[str], timeout: float) -> dict[str, Any]:
    t = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "mhgpo", *argv], capture_output=True, text=True, timeout=timeout)
    lines = proc.stderr.splitlines()
    return {
        "command": "mhgpo " + " ".join(argv),
        "rc": proc.returncode,
        "seconds": time.monotonic() - t,
        "precision": next((line for line in lines if line.startswith("mhgpo: precision")), None),
        "last_lines": (proc.stdout.splitlines() + lines)[-3:] if proc.returncode else [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokenizer", help="a Hugging Face tokenizer folder (default: the default model's GGUF)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="the limit of each command")
    parser.add_argument("--deadline-s", type=float, help=argparse.SUPPRESS)  # (the wrapper's; unused here)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"commands": []}
    with tempfile.TemporaryDirectory() as tmp:
        model, run_dir = Path(tmp) / "model", Path(tmp) / "run"
        save_model(model, args.tokenizer)
        steps = [
            ("train", ["train", f"--model={model}", f"--output-dir={run_dir}", "--steps=2", *SETTINGS]),
            ("resume", ["train", "--resume", str(run_dir), "steps=3"]),
            ("eval", ["eval", f"--model={run_dir}", "--limit=4", f"--output-dir={Path(tmp) / 'eval'}"]),
            ("export", ["export", str(run_dir), f"--out={Path(tmp) / 'export'}"]),
        ]
        for name, argv in steps:
            result = run(name, argv, args.timeout_s)
            report["commands"].append({"name": name, **result})
            print(f"gpu_pipeline: {name}: rc {result['rc']}, {result['seconds']:.1f} s, {result['precision']}")
            if result["rc"]:
                break
        metrics = run_dir / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
        report["steps_logged"] = [r["step"] for r in rows]
        report["val_f1"] = [r["val/f1"] for r in rows if "val/f1" in r]
        report["checkpoints"] = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
        report["ok"] = all(c["rc"] == 0 for c in report["commands"]) and report["steps_logged"] == [1, 2, 3]
    (out / "gpu_pipeline.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
