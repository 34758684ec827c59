"""Numeric precision: the dtype each kind of weight is stored in, and the dtype the forward passes compute in.

The ``precision`` config key takes one of:

- ``fp32``: every weight, gradient and optimiser state in float32, and every forward in float32.
- ``bf16-mixed``: the weights that train (full fine-tuning: all of them; LoRA: the adapters; the critic's adapter
  and value head) and their optimiser state stay float32 (master weights); weights that never change (the frozen
  base under LoRA, which is also the reference and the critic's base; a model loaded only to evaluate) are stored
  in bfloat16, while the full fine-tuning reference copy keeps the actor's float32 so that the KL starts at 0;
  every forward (and so its backward), the reference pass, the critic and generation run under
  ``torch.autocast(bfloat16)``. Updates far below bfloat16's resolution (an Adam step of 5e-7 on a weight of 0.01)
  still land in the float32 master weights.
- ``bf16``: every weight and its optimiser state in bfloat16, no autocast. Unsafe for small learning rates: an
  update smaller than about 1/256 of a weight's magnitude rounds away (at lr 5e-7: on every weight above about
  1e-4, i.e. almost all of them).
- ``auto`` (the default): ``bf16-mixed`` on a CUDA GPU with bfloat16 support; on a CPU, ``bf16-mixed`` where the
  CPU has bfloat16 matrix instructions (AMX tiles, or AVX-512 BF16 dot products) that oneDNN may use (no
  ``ONEDNN_MAX_CPU_ISA`` below them) and :data:`AUTO_MIXED_ON_BF16_CPU` is set, else ``fp32``.

Commands print the resolved value when they start, and a run's ``config.yaml`` records it.
"""

from __future__ import annotations

import os
import sys
from contextlib import AbstractContextManager
from typing import Any

import torch

from mhgpo.config.choices import PRECISIONS

# Whether `auto` picks bf16-mixed on a CPU with bfloat16 matrix instructions. Measured on 2 cores, GEMM at the
# training shape: AMX 7.7x float32; AVX-512 BF16 (no AMX) 2.9x, a LoRA forward + backward 2.2x.
AUTO_MIXED_ON_BF16_CPU = True


def _cpu_supports(query: str) -> bool:
    probe = getattr(torch.cpu, query, None)
    if probe is None:
        return False
    try:
        return bool(probe())
    except (RuntimeError, AttributeError):  # a build without the CPU capability queries
        return False


# oneDNN's instruction sets as ONEDNN_MAX_CPU_ISA names them, each with the bits of its `dnnl_cpu_isa_t` value: a
# cap admits an instruction set when it holds all of that set's bits. bfloat16 dot products (AVX-512 BF16) need
# AVX512_CORE_BF16, AMX tiles AVX10_1_512_AMX; below them oneDNN computes bfloat16 products without those
# instructions, slower than float32 (measured on an AVX-512 BF16 CPU, GEMM at the training shape, one thread: 194
# GFLOP/s in bfloat16 uncapped, 32 capped at AVX512_CORE, 2 at AVX2, against 75 in float32).
ONEDNN_ISA_BITS = {
    "SSE41": 0x1,
    "AVX": 0x3,
    "AVX2": 0x7,
    "AVX2_VNNI": 0xF,
    "AVX2_VNNI_2": 0x1F,
    "AVX512_CORE": 0x27,
    "AVX512_CORE_VNNI": 0x67,
    "AVX512_CORE_BF16": 0xE7,
    "AVX10_1_512": 0x1EF,
    "AVX512_CORE_FP16": 0x1EF,
    "AVX10_1_512_AMX": 0xFEF,
    "AVX512_CORE_AMX": 0xFEF,
    "AVX10_1_512_AMX_FP16": 0x1FEF,
    "AVX512_CORE_AMX_FP16": 0x1FEF,
}
_NEEDS = {"AMX": ONEDNN_ISA_BITS["AVX10_1_512_AMX"], "AVX-512 BF16": ONEDNN_ISA_BITS["AVX512_CORE_BF16"]}


def onednn_isa_cap() -> tuple[str, int] | None:
    """``(variable=VALUE, bits)`` of the instruction-set cap oneDNN reads from the environment (ONEDNN_MAX_CPU_ISA,
    else DNNL_MAX_CPU_ISA), or None where no cap is set (unset, ``ALL``, ``DEFAULT``, or a name oneDNN does not
    have)."""
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        value = os.environ.get(name, "").strip()
        if value:
            bits = ONEDNN_ISA_BITS.get(value.upper())
            return (f"{name}={value}", bits) if bits is not None else None
    return None


def cpu_bf16_instructions() -> list[str]:
    """This CPU's bfloat16 matrix instructions as PyTorch detects them, best first: ``"AMX"`` (tiles),
    ``"AVX-512 BF16"`` (dot products)."""
    queries = (("AMX", "_is_amx_tile_supported"), ("AVX-512 BF16", "_is_avx512_bf16_supported"))
    return [kind for kind, query in queries if _cpu_supports(query)]


def cpu_bf16_matmul() -> str | None:
    """The best of this CPU's bfloat16 matrix instructions that oneDNN may use (see :func:`onednn_isa_cap`), or
    None."""
    cap = onednn_isa_cap()
    allowed = [k for k in cpu_bf16_instructions() if cap is None or cap[1] & _NEEDS[k] == _NEEDS[k]]
    return allowed[0] if allowed else None


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_precision(precision: str, device: Any = None) -> tuple[str, str]:
    """``(fp32 | bf16-mixed | bf16, the reason in words)`` for ``precision`` on ``device`` (default: CUDA when
    present, else CPU)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision != "auto":
        return precision, "set in the config"
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16-mixed", "auto: CUDA with bfloat16"
        return "fp32", "auto: this GPU has no bfloat16"
    if device.type == "cpu":
        found = cpu_bf16_matmul()
        if found is None:
            cap = onednn_isa_cap()
            if cap is not None and cpu_bf16_instructions():
                return "fp32", f"auto: {cap[0]} keeps oneDNN from this CPU's bfloat16 matrix instructions"
            return "fp32", "auto: this CPU has no bfloat16 matrix instructions (AMX, AVX-512 BF16)"
        if AUTO_MIXED_ON_BF16_CPU:
            return "bf16-mixed", f"auto: CPU with bfloat16 matrix instructions ({found})"
        return "fp32", "auto: fp32 on CPUs, bfloat16 instructions or not"
    return "fp32", f"auto: {device.type}"


def announce(precision: str, reason: str) -> None:
    """One line on stderr saying which precision a command runs in, and why."""
    if os.environ.get("RANK", "0") == "0":  # a data-parallel run: rank 0 says it
        print(f"mhgpo: precision {precision} ({reason})", file=sys.stderr, flush=True)


def weight_dtype(precision: str, trainable: bool) -> torch.dtype:
    """The dtype to store weights in: bfloat16 under ``bf16``, and under ``bf16-mixed`` for weights that never
    train; float32 otherwise."""
    if precision == "bf16" or (precision == "bf16-mixed" and not trainable):
        return torch.bfloat16
    return torch.float32


def autocast(precision: str, device: Any) -> AbstractContextManager:
    """``torch.autocast`` to bfloat16 under ``bf16-mixed`` (for forwards; a backward follows the forward's
    dtypes), a no-op otherwise."""
    device_type = torch.device(device).type
    return torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed")


def module_device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device
