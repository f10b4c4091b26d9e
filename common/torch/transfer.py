"""Host-to-device copies that do not wait for the device.

A plain copy of host memory to a CUDA device waits until the stream's queued work is done
(pageable memory is staged synchronously). The executor builds step N+1's inputs while step N
runs (common.host.step_pipeline.run_overlapped), so its copies go through pinned memory and are
queued behind the work already on the stream instead. On other devices they are plain copies.
"""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` (a list, a numpy array or a CPU tensor) as a tensor of ``dtype`` on
    ``device``. On the CPU an array or tensor of that dtype is not copied: pass one that is not
    written again."""
    device = torch.device(device)
    host = torch.as_tensor(values, dtype=dtype)
    if device.type == "cuda":
        # The pinned block goes back to torch's host cache only once the copy has run.
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
