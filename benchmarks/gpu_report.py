"""The text summary benchmarks/gpu_step.py prints after its JSON report (the same figures)."""

from __future__ import annotations

from benchmarks.gpu_prefill import print_prefill
from benchmarks.gpu_tuning import print_tuning


def _list(report: dict, key: str) -> list:
    """report[key] when a section produced rows (a failed section holds its error)."""
    value = report.get(key)
    return value if isinstance(value, list) else []


def print_report(report: dict, batch: int, context: int) -> None:
    """The decode rows against the bound and the copy rate, prefill and tuning, the attention
    sweep, the host and device profiles, and the executor step at ``batch`` x ``context``."""
    streamed = report["streamed_weight_bytes"] / 1e9
    print(
        f"\nweights {report['weights_bytes'] / 1e9:.2f} GB ({streamed:.2f} GB streamed per "
        f"step); bound at 4.8 TB/s {report['bound_ms']:.2f} ms; copy {report.get('copy_TBps')} TB/s"
    )
    print(f"{'batch':>5} {'ctx':>5} {'variant':>7} {'ms':>8} {'x bound':>8} {'KV GB':>6} x copy")
    for r in report["forward"]:
        print(
            f"{r['batch']:>5} {r['context']:>5} {r['variant']:>7} {r['ms']:>8.2f} "
            f"{r['over_bound']:>8.2f} {r['kv_bytes'] / 1e9:>6.2f} {r['over_copy']}"
        )
    print_prefill(report)
    print_tuning(report)
    for r in _list(report, "attention_sweep"):
        print(
            f"attention b={r['batch']:>2} ctx={r['context']:>4} parts={r['parts']:>2} "
            f"tile={r['tile']:>3}: {r['us']:7.1f} us {r['TBps']:5.2f} TB/s"
            f"{' (picked)' if r['picked'] else ''}"
        )
    for r in _list(report, "host_profile"):
        print(
            f"host {r['tottime_ms_per_step']:7.3f} ms self {r['cumtime_ms_per_step']:7.3f} ms "
            f"cum {r['calls'] // 20:5d}x/step  {r['function']}"
        )
    for r in _list(report, "profile"):
        print(f"{r['us_per_step']:9.1f} us {r['calls']:4d}x  {r['kernel']}")
    overlap = report.get("overlap_profile")
    if isinstance(overlap, dict) and "wall_ms" in overlap:  # (else the section's error)
        print(
            f"overlapped steps: {overlap['wall_ms']:.3f} ms wall, "
            f"device busy {overlap['busy_ms']:.3f} ms"
        )
        for r in overlap["kernels"]:
            print(f"  {r['us_per_step']:9.1f} us {r['calls']:6.1f}x  {r['kernel']}")
    steps = report.get("executor_steps")
    steps = steps if isinstance(steps, dict) else {}
    print(
        f"executor step (execute_model), batch {batch}, ctx {context}: "
        f"{report.get('executor_step_ms')} ms one at a time, "
        f"{steps.get('overlapped_ms')} ms overlapped"
    )
