"""Who may write into a run (or evaluation) directory: one process at a time, holding `mhgpo.lock`.

The lock file holds the owner's pid, host, start time and command. A second run into the same folder stops with a
message naming the owner. A lock left by a process that ended without releasing it (killed, or the machine
restarted) is taken over with a message naming that process.
`train` also refuses a folder that is not empty (it says what is in it), so a run never mixes with or overwrites
another one: continuing a run is `--resume`.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from mhgpo.errors import InputError
from mhgpo.io import fsync_dir

LOCK_FILE = "mhgpo.lock"


def _describe(owner: dict[str, Any]) -> str:
    if not owner.get("pid"):
        return "another mhgpo process (starting)"
    when = owner.get("started")
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) if isinstance(when, (int, float)) else "?"
    return f"process {owner.get('pid')} on {owner.get('host')} (mhgpo {owner.get('command', '?')}, since {stamp})"


class RunLock:
    """`with RunLock(folder, "train"):` holds `folder/mhgpo.lock` (creating the folder) until the block ends.

    The exclusion itself is an advisory lock (`flock`) on the file, which the system drops when its process
    ends however it ends; the file's content (pid, host, start, command) names the owner in messages and, found
    without its lock, tells that a run died holding the folder."""

    def __init__(self, folder: Path, command: str = ""):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self.command = command or " ".join(sys.argv[1:2]) or "python"
        self.created_folder = False
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        if self.folder.exists() and not self.folder.is_dir():
            raise InputError(f"{self.folder}: exists and is not a folder")
        if not self.folder.exists():
            try:
                self.folder.mkdir(parents=True)
                self.created_folder = True
            except FileExistsError:
                pass
            except OSError as e:
                raise InputError(f"{self.folder}: cannot create the folder ({e.strerror})") from None
        for _attempt in range(5):
            if self.path.is_symlink():
                raise InputError(
                    f"{self.path}: is a symbolic link; mhgpo writes its lock only into a regular file "
                    f"(remove the link, or pick another folder)"
                )
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError as e:
                raise InputError(f"{self.path}: cannot write the lock file ({e.strerror})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                owner = _read_owner(fd)
                os.close(fd)
                raise InputError(
                    f"{self.folder} is in use by {_describe(owner)}; wait for it to finish or pick another folder"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # released and removed by its owner meanwhile: lock the new file instead
                os.close(fd)
                continue
            previous = _read_owner(fd)
            if previous:
                print(
                    f"mhgpo: taking over {self.path}, left by {_describe(previous)}, which ended without releasing it",
                    file=sys.stderr,
                    flush=True,
                )
            me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "command": self.command}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
            os.fsync(fd)
            fsync_dir(self.folder)
            self._fd = fd
            return self
        raise InputError(f"{self.path}: could not take the lock (other processes keep taking it)")

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        self.path.unlink(missing_ok=True)  # while still locked: no one else can hold this file now
        os.close(fd)
        if self.created_folder:
            try:
                self.folder.rmdir()  # nothing was written: leave no empty folder behind
            except OSError:
                pass

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _read_owner(fd: int) -> dict[str, Any]:
    try:
        owner = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace") or "{}")
    except (OSError, ValueError):
        return {"pid": "?", "host": "?"}
    return owner if isinstance(owner, dict) else {"pid": "?", "host": "?"}


def contents(folder: Path, limit: int = 6) -> str:
    """What a folder holds, in a few words: `config.yaml, metrics.jsonl (10 lines), checkpoints/ (step_8, ...)`."""
    items = []
    entries = sorted(p for p in Path(folder).iterdir() if p.name != LOCK_FILE)
    for p in entries[:limit]:
        if p.is_dir():
            children = sorted(c.name for c in p.iterdir())
            shown = ", ".join(children[:3]) + (", ..." if len(children) > 3 else "")
            items.append(f"{p.name}/ ({shown or 'empty'})")
        elif p.suffix == ".jsonl":
            try:
                with p.open("rb") as f:
                    n = sum(1 for _ in f)
                items.append(f"{p.name} ({n} line{'' if n == 1 else 's'})")
            except OSError:
                items.append(p.name)
        else:
            items.append(p.name)
    if len(entries) > limit:
        items.append(f"and {len(entries) - limit} more")
    return ", ".join(items)


def require_empty_run_dir(folder: Path, flag: str = "--output-dir") -> None:
    """A new run writes only into an empty (or new) folder; otherwise say what is there and what to do."""
    from mhgpo.model.checkpoint import list_checkpoints

    folder = Path(folder)
    if not folder.exists():
        return
    if not folder.is_dir():
        raise InputError(f"{folder}: exists and is not a folder")
    if not any(p.name != LOCK_FILE for p in folder.iterdir()):
        return
    held = contents(folder)
    if list_checkpoints(folder) and (folder / "config.yaml").is_file():
        raise InputError(
            f"{folder} already holds a run ({held}); continue it with: mhgpo train --resume {folder}, "
            f"or pick another {flag}"
        )
    raise InputError(f"{folder} is not empty ({held}) and holds no run to resume; pick another {flag}")


# Folders that a tracker of `report_to` keeps in a run and writes itself (W&B links its own latest logs there); a
# link as the folder itself is still refused.
TRACKER_DIRS = ("wandb",)


def refuse_links(folder: Path, names: tuple[str, ...] | None = None) -> None:
    """Raise InputError naming the first link inside `folder` (at any depth; or only among `names` in it): a run or
    evaluation folder that mhgpo writes into again (`--resume`) holds only what mhgpo made, and a link planted there
    (`metrics.jsonl`, `checkpoints/`, `rollouts/`, ...) would make it write outside the folder."""
    folder = Path(folder)
    walk = [(str(folder), list(names), [])] if names is not None else os.walk(folder)
    for root, dirs, files in walk:  # (os.walk lists links to folders in `dirs` and does not enter them)
        if Path(root) == folder and names is None:
            dirs[:] = [d for d in dirs if d not in TRACKER_DIRS or (folder / d).is_symlink()]
        for name in sorted(dirs + files):
            path = Path(root) / name
            if path.is_symlink():
                raise InputError(
                    f"{path}: is a link; a folder that mhgpo continues holds no links (remove it, or "
                    f"copy the folder without links)"
                )
