"""ProbeRecord: what one probe observed, in the JSON layout of the C++ emsa::ProbeRecord.

The C++ side (include/emsa/probe_record.h) owns the format and its validation; this module only
mirrors the fields so Python code can build, inspect, save and load records. `check()` hands the
record to the C++ parser, which is the authority on whether a record is valid.
Times are seconds from the start of the probed forward; memory is in bytes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from . import _files

__all__ = ["ParamRecord", "MemorySample", "GraphOp", "ProbeRecord"]

FORMAT = "emsa.probe"
VERSION = 1


@dataclass
class ParamRecord:
    name: str
    module: str
    shape: list[int]
    dtype: str = "float32"
    numel: int = 0
    bytes: int = 0
    trainable: bool = True
    tied_names: list[str] = field(default_factory=list)
    use_count: int = 1
    forward_order: int = -1
    forward_time: float = 0.0
    grad_ready_order: int = -1
    grad_ready_time: float = 0.0


@dataclass
class MemorySample:
    module: str
    event: str  # "forward_pre", "forward_post", "backward_post"
    time: float
    device_bytes: int


@dataclass
class GraphOp:
    name: str
    params: list[str] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)


@dataclass
class ProbeRecord:
    model: str = ""
    device: str = ""
    forward_time: float = 0.0
    backward_time: float = 0.0
    # Forward + backward timed again under emsa's host-tier load (HostLoad); 0: not measured.
    period_under_load: float = 0.0
    peak_device_bytes: int = 0
    activation_peak_bytes: int = 0
    params: list[ParamRecord] = field(default_factory=list)
    memory: list[MemorySample] = field(default_factory=list)
    graph: list[GraphOp] = field(default_factory=list)
    # The DeviceProfile as the C++ side wrote it (its layout is the C++ side's); None: absent.
    profile: dict[str, Any] | None = None
    # Not serialized: weak references to the live parameters, parallel to `params`, when the
    # record was made by emsa.probe() in this process. Lets an optimizer match by identity.
    tensors: list[Any] | None = field(default=None, repr=False, compare=False)
    # Not serialized: seconds per phase of the emsa.probe() that made it ("profile", "passes",
    # "trace", "under_load"), and where its profile's bandwidths came from (the profile cache's
    # summary; "" when the caller passed the profile).
    setup_times: dict[str, float] = field(default_factory=dict, repr=False, compare=False)
    profile_source: str = field(default="", repr=False, compare=False)

    # ---- JSON -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"format": FORMAT, "version": VERSION}
        for f in dataclasses.fields(self):
            if f.name in ("tensors", "profile", "setup_times", "profile_source"):
                continue
            value = getattr(self, f.name)
            if isinstance(value, list):
                value = [dataclasses.asdict(item) for item in value]
            doc[f.name] = value
        if self.profile is not None:
            doc["profile"] = self.profile
        return doc

    def to_json(self) -> str:
        """Pretty-printed JSON with the C++ writer's key order; scalar arrays stay on one line."""
        return _write(self.to_dict(), 0) + "\n"

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> "ProbeRecord":
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError('not a probe record: expected {"format": "emsa.probe", ...}')
        if doc.get("version") != VERSION:
            raise ValueError(f"probe record version {doc.get('version')!r} is not supported; "
                             f"this emsa reads version {VERSION} (probe again with this emsa)")
        for key in ("forward_time", "backward_time", "peak_device_bytes",
                    "activation_peak_bytes", "params"):
            if key not in doc:
                raise ValueError(f"probe record lacks the required field {key!r}")
        return cls(
            model=doc.get("model") or "",
            device=doc.get("device") or "",
            forward_time=float(doc["forward_time"]),
            backward_time=float(doc["backward_time"]),
            period_under_load=float(doc.get("period_under_load") or 0.0),
            peak_device_bytes=int(doc["peak_device_bytes"]),
            activation_peak_bytes=int(doc["activation_peak_bytes"]),
            params=[_read(ParamRecord, p, f"params[{i}]") for i, p in enumerate(doc["params"])],
            memory=[_read(MemorySample, m, f"memory[{i}]")
                    for i, m in enumerate(doc.get("memory") or [])],
            graph=[_read(GraphOp, g, f"graph[{i}]") for i, g in enumerate(doc.get("graph") or [])],
            profile=doc.get("profile"),
        )

    @classmethod
    def from_json(cls, text: str) -> "ProbeRecord":
        try:
            doc = json.loads(text)
        except RecursionError:
            raise ValueError("the probe record's JSON nests too deeply to be a probe "
                             "record") from None
        return cls.from_dict(doc)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the JSON form; checks it with the C++ parser first, so nothing invalid lands."""
        self.check()
        _files.write_text(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ProbeRecord":
        return cls.from_json(_files.read_text(path))

    def check(self) -> None:
        """Raises EmsaError with the C++ parser's message (naming the field) when invalid."""
        from ._native.planner import check_probe_record  # the library is loaded only when asked

        check_probe_record(self.to_json())

    # ---- convenience ---------------------------------------------------------------------
    def param(self, name: str) -> ParamRecord:
        """The record of a parameter by any of its names (tied aliases included)."""
        for p in self.params:
            if p.name == name or name in p.tied_names:
                return p
        raise KeyError(f"no parameter named {name!r} in this probe record")


def _read(cls, raw: dict[str, Any], where: str):
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object")
    names = {f.name for f in dataclasses.fields(cls)}
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if cls is ParamRecord:
        required += ["dtype", "numel", "bytes"]
    for key in required:
        if key not in raw:
            raise ValueError(f"{where}: lacks the required field {key!r}")
    return cls(**{k: v for k, v in raw.items() if k in names and v is not None})


def _scalar(v: Any) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"{v} cannot be written to JSON; times and sizes must be finite")
    return json.dumps(v)


def _write(v: Any, indent: int) -> str:
    pad, inner = " " * indent, " " * (indent + 2)
    if isinstance(v, dict):
        if not v:
            return "{}"
        items = [f"{inner}{json.dumps(k)}: {_write(x, indent + 2)}" for k, x in v.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(v, list):
        if all(not isinstance(x, (dict, list)) for x in v):
            return "[" + ", ".join(_scalar(x) for x in v) + "]"
        return "[\n" + ",\n".join(inner + _write(x, indent + 2) for x in v) + "\n" + pad + "]"
    return _scalar(v)
