"""The option reference, docs/options.md, generated from the config dataclasses.

    python -m launch.options_doc > docs/options.md

One table per program whose command line ``protocol.cli`` builds from a config tree
(eps-server, l2l-worker, l2l-launch, l2l-export): each option's flag, its key in a ``--config``
file, its type or choices, its default and its field's docstring, in declaration order. The
text depends only on the code, not on the machine (the per-user default endpoint is written
with ``$UID``), so tests/test_docs.py compares docs/options.md with it.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import types
import typing
from dataclasses import MISSING
from typing import Any

from eps_server.config import ServerArgs
from protocol import cli
from protocol.endpoints import default_endpoint
from worker.config import WorkerArgs
from worker.export import ExportArgs

from .config import LaunchArgs

COMMAND = "python -m launch.options_doc > docs/options.md"

# (program, the module whose docstring describes it, the root of its config tree)
PROGRAMS: tuple[tuple[str, str, type], ...] = (
    ("l2l-launch", "launch.__main__", LaunchArgs),
    ("eps-server", "eps_server.__main__", ServerArgs),
    ("l2l-worker", "worker.__main__", WorkerArgs),
    ("l2l-export", "worker.export", ExportArgs),
)

_CODE = re.compile(r"(`+)(.+?)\1")  # a code span: ``x`` or `x`
_FLAG = re.compile(r"(?<![\w`-])(--[a-z][a-z0-9-]*)")
_UNDERSCORE = re.compile(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")


def _plain(text: str) -> str:
    """Text outside code spans, for a table cell: flags as code, markdown's characters escaped."""
    text = text.replace("\\", "\\\\").replace("*", "\\*").replace("|", "\\|")
    text = text.replace("<", "&lt;").replace(">", "&gt;")
    text = _UNDERSCORE.sub(r"\\_", text)
    return _FLAG.sub(r"`\1`", text)


def cell(text: str) -> str:
    """Free text as one table cell: one line, code spans kept, the rest escaped."""
    text = " ".join(text.split())
    out, at = [], 0
    for m in _CODE.finditer(text):
        out += [_plain(text[at:m.start()]), code(m.group(2))]
        at = m.end()
    return "".join([*out, _plain(text[at:])])


def code(text: str) -> str:
    """``text`` as a code span in a table cell (a pipe still needs its backslash there)."""
    text = str(text).replace("|", "\\|")
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def type_cell(opt: cli.Option) -> str:
    if opt.choices is not None:
        return " \\| ".join(code(c) for c in opt.choices)
    if opt.type is bool:
        return f"switch: {code(opt.flag)} / {code('--no-' + opt.flag[2:])}"
    if typing.get_origin(opt.type) in (typing.Union, types.UnionType):
        return " or ".join(code(getattr(a, "__name__", str(a))) for a in typing.get_args(opt.type))
    return code(getattr(opt.type, "__name__", str(opt.type)))


def default_cell(default: Any) -> str:
    if default is MISSING:
        return "(required)"
    if isinstance(default, bool):
        return code(str(default).lower())
    if default == "":
        return "(empty)"
    if isinstance(default, str) and default == default_endpoint():
        return (code("ipc://$XDG_RUNTIME_DIR/l2l-$UID/eps.sock") + " (without "
                + code("$XDG_RUNTIME_DIR") + ": the temp directory, e.g. " + code("/tmp") + ")")
    return code(default) if isinstance(default, str) else code(repr(default))


def module_doc(module: str) -> str:
    """A module's docstring, read from its source without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return ""
    with open(spec.origin) as f:
        return ast.get_docstring(ast.parse(f.read())) or ""


def _intro(doc: str) -> list[str]:
    """The docstring's first paragraph as text, and its indented paragraphs (usage) as code."""
    paragraphs = doc.split("\n\n")
    out = [" ".join(paragraphs[0].split()), ""] if paragraphs[0].strip() else []
    for para in paragraphs[1:]:
        lines = para.split("\n")
        if all(line.startswith("    ") for line in lines):
            out += ["```", *(line[4:] for line in lines), "```", ""]
    return out


def _config_help(root: type, prog: str) -> str:
    p = cli.parser(root, prog)
    return next(a.help for a in p._actions if "--config" in a.option_strings)


def table(prog: str, module: str, root: type) -> list[str]:
    opts = cli.options(root)
    lines = [f"## {prog}", "", *_intro(module_doc(module))]
    lines += [f"{len(opts)} options; `{prog} --help` lists the same ones with their defaults.", ""]
    lines += ["| flag | config key | type / choices | default | description |",
              "| --- | --- | --- | --- | --- |",
              f"| `--config FILE` | | path | (none) | {cell(_config_help(root, prog))} |"]
    for opt in opts:
        lines.append(f"| {code(opt.flag)} | {code('.'.join(opt.path))} | {type_cell(opt)} "
                     f"| {default_cell(opt.default)} | {cell(opt.help)} |")
    return [*lines, ""]


def render() -> str:
    lines = [
        "# Option reference",
        "",
        "<!-- Generated from the config dataclasses by launch/options_doc.py; do not edit by",
        f"     hand. Regenerate with: {COMMAND} -->",
        "",
        "Generated from the config dataclasses (`launch/config.py`, `worker/config.py`,",
        "`eps_server/config.py`, `worker/export.py`): every option is a field, its description",
        "the field's docstring. Regenerate it after changing one:",
        "",
        "```bash",
        COMMAND,
        "```",
        "",
        "A field has the same flag in every program that takes it. The config key is its",
        "place in a `--config` file (JSON, or YAML: nested maps, such as",
        "`server: {optimizer: {lr: 0.001}}`); flags given on the command line override the",
        "file. `l2l.run(...)` and `l2l.Job(...)` take l2l-launch's flags as keyword arguments,",
        "dashes made underscores (`l2l.export(checkpoint, out, ...)` l2l-export's model",
        "options). A switch is turned off with its `--no-` form. `l2l-launch` takes the",
        "worker's and the server's options but those it sets for each child (`PER_WORKER` and",
        "`PER_SERVER` in `launch/config.py`); its `launch` section is its own.",
        "",
        *(f"- [{prog}](#{prog})" for prog, _, _ in PROGRAMS),
        "",
        "`l2l-ctl` and `l2l-plot` have no config tree: `l2l-ctl --help`,",
        "`l2l-ctl COMMAND --help` and `l2l-plot --help` list their options.",
        "",
    ]
    for prog, module, root in PROGRAMS:
        lines += table(prog, module, root)
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
