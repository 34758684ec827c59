"""The result cache: one JSON per (row, seed) in a data folder of the output folder, written atomically, with the
settings it ran under.

OUT/DATA/ (DATA: `synthetic`, or the kind of `--data` and a hash of both data specs) holds `settings.json` (the
settings its first run pinned: every result in it is comparable with the others), `ROW-seedS.json` per finished
(row, seed), `runs/ROW-seedS/` the trained run (or the evaluation) it came from, kept for later evaluations,
`warm_start-...-seedS-HASH/` the warm starts, `logs/` and `.locks/`. A result file that is missing or unreadable (cut
short) is run again; one that ran under other settings stops the run. Results of the earlier comparison scripts,
whose rows were named `warm+rr@reward.aggr=max` and the like, are read under their rows' names here (`LEGACY_ROWS`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mhgpo.config.load import shown
from mhgpo.errors import InputError
from mhgpo.experiments.claims import ROLES, oracle_key
from mhgpo.io import atomic_write_json, read_small_file

# What a finished result must hold; a file without them (or not JSON) was cut short and is run again.
RESULT_KEYS = ("row", "seed", "steps", "val_f1", "val_acc", "settings")
SETTINGS = "settings.json"
RUNS = "runs"  # OUT/DATA/runs/ROW-seedS: a row's run folder
MARKER = "experiment.json"  # in a run or warm start folder the harness made: its result

# The rows of the earlier comparison scripts (`[warm+]ALGO[+OPTION][@key=value,...]`) by their names here.
LEGACY_ROWS = {
    "untrained": "untrained",
    "warm": "warm",
    "warm@system=llm": "warm_llm",
    **{f"warm+{s}": f"warm_{s}" for s in ("rr", "fof", "is", "fof_os", "mappo", "grpo")},
    **{f"warm+{s}@reward.aggr={a}": f"warm_{s}_aggr_{a}" for s in ("rr", "fof_os") for a in ("max", "min", "rand")},
    **{f"warm+{s}@reward.penalties=false": f"warm_{s}_final_only" for s in ("rr", "mappo")},
    **{f"warm+fof@train_roles=[{r}]": f"warm_fof_only_{r}" for r in ROLES},
    **{f"warm+fof@frozen_roles=[{r}]": f"warm_fof_freeze_{r}" for r in ROLES},
    "warm+rr@advantage=agent": "warm_rr_groups_agent",
    "warm+rr@advantage=prompt_agent_turn": "warm_rr_groups_prompt_agent_turn",
    "warm+rr@budget=30,train_roles=[reranker]": "warm_rr_reranker_30min",
    "warm+rr@budget=30": "warm_rr_30min",
    "warm+rr+per_role": "warm_rr_per_role",
    "warm+rr+filter": "warm_rr_filter",
}


def settings_of(
    minutes: float, clock: str, val_limit: int, overrides: list[str], scale: str = "demo", val_every: int | None = None
) -> dict:
    """What a result depends on beyond its row and seed (a rerun may reuse it only under the same). The demo scale
    and no `val_every` (a validation at the last step only) are left out, as the earlier results have them."""
    settings = {"minutes": minutes, "clock": clock, "val_limit": val_limit, "overrides": list(overrides)}
    if val_every:
        settings["val_every"] = val_every
    return settings if scale == "demo" else {**settings, "scale": scale}


SERVICE_KEY = "retrieval.retriever"  # the one key whose value may be a URL with a password


def recorded_overrides(overrides: list[str]) -> list[str]:
    """The overrides as settings, results, job command lines and the page hold them: the retrieval service URL's
    userinfo redacted (`user:***@`), kept for this process's jobs (:func:`service_env`); a URL with a password
    under another key is refused (nothing would read it back)."""
    from mhgpo.config.choices import redact_text, split_userinfo
    from mhgpo.config.eval import keep_service_password

    out = []
    for item in overrides:
        key, sep, value = item.partition("=")
        userinfo, _, shown = split_userinfo(value.strip())
        if not sep or not userinfo or shown == value.strip():
            out.append(item)
        elif key.strip() == SERVICE_KEY:
            out.append(f"{key}={keep_service_password(value.strip())}")
        else:
            raise InputError(
                f"{key.strip()}: {redact_text(value.strip())} carries a password, which the results would record; "
                f"only {SERVICE_KEY} takes one"
            )
    return out


def service_env(overrides: list[str]) -> dict[str, str]:
    """The environment that gives a job the retrieval service's password that :func:`recorded_overrides` redacted
    (`$MHGPO_RETRIEVER_AUTH`: not on its command line, which other users can read)."""
    from mhgpo.config.eval import AUTH_ENV, kept_userinfo

    for item in overrides:
        key, _, value = item.partition("=")
        if key.strip() == SERVICE_KEY and (userinfo := kept_userinfo(value.strip())):
            return {AUTH_ENV: userinfo}
    return {}


def result_path(folder: Path, key: str, seed: int) -> Path:
    name = key.replace("/", "_").replace("@", "__").replace(",", "_")
    return Path(folder) / f"{name}-seed{seed}.json"


def run_folder(folder: Path, key: str, seed: int) -> Path:
    return Path(folder) / RUNS / result_path(Path(), key, seed).stem


MAX_RESULT_BYTES = 64 << 20  # a result (its per-step metrics and per-question scores included) is far smaller


def read_result(path: Path) -> dict | None:
    """The finished result in `path`, or None when it is missing, unreadable, cut short or malformed
    (:func:`inspect_result` says why)."""
    return inspect_result(path)[0]


def inspect_result(path: Path) -> tuple[dict | None, str | None]:
    """(the finished result in `path`, None) or (None, why not): missing, a link or not a regular file, too large,
    not UTF-8, not JSON (cut short), a key given twice, a key missing or of the wrong type."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return None, "missing"
    try:
        text = read_small_file(path, MAX_RESULT_BYTES)
        result = json.loads(text, object_pairs_hook=_unique)
    except InputError as e:
        return None, str(e).removeprefix(f"{path}: ")
    except json.JSONDecodeError as e:
        return None, f"not JSON at line {e.lineno} ({e.msg}; cut short?)"
    except RecursionError:
        return None, "nested too deeply"
    problem = result_problem(result)
    if (
        problem is None
        and result["row"] != "warm_start"
        and result_path(path.parent, result["row"], result["seed"]) != path
    ):
        problem = f"it holds {shown(result['row'])} seed {result['seed']}, which is not what its name says"
    return (None, problem) if problem else (result, None)


