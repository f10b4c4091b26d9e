"""The KV budget of a sharded TPU executor (executor_tpu.tp_memory), with a stand-in runner."""

from __future__ import annotations

from types import SimpleNamespace

from executor_tpu.attention import plain_layout
from executor_tpu.tp_memory import modelled_peak_bytes, sharded_memory_profile

GIB = 2**30


def _runner(attention: str) -> SimpleNamespace:
    args = SimpleNamespace(
        num_heads=32, num_kv_heads=8, hidden_size=4096, intermediate_size=14336, vocab_size=128256
    )
    return SimpleNamespace(
        plan=SimpleNamespace(token_buckets=[16, 256], request_buckets=[8, 64]),
        layout=plain_layout(8, 128),
        model=SimpleNamespace(args=args),
        max_blocks=512,
        config=SimpleNamespace(block_size=16),
        precision=SimpleNamespace(kv_bytes=2),
        attention_backend=attention,
        chip_weights_bytes=4 * GIB,
        weights_bytes=16 * GIB,
    )


def test_budget_per_chip_set_by_the_smallest():
    runner = _runner("xla_ragged")
    mesh = SimpleNamespace(size=4, chip_limits=[16 * GIB, 15 * GIB, 16 * GIB, 16 * GIB])
    peak = modelled_peak_bytes(runner, 4)
    profile = sharded_memory_profile(runner, mesh, 0.9)
    assert profile.available_kv_bytes == (int(15 * GIB * 0.9) - 4 * GIB - peak) * 4
    assert profile.weights_bytes == 16 * GIB and profile.peak_activation_bytes == peak
    # The gather path materializes every token's context: a far larger peak than the kernel's.
    assert modelled_peak_bytes(_runner("xla_gather"), 4) > 10 * peak


def test_no_room_is_no_budget():
    runner = _runner("xla_gather")
    mesh = SimpleNamespace(size=2, chip_limits=[GIB, GIB])
    assert sharded_memory_profile(runner, mesh, 0.9).available_kv_bytes == 0
