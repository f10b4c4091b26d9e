"""Loading settings: the command line (pydantic-settings' CliSettingsSource on a parser that
adds what it lacks), TANDEM_* variables and a --config YAML file, merged by precedence,
validated once, and every error reported as a usage error (status 2) naming its origin."""

from __future__ import annotations

import argparse
import json
import sys
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from pydantic_settings import BaseSettings, CliSettingsSource, SettingsError

from common.settings import fields, sources

CONFIG_HELP = (
    "YAML file of settings, one `name: value` per setting (a flag's name without the dashes, "
    "with - or _); flags and TANDEM_* variables override it"
)


class SettingsParser(argparse.ArgumentParser):
    """The parser CliSettingsSource fills with a settings class's flags, plus what that source
    does not do:

    - help sections by topic: the source makes sections only of nested models, whose flags
      it renames (`--fleet.health-check-interval`); here each field names its section;
    - one value per occurrence of a repeatable text flag: the source splits list values at
      commas, which cut `--executor-limits tpu=64,8` in two (and would split an API key or a
      path holding a comma); here such values reach it whole, JSON-encoded;
    - a value placeholder per setting (`PATH`, `N`) rather than `list[str]`;
    - no flag for a derived field.
    """

    def __init__(self, settings_cls: type[BaseSettings], known_only: bool, **kwargs):
        super().__init__(allow_abbrev=False, formatter_class=argparse.HelpFormatter, **kwargs)
        self.settings_cls = settings_cls  # the class whose fields are the flags
        self.known_only = known_only  # leave unknown arguments in `rest` instead of failing
        self.field_of = sources.name_table(settings_cls, derived=True)  # any name -> field
        self.flags: dict[str, list[str]] = {}  # field name -> its option strings
        self.text_lists: set[str] = set()  # dests of repeatable text flags
        self.namespace: argparse.Namespace | None = None  # the last parse
        self.rest: list[str] = []  # arguments left over (known_only)
        self._sections: dict[str, Any] = {}  # help section title -> argument group

    def add_setting(self, *option_strings: str, **kwargs: Any) -> argparse.Action | None:
        """CliSettingsSource's add_argument: one setting's flags, in its help section."""
        field_name = self.field_of.get(kwargs.get("dest", ""))
        if field_name is None:  # not a setting: e.g. --help
            return self.add_argument(*option_strings, **kwargs)
        field = self.settings_cls.model_fields[field_name]
        if not fields.is_setting(field):
            return None
        # The source prints an empty default as "(default: )".
        kwargs["help"] = kwargs.get("help", "").replace("(default: )", "(default: '')")
        if "metavar" in kwargs:
            kwargs["metavar"] = fields.metavar(field) or _item_metavar(kwargs["metavar"])
        if fields.is_list(field) and typing.get_args(field.annotation) == (str,):
            self.text_lists.add(kwargs["dest"])
        action = self._section(fields.help_group(field)).add_argument(*option_strings, **kwargs)
        self.flags[field_name] = list(action.option_strings)
        return action

    def _section(self, title: str) -> Any:
        if not title:
            return self
        if title not in self._sections:
            self._sections[title] = self.add_argument_group(title)
        return self._sections[title]

    def parse_settings(self, args: list[str]) -> argparse.Namespace:
        """CliSettingsSource's parse_args: repeatable text flags JSON-encoded, whole."""
        if self.known_only:
            namespace, self.rest = self.parse_known_args(args)
        else:
            namespace = self.parse_args(args)
        for dest in self.text_lists:
            value = getattr(namespace, dest, None)
            if isinstance(value, list):
                setattr(namespace, dest, json.dumps(value))
        self.namespace = namespace
        return namespace

    def flag_text(self, field_name: str) -> str:
        """How a message names a setting's flag: its positive spellings, as argparse does."""
        flags = self.flags.get(field_name, [])
        shown = [f for f in flags if not f.startswith("--no-")] or flags
        return "/".join(shown) or field_name


def _item_metavar(metavar: str) -> str:
    """`list[int]` -> `int`: a repeatable flag takes one item per occurrence."""
    if metavar.startswith("list[") and metavar.endswith("]"):
        return metavar[5:-1]
    return metavar


