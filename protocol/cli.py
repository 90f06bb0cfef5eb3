"""Command lines and config files generated from config dataclasses: one definition per option.

A process's configuration is a tree of kw-only dataclasses (``WorkerArgs``: ``worker``,
``model``, ``data``; ``ServerArgs``: ``server`` with its ``optimizer``). Every leaf field is one
option:

- flag: the field's name with dashes (``micro_batch_size`` -> ``--micro-batch-size``), unless
  its metadata names another (``field(default=..., metadata={"flag": "--adam-eps"})``); flags
  are unique across the tree (checked when the parser is built);
- help: the field's attribute docstring (the string literal under it), plus its default;
- type and choices: from the annotation (``int``, ``float``, ``str``, ``bool`` as
  ``--x/--no-x``, ``Literal[...]`` as choices);
- a field whose metadata says ``{"omit": (names...)}`` (on a nested dataclass field) leaves
  those names of the nested config out of this tree: the process that owns the tree sets them
  itself (the launcher sets each child's endpoint and rank).

``--config FILE`` (JSON; YAML if PyYAML is installed) holds the same tree as nested maps, e.g.
``{"model": {"layers": 8}, "server": {"optimizer": {"lr": 0.001}}}``; command-line flags
override it. Unknown keys and values of the wrong type are refused with the key's path. The
dataclasses' own ``__post_init__`` checks run last; their ValueError becomes a usage error.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import difflib
import inspect
import json
import re
import textwrap
import types
import typing
from dataclasses import MISSING, dataclass
from functools import cache
from typing import Any, Literal, NoReturn


class ConfigError(ValueError):
    """A config value or file that cannot be used; the message names the key's path."""


@dataclass(frozen=True)
class Option:
    path: tuple[str, ...]  # field names from the root, e.g. ("server", "optimizer", "lr")
    flag: str
    type: Any
    default: Any
    help: str
    choices: tuple | None


# ----------------------------------------------------------------------------- the tree


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass and its bases: the string literal under a field."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0]
        if not isinstance(body, ast.ClassDef):
            continue
        for prev, node in zip(body.body, body.body[1:]):
            if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name)
                    and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)):
                docs[prev.target.id] = inspect.cleandoc(node.value.value)
    return docs


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_config(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def options(root: type, path: tuple[str, ...] = (), omit: tuple[str, ...] = ()) -> list[Option]:
    """Every leaf option of the config tree under ``root``, in declaration order."""
    out: list[Option] = []
    docs = field_docs(root)
    for f in dataclasses.fields(root):
        if f.name in omit or not f.init:
            continue
        tp = _hints(root)[f.name]
        if _is_config(tp):
            out += options(tp, (*path, f.name), tuple(f.metadata.get("omit", ())))
            continue
        choices = tuple(typing.get_args(tp)) if typing.get_origin(tp) is Literal else None
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        out.append(Option((*path, f.name), flag, tp, _default(f), docs.get(f.name, ""),
                          choices))
    return out


# ----------------------------------------------------------------------------- values


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(map(repr, typing.get_args(tp)))
    return getattr(tp, "__name__", str(tp))


def check_value(tp: Any, value: Any, path: str) -> Any:
    """``value`` as type ``tp`` (an int is accepted for a float), else ConfigError."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if not any(type(value) is type(a) and value == a for a in typing.get_args(tp)):
            raise ConfigError(f"{path}: must be one of {', '.join(map(repr, typing.get_args(tp)))}"
                              f", got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(tp)):
            return None
        for arg in args:
            try:
                return check_value(arg, value, path)
            except ConfigError:
                pass
        raise ConfigError(f"{path}: expected {' or '.join(map(_type_name, args))}, "
                          f"got {type(value).__name__}")
    if tp is float and type(value) in (int, float):
        return float(value)
    if tp in (int, str, bool) and type(value) is tp:
        return value
    raise ConfigError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} "
                      f"{value!r}")


def from_dict(cls: type, data: dict, path: str = "", omit: tuple[str, ...] = ()) -> Any:
    """Build config ``cls`` from nested maps; unknown keys and wrong types name their path.
    Missing keys take the field's default."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a map, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name not in omit}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}.{unknown[0]}" if path else str(unknown[0])
        near = difflib.get_close_matches(str(unknown[0]), fields, n=1)
        raise ConfigError(f"{where}: unknown key{f'; did you mean {near[0]}?' if near else ''} "
                          f"(known: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, value in data.items():
        f, tp, where = fields[name], _hints(cls)[name], f"{path}.{name}" if path else name
        if _is_config(tp):
            kwargs[name] = from_dict(tp, value, where, tuple(f.metadata.get("omit", ())))
        else:
            kwargs[name] = check_value(tp, value, where)
    for name, f in fields.items():  # nested configs not mentioned: their defaults
        if name not in kwargs and _is_config(_hints(cls)[name]) and _default(f) is MISSING:
            kwargs[name] = from_dict(_hints(cls)[name], {}, f"{path}.{name}" if path else name,
                                     tuple(f.metadata.get("omit", ())))
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path}: {e}" if path else str(e)) from None


def to_dict(cfg: Any, omit: tuple[str, ...] = ()) -> dict:
    """The config tree as nested maps of plain values (what ``from_dict`` reads back: fields
    its ``omit`` metadata leaves out are left out). A value the config filled in itself (in
    its ``as_given`` map: {field: what was given}) is written as given, so it is derived again."""
    out = {}
    given = getattr(cfg, "as_given", {})
    for f in dataclasses.fields(cfg):
        if f.name in omit or not f.init:
            continue
        value = given.get(f.name, getattr(cfg, f.name))
        out[f.name] = (to_dict(value, tuple(f.metadata.get("omit", ())))
                       if dataclasses.is_dataclass(value) else copy.deepcopy(value))
    return out


def _yaml_loader(yaml):
    """PyYAML's safe loader, reading 1e-4 as YAML 1.2 does, a float (YAML 1.1's float needs a
    dot: 1.0e-4; "lr: 1e-4" was a string, refused as one)."""
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
        r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"), list("-+0123456789."))
    return Loader


def load_file(path: str) -> dict:
    with open(path) as f:
        text = f.read()
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"{path}: reading YAML needs PyYAML (pip install pyyaml); "
                              "or write the config as JSON") from None
        try:
            data = yaml.load(text, Loader=_yaml_loader(yaml))
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
    else:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a map of sections")
    return data


