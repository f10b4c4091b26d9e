"""Helpers the tests share: real processes, the transformers reference, a local DNS server."""
