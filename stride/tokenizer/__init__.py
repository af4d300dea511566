"""Tokenizer pool logic: loading, chat templates, incremental detokenization, stop strings."""