def write_file(cfg: Any, path: str) -> None:
    with open(path, "w") as f:
        json.dump(to_dict(cfg), f, indent=1)


# ----------------------------------------------------------------------------- argparse


class Parser(argparse.ArgumentParser):
    """A usage error is one line, with the nearest flag for a misspelt one ("did you mean
    --layers?"), and a pointer to --help: not a page of usage above the line that matters."""

    def error(self, message: str) -> NoReturn:
        unknown = message.partition("unrecognized arguments: ")[2].split()
        flags = [f for p in _parsers(self) for a in p._actions for f in a.option_strings]
        unknown = [f.partition("=")[0] for f in unknown if f.startswith("--")]
        near = [(m[0], f) for f in unknown for m in [difflib.get_close_matches(f, flags, n=1)]
                if m]
        if len(near) == 1:
            message += f"; did you mean {near[0][0]}?"
        elif near:
            message += "; did you mean " + ", ".join(f"{m} for {f}" for m, f in near) + "?"
        self.exit(2, f"{self.prog}: error: {message}\n(options: {self.prog} --help)\n")


def _parsers(p: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``p`` and its subcommands' parsers."""
    subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    return [p, *(q for a in subs for sub in a.choices.values() for q in _parsers(sub))]


def parser(root: type, prog: str, description: str = "") -> argparse.ArgumentParser:
    """An argparse parser with one flag per option of ``root`` plus ``--config``."""
    p = Parser(prog=prog, description=description)
    p.add_argument("--config", default="", metavar="FILE",
                   help="read options from this JSON/YAML file (sections as in the config "
                        "tree); flags given here override it")
    groups: dict[tuple[str, ...], argparse._ArgumentGroup] = {}
    seen: dict[str, tuple[str, ...]] = {}
    for opt in options(root):
        if opt.flag in seen:
            raise RuntimeError(f"flag {opt.flag} is defined by both {'.'.join(seen[opt.flag])} "
                               f"and {'.'.join(opt.path)}")
        seen[opt.flag] = opt.path
        section = opt.path[:1]
        if section not in groups:
            groups[section] = p.add_argument_group(section[0] if len(opt.path) > 1 else None)
        kw: dict[str, Any] = {"dest": "/".join(opt.path), "default": argparse.SUPPRESS,
                              "help": _help(opt)}
        if opt.type is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif opt.choices is not None:
            kw.update(choices=opt.choices, type=type(opt.choices[0]))
        else:
            kw.update(type=opt.type, metavar=opt.flag.lstrip("-").replace("-", "_").upper())
        groups[section].add_argument(opt.flag, **kw)
    return p


def _help(opt: Option) -> str:
    text = " ".join(opt.help.split("\n\n")[0].split())
    default = opt.default
    if default is MISSING:
        return text
    shown = "''" if default == "" else repr(default) if isinstance(default, str) else default
    return f"{text} (default: {shown})".strip()


def parse(root: type, argv: list[str] | None, prog: str, description: str = "", *,
          other_sections: bool = False, under=None, positionals: tuple[Option, ...] = ()
          ) -> Any:
    """Defaults, then ``--config FILE``, then flags; returns a ``root`` instance. Bad values
    exit with a usage error naming the option. ``other_sections``: a config file's sections
    that ``root`` has not are left out (a tool that needs one part of a job's file: l2l-export
    its model); ``under(data)``: maps to put under the file's and the flags' ``data``
    (l2l-export: the model options its checkpoint recorded); ``positionals``: options that
    may be given without their flags, anywhere among the others: in this order, those not
    given as flags."""
    p = parser(root, prog, description)
    if positionals:
        p.add_argument("positional", nargs="*", metavar=" ".join(
            o.flag.lstrip("-").upper() for o in positionals),
                       help=f"the same as {' '.join(o.flag for o in positionals)}")
        ns = vars(p.parse_intermixed_args(argv))
        given = ns.pop("positional")
        free = [o for o in positionals if "/".join(o.path) not in ns]  # (not given as flags)
        if len(given) > len(free):
            p.error(f"unrecognized arguments: {' '.join(given[len(free):])}")
        for opt, value in zip(free, given):
            ns["/".join(opt.path)] = value  # (checked with the others below)
    else:
        ns = vars(p.parse_args(argv))
    try:
        data = load_file(ns.pop("config")) if ns.get("config") else {}
        ns.pop("config", None)
        if other_sections:
            known = {f.name for f in dataclasses.fields(root)}
            data = {k: v for k, v in data.items() if k in known}
        for dest, value in ns.items():
            node = data
            *parents, leaf = dest.split("/")
            for key in parents:
                node = node.setdefault(key, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"{key}: expected a map")
            node[leaf] = value
        return from_dict(root, _merge(under(data), data) if under else data)
    except (ConfigError, OSError) as e:
        p.error(str(e))


def _merge(base: dict, over: dict) -> dict:
    """``base`` with ``over``'s values in it, map by map."""
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merge(out[key], value) if both else value
    return out
