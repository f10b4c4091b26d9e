"""The controller's pure-Python core: requests, the step scheduler and its pluggable
interface, the KV block pool with prefix caching. No asyncio, no gRPC, no HTTP, no torch: it is
driven step by step and tested by fabricating step results."""
