"""TOML config files for a command's options: ``jscaler train --config run.toml``.

A config file holds a command's options as top-level keys spelled exactly as the long
option on the command line, without the leading dashes::

    model = "gpt-small"
    plan = "megatron(tp=2, dp=4)"
    steps = 200
    lr = 3e-4
    lr-schedule = "cosine"
    checkpoint-dir = "ckpt"
    resume = true              # a flag: true or false

The file's values become the options' defaults, so a flag given on the command line wins
over the file, and an option in neither keeps its built-in default. Each value is checked
as the command line would check it (``steps = 0`` is an error naming ``steps``); a key that
is no option of the command is a :class:`~jscaler.errors.ConfigError` naming it and the
valid keys. ``--print-config`` prints the merged options in this format and exits, so its
output is itself a config file.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import tomllib
from pathlib import Path

from jscaler.errors import ConfigError

__all__ = ["CommandParser", "add_config", "apply", "find_config", "load", "options", "to_toml"]

# the options that name or print the config, never keys of one
_OWN = ("config", "print-config")


def add_config(p: argparse.ArgumentParser) -> None:
    """Adds ``--config FILE`` and ``--print-config`` to a command's parser."""
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="read options from a TOML file: keys are the long options without the "
        "leading dashes, as on the command line ('batch-size = 8', 'resume = true'); a "
        "flag on the command line overrides the file (see docs/training.md)",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the options after merging --config and the command line, as TOML "
        "(itself a valid --config file), and exit without running",
    )


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that lists its long options: the parser class of every
    ``jscaler`` command (``add_subparsers(parser_class=CommandParser)``)."""

    def long_options(self) -> dict[str, argparse.Action]:
        """``{name: action}`` for each long option, by its first ``--name`` spelling."""
        found = {}
        for action in self._actions:
            longs = [s for s in action.option_strings if s.startswith("--")]
            if longs:
                found[longs[0][2:]] = action
        return found


def options(parser: CommandParser) -> dict[str, argparse.Action]:
    """The keys a config file for ``parser``'s command may hold, each with its option: every
    long option but ``--help``, ``--config`` and ``--print-config``."""
    return {k: a for k, a in parser.long_options().items() if k not in ("help", *_OWN)}


def find_config(argv: list[str]) -> str | None:
    """The value of ``--config FILE`` (or ``--config=FILE``) in a command's arguments."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    pre.add_argument("--config", default=None)
    try:
        known, _ = pre.parse_known_args(argv)
    except argparse.ArgumentError:  # --config without a file: the command's parser says so
        return None
    return known.config


def load(path: str | Path) -> dict:
    """The top-level table of a TOML file.

    Raises:
      ConfigError: the file is missing or is not valid TOML (the message has the line).
    """
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"--config {path}: is a directory, not a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML: {e}") from None


def _unknown_key(key: str, valid: list[str], source: str) -> ConfigError:
    near = difflib.get_close_matches(key.replace("_", "-"), valid, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return ConfigError(
        f"{source}: unknown key {key!r}{hint} Keys are the long options without the "
        f"leading dashes, spelled as on the command line; valid keys: {', '.join(valid)}"
    )


def _value(key: str, value, action: argparse.Action, source: str):
    """``value`` from the file, checked and converted as the command line would."""
    where = f"{source}: {key} = {value!r}"
    if action.nargs == 0:  # a flag (store_true)
        if not isinstance(value, bool) or action.const is not True:
            raise ConfigError(f"{where}: {key} is a flag; write {key} = true or false")
        return value
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{where}: expected a {_kind(action)}, got a {type(value).__name__}")
    text = value if isinstance(value, str) else repr(value)
    try:
        converted = action.type(text) if action.type is not None else text
    except (argparse.ArgumentTypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e or 'expected a ' + _kind(action)}") from None
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigError(f"{where}: expected one of {choices}")
    return converted


def _kind(action: argparse.Action) -> str:
    names = {int: "integer", float: "number"}
    return names.get(action.type, "number" if action.type else "string")


def apply(parser: CommandParser, values: dict, source: str) -> None:
    """Makes ``values`` (a config file's table) the defaults of ``parser``'s options, so
    the command line overrides them; an option the file sets is no longer required.

    Raises:
      ConfigError: a key that is no option of the command (named, with the valid keys and
        the nearest one), or a value the option would refuse on the command line.
    """
    known = options(parser)
    defaults = {}
    for key, value in values.items():
        if key not in known:
            raise _unknown_key(key, sorted(known), source)
        action = known[key]
        defaults[action.dest] = _value(key, value, action, source)
        action.required = False
    parser.set_defaults(**defaults)


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)  # inf, -inf: as TOML spells them
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def to_toml(parser: CommandParser, args: argparse.Namespace, header: str) -> str:
    """``args`` as a config file for ``parser``'s command: one ``key = value`` line per
    option, and a comment for each option left unset (None: its default is derived)."""
    lines = [f"# {header}"]
    for key, action in options(parser).items():
        value = getattr(args, action.dest, None)
        lines.append(f"# {key}: not set" if value is None else f"{key} = {_toml(value)}")
    return "\n".join(lines) + "\n"
