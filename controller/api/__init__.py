"""The OpenAI-compatible HTTP API of the controller."""
