"""Which element types an executor computes and caches in: ``--dtype`` and ``--kv-cache-dtype``
resolved against the checkpoint and the device (no torch: the decisions are plain strings).

``--dtype auto`` is the checkpoint's ``torch_dtype`` (config.json; bf16 for most models) on
accelerators (CUDA, TPU) and float32 on the CPU, where float32 is what the token-identity
guarantee is tested in (bf16 on the CPU is there when asked for). ``--kv-cache-dtype auto`` is
the model's dtype; ``fp8`` (float8_e4m3fn, stored without scales and widened on read) needs a
CUDA device of compute capability 8.9 or newer and is refused elsewhere at startup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from common.wire.model_config import read_model_config

#: What --dtype accepts (the setting's type: declared once, here).
ModelDtype = Literal["auto", "float32", "bfloat16", "float16"]
#: What --kv-cache-dtype accepts ("fp8" is float8_e4m3fn).
KVCacheDtype = Literal["auto", "float32", "bfloat16", "float16", "fp8"]
DTYPE_CHOICES = get_args(ModelDtype)
KV_CACHE_DTYPE_CHOICES = get_args(KVCacheDtype)
#: Bytes of one element of each resolved dtype.
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
#: Device kinds the decisions distinguish (the executor_gpu on the CPU and XLA:CPU are "cpu").
DEVICE_KINDS = ("cpu", "cuda", "tpu")
#: Smallest CUDA compute capability with fp8 arithmetic (Ada, Hopper).
FP8_MIN_CAPABILITY = (8, 9)
#: Smallest CUDA compute capability with bf16 arithmetic (Ampere).
BF16_MIN_CAPABILITY = (8, 0)

# config.json spellings of torch dtypes ("torch.bfloat16" in old files, "half", ...).
_CHECKPOINT_NAMES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}


class DtypeError(ValueError):
    """A dtype the device cannot run: raised at startup, the message names the flag."""


@dataclass(frozen=True)
class Precision:
    """The resolved element types of one executor."""

    dtype: str  # weights and activations: float32, bfloat16 or float16
    kv_cache_dtype: str  # the KV cache: float32, bfloat16, float16 or fp8

    @property
    def kv_bytes(self) -> int:
        """Bytes of one KV-cache element."""
        return DTYPE_SIZES[self.kv_cache_dtype]


def checkpoint_dtype(model_dir: str) -> str:
    """The checkpoint's own dtype from its config.json (``torch_dtype``, or ``dtype`` as newer
    transformers write it); float32 when it names none or one Tandem does not compute in."""
    try:
        cfg = read_model_config(model_dir)
    except (OSError, ValueError):
        return "float32"
    raw = (
        cfg.get("torch_dtype")
        or cfg.get("dtype")
        or (cfg.get("text_config") or {}).get("torch_dtype")
    )
    if not isinstance(raw, str):
        return "float32"
    return _CHECKPOINT_NAMES.get(raw.removeprefix("torch."), "float32")


def resolve_dtype(
    requested: str,
    checkpoint: str,
    device_kind: str,
    capability: tuple[int, int] | None = None,
) -> str:
    """The weights / activations dtype for ``--dtype requested`` on ``device_kind`` (cpu, cuda,
    tpu; ``capability`` is the CUDA compute capability). Raises DtypeError where the device
    cannot run the requested dtype."""
    if device_kind not in DEVICE_KINDS:
        raise ValueError(f"unknown device kind {device_kind!r}; have {DEVICE_KINDS}")
    if requested == "auto":
        if device_kind == "cpu":
            return "float32"
        chosen = checkpoint
        if device_kind == "tpu" and chosen == "float16":
            chosen = "bfloat16"  # TPUs compute in bf16; fp16 checkpoints fit its range
        if (
            device_kind == "cuda"
            and chosen == "bfloat16"
            and _below(capability, BF16_MIN_CAPABILITY)
        ):
            chosen = "float16"  # pre-Ampere GPUs have no bf16 arithmetic
        return chosen
    if requested not in DTYPE_CHOICES:
        raise DtypeError(f"--dtype {requested!r}: choose one of {', '.join(DTYPE_CHOICES)}")
    if requested == "float16" and device_kind != "cuda":
        where = "a TPU / XLA device" if device_kind == "tpu" else "the CPU"
        raise DtypeError(
            f"--dtype float16 is not supported on {where}: use bfloat16 (same size, float32's "
            "range) or float32"
        )
    if (
        requested == "bfloat16"
        and device_kind == "cuda"
        and _below(capability, BF16_MIN_CAPABILITY)
    ):
        raise DtypeError(
            f"--dtype bfloat16 needs CUDA compute capability {_fmt(BF16_MIN_CAPABILITY)} or "
            f"newer (this GPU: {_fmt(capability)}); use float16 or float32"
        )
    return requested


def resolve_kv_cache_dtype(
    requested: str,
    model_dtype: str,
    device_kind: str,
    capability: tuple[int, int] | None = None,
) -> str:
    """The KV cache's dtype for ``--kv-cache-dtype requested`` with the resolved model dtype.
    Raises DtypeError for fp8 where the device has no fp8 (anything but CUDA >= 8.9) and for
    float16 off CUDA."""
    if requested == "auto":
        return model_dtype
    if requested not in KV_CACHE_DTYPE_CHOICES:
        raise DtypeError(
            f"--kv-cache-dtype {requested!r}: choose one of {', '.join(KV_CACHE_DTYPE_CHOICES)}"
        )
    if requested == "fp8" and (device_kind != "cuda" or _below(capability, FP8_MIN_CAPABILITY)):
        where = f"CUDA capability {_fmt(capability)}" if device_kind == "cuda" else device_kind
        raise DtypeError(
            f"--kv-cache-dtype fp8 needs a CUDA device of compute capability "
            f"{_fmt(FP8_MIN_CAPABILITY)} or newer (this executor runs on {where}); use "
            "bfloat16 to halve the cache instead"
        )
    if requested == "float16" and device_kind != "cuda":
        raise DtypeError(
            f"--kv-cache-dtype float16 is not supported on {device_kind}: use bfloat16"
        )
    return requested


def resolve_precision(
    dtype: str,
    kv_cache_dtype: str,
    checkpoint: str,
    device_kind: str,
    capability: tuple[int, int] | None = None,
) -> Precision:
    """Both decisions at once (see resolve_dtype, resolve_kv_cache_dtype)."""
    model = resolve_dtype(dtype, checkpoint, device_kind, capability)
    kv = resolve_kv_cache_dtype(kv_cache_dtype, model, device_kind, capability)
    return Precision(dtype=model, kv_cache_dtype=kv)


def _below(capability: tuple[int, int] | None, minimum: tuple[int, int]) -> bool:
    return capability is not None and tuple(capability) < minimum


def _fmt(capability: tuple[int, int] | None) -> str:
    return "unknown" if capability is None else f"{capability[0]}.{capability[1]}"
