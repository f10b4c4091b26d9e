"""The TPU executor's own settings, and the choice of PJRT device.

Nothing here imports torch_xla: the PJRT device must be chosen (``PJRT_DEVICE``) before
torch_xla initializes its runtime.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, PositiveInt, field_validator

from common.host.settings import ExecutorSettings
from common.settings import setting

#: Where the persistent compilation cache goes on a TPU unless configured.
DEFAULT_TPU_CACHE_DIR = os.path.expanduser("~/.cache/tandem/xla-cache")
TPU_DEVICES = ("auto", "tpu", "cpu")  # what --device may be here


TPU = "TPU / XLA"


class TPUOptions(BaseModel):
    """Settings of a TPU executor beyond the shared ExecutorConfig (the worker's options)."""

    model_config = ConfigDict(extra="forbid")

    compile_cache_dir: str = setting(
        "auto",
        f"persistent XLA compilation cache; 'auto' = {DEFAULT_TPU_CACHE_DIR} on a TPU, off on "
        "XLA:CPU; '' = off",
        group=TPU,
        metavar="PATH",
    )
    token_buckets: list[PositiveInt] = setting(
        [],
        "token counts a step is padded to, e.g. 16,32,64 ([] = powers of two from 16 to the "
        "controller's step budget)",
        group=TPU,
        metavar="N[,N...]",
    )
    request_buckets: list[PositiveInt] = setting(
        [],
        "request counts a step is padded to, e.g. 8,16 ([] = powers of two from 8 to the "
        "controller's max_num_seqs)",
        group=TPU,
        metavar="N[,N...]",
    )
    attention: Literal["auto", "ragged", "gather"] = setting(
        "auto",
        "ragged paged attention kernel (TPU) or the static gather path; auto = the kernel on a TPU",
        group=TPU,
    )
    kv_layout: Literal["auto", "padded", "plain"] = setting(
        "auto", "pad KV heads / head size for the kernel (auto: when it is used)", group=TPU
    )


class TPUSettings(ExecutorSettings, TPUOptions):
    """A TPU executor process: the shared executor settings and the TPU options."""

    @field_validator("device")
    @classmethod
    def _tpu_device(cls, device: str) -> str:
        if device.lower() not in TPU_DEVICES:
            raise ValueError("the TPU executor takes auto, tpu or cpu")
        return device


def tpu_present() -> bool:
    """Whether this host has TPU chips and the TPU runtime library."""
    chips = glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
    return bool(chips) and importlib.util.find_spec("libtpu") is not None


def select_pjrt_device(spec: str) -> str:
    """Set ``PJRT_DEVICE`` from ``--device`` (auto, tpu or cpu) unless the environment already
    sets it; returns the PJRT device in use ("TPU" or "CPU")."""
    if os.environ.get("PJRT_DEVICE"):
        return os.environ["PJRT_DEVICE"].upper()
    spec = spec.lower()
    if spec not in TPU_DEVICES:
        raise ValueError(f"--device {spec!r}: the TPU executor takes auto, tpu or cpu")
    device = "TPU" if spec == "tpu" or (spec == "auto" and tpu_present()) else "CPU"
    os.environ["PJRT_DEVICE"] = device
    return device


def resolve_cache_dir(option: str, pjrt_device: str) -> str:
    """The persistent cache directory to use ("" = none)."""
    if option == "auto":
        # torch_xla 2.9 cannot load executables it cached on XLA:CPU, so there it is off.
        return DEFAULT_TPU_CACHE_DIR if pjrt_device == "TPU" else ""
    return option
