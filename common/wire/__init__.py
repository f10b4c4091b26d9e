"""The torch-free layer every process shares: step and config types, their protobuf
conversion, the generated stubs (pb/), model geometry from config.json, the RPC token and TLS.

It imports neither torch nor anything of the controller or the executors."""
