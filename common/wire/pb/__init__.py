"""Generated protobuf and gRPC stubs for proto/executor.proto (`make proto`; not tracked)."""