def _unique(pairs: list[tuple[str, Any]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) < len(keys):
        raise InputError(f"the key {shown(next(k for k in keys if keys.count(k) > 1))} given twice")
    return dict(pairs)


def is_number(value: Any) -> bool:
    """A JSON number (not a boolean)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_count(value: Any) -> bool:
    """A whole number ≥ 0 (not a boolean)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _settings_ok(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and is_number(value.get("minutes"))
        and isinstance(value.get("clock"), str)
        and is_count(value.get("val_limit"))
        and isinstance(value.get("overrides"), list)
        and all(isinstance(o, str) for o in value["overrides"])
        and isinstance(value.get("scale", ""), str)
    )


def _ood_ok(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(entry, dict) and isinstance(entry.get("data"), str) and is_number(entry.get("f1"))
        for entry in value.values()
    )


def _questions_ok(value: Any) -> bool:
    """Per-question scores: a list of {id: str, f1: number, ...}."""
    return isinstance(value, list) and all(
        isinstance(q, dict) and isinstance(q.get("id"), str) and is_number(q.get("f1")) for q in value
    )


def _curve_ok(value: Any) -> bool:
    """A learning curve: a non-empty list of {step, cpu_minutes, f1, em, acc}, all numbers."""
    keys = ("step", "cpu_minutes", "f1", "em", "acc")
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(p, dict) and all(is_number(p.get(k)) for k in keys) for p in value)
    )


