"""Tensors of an HF checkpoint directory (``*.safetensors``, sharded with an index or not), streamed one at a time
under their HF names."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch


def safetensors_stream(root: Path) -> tuple[Iterator[tuple[str, torch.Tensor]], int]:
    from safetensors import safe_open

    index = root / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {root}")
    total = 0
    for f in files:
        with safe_open(str(root / f), framework="pt") as st:
            total += len(list(st.keys()))

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for f in files:
            with safe_open(str(root / f), framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)

    return stream(), total
