"""The TPU executor's own options and flags, and the choice of PJRT device.

Nothing here imports torch_xla: the PJRT device must be chosen (``PJRT_DEVICE``) before
torch_xla initializes its runtime.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
from dataclasses import dataclass, field

#: Where the persistent compilation cache goes on a TPU unless configured.
DEFAULT_TPU_CACHE_DIR = os.path.expanduser("~/.cache/tandem/xla-cache")


@dataclass
class TPUOptions:
    """Settings of a TPU executor beyond the shared ExecutorConfig."""

    compile_cache_dir: str = "auto"  # persistent XLA cache dir; "auto": TPU only; "" = off
    token_buckets: list[int] = field(default_factory=list)  # step token paddings; [] = powers
    # of two from 16 to the step budget
    request_buckets: list[int] = field(default_factory=list)  # step request paddings; [] =
    # powers of two from 8 to max_num_seqs
    attention: str = "auto"  # "auto" (kernel on TPU, gather elsewhere), "ragged" or "gather"
    kv_layout: str = "auto"  # "auto" (padded for the kernel), "padded" or "plain"


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
    if spec not in ("auto", "tpu", "cpu"):
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


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"bucket sizes must be positive: {text!r}")
    return values


def add_tpu_arguments(parser: argparse.ArgumentParser) -> None:
    """The TPU executor's flags (on top of the shared executor flags)."""
    g = parser.add_argument_group("TPU / XLA")
    g.add_argument(
        "--compile-cache-dir",
        default="auto",
        help="persistent XLA compilation cache; 'auto' = "
        f"{DEFAULT_TPU_CACHE_DIR} on a TPU, off on XLA:CPU; '' = off",
    )
    g.add_argument(
        "--token-buckets",
        type=_int_list,
        default=[],
        help="token counts a step is padded to, e.g. 16,32,64 (default: powers of "
        "two from 16 to the controller's step budget)",
    )
    g.add_argument(
        "--request-buckets",
        type=_int_list,
        default=[],
        help="request counts a step is padded to, e.g. 8,16 (default: powers of "
        "two from 8 to the controller's max_num_seqs)",
    )
    g.add_argument(
        "--attention",
        choices=["auto", "ragged", "gather"],
        default="auto",
        help="ragged paged attention kernel (TPU) or the static gather path; "
        "auto = the kernel on a TPU",
    )
    g.add_argument(
        "--kv-layout",
        choices=["auto", "padded", "plain"],
        default="auto",
        help="pad KV heads / head size for the kernel (auto: when it is used)",
    )


def options_from_args(args: argparse.Namespace) -> TPUOptions:
    """The TPUOptions the flags describe."""
    return TPUOptions(
        compile_cache_dir=args.compile_cache_dir,
        token_buckets=list(args.token_buckets),
        request_buckets=list(args.request_buckets),
        attention=args.attention,
        kv_layout=args.kv_layout,
    )
