"""The user guide cannot drift: docs/options.md is what launch/options_doc.py generates from the
config dataclasses, and every relative link in README.md and docs/*.md reaches a file (and a
heading, where it names one)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from launch import options_doc

from .helpers import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_CODE = re.compile(r"(`+).+?\1", re.S)
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def test_options_md_is_generated_from_the_config_dataclasses():
    path = ROOT / "docs" / "options.md"
    assert path.is_file(), f"docs/options.md is missing; write it with: {options_doc.COMMAND}"
    assert path.read_text() == options_doc.render(), (
        "docs/options.md differs from the config dataclasses' options; regenerate it with: "
        f"{options_doc.COMMAND}")


def test_every_program_with_a_config_tree_has_a_table():
    text = options_doc.render()
    for prog, _, root in options_doc.PROGRAMS:
        assert f"\n## {prog}\n" in text
    for flag in ("--workers", "--world-size", "--adam-eps", "--data-format", "--checkpoint"):
        assert f"| `{flag}` |" in text, flag


def test_the_reference_does_not_depend_on_the_machine(monkeypatch):
    """The per-user default endpoint ($XDG_RUNTIME_DIR, the uid) is written as a pattern."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/4242")
    text = options_doc.render()
    assert "/run/user/4242" not in text
    assert "`ipc://$XDG_RUNTIME_DIR/l2l-$UID/eps.sock`" in text


def _prose(text: str) -> str:
    """Markdown without its code blocks, code spans and comments (links there are not links)."""
    return _CODE.sub("", _FENCE.sub("", _COMMENT.sub("", text)))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces made dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    return _LINK.findall(_prose(path.read_text()))


def test_the_slugs_are_githubs():
    assert slug("Quick start (fresh machine: Python 3.10+, make)") == \
        "quick-start-fresh-machine-python-310-make"
    assert slug("The GPU check") == "the-gpu-check"
    assert slug("l2l-launch") == "l2l-launch"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_its_heading(page):
    assert links(page) or page.name == "options.md", f"{page}: no links found"
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        where = f"{page.relative_to(ROOT)}: link {target!r}"
        assert dest.exists(), f"{where}: {dest} does not exist"
        assert ROOT in dest.parents or dest == ROOT, f"{where}: outside the repository"
        if anchor and dest.suffix == ".md":
            assert anchor in anchors(dest), f"{where}: no heading #{anchor} in {dest.name}"


def test_the_readme_keeps_the_two_commands_ci_runs():
    """.ci/run runs the README's two commands; the README keeps them and links the guide."""
    readme = (ROOT / "README.md").read_text()
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip().startswith("make ")]
    assert ci == ["make demo", "make test"]
    for command in ci:
        assert re.search(rf"^{re.escape(command)}\b", readme, re.M), command
    assert "(docs/README.md)" in readme
    assert len(readme.splitlines()) < 200, "README.md is the door: move details into docs/"


def test_the_protocol_spec_names_the_version_the_code_speaks():
    """SPEC.md's title, Hello and Welcome said 6 (and an Error "is not 5") at version 7."""
    from protocol.messages import PROTOCOL_VERSION

    spec = (ROOT / "protocol" / "SPEC.md").read_text()
    assert spec.splitlines()[0] == f"# L2L wire protocol, version {PROTOCOL_VERSION}"
    said = re.findall(r"server's version \((\d+)\)|\| protocol_version \| int \| (\d+) \||"
                      r"is not the server's \((\d+)\)", spec)
    assert len(said) == 3 and {v for m in said for v in m if v} == {str(PROTOCOL_VERSION)}
