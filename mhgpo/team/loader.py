"""Teams of one's own: load a `Workflow` class named `PATH.py:Class` or `module.path:Class`, resolve its config
section (`team:`), build it, and report what goes wrong in its code.

Every error names the file (and line), the class and the method, so that a mistake in a user's file reads like
any other bad input: `mhgpo: error: examples/x.py:41: MyTeam.apply: ValueError: ... (question q7, agent planner)`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mhgpo.errors import InputError
from mhgpo.model import wire
from mhgpo.team.workflow import Workflow


class WorkflowError(InputError):
    """A workflow could not be loaded or built, or one of its methods failed on a question."""


def display_path(path: str | Path | None) -> str:
    """A file path as a user would type it: relative to the working directory when inside it."""
    if path is None:
        return "<unknown file>"
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(p)


def source_file(cls: type) -> str:
    try:
        return display_path(inspect.getsourcefile(cls))
    except TypeError:  # a class defined interactively
        return f"<{cls.__module__}>"


# ----------------------------------------------------------------------------------------------- loading


_MODULES: dict[Path, Any] = {}


def _import_file(path: Path) -> Any:
    """Import a Python file as a module of its own (once per file), registered so that dataclasses and pickling
    inside it work; the module name is derived from the file's path."""
    resolved = path.resolve()
    if resolved in _MODULES:
        return _MODULES[resolved]
    name = f"mhgpo_team_{path.stem}_{hashlib.sha256(str(resolved).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise WorkflowError(f"system: {display_path(path)} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[name]
        if not isinstance(e, Exception):
            raise
        raise WorkflowError(
            f"{_where(e, resolved, display_path(path))}: importing the file failed: {_describe(e)}"
        ) from e
    _MODULES[resolved] = module
    return module


def refuse_untrusted_code(system: str, saved_in: Path, trusted: bool, command: str) -> None:
    """Refuse to continue a run or evaluation whose saved `system` is a workflow class (a Python file or module,
    imported and run) unless the caller trusts it: `--trust-code`, or the same `--system` given again. The folder
    alone never makes mhgpo import code: it may come from someone else."""
    if trusted or ":" not in system:  # mas, llm: built in
        return
    where, _, _ = system.rpartition(":")
    what = (
        f"the Python file {where}"
        if where.endswith(".py") or "/" in where or "\\" in where
        else f"the Python module {where}"
    )
    raise InputError(
        f"{saved_in}: system: {system}: continuing would import and run {what}; if you trust it, "
        f"add --trust-code (or --system {system}) to `{command} --resume`"
    )