# What each key of a result must hold (those a result may lack: when it has them).
RESULT_TYPES: dict[str, tuple[Any, str]] = {
    "row": (lambda v: isinstance(v, str) and 0 < len(v) <= 200, "a row name"),
    "seed": (lambda v: is_count(v) and v <= 2**32 - 1, "a seed"),
    "steps": (is_count, "a count"),
    "settings": (_settings_ok, "the settings (minutes, clock, val_limit, overrides)"),
    **{k: (is_number, "a number") for k in ("val_f1", "val_acc", "val_em", "llm_calls", "budget_minutes_used")},
    **{k: (is_count, "a count") for k in ("val_n", "questions_per_step")},
    **{k: (lambda v: v is None or is_number(v), "a number or null") for k in ("peak_mb", "budget_minutes")},
    **{k: (lambda v: v is None or is_number(v), "a number or null") for k in ("recall_retrieved", "recall_shown")},
    "machine": (
        lambda v: isinstance(v, dict) and all(isinstance(x, (str, int, type(None))) for x in v.values()),
        "a machine",
    ),
    "steps_metrics": (
        lambda v: isinstance(v, list) and all(isinstance(m, dict) and all(map(is_number, m.values())) for m in v),
        "a list of per-step metrics",
    ),
    "ood": (lambda v: v is None or _ood_ok(v), "evaluations by name, each with its data and f1"),
    "overrides": (lambda v: isinstance(v, dict), "a mapping"),
    "steps_of": (lambda v: isinstance(v, str), "a row name"),
    **{k: (_questions_ok, "a list of per-question scores") for k in ("val_questions", "start_questions")},
    "val_curve": (_curve_ok, "a learning curve (points of step, cpu_minutes, f1, em, acc)"),
    "start": (lambda v: isinstance(v, dict) and v.get("healthy") in (True, False, None), "a curve's start"),
    "healthy": (lambda v: v in (True, False, None), "true, false or null"),
}


def result_problem(result: Any) -> str | None:
    """Why `result` is not a finished result (a key missing: cut short; a key of the wrong type), or None."""
    if not isinstance(result, dict):
        return "not a JSON object"
    missing = [k for k in RESULT_KEYS if k not in result]
    if missing:
        return f"no {missing[0]!r} (cut short?)"
    for key, (ok, what) in RESULT_TYPES.items():
        if key in result and not ok(result[key]):
            return f"{key}: expected {what}, got {shown(result[key])}"
    return None


def load_result(path: Path, settings: dict) -> dict | None:
    """:func:`read_result`; one that ran under other settings stops the run (its numbers would be mixed with
    these)."""
    result = read_result(path)
    if result is not None and result["settings"] != settings:
        raise InputError(
            f"{path}: ran with {json.dumps(result['settings'])}, not {json.dumps(settings)}; use another --out "
            f"(or move it away)"
        )
    return result


def legacy_names(key: str) -> list[str]:
    return [old for old, new in LEGACY_ROWS.items() if new == key and old != key]


def find_result(folder: Path, key: str, seed: int, settings: dict) -> dict | None:
    """The finished result of (`key`, `seed`) in the data folder: its own file, or the earlier scripts' under the
    row's old name (read under `key`)."""
    for name in [key, *legacy_names(key)]:
        result = load_result(result_path(folder, name, seed), settings)
        if result is not None:
            return {**result, "row": key}
    return None


def pinned_settings(folder: Path) -> dict | None:
    """The settings pinned in a data folder (None when none are); InputError naming the file when it is not a
    settings file."""
    pinned = Path(folder) / SETTINGS
    if not pinned.exists() and not pinned.is_symlink():
        return None
    text = read_small_file(pinned, 1 << 20)
    try:
        found = json.loads(text, object_pairs_hook=_unique)
    except (json.JSONDecodeError, RecursionError, InputError):  # (InputError: a key twice)
        found = None
    if not _settings_ok(found):
        raise InputError(f"{pinned}: not the settings of mhgpo reproduce; move it away or use another --out")
    return found


def pin_settings(folder: Path, settings: dict) -> None:
    """The data folder's settings: those of its first run; other settings are refused."""
    pinned = Path(folder) / SETTINGS
    found = pinned_settings(folder)
    if found is not None:
        if found != settings:
            raise InputError(
                f"{folder} holds results run with {json.dumps(found)}, not {json.dumps(settings)}; use another --out"
            )
    atomic_write_json(pinned, settings)


def unpin_unused(folder: Path) -> None:
    """Remove the data folder's pinned settings when it holds no finished result (a run whose every job failed:
    its settings bind nothing)."""
    if not any(read_result(p) is not None for p in Path(folder).glob("*-seed*.json")):
        (Path(folder) / SETTINGS).unlink(missing_ok=True)


