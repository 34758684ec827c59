"""`mhgpo data split`: disjoint parts of a question file, drawn with a seed, written as the original records.

The questions the data SPEC loads (MuSiQue's unanswerable records left out) are shuffled with `numpy`'s generator
seeded by `seed`; part i takes the next `sizes[i]` of them and keeps them in file order. Each part is written as JSON
Lines in the file's own layout (`NAME.jsonl`, usable as `--data LAYOUT:DIR/NAME.jsonl`), with `split.json` saying
where they came from. The same file, sizes and seed give the same bytes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mhgpo.data.spec import question_records
from mhgpo.errors import InputError
from mhgpo.io import atomic_write_json, atomic_write_jsonl, check_outputs

DEFAULT_NAMES = ("train", "val", "test")


def split_data(
    spec: str, out: Path, sizes: list[int], seed: int = 0, names: list[str] | None = None, overwrite: bool = False
) -> dict[str, tuple[str, int]]:
    """Write the parts; return {name: (data spec of the part, number of records)}. Existing part files (and
    split.json) are refused unless `overwrite`; the source file is never written, `overwrite` or not."""
    if not sizes or any(n < 1 for n in sizes):
        raise InputError(f"--sizes: expected positive numbers of records, got {sizes}")
    if names is None:
        if len(sizes) > len(DEFAULT_NAMES):
            raise InputError(f"--names: {len(sizes)} parts need names (the defaults name {len(DEFAULT_NAMES)})")
        names = list(DEFAULT_NAMES[: len(sizes)])
    if len(names) != len(sizes) or len(set(names)) != len(names) or not all(n and "/" not in n for n in names):
        raise InputError(f"--names: expected {len(sizes)} distinct file names, got {names}")
    layout, path, records = question_records(spec)
    if sum(sizes) > len(records):
        raise InputError(f"--sizes: {sum(sizes)} records asked for, but {path} holds {len(records)} questions")
    out = Path(out)
    check_outputs([out / f"{name}.jsonl" for name in names] + [out / "split.json"], [Path(path)], overwrite)
    order = np.random.default_rng(seed).permutation(len(records))
    parts: dict[str, tuple[str, int]] = {}
    start = 0
    for name, size in zip(names, sizes):
        chosen = sorted(int(i) for i in order[start : start + size])
        start += size
        target = out / f"{name}.jsonl"
        atomic_write_jsonl(target, (records[i] for i in chosen))
        parts[name] = (f"{layout}:{target}", size)
    atomic_write_json(
        out / "split.json",
        {
            "source": str(path),
            "layout": layout,
            "seed": seed,
            "questions": len(records),
            "parts": dict(zip(names, sizes)),
        },
    )
    return parts
