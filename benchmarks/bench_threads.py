"""How each phase of a training step scales with intra-op threads: the default model with LoRA r 16 on every linear
layer (B initialised at random, so the adapters compute), in one process, at 1 then 2 threads (or `--threads`):

- the update's forward + backward of 4 rows of 512 tokens (the LM head on the last 64 positions of each row);
- the prefill of 16 prompts of 250-300 tokens (a Reranker call's shape);
- one greedy decoding step of those 16 rows (decoding 33 tokens minus decoding 1, so the prefill drops out).

    python benchmarks/bench_threads.py [--precision fp32|bf16-mixed] [--threads 1,2] [--compile]

`--compile`: the decoding steps run the model through `torch.compile(dynamic=True)` (compiled at the first
setting's warm-up, its seconds printed).

Run it on quiet cores: a core that another process holds makes the wider setting look worse than it is.
"""

from __future__ import annotations

import argparse
import random
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed"])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--compile", action="store_true", help="decode through torch.compile(dynamic=True)")
    args = parser.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model

    from mhgpo.model.generation import HFGenerator, SamplingParams
    from mhgpo.model.precision import autocast
    from mhgpo.model.pretrained import load_pretrained, stored_as

    loaded = load_pretrained(device="cpu")
    if args.precision == "bf16-mixed":
        stored_as(loaded.model, torch.bfloat16)  # the frozen base as training keeps it
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(loaded.model, LoraConfig(r=16, lora_alpha=32, target_modules=targets, lora_dropout=0.0))
    generator = torch.Generator().manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0.0, 0.01, generator=generator)
    rng = random.Random(0)
    rows = torch.tensor([[rng.randrange(1000, 40000) for _ in range(512)] for _ in range(4)])
    prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randrange(250, 300))] for _ in range(16)]
    decoder = HFGenerator(model, loaded.tokenizer, batch_size=16, precision=args.precision)
    decoder.eos_ids = [-1]  # no row stops early: every step decodes 16 rows
    if args.compile:
        decoder.model = torch.compile(model, dynamic=True)  # the decoding steps' forward; prefill stays eager
        started = time.perf_counter()
        decoder.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0.0))
        print(f"torch.compile: first decoding steps {time.perf_counter() - started:.0f} s")

    def forward_backward() -> None:
        model.train()
        with autocast(args.precision, "cpu"):
            logits = model(input_ids=rows, logits_to_keep=64).logits
        logits.float().logsumexp(-1).mean().backward()

    def timed(fn) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - wall, time.process_time() - cpu

    print(f"precision {args.precision}, default model, LoRA r 16")
    print(
        "| threads | forward + backward, 4 × 512 (wall s / CPU s) | prefill, 16 × ~275 (wall s) | decoding step, 16 rows (ms) |"
    )
    print("|---|---|---|---|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        forward_backward()  # warm-up: the heap, the kernels' first calls
        decoder.generate(prompts[:2], SamplingParams(max_new_tokens=2, temperature=0.0))
        update = [timed(forward_backward) for _ in range(2)]
        prefill, _ = timed(lambda: decoder.generate(prompts, SamplingParams(max_new_tokens=1, temperature=0.0)))
        both, _ = timed(lambda: decoder.generate(prompts, SamplingParams(max_new_tokens=33, temperature=0.0)))
        wall, cpu = (sum(u[i] for u in update) / len(update) for i in (0, 1))
        print(f"| {threads} | {wall:.2f} / {cpu:.2f} | {prefill:.2f} | {(both - prefill) / 32 * 1000:.0f} |")


if __name__ == "__main__":
    main()
