"""The TPU executor: a worker and model runner on torch_xla with static shapes.

It serves the same Executor service as executor_gpu: the controller drives it the same way and
sizes its steps from the capabilities it reports (token and request buckets). On a host without
TPU chips it runs on XLA:CPU (``PJRT_DEVICE=CPU``) for development and CI. torch_xla is imported
only once the PJRT device is chosen (``TPUWorker.init_device``).
"""

from executor_tpu.options import TPUOptions
from executor_tpu.worker import TPUWorker

__all__ = ["TPUOptions", "TPUWorker"]
