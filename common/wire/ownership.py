"""gRPC metadata keys of executor ownership, shared by the executor and the controller (the
protocol: proto/executor.proto, "Ownership")."""

SESSION_METADATA = "tandem-session-generation"  # a call's session generation (metadata key)
OWNER_TRAILER = "tandem-lease-owner"  # on a refused InitDevice: who owns the executor
SECONDS_LEFT_TRAILER = "tandem-lease-seconds-left"  # and how long its lease still lives
