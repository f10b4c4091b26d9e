"""`TandemSettings`: the base of every program's settings, and how they are loaded."""

from __future__ import annotations

import typing
from typing import Any

from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from common.settings.cli import load_settings
from common.settings.fields import ENV_PREFIX


class TandemSettings(BaseSettings):
    """Base of every program's settings. A subclass declares its settings as fields with
    ``setting()`` (and computed ones with ``derived()``); ``load()`` reads them from the
    command line, the TANDEM_* environment and an optional ``--config`` YAML file (in that
    order of precedence), and ``finalize()`` fills in what they imply. Constructing one
    directly takes the given values and defaults only, as a plain model does."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",
        validate_by_name=True,
        validate_by_alias=True,
        cli_kebab_case=True,
        cli_implicit_flags=True,
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Only the constructor's arguments: tests and benchmarks build settings directly, and
        nothing in their environment may change them; `load` reads the outside world."""
        return (init_settings,)

    def finalize(self) -> None:
        """Fill in what the loaded settings imply (defaults that depend on other settings,
        files to read); raise SettingError to reject them. Runs in `load` only."""

    @classmethod
    def load(
        cls,
        argv: list[str] | None = None,
        *,
        prog: str | None = None,
        description: str = "",
        defaults: dict[str, Any] | None = None,
        environ: typing.Mapping[str, str] | None = None,
    ) -> typing.Self:
        """The settings that ``argv`` (default: sys.argv[1:]), ``environ`` (default: the
        process environment) and the ``--config`` file describe, finalized; ``defaults``
        replace field defaults. A bad value prints usage and a message naming its flag,
        variable or key, and exits with status 2."""
        settings, _ = load_settings(
            cls, argv, prog=prog, description=description, defaults=defaults, environ=environ
        )
        return settings