def load_workflow_class(spec: str) -> type[Workflow]:
    """The `Workflow` subclass that `spec` names: `PATH.py:Class` (a file) or `module.path:Class` (importable)."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise InputError(f"system: expected PATH.py:Class or module.path:Class, got {spec!r}")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where).expanduser()
        if not path.is_file():
            raise InputError(f"system: {where}: file not found")
        module, shown = _import_file(path), display_path(path)
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise WorkflowError(f"system: importing module {where!r} failed: {_describe(e)}") from e
        shown = display_path(getattr(module, "__file__", None) or where)
    cls = module
    for part in name.split("."):
        cls = getattr(cls, part, None)
        if cls is None:
            found = sorted(
                k
                for k, v in vars(module).items()
                if inspect.isclass(v) and issubclass(v, Workflow) and v is not Workflow
            )
            raise InputError(f"{shown}: no class {name!r} (Workflow classes there: {', '.join(found) or 'none'})")
    if not (inspect.isclass(cls) and issubclass(cls, Workflow)):
        raise InputError(f"{shown}: {name} is not a subclass of mhgpo.team.workflow.Workflow")
    check_workflow_class(cls)
    return cls


def check_workflow_class(cls: type[Workflow]) -> None:
    """What can be checked before a rollout: concrete, names its agents, a dataclass config section."""
    where = f"{source_file(cls)}: {cls.__name__}"
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise InputError(f"{where} does not define {missing}")
    if not cls.agents or not all(isinstance(a, str) for a in cls.agents):
        raise InputError(f"{where}.agents must name the LLM agents (a tuple of strings), got {cls.agents!r}")
    overlap = set(cls.agents) & set(cls.tools)
    if overlap:
        raise InputError(f"{where}: {', '.join(sorted(overlap))} cannot be both an agent and a tool")
    config_class = cls.config_class
    if config_class is not None and not (inspect.isclass(config_class) and dataclasses.is_dataclass(config_class)):
        raise InputError(f"{where}.config_class must be a dataclass, got {config_class!r}")


def system_spec(cls: type[Workflow]) -> str:
    """How a config names `cls` so that it can be built again (config.yaml, resume): `PATH.py:Class` for a class
    of a script or of a file loaded by path, else `module.path:Class`."""
    module = cls.__module__
    if module == "__main__" or module.startswith("mhgpo_team_"):
        return f"{source_file(cls)}:{cls.__qualname__}"
    return f"{module}:{cls.__qualname__}"


# ------------------------------------------------------------------------------------------- config, build


def team_config(cls: type[Workflow], section: dict[str, Any] | None) -> Any:
    """The instance of `cls.config_class` that the `team:` section describes (defaults for the keys it leaves
    out; unknown keys rejected naming them), or None for a workflow without a config class."""
    from mhgpo.config import from_dict

    section = dict(section or {})
    if cls.config_class is None:
        if section:
            raise InputError(
                f"team: {cls.__name__} declares no config_class, so it takes no team.* keys "
                f"(got team.{sorted(section)[0]})"
            )
        return None
    return from_dict(cls.config_class, section, prefix="team.")


def team_section(cls: type[Workflow], section: dict[str, Any] | None) -> dict[str, Any]:
    """The resolved `team:` section (every key of the config class), as written to config.yaml."""
    config = team_config(cls, section)
    return {} if config is None else dataclasses.asdict(config)


def construct(cls: type[Workflow], config: Any, retriever: Callable[[], Any]) -> Workflow:
    """`cls(config=..., retriever=...)`, each argument passed when the constructor takes it; `retriever()` is
    only called (the index built or loaded) when the constructor asks for one."""
    params = inspect.signature(cls).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs: dict[str, Any] = {}
    if config is not None:
        if "config" not in params and not takes_any:
            raise InputError(
                f"{source_file(cls)}: {cls.__name__} declares config_class but its constructor "
                f"takes no `config` argument"
            )
        kwargs["config"] = config
    if "retriever" in params:
        kwargs["retriever"] = retriever()
    try:
        return cls(**kwargs)
    except Exception as e:
        raise WorkflowError(
            f"{_where(e, inspect.getsourcefile(cls), source_file(cls))}: {cls.__name__}.__init__: {_describe(e)}"
        ) from e


def require_demonstrations(source: Any) -> None:
    """A warm start (`mhgpo sft`, `warm_start.enabled`) walks the team through gold outputs: the workflow that
    `source` names (a `Team.source` of `mhgpo.team.build`: a built-in team's name, a class or an instance) must
    define `demonstration(state, agent)`; the built-in teams do."""
    cls = source if inspect.isclass(source) else type(source) if isinstance(source, Workflow) else None
    if cls is not None and cls.demonstration is Workflow.demonstration:
        raise InputError(
            f"{source_file(cls)}: {cls.__name__} defines no demonstration(state, agent), the gold "
            f"output of an agent that a warm start (mhgpo sft, warm_start.enabled) trains on"
        )


# ------------------------------------------------------------------------------------------------ failures


@dataclass
class RolloutFailure:
    """One question whose rollout failed in a workflow method (or broke the workflow's contract)."""

    question_id: str | None  # None: not one question's (e.g. `sampling`)
    workflow: str  # class name
    method: str
    where: str  # file:line of the innermost frame in the workflow's file
    error: str  # "ValueError: ..." or what went wrong
    agent: str | None = None
    traceback: str = ""

    def message(self) -> str:
        about = ([f"question {self.question_id}"] if self.question_id is not None else []) + (
            [f"agent {self.agent}"] if self.agent else []
        )
        text = f"{self.where}: {self.workflow}.{self.method}: {self.error}"
        return f"{text} ({', '.join(about)})" if about else text

    def record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


wire.register(RolloutFailure)  # (gathered from the ranks of a data-parallel run)


def failure(
    workflow: Workflow,
    method: str,
    question_id: str | None,
    agent: str | None = None,
    exc: BaseException | None = None,
    problem: str = "",
) -> RolloutFailure:
    """A `RolloutFailure` for `workflow.method` on a question: from the exception it raised, or a `problem`."""
    cls = type(workflow)
    try:
        path = inspect.getsourcefile(cls)
    except TypeError:
        path = None
    shown = source_file(cls)
    if exc is None:
        return RolloutFailure(question_id, cls.__name__, method, shown, problem, agent)
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return RolloutFailure(question_id, cls.__name__, method, _where(exc, path, shown), _describe(exc), agent, tb)


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _where(e: BaseException, path: str | Path | None, shown: str) -> str:
    """`shown:LINE` for the innermost traceback frame in `path` (a syntax error's own line), else `shown`."""
    if isinstance(e, SyntaxError) and e.lineno and path is not None and _same(e.filename, path):
        return f"{shown}:{e.lineno}"
    line = None
    if path is not None:
        for frame in traceback.extract_tb(e.__traceback__):
            if _same(frame.filename, path):
                line = frame.lineno
    return f"{shown}:{line}" if line else shown


def _same(a: str | Path | None, b: str | Path) -> bool:
    try:
        return a is not None and Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False
