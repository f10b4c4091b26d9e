"""A simulated executor: the real Executor gRPC service with no model and no device.

`python -m executor_sim` serves the same protocol through the same servicer as `executor_gpu`
(``common.host.server.serve`` with a ``WorkerBase`` subclass). It reads only the model's
config.json for geometry, reports a configurable KV cache, samples tokens at random (seeded)
and sleeps each step for as long as a latency model says. It counts its busy time and the
bytes it receives as Prometheus metrics, so many of them can stand in for a fleet of devices
when measuring the controller. It imports no torch.
"""
