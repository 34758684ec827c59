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
