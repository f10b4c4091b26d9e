"""Where settings come from besides the command line: TANDEM_* environment variables and a
YAML config file. Both give each setting's value keyed by its field name."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource
from pydantic_settings.sources.utils import parse_env_vars

from common.settings import fields


def split_list(value: Any) -> Any:
    """A list setting's text value as a list: a JSON list, else comma-separated items (how
    an environment variable or a config-file scalar gives several values)."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        return json.loads(text)
    return [item.strip() for item in text.split(",") if item.strip()]


class EnvSource(EnvSettingsSource):
    """TANDEM_<FIELD> for every setting, and nothing else.

    pydantic-settings names a field with a validation alias by the alias alone, without
    env_prefix (its `env_prefix_target` default): `--scheduling-policy` would have made
    SCHEDULING_POLICY and POLICY settings. Here one variable per setting, named after the
    field, whatever its aliases; derived fields have none."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str] | None):
        self._environ = os.environ if environ is None else environ  # variables to read
        super().__init__(settings_cls, case_sensitive=False)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(self._environ, False, self.env_ignore_empty, self.env_parse_none_str)

    def _extract_field_info(
        self, field: FieldInfo, field_name: str, model_config: Mapping[str, Any] | None = None
    ) -> list[tuple[str, str, bool]]:
        if not fields.reads_env(field):
            return []
        return [(field_name, fields.env_name(field_name).lower(), False)]

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        if not fields.reads_env(field):
            return None, field_name, False
        return super().get_field_value(field, field_name)

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        try:
            if fields.is_list(field):
                return split_list(value)
            return super().decode_complex_value(field_name, field, value)
        except ValueError as e:
            raise fields.SettingError(field_name, f"cannot decode {value!r}: {e}") from None


def name_table(settings_cls: type[BaseSettings], derived: bool = False) -> dict[str, str]:
    """Every name a setting goes by (field name, aliases, with `_` or `-`) -> its field name;
    with ``derived``, those of derived fields too."""
    table = {}
    for field_name, field in settings_cls.model_fields.items():
        if derived or fields.is_setting(field):
            for name in fields.names(field_name, field):
                table[name] = table[name.replace("_", "-")] = field_name
    return table


def read_config_file(settings_cls: type[BaseSettings], path: str) -> dict[str, Any]:
    """The settings a YAML file holds, by field name. Keys are setting names (with `-` or
    `_`); an unknown key, or a file that is not a mapping, raises SettingError."""
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise fields.SettingError("config", f"cannot read {path}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise fields.SettingError("config", f"{path}: expected a mapping of setting: value")
    table = name_table(settings_cls)
    values = {}
    for key, value in data.items():
        field_name = table.get(str(key))
        if field_name is None:
            raise fields.SettingError("config", f"{path}: unknown setting {key!r}")
        field = settings_cls.model_fields[field_name]
        try:
            values[field_name] = split_list(value) if fields.is_list(field) else value
        except ValueError as e:
            raise fields.SettingError(field_name, f"{path}: {key}: {e}") from None
    return values
