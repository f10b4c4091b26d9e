"""Declaring settings: one typed field per setting, carrying everything its flag, its
environment variable, its config-file key and its help line are derived from."""

from __future__ import annotations

import typing
from typing import Any

from pydantic import AliasChoices, Field
from pydantic.fields import FieldInfo

#: Every setting's environment variable is this prefix plus its field name, upper-cased.
ENV_PREFIX = "TANDEM_"

# Keys of a field's json_schema_extra that describe it as a setting.
_GROUP = "tandem_group"  # help section title; "" = the main one
_METAVAR = "tandem_metavar"  # placeholder of the value in help; "" = the type's name
_ENV = "tandem_env"  # whether TANDEM_<NAME> sets it (False: the field reads its own variable)
_DERIVED = "tandem_derived"  # computed from other settings: no flag, variable or config key


def setting(
    default: Any = ...,
    help: str = "",
    *,
    aliases: tuple[str, ...] = (),
    group: str = "",
    metavar: str = "",
    env: bool = True,
    **constraints: Any,
) -> Any:
    """One setting: a field with its default and help. ``aliases`` are further names: each
    is a flag ``--<alias>`` and a config-file key (the first is the one help lists first;
    name the field itself first to keep it first). ``group`` is the help section,
    ``metavar`` the value's placeholder in help, ``env=False`` leaves TANDEM_<FIELD> to code
    of the field's own. ``constraints`` are pydantic's (ge, le, ...)."""
    extra = {_GROUP: group, _METAVAR: metavar, _ENV: env}
    alias = AliasChoices(*aliases) if aliases else None
    # A list default is copied per instance by pydantic, and shows in help as it is.
    return Field(
        default, description=help, validation_alias=alias, json_schema_extra=extra, **constraints
    )


def derived(default: Any = None, *, default_factory: Any = None, help: str = "") -> Any:
    """A field that other settings determine (or code sets): not a flag, an environment
    variable or a config-file key."""
    extra = {_DERIVED: True}
    if default_factory is not None:
        return Field(default_factory=default_factory, description=help, json_schema_extra=extra)
    return Field(default, description=help, json_schema_extra=extra)


def _extra(field: FieldInfo) -> dict[str, Any]:
    extra = field.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def is_setting(field: FieldInfo) -> bool:
    """Whether the field is read from the outside world (not derived)."""
    return not _extra(field).get(_DERIVED, False)


def reads_env(field: FieldInfo) -> bool:
    """Whether TANDEM_<FIELD> is read for the field by the generic environment source."""
    return is_setting(field) and _extra(field).get(_ENV, True)


def help_group(field: FieldInfo) -> str:
    """The help section of a setting ("" = the main one)."""
    return str(_extra(field).get(_GROUP, ""))


def metavar(field: FieldInfo) -> str:
    """The placeholder of a setting's value in help ("" = derive it from the type)."""
    return str(_extra(field).get(_METAVAR, ""))


def is_list(field: FieldInfo) -> bool:
    """Whether a setting holds a list (a repeatable flag)."""
    return typing.get_origin(field.annotation) is list


def names(field_name: str, field: FieldInfo) -> list[str]:
    """Every name of a setting: its aliases, then its field name."""
    found = []
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        found = [str(choice) for choice in alias.choices if isinstance(choice, str)]
    return list(dict.fromkeys([*found, field_name]))


def env_name(field_name: str) -> str:
    """The environment variable of a setting."""
    return ENV_PREFIX + field_name.upper()


class SettingError(ValueError):
    """A setting's value is unusable (raised by ``finalize``; reported like a bad flag)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field  # field name of the setting at fault