def collect(folder: Path) -> dict[str, dict[int, dict]]:
    """{row: {seed: result}} of the finished results in a data folder run under its pinned settings (those of its
    first result when none are pinned; the earlier scripts' rows under their names here). A file that is not a
    finished result, or that ran under other settings, is left out with a line naming it."""
    by_row: dict[str, dict[int, dict]] = {}
    try:
        settings = pinned_settings(folder)
    except InputError as e:
        print(f"mhgpo: left out {folder}: {e}", file=sys.stderr, flush=True)
        return {}
    for path in sorted(Path(folder).glob("*-seed*.json")):
        res, why = inspect_result(path)
        if res is None:
            if why != "missing":
                print(f"mhgpo: left out {path}: {why}", file=sys.stderr, flush=True)
            continue
        if res["row"] == "warm_start":
            continue
        settings = settings if settings is not None else res["settings"]
        if res["settings"] != settings:
            print(f"mhgpo: left out {path}: it ran under other settings than {folder}'s", file=sys.stderr, flush=True)
            continue
        key = LEGACY_ROWS.get(res["row"], res["row"])
        seeds = by_row.setdefault(key, {})
        if res["row"] == key or res["seed"] not in seeds:  # a result under the row's own name comes first
            seeds[res["seed"]] = {**res, "row": key}
    return by_row


def data_tag(data: str, val_data: str | None) -> str:
    """OUT's folder for the results on one data set: `synthetic`, or the kind of `data` and a hash of both specs."""
    if data == "synthetic" and val_data is None:
        return "synthetic"
    digest = hashlib.sha1(f"{data}|{val_data}".encode()).hexdigest()[:8]
    kind = "".join(c if c.isascii() and (c.isalnum() or c in "_-") else "_" for c in data.partition(":")[0])[:40]
    return f"{kind}-{digest}"  # (a name, never a path: a spec without its kind is a path, `../x.jsonl`)


def data_folders(out: Path) -> list[Path]:
    """OUT's data folders (those a run has pinned its settings in), the synthetic world's first."""
    out = Path(out)
    found = [p for p in out.iterdir() if not p.is_symlink() and (p / SETTINGS).is_file()] if out.is_dir() else []
    return sorted(found, key=lambda p: (p.name != "synthetic", p.name))


def data_overrides(data: str, val_data: str | None) -> list[str]:
    """`--data synthetic` (the scale's data) or `--data TRAIN --val-data VAL`."""
    if data == "synthetic" and val_data is None:
        return []
    if val_data is None:
        raise InputError(
            f"--data {data}: give the validation questions too (--val-data SPEC; `mhgpo data split` "
            "cuts disjoint parts of one file)"
        )
    return [f"data={data}", f"val_data={val_data}"]


def data_specs(overrides: list[str]) -> dict[str, str]:
    """The `data` and `val_data` of a result's settings (empty for the synthetic world)."""
    return {k: v for k, _, v in (kv.partition("=") for kv in overrides) if k in ("data", "val_data")}


def machine() -> dict:
    """The CPU model and core count (and the GPU, if any) a result was measured on."""
    import torch

    model = "unknown"
    if Path("/proc/cpuinfo").is_file():
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), model)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": model, "cores": os.cpu_count(), "gpu": gpu}


@contextmanager
def waiting_lock(folder: Path, name: str) -> Iterator[None]:
    """Hold `folder/.locks/NAME.lock` (waiting for another process that holds it): one process at a time trains a
    warm start or a (row, seed). A link in the lock's place is refused, not followed."""
    locks = Path(folder) / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    path = locks / f"{name}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise InputError(f"{path}: cannot open the lock ({e.strerror}; a link is refused)") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when the file closes, or when this process ends
        yield
    finally:
        os.close(fd)


def open_log(path: Path):
    """A job's log, appended to; a link in its place is refused, not written through."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise InputError(f"{path}: cannot open the log ({e.strerror}; a link is refused)") from None
    return os.fdopen(fd, "a", encoding="utf-8")


def is_oracle(key: str) -> bool:
    return key.startswith(oracle_key(""))
