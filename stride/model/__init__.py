"""What a model is on disk and as numbers: checkpoint files and the default model's path, the GGUF reader,
the model arguments every family is built from, and the one table of checkpoint tensor names."""
