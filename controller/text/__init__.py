"""Text in and out: the tokenizer and chat template, incremental detokenization and stop
strings."""
