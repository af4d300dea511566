"""Tensors of an HF checkpoint directory (``*.safetensors``, sharded with an index or not) under their HF names,
each read by region straight from its memory-mapped file (safetensors' slices), so a rank reads only its part."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stride.workers.checkpoint import CheckpointTensor, Region


def safetensors_tensors(root: Path) -> list[CheckpointTensor]:
    from safetensors import safe_open

    index = root / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {root}")
    handles: dict[str, Any] = {}  # file → its open (memory-mapped) safetensors handle, opened on first read

    def reader(f: str, name: str) -> Any:
        def read(region: Region) -> Any:
            if f not in handles:
                handles[f] = safe_open(str(root / f), framework="pt")
            part = handles[f].get_slice(name)
            if region is None:
                return part[:]
            dim, start, length = region
            return part[(slice(None),) * dim + (slice(start, start + length),)]
        return read

    out = []
    for f in files:
        with safe_open(str(root / f), framework="pt") as st:
            for name in st.keys():
                out.append(CheckpointTensor(name, tuple(st.get_slice(name).get_shape()), reader(f, name)))
    return out
