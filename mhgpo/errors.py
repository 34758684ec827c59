"""The error types the command line reports as one line, without a traceback."""


class InputError(ValueError):
    """Bad user input (a file, a line, a key). The message names where; the CLI prints it without a traceback."""


class RunError(RuntimeError):
    """A run that cannot go on (a full disk, ...). The message says what is kept and how to continue; the CLI
    prints it without a traceback."""


class ServiceError(RunError):
    """A service the run depends on (a retrieval server) is unreachable or answers wrongly. The message names the
    URL and what went wrong; the run stops cleanly (a training run keeps its completed steps and can be resumed)."""


class NotFinite(RunError):
    """A loss, gradient norm or trained weight that is NaN or infinite: the update is not applied and nothing is
    saved after it, so the last checkpoint stays the last good one."""


# Control characters (C0 but tab and newline, DEL, C1) and the bidirectional overrides, which can rewrite what a
# terminal shows; `printable` writes each as its escape (`\x1b`, `\u202e`).
_INVISIBLE = [*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0), 0x200E, 0x200F]
_INVISIBLE += [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]
_ESCAPES = {c: (f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}") for c in _INVISIBLE}


def printable(text: str) -> str:
    """`text` (from a service, a corpus or a file) with its control characters made visible as escapes, so that
    printing it cannot move the cursor, recolour or retitle a terminal, or hide what follows it."""
    return text.translate(_ESCAPES)