def _by_field(parser: SettingsParser, values: Mapping[str, Any]) -> dict[str, Any]:
    """A source's values keyed by field name (sources key some by an alias)."""
    known = parser.settings_cls.model_fields
    by_field = {parser.field_of[k]: v for k, v in values.items() if k in parser.field_of}
    return {k: v for k, v in by_field.items() if fields.is_setting(known[k])}


def _where(parser: SettingsParser, field_name: str, origin: str, config: str) -> str:
    """Where a setting's value came from, for a message."""
    if origin == "env":
        return fields.env_name(field_name)
    if origin == "config":
        return f"{config}: {field_name}"
    if origin == "cli":
        return f"argument {parser.flag_text(field_name)}"
    return field_name


def _describe(parser: SettingsParser, error: ValidationError, origin: dict, config: str) -> str:
    """One line per invalid setting, each naming the flag, variable or key it came from."""
    lines = []
    for item in error.errors():
        name = str(item["loc"][0]) if item["loc"] else ""
        field_name = parser.field_of.get(name, name)
        if item["type"] == "missing":
            lines.append(
                f"{parser.flag_text(field_name)} is required "
                f"(or {fields.env_name(field_name)}, or `{field_name}:` in --config)"
            )
            continue
        message = str(item["msg"]).removeprefix("Value error, ")
        where = _where(parser, field_name, origin.get(field_name, ""), config)
        lines.append(f"{where}: {message} (got {item.get('input')!r})")
    return "; ".join(lines)


def _layers(
    parser: SettingsParser,
    cli: CliSettingsSource,
    env: sources.EnvSource,
    defaults: Mapping[str, Any],
) -> list[tuple[str, dict[str, Any]]]:
    """(origin, values by field name), lowest precedence first."""
    config = getattr(parser.namespace, "config", None)
    from_file = sources.read_config_file(parser.settings_cls, config) if config else {}
    return [
        ("default", dict(defaults)),
        ("config", from_file),
        ("env", _by_field(parser, env())),
        ("cli", _by_field(parser, cli())),
    ]


def load_settings(
    cls: type[BaseSettings],
    argv: list[str] | None,
    *,
    prog: str | None = None,
    description: str = "",
    epilog: str = "",
    defaults: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    known_only: bool = False,
    config_file: bool = True,
) -> tuple[Any, list[str]]:
    """The finalized settings of ``cls`` from ``argv`` (default: sys.argv[1:]), ``environ``
    and the --config file (a flag only with ``config_file``), and the arguments left over
    (``known_only``; else unknown ones are an error). Precedence: command line > environment
    > config file > ``defaults`` > field defaults. Exits with status 2 and a message on any
    bad value."""
    parser = SettingsParser(cls, known_only, prog=prog, description=description, epilog=epilog)
    if config_file:
        parser.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    env = sources.EnvSource(cls, environ)
    cli = CliSettingsSource(
        cls,
        root_parser=parser,
        cli_prog_name=parser.prog,
        cli_show_env_vars=True,
        _env_settings_source=env,
        add_argument_method=SettingsParser.add_setting,
        parse_args_method=SettingsParser.parse_settings,
        formatter_class=parser.formatter_class,
    )
    cli(args=sys.argv[1:] if argv is None else list(argv))
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    try:
        for label, layer in _layers(parser, cli, env, defaults or {}):
            values.update(layer)
            origin.update(dict.fromkeys(layer, label))
        settings = cls(**values)
        settings.finalize()
    except ValidationError as e:
        parser.error(_describe(parser, e, origin, getattr(parser.namespace, "config", "")))
    except fields.SettingError as e:
        where = _where(parser, e.field, origin.get(e.field, ""), "")
        parser.error(str(e) if e.field == "config" else f"{where}: {e}")
    except SettingsError as e:  # a variable the environment source could not decode
        field = getattr(e.__cause__, "field", "")
        parser.error(f"{fields.env_name(field)}: {e.__cause__}" if field else str(e))
    return settings, parser.rest
