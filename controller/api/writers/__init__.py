"""Stream writer processes: streamed responses' chunks detokenized, formatted and written to
their sockets away from the scheduling core (docs/design/stream_writers.md)."""
