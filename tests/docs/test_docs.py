"""The user-facing documentation stays true to the repository.

Every relative link in README.md, docs/ and deploy/README.md points at a file
that exists (and at a heading that exists, when it names one); every
`specdec ...` command line in a shell block of the hand-written pages that
show commands parses with the real CLI; every `--flag` the hand-written pages
mention is a flag of some `specdec` command. Each check fails on a page with
nothing to check (no commands, no flags), so none passes by seeing nothing.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from specdec.cli.main import build_parser

REPO = Path(__file__).resolve().parents[2]
# Pages written by hand; the benchmark reports under docs/bench/ are generated
# and only have their links checked.
GUIDES = [REPO / "README.md", REPO / "docs" / "serving.md", REPO / "docs" / "algorithms.md",
          REPO / "docs" / "training.md", REPO / "docs" / "benchmarks.md", REPO / "docs" / "bench" / "history.md"]
# The guides that show `specdec` command lines (algorithms.md and bench/history.md name flags only).
COMMAND_GUIDES = [REPO / "README.md", REPO / "docs" / "serving.md", REPO / "docs" / "training.md",
                  REPO / "docs" / "benchmarks.md"]
LINKED_PAGES = sorted({REPO / "README.md", REPO / "deploy" / "README.md", *(REPO / "docs").rglob("*.md")})

LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown page."""
    text = FENCE.sub("", page.read_text())
    anchors = set()
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def relative_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` to a file that does not exist, or to a
    heading its Markdown target does not have."""
    broken = []
    for link in relative_links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(link)
        elif anchor and target.suffix == ".md" and anchor not in heading_anchors(target):
            broken.append(link)
    return broken


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_at_existing_files_and_headings(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(REPO)}: broken links {broken}"


def test_the_link_checker_sees_links_and_catches_a_broken_one(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading!\n")
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n[ok](page.md#top) [gone](missing.md) [web](https://example.org)\n"
                    "[here](#top) [nowhere](#bottom) [there](other.md#a-code-heading) [lost](other.md#top)\n"
                    "```sh\n[fenced](also-missing.md)\n```\n")
    assert relative_links(page) == ["page.md#top", "missing.md", "#top", "#bottom", "other.md#a-code-heading",
                                    "other.md#top"]
    assert heading_anchors(page) == {"top"}
    assert broken_links(page) == ["missing.md", "#bottom", "other.md#top"]


def help_text(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    return out.getvalue()


def all_helps() -> dict[str, str]:
    """The help of every command and subcommand, found by walking the
    positional choices the help lists."""
    helps, todo = {}, [[]]
    while todo:
        argv = todo.pop()
        text = helps[" ".join(argv)] = help_text(argv)
        section = text.split("positional arguments:", 1)[1] if "positional arguments:" in text else ""
        for line in section.splitlines():
            match = re.match(r"^  \{([a-z0-9,-]+)\}", line)
            if match:
                todo += [[*argv, name] for name in match.group(1).split(",")
                         if " ".join([*argv, name]) not in helps and name not in argv]
    return helps


def documented_commands(page: Path) -> list[str]:
    lines = []
    for lang, body in FENCE.findall(page.read_text()):
        if lang == "sh":
            lines += [line for line in body.splitlines() if line.startswith("specdec ")]
    return lines


def test_every_guide_has_commands_or_flags_to_check():
    assert len(documented_commands(REPO / "README.md")) >= 15
    assert len(documented_commands(REPO / "docs" / "serving.md")) >= 4
    assert [page for page in GUIDES if not FLAG.findall(page.read_text())] == []
    # a guide left out of the command checks shows no command to check
    assert [page for page in GUIDES if page not in COMMAND_GUIDES and documented_commands(page)] == []


@pytest.mark.parametrize("page", COMMAND_GUIDES, ids=lambda p: str(p.relative_to(REPO)))
def test_documented_commands_parse(page):
    lines = documented_commands(page)
    assert lines, f"{page.relative_to(REPO)} shows no `specdec` command in a sh block"
    for line in lines:
        argv = shlex.split(line, comments=True)[1:]
        try:
            with contextlib.redirect_stderr(io.StringIO()) as err:
                build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{page.relative_to(REPO)}: `{line}` does not parse: {err.getvalue().strip().splitlines()[-1]}")


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: str(p.relative_to(REPO)))
def test_documented_flags_exist(page):
    known = set()
    for text in all_helps().values():
        known |= set(FLAG.findall(text))
    assert {"--tp", "--verify-token-budget", "--draft-lm", "--sweep-totals"} <= known
    mentioned = set(FLAG.findall(page.read_text()))
    assert mentioned, f"{page.relative_to(REPO)} mentions no flag"
    unknown = sorted(mentioned - known)
    assert not unknown, f"{page.relative_to(REPO)} mentions flags no specdec command has: {unknown}"
