"""Telling a device failure from a request's failure.

A request fails alone when its own data cannot run (a check, non-finite values): the executor
goes on. A device failure is no request's fault and leaves the device unusable (a CUDA error
poisons the CUDA context, an XLA runtime failure the PJRT client, running out of device memory
within the limits the executor itself reported means its profile was wrong): every later step
would fail too, so the executor must stop taking work (health NOT_SERVING, then exit) and let
the controller move its requests and Kubernetes restart it.

The common host imports no torch: errors are recognized by their type's name and message, the
forms torch, torch_xla and the CUDA libraries raise them in. A runner may also raise
``FatalDeviceError`` itself.
"""

from __future__ import annotations

# Exception type names that always mean the device is gone (torch.OutOfMemoryError and its
# alias torch.cuda.OutOfMemoryError, torch.AcceleratorError for CUDA errors since torch 2.8,
# jaxlib's XlaRuntimeError).
_FATAL_TYPES = frozenset({"OutOfMemoryError", "AcceleratorError", "XlaRuntimeError"})
# Message fragments of device failures raised as plain RuntimeErrors.
_FATAL_MARKERS = (
    "CUDA error",
    "CUDA out of memory",
    "CUBLAS_STATUS_",
    "CUDNN_STATUS_",
    "cuDNN error",
    "NCCL error",
    "device-side assert",
    "illegal memory access",
    "Bad StatusOr access",  # torch_xla: a failed PJRT call
    "RESOURCE_EXHAUSTED",  # XLA: out of device memory
    "XLA runtime",
)


class FatalDeviceError(RuntimeError):
    """The device failed in a way no request caused; the executor cannot serve steps."""


def is_fatal_device_error(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception in its cause chain) is a device failure."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, FatalDeviceError) or type(exc).__name__ in _FATAL_TYPES:
            return True
        message = str(exc)
        if any(marker in message for marker in _FATAL_MARKERS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
