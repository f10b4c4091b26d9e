"""--dtype auto and --kv-cache-dtype: the decisions per device kind, the checkpoint's dtype, and
the KV spec's bytes per block (the controller's block count follows it)."""

from __future__ import annotations

import json

import pytest

from common.host.dtypes import (
    DtypeError,
    Precision,
    checkpoint_dtype,
    resolve_dtype,
    resolve_kv_cache_dtype,
    resolve_precision,
)

HOPPER, AMPERE, TURING = (9, 0), (8, 0), (7, 5)


@pytest.mark.parametrize(
    "checkpoint, kind, capability, expected",
    [
        ("bfloat16", "cpu", None, "float32"),  # the CPU: float32 unless asked
        ("float16", "cpu", None, "float32"),
        ("bfloat16", "cuda", HOPPER, "bfloat16"),  # accelerators: the checkpoint's
        ("float16", "cuda", HOPPER, "float16"),
        ("float32", "cuda", HOPPER, "float32"),
        ("bfloat16", "cuda", TURING, "float16"),  # no bf16 before Ampere
        ("bfloat16", "tpu", None, "bfloat16"),
        ("float16", "tpu", None, "bfloat16"),  # TPUs compute in bf16
        ("float32", "tpu", None, "float32"),
    ],
)
def test_auto_follows_the_device_and_the_checkpoint(checkpoint, kind, capability, expected):
    assert resolve_dtype("auto", checkpoint, kind, capability) == expected


def test_explicit_dtypes_are_kept_where_the_device_runs_them():
    assert resolve_dtype("bfloat16", "float32", "cpu") == "bfloat16"  # asked for: bf16 on CPU
    assert resolve_dtype("float32", "bfloat16", "tpu") == "float32"
    assert resolve_dtype("float16", "bfloat16", "cuda", AMPERE) == "float16"


@pytest.mark.parametrize("kind", ["cpu", "tpu"])
def test_float16_is_refused_off_cuda(kind):
    with pytest.raises(DtypeError, match="--dtype float16 is not supported"):
        resolve_dtype("float16", "float16", kind)


def test_bfloat16_is_refused_on_a_gpu_without_it():
    with pytest.raises(DtypeError, match="compute capability 8.0 or newer .this GPU: 7.5"):
        resolve_dtype("bfloat16", "bfloat16", "cuda", TURING)


def test_kv_cache_dtype_auto_is_the_models():
    assert resolve_kv_cache_dtype("auto", "bfloat16", "cuda", HOPPER) == "bfloat16"
    assert resolve_kv_cache_dtype("auto", "float32", "cpu") == "float32"
    assert resolve_kv_cache_dtype("bfloat16", "float32", "cpu") == "bfloat16"


@pytest.mark.parametrize(
    "kind, capability", [("cpu", None), ("tpu", None), ("cuda", AMPERE), ("cuda", TURING)]
)
def test_fp8_kv_cache_is_refused_without_fp8_hardware(kind, capability):
    with pytest.raises(DtypeError, match="fp8 needs a CUDA device of compute capability 8.9"):
        resolve_kv_cache_dtype("fp8", "bfloat16", kind, capability)


def test_fp8_kv_cache_on_ada_and_hopper():
    p = resolve_precision("auto", "fp8", "bfloat16", "cuda", (8, 9))
    assert p == Precision("bfloat16", "fp8") and p.kv_bytes == 1
    assert resolve_precision("auto", "auto", "bfloat16", "cuda", HOPPER).kv_bytes == 2


def test_checkpoint_dtype_reads_config_json(tmp_path):
    def with_config(cfg) -> str:
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        return checkpoint_dtype(str(tmp_path))

    assert with_config({"torch_dtype": "bfloat16"}) == "bfloat16"
    assert with_config({"dtype": "float16"}) == "float16"  # newer transformers' key
    assert with_config({"torch_dtype": "torch.bfloat16"}) == "bfloat16"
    assert with_config({"text_config": {"torch_dtype": "bfloat16"}}) == "bfloat16"
    assert with_config({"torch_dtype": "float64"}) == "float32"
    assert with_config({}) == "float32"
    assert checkpoint_dtype(str(tmp_path / "missing")) == "float32"
