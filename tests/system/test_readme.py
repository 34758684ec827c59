"""The `mhgpo` commands in the README's (and the docs') shell blocks parse with the real parser and their `key=value`
overrides are config keys, the README stays short, and every relative link in the README and docs/ points at a
file (and heading) that exists. Fast: nothing is executed, no model is loaded."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from mhgpo.cli import train as train_cli
from mhgpo.cli.common import flag_overrides
from mhgpo.cli.main import _eval_config, build_parser
from mhgpo.config import SFTConfig, TrainConfig, demo_config_path, load_config
from mhgpo.errors import InputError

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
MAX_README_LINES = 200

FENCE = re.compile(r"^[ ]*```([\w-]*)[ \t]*\n(.*?)^[ ]*```", re.M | re.S)
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
LINK_DEF = re.compile(r"^ {0,3}\[([^\]\n]+)\]:[ \t]*(\S+)", re.M)  # a reference link's target: [name]: TARGET
LINK_REF = re.compile(r"(?<!!)\[([^\]\n]+)\]\[([^\]\n]*)\]")  # [text][name], or [name][]
CODE_SPAN = re.compile(r"`[^`\n]*`")
SHELL_LANGS = {"bash", "sh", "shell", "console"}  # a block without a language is not read as commands


def shell_commands(markdown: str) -> list[str]:
    """Every simple command in the markdown's shell code blocks: continuation lines joined, comments dropped,
    `cmd1 && cmd2`, `;` and `|` split into their commands."""
    commands = []
    for lang, body in FENCE.findall(markdown):
        if lang not in SHELL_LANGS:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            current: list[str] = []
            try:
                tokens = list(lexer)
            except ValueError as e:
                raise ValueError(f"{line!r}: {e}") from None
            for token in tokens:
                if token and set(token) <= set(";&|"):
                    if current:
                        commands.append(shlex.join(current))
                    current = []
                else:
                    current.append(token)
            if current:
                commands.append(shlex.join(current))
    return commands


def mhgpo_argv(command: str) -> list[str] | None:
    """The arguments after `mhgpo` (`mhgpo ...`, `.venv/bin/mhgpo ...`, `python -m mhgpo ...`), else None."""
    words = shlex.split(command)
    if not words:
        return None
    if words[0] == "mhgpo" or words[0].endswith("/mhgpo"):
        return words[1:]
    if "python" in Path(words[0]).name and words[1:3] == ["-m", "mhgpo"]:
        return words[3:]
    return None


class ParseError(Exception):
    pass


def parse_cli(argv: list[str]) -> argparse.Namespace:
    """Parse `argv` as `mhgpo.cli.main.main` does, without running the command; raises ParseError where `main` would
    stop with a usage error. For `train`, `demo`, `sft` and `eval` the flags and `key=value` overrides are also
    resolved into their config as the command resolves them (unknown keys and bad values are refused there), which
    reads a `--config` file but runs nothing."""
    parser = build_parser()

    def fail(message: str):
        raise ParseError(message)

    for p in _all_parsers(parser):
        p.error = fail  # type: ignore[method-assign]
    argv = [a for a in argv if a != "--debug"]
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = list(args.overrides) + extra
        else:
            fail(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "train" and not args.resume:
        train_cli.train_config(args)
    elif args.command == "demo":
        load_config(TrainConfig, args.config or demo_config_path(), train_cli._overrides(args))
    elif args.command == "eval" and not args.resume:
        _eval_config(args)
    elif args.command == "reproduce":  # the rows it names are rows of the table
        from mhgpo.cli.reproduce import _keys
        from mhgpo.config.rows import load_rows
        from mhgpo.experiments.claims import split_key

        table = load_rows(args.rows_file)
        for key in _keys(args)[0]:
            for row in split_key(key):
                if row is not None:
                    table.row(row)
    elif args.command == "sft" and not args.resume:
        load_config(SFTConfig, args.config, flag_overrides(args, train_cli.SFT_FLAGS) + list(args.overrides))
    return args


def _all_parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


README_COMMANDS = [c for c in shell_commands(README.read_text(encoding="utf-8")) if mhgpo_argv(c) is not None]


def test_readme_shows_every_command():
    """The README has one line per command of the CLI, and the test found them (a change to the code-block format
    that hid them from `shell_commands` would otherwise pass unnoticed)."""
    shown = {
        tuple(mhgpo_argv(c)[:2]) if mhgpo_argv(c)[0] in ("data", "index") else (mhgpo_argv(c)[0],)
        for c in README_COMMANDS
    }
    expected = {
        ("demo",),
        ("train",),
        ("eval",),
        ("ask",),
        ("sft",),
        ("index", "build"),
        ("eval-retrieval",),
        ("data", "synth"),
        ("data", "split"),
        ("export",),
        ("report",),
        ("reproduce",),
    }
    assert expected <= shown, sorted(expected - shown)


@pytest.mark.parametrize("command", README_COMMANDS, ids=README_COMMANDS)
def test_readme_command_parses(command, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)  # `--config configs/...` and `--system examples/...` are relative to the repository
    monkeypatch.setenv("MHGPO_CACHE", str(tmp_path))
    parse_cli(mhgpo_argv(command))


DOC_PAGES = [*DOCS, REPO / "experiments" / "README.md"]
DOC_COMMANDS = [
    f"{page.name}: {c}"
    for page in DOC_PAGES
    for c in shell_commands(page.read_text(encoding="utf-8"))
    if mhgpo_argv(c) is not None and "$" not in c
]  # a loop's `$team` is filled in only by the shell


@pytest.mark.parametrize("command", DOC_COMMANDS, ids=DOC_COMMANDS)
def test_docs_command_parses(command, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("MHGPO_CACHE", str(tmp_path))
    parse_cli(mhgpo_argv(command.split(": ", 1)[1]))


BROKEN = [
    "mhgpo evaluate --limit 5",  # no such command
    "mhgpo eval --limit five",  # not an int
    "mhgpo train --algo dpo",  # not a choice
    "mhgpo eval --no-such-flag 3",
    "mhgpo export runs/demo",  # --out is required
    "mhgpo train --steps 2 optim.no_such_key=1",  # an override the config does not have
    "mhgpo eval --limit 0",  # a count below 1
    "mhgpo train --config experiments/rows.yaml:no_such_row --scale demo",
    "mhgpo train --config experiments/rows.yaml:mappo --scale huge",
    "mhgpo reproduce --rows warm,warm+rr --seeds 0",  # the earlier scripts' row names are no rows
]


@pytest.mark.parametrize("broken", BROKEN, ids=BROKEN)
def test_a_command_that_does_not_parse_is_caught(broken, monkeypatch, tmp_path):
    """The check above can fail: each of these stops `mhgpo` with a usage or config error."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("MHGPO_CACHE", str(tmp_path))
    with pytest.raises((ParseError, InputError)):  # a usage error, or a config error naming the key
        parse_cli(mhgpo_argv(broken))


