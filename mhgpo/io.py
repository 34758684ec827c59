"""Small file helpers: durable atomic writes (write to a temporary name in the same folder, flush to disk, rename,
flush the folder), appends that reach the disk, JSON Lines reading that names the bad line, and the check of an
output folder before any slow work starts."""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mhgpo.errors import InputError, RunError

# a file system that cannot flush folders answers these; there is nothing to flush then (not a lost write)
_NO_DIR_SYNC = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF}


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (new names, renames) to disk. A no-op where folders cannot be opened (Windows) or
    flushed (file systems without it); any other failure (an I/O error, a full disk) raises RunError naming the
    folder: the renames just made may not survive a power cut."""
    if os.name == "nt":
        return
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError as e:
        raise RunError(f"{path}: cannot open the folder to flush it to disk ({e.strerror})") from e
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _NO_DIR_SYNC:
            raise RunError(
                f"{path}: could not flush the folder to disk ({e.strerror}); its latest files may not survive a crash"
            ) from e
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    """Write `data` to `path` (created or replaced in place) and flush it to disk."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    """Write `data` to a temporary file beside `path`, flush it to disk, rename it onto `path` and flush the
    folder: readers see the old file or the new one, never a part of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        usual_permissions(Path(tmp))  # mkstemp makes 0600 files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_text(path: Path, text: str) -> Path:
    """`atomic_write_bytes` of `text` in UTF-8."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def usual_permissions(path: Path) -> None:
    """Give a file the permissions a plain `open` would (writers that go through temporary files make 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def json_line(row: dict[str, Any]) -> str:
    return json.dumps(row, ensure_ascii=False, default=str) + "\n"


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False, default=str) + "\n")


def atomic_write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    atomic_write_text(path, "".join(json_line(r) for r in rows))


def append_text(path: Path, text: str, then: str = "") -> None:
    """Append `text` (whole lines) to `path` and flush it to disk. If the disk refuses (full, an I/O error), the
    file is cut back to its earlier lines (no part of a line stays to break the next append) and RunError names the
    file and the cause, followed by `then` (what is kept, how to continue)."""
    data = text.encode("utf-8")
    if not data:
        return
    path = Path(path)
    start = None
    try:
        with open(path, "ab") as f:
            start = f.tell()
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if start is not None:
            try:
                os.truncate(path, start)
            except OSError:
                pass  # read_jsonl leaves a last line cut short out
        raise RunError(
            f"{path}: could not append ({e.strerror or e}); the lines before are intact" + (f"; {then}" if then else "")
        ) from e


def append_jsonl(path: Path, rows: Iterable[dict[str, Any]], then: str = "") -> None:
    """Append rows to a JSON Lines file in one write and flush them to disk (:func:`append_text`)."""
    append_text(path, "".join(json_line(r) for r in rows), then)


# -------------------------------------------------------------------------- temporary folders of a command

_HOST = socket.gethostname().replace("-", "_").replace(".", "_") or "host"


def temp_path(target: Path) -> Path:
    """The temporary name beside `target` that a command writes into before renaming it onto `target`: it names
    this host and process, so that :func:`remove_stale_temps` can tell a dead command's leftovers from a live one."""
    target = Path(target)
    return target.parent / f".{target.name}.tmp-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def remove_stale_temps(target: Path, what: str) -> list[Path]:
    """Remove the temporary folders (:func:`temp_path`) beside `target` left by a command of this host that was
    killed (its process is gone), printing one line each; those of a live process, or of another host sharing the
    folder, are left alone. Returns what was removed."""
    target = Path(target)
    if not target.parent.is_dir():
        return []
    removed = []
    for p in sorted(target.parent.glob(f".{target.name}.tmp-*")):
        host, pid, *_ = p.name[len(f".{target.name}.tmp-") :].split("-") + ["", ""]
        if host != _HOST or not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
        print(f"mhgpo: removed {p}, left by an interrupted {what}", file=sys.stderr, flush=True)
    return removed


def read_small_file(path: Path, limit: int) -> str:
    """The UTF-8 text of the regular file `path` (not followed if a link, not waited on if a FIFO); InputError
    naming it for a link, another kind of file, more than `limit` bytes or bytes that are not UTF-8."""
    import stat

    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if path.is_symlink():
            raise InputError(f"{path}: is a link (only a file of its own is read)") from None
        raise InputError(f"{path}: cannot be read ({e.strerror})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise InputError(f"{path}: not a regular file")
    with os.fdopen(fd, "rb") as f:
        if info.st_size > limit:
            raise InputError(f"{path}: {info.st_size} bytes, more than the {limit} such a file holds")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise InputError(f"{path}: more than the {limit} bytes such a file holds")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (byte {e.start})") from None


def read_json(path: Path) -> Any:
    """A JSON file's content; an unreadable or invalid file raises InputError naming it (and the line)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """The rows of a JSON Lines file that a run appends to, and whether its last line was cut short (a process
    killed while appending: that line is left out). Any other bad line raises InputError naming file and line."""
    path = Path(path)
    if not path.exists():
        return [], False
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise InputError(f"{path}: cannot be read ({e.strerror})") from None
    lines = text.split("\n")
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):  # no newline after it: the write was cut short
                return rows, True
            raise InputError(f"{path}:{number}: invalid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise InputError(f"{path}:{number}: expected a JSON object")
        rows.append(row)
    return rows, False


def prepare_output_dir(path: Path, what: str = "output folder") -> Path:
    """Create the folder a command will write to (or check the existing one) before it does anything slow:
    a file in its place, a folder that cannot be created or written raise InputError naming it."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise InputError(f"{path}: exists and is not a folder (the {what})")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"{path}: cannot create the {what} ({e.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise InputError(f"{path}: the {what} is not writable")
    return path


def check_output_dir(path: Path, what: str = "output folder") -> Path:
    """Check, without creating anything, that a command will be able to create or write the folder `path` when
    its slow work is done: not a file, and its nearest existing ancestor is a writable folder."""
    path = Path(path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise InputError(f"{path}: exists and is not a folder (the {what})")
        existing = path
    else:
        existing = path.parent
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            raise InputError(f"{path}: cannot create the {what} ({existing} is not a folder)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{path}: the {what} cannot be written ({existing} is not writable)")
    return path


def check_outputs(paths: Iterable[Path], sources: Iterable[Path], overwrite: bool = False) -> None:
    """Before a command writes `paths`: none may be one of its `sources` (the files it reads), `overwrite` or not,
    and none may exist unless `overwrite` (then each is replaced atomically: a link there is replaced, not
    followed). InputError names the first offending file."""
    sources = [Path(s) for s in sources]
    for path in paths:
        path = Path(path)
        if any(_same_file(path, s) for s in sources):
            raise InputError(f"{path}: is the source file being read; pick another --out or --names")
        if (path.exists() or path.is_symlink()) and not overwrite:
            raise InputError(f"{path}: already exists; pass --overwrite to replace it, or pick another --out")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False
