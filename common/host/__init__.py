"""The executor host: the gRPC servicer and server, `WorkerBase`, `ModelRunnerBase` and the
executor's own metrics. Device-agnostic and torch-free; each executor kind subclasses the bases."""