def test_shell_commands_splits_and_joins():
    text = "```bash\nbash scripts/setup.sh && .venv/bin/mhgpo demo   # comment\nmhgpo eval \\\n  --limit 3\n```\n"
    commands = shell_commands(text)
    assert commands == ["bash scripts/setup.sh", ".venv/bin/mhgpo demo", "mhgpo eval --limit 3"]
    assert [mhgpo_argv(c) for c in commands] == [None, ["demo"], ["eval", "--limit", "3"]]


def test_readme_python_compiles():
    blocks = [body for lang, body in FENCE.findall(README.read_text(encoding="utf-8")) if lang == "python"]
    assert blocks
    for body in blocks:
        compile(body, "README.md", "exec")


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; the details belong in docs/"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (underscores kept), spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {slug(m) for m in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M)}


LINKED_PAGES = [README, *DOCS, REPO / "experiments" / "README.md", REPO / "CHANGELOG.md"]


def link_targets(text: str) -> list[str]:
    """The targets of the inline links `[text](TARGET)` and of the reference definitions `[name]: TARGET`."""
    return LINK.findall(text) + [target for _, target in LINK_DEF.findall(text)]


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_point_at_files(page):
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    broken = []
    for target in link_targets(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        path = (page.parent / file_part).resolve() if file_part else page
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.name}: {broken}"


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_reference_links_are_defined(page):
    """Every `[text][name]` has its `[name]: TARGET` on the page (GitHub shows an undefined one as plain text)."""
    text = CODE_SPAN.sub("", FENCE.sub("", page.read_text(encoding="utf-8")))
    defined = {name.lower() for name, _ in LINK_DEF.findall(text)}
    used = {(name or label).lower() for label, name in LINK_REF.findall(text)}
    assert used <= defined, f"{page.name}: undefined references {sorted(used - defined)}"


def test_reference_links_are_read():
    text = "See [the table][algo] and [oracles][].\n\n[algo]: reproduction.md#algorithms\n[oracles]: #x\n"
    assert link_targets(text) == ["reproduction.md#algorithms", "#x"]
    assert LINK_REF.findall(text) == [("the table", "algo"), ("oracles", "")]
