"""The fleet: the engine that places requests, one session per executor (connection,
handshake, health, step loop), placement, discovery and the gRPC client."""
