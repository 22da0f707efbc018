"""The README's flag tables list exactly the flags the CLI defines, each under the commands that take it.

Every table whose header is `| flag | commands | meaning |` counts: the flags are the `-x` / `--xxx` words of the
first cell, the commands the comma-separated names of the second. The CLI's side is read from the argparse
subparsers of `tandem.cli.main.build_parser` (`-h/--help` excluded), so a flag added, renamed or dropped on either
side fails here with the flags that differ.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

from tandem.cli.main import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"
HEADER = ["flag", "commands", "meaning"]
FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def flag_rows(text: str) -> Iterator[tuple[str, list[str]]]:
    """(line, cells) of every row of the README's flag tables (those under HEADER), separator rows left out."""
    in_table = False
    for line in text.splitlines():
        if not line.lstrip().startswith("|"):
            in_table = False
            continue
        cells = _cells(line)
        if cells == HEADER:
            in_table = True
        elif in_table and not set(line.replace("|", "").strip()) <= set("-: "):
            yield line, cells


def readme_flags(text: str) -> dict[str, set[str]]:
    """command -> the flags the README's flag tables give it."""
    by_command: dict[str, set[str]] = {}
    for line, cells in flag_rows(text):
        flags = FLAG.findall(cells[0].replace("`", " "))
        assert flags, f"README flag table row without a flag: {line!r}"
        for command in (c.strip() for c in cells[1].split(",")):
            by_command.setdefault(command, set()).update(flags)
    return by_command


def cli_flags() -> dict[str, set[str]]:
    """command -> every option string its argparse subparser defines, help excluded."""
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {
        name: {
            s
            for action in sub._actions
            if not isinstance(action, argparse._HelpAction)
            for s in action.option_strings
        }
        for name, sub in subs.choices.items()
    }


def test_readme_flag_tables_match_the_cli() -> None:
    documented = readme_flags(README.read_text(encoding="utf-8"))
    defined = cli_flags()
    problems = []
    for command in sorted(set(documented) | set(defined)):
        missing = sorted(defined.get(command, set()) - documented.get(command, set()))
        extra = sorted(documented.get(command, set()) - defined.get(command, set()))
        if command not in defined:
            problems.append(f"README names a command the CLI does not have: {command} ({', '.join(extra)})")
            continue
        if missing:
            problems.append(f"tandem {command}: defined by the CLI, missing from the README: {', '.join(missing)}")
        if extra:
            problems.append(f"tandem {command}: in the README, not defined by the CLI: {', '.join(extra)}")
    assert not problems, "README.md's flag tables and src/tandem/cli/main.py differ:\n" + "\n".join(problems)


def test_readme_flag_cells_are_one_sentence() -> None:
    """A flag's meaning is one sentence; its details belong in docs/FLAGS.md."""
    long = []
    for _, cells in flag_rows(README.read_text(encoding="utf-8")):
        if len(cells) == 3:
            meaning = re.sub(r"`[^`]*`", "x", cells[2])  # code spans may hold dots
            sentences = [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", meaning) if s.strip()]
            if len(sentences) > 1 or len(cells[2]) > 200:
                long.append(cells[0])
    assert not long, f"README flag cells longer than one sentence (move the details to docs/FLAGS.md): {long}"


def test_readme_names_no_file_outside_the_repository() -> None:
    text = README.read_text(encoding="utf-8")
    assert "../" not in text, "README.md points outside the repository"
