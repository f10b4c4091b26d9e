"""Settings of every Tandem program, each declared once as a typed field (see `fields`) and
read from flags, TANDEM_* environment variables and a --config YAML file (see `cli`)."""

from common.settings.base import TandemSettings
from common.settings.fields import ENV_PREFIX, SettingError, derived, env_name, setting

__all__ = ["ENV_PREFIX", "SettingError", "TandemSettings", "derived", "env_name", "setting"]
