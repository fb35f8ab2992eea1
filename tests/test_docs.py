"""The README and docs/ as a reader follows them: every relative link leads to a file (and a
heading, where it names one), and every `kvmesh` command line they quote is one the CLI takes:
its subcommands exist and each option it gives is in that subcommand's own --help."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from kvmesh.main import cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?$(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`(?:\.venv/bin/)?(kvmesh [^`]+)`")
OPTION = re.compile(r"^--[a-z][a-z0-9-]*")


def anchor(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_leads_somewhere(page: Path) -> None:
    broken = []
    for target in links(page):
        path, _, heading = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif heading and file.suffix == ".md" and heading not in anchors(file):
            broken.append(f"{target}: no such heading in {file.name}")
    assert not broken, f"{page.name}: {broken}"


def commands(page: Path) -> list[str]:
    """The `kvmesh ...` command lines a page quotes, in code blocks and inline."""
    text = page.read_text()
    found = INLINE.findall(FENCE.sub("", text))
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ").removeprefix(".venv/bin/")
            for part in re.split(r"\s*(?:&&|\||;)\s*", line.split(" #")[0]):
                if part.startswith(("kvmesh ", "python -m kvmesh ")):
                    found.append(part.removeprefix("python -m "))
    return found


def help_of(path: list[str]) -> str:
    """What `kvmesh PATH --help` prints (its deepest subcommand's options)."""
    out, err = io.StringIO(), io.StringIO()
    with (
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        pytest.raises(SystemExit) as done,
    ):
        cli().parse_args([*path, "--help"])
    assert done.value.code == 0, f"kvmesh {shlex.join(path)}: {err.getvalue().strip()}"
    return out.getvalue()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_kvmesh_command_quoted_is_one_the_cli_takes(page: Path) -> None:
    wrong = []
    for line in commands(page):
        try:
            words = shlex.split(line)[1:]
        except ValueError:  # (an unclosed quote in a sketch of a line)
            words = line.split()[1:]
        leading = []
        for word in words:
            if word.startswith("-"):
                break
            leading.append(word)
        try:
            text = help_of(leading)
        except AssertionError as err:
            wrong.append(str(err))
            continue
        for word in words:
            option = OPTION.match(word)
            if option and not re.search(rf"(?<![\w-]){re.escape(option[0])}(?![\w-])", text):
                wrong.append(f"{line}: {option[0]} is not an option of kvmesh {' '.join(leading)}")
    assert not wrong, f"{page.name}:\n" + "\n".join(wrong)
