"""Scheduler traces: every input (arrivals, cancellations, step results) and every decision, one JSON
object per line, so a run can be replayed to the same decisions (:mod:`stride.sched.replay`).

Records, in call order, each with ``kind`` and the logical time ``now`` where it has one:

- ``config``: ``scheduler`` and ``cache`` (SchedulerConfig / CacheConfig as dicts), ``eos_token_ids``;
- ``add``: ``req_id, tenant, prompt, params, service_class, rejected`` (None or the reason);
- ``abort``: ``req_id``;
- ``schedule``: ``step`` and ``decisions`` (:meth:`StepPlan.decisions`); ``ahead: true`` for a step built while
  the one before was in flight (:meth:`Scheduler.schedule_ahead`; only steps it built are recorded);
- ``update``: ``step`` and ``sampled`` (the step's sampled ids, -1 where a row did not sample); ``stop_rows``
  where some rows ended because their output's grammar was complete.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import IO, Any

from stride.config import CacheConfig, SchedulerConfig, ServiceClass
from stride.params import LogitBias, SamplingParams


class TraceWriter:
    """Appends records to a JSON-lines file (or any text stream)."""

    def __init__(self, out: str | Path | IO[str]) -> None:
        if isinstance(out, str | Path):
            # Line-buffered: a record reaches the file as it is written, so the trace of a process that is killed
            # (the run one most wants to replay) is whole up to its last record.
            self._file: IO[str] = open(out, "w", encoding="utf-8", buffering=1)  # noqa: SIM115 -- closed in close()
            self._owned = True
        else:
            self._file = out
            self._owned = False

    def write_config(self, sched: SchedulerConfig, cache: CacheConfig,
                     eos_token_ids: tuple[int, ...]) -> None:
        self._emit({"kind": "config", "scheduler": dataclasses.asdict(sched),
                    "cache": dataclasses.asdict(cache), "eos_token_ids": list(eos_token_ids)})

    def write(self, kind: str, now: float, **fields: Any) -> None:
        record: dict[str, Any] = {"kind": kind, "now": now}
        for key, value in fields.items():
            record[key] = dataclasses.asdict(value) if isinstance(value, SamplingParams) else value
        self._emit(record)

    def _emit(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if self._owned:
            self._file.close()
        else:
            self._file.flush()


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a trace file; ``ValueError`` naming the line of a malformed one."""
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
    if not records or records[0].get("kind") != "config":
        raise ValueError(f"{path}: a trace starts with a config record")
    return records


def configs_from(record: dict[str, Any]) -> tuple[SchedulerConfig, CacheConfig, tuple[int, ...]]:
    """The scheduler and cache configs and EOS ids of a ``config`` record."""
    sched = dict(record["scheduler"])
    sched["service_classes"] = tuple(ServiceClass(**c) for c in sched["service_classes"])
    return (SchedulerConfig(**sched), CacheConfig(**record["cache"]),
            tuple(int(t) for t in record["eos_token_ids"]))


def params_from(data: dict[str, Any]) -> SamplingParams:
    fields = dict(data)
    fields["stop"] = tuple(fields.get("stop", ()))
    fields["stop_token_ids"] = tuple(fields.get("stop_token_ids", ()))
    fields["logit_bias"] = tuple(LogitBias(**b) for b in fields.get("logit_bias", ()))
    return SamplingParams(**fields)
