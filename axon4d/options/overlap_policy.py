"""The overlap policy as plain data (docs/design.md §4): which mechanisms are on and their knobs.

``OverlapPolicy`` is what ``axon4d.init(..., overlap=...)`` and ``axon4d plan --overlap`` accept
(``OverlapPolicy.parse``) and what the planner prices; the scheduler (``axon4d.scheduler``) acts
on it. Mechanisms: OAG (prefetch the next layers' weight all-gathers over z, E10), OAR (the dX
all-reduce E9 overlapped with the dW matmul), ORS (the dW reduce-scatter E11 left running), ODP
(data-parallel and bias all-reduces E12/E13 in buckets, asynchronously), and the chunked forward
all-reduce (E8 split into token chunks).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from axon4d.grid import counts
from axon4d.layout.geometry import chunk_sizes, forward_chunk_count

#: forward chunking where the policy leaves it to the device — (smallest chunk in KiB, row
#: multiple): on the host, chunks as small as 256 KiB pay off and any row count is as good as
#: another; on an accelerator a collective below ~1 MiB is latency-bound (NCCL's ring start-up) and
#: a GEMM whose rows are not a multiple of 128 runs partial tiles (docs/design.md §4)
DEVICE_CHUNKING: dict[str, tuple[float, int]] = {"host": (256.0, 1), "accelerator": (1024.0, 128)}
#: ODP's and ZeRO's bucket size in MiB where the policy leaves it to the device (docs/overlap.md,
#: "Buckets"): on an accelerator 25 MiB, where NCCL's per-call latency is at most ~8% of a data-axis
#: all-reduce's time across nodes on every shipped machine file (bench/bucket_size.py --model) and a
#: bucket in flight costs 25 MiB; on the host 0, one bucket per tensor — the host is where the tests
#: run, and what they count and compare is the per-tensor reduction (bench/bucket_size.py measures what
#: gloo would gain from buckets)
DEVICE_BUCKET_MB: dict[str, float] = {"host": 0.0, "accelerator": 25.0}

MECHANISMS = ("oag", "oar", "ors", "odp", "chunks")
#: the overlap spec by which the planner chooses the knobs for the job (``axon4d.plan.candidate.tune_overlap``)
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class OverlapPolicy:
    """Which overlap mechanisms are on (all by default) and their knobs."""

    oag: bool = True
    """Prefetch the next layer's all-gather of weights over z (E10)."""
    oag_depth: int = 1
    """Layers OAG gathers ahead: each layer's forward (backward) keeps the weight blocks of the next
    ``oag_depth`` layers in forward (reverse) order in flight, so a slow link is never left idle
    between short layers (each block in flight is held until its layer uses it)."""
    oag_keep: bool = False
    """Keep the forward's gathered weight block for backward instead of gathering it again."""
    oar: bool = True
    """Issue the dX all-reduce (E9) before the dW matmul and wait after it."""
    ors: bool = True
    """Leave the dW reduce-scatter over z (E11) running; fold it into .grad later."""
    ors_inflight: int = 1
    """Reduce-scatters ORS leaves running behind the layer whose backward issues the next one:
    that many layers' backward hide each (each holds its layer's dW block until folded)."""
    odp: bool = True
    """Launch the data all-reduces (E12) and bias all-reduces (E13) asynchronously in buckets."""
    bucket_mb: float | None = None
    """ODP's (and ZeRO's all-gather) bucket size in MiB; 0 makes every layer's weight shard (every
    parameter) its own bucket; None: the device's (``DEVICE_BUCKET_MB``, read by ``bucket_bytes``)."""
    forward_chunks: int = 4
    """Split the forward all-reduce (E8) into this many token chunks (1 = one all-reduce)."""
    min_chunk_kb: float | None = None
    """Never make a forward chunk smaller than this (tiny messages gain nothing from chunking);
    None: the device's floor (``DEVICE_CHUNKING``: 256 KiB on the host, 1 MiB on accelerators)."""
    chunk_rows: int | None = None
    """Forward chunks hold whole blocks of this many token rows (the last takes the rows left
    over), so each chunk's GEMM keeps the device's tile shape; None: the device's (1 on the host,
    128 on accelerators)."""

    @classmethod
    def off(cls) -> OverlapPolicy:
        """Every collective waited on where it is issued, as a serial implementation would."""
        return cls(oag=False, oar=False, ors=False, odp=False, forward_chunks=1)

    @classmethod
    def only(cls, *mechanisms: str, **knobs: Any) -> OverlapPolicy:
        """All mechanisms off except ``mechanisms`` (names from ``MECHANISMS``)."""
        unknown = set(mechanisms) - set(MECHANISMS)
        if unknown:
            raise ValueError(f"unknown overlap mechanisms {sorted(unknown)}; choose from {MECHANISMS}")
        base = dataclasses.asdict(cls.off())
        for m in mechanisms:
            base["forward_chunks" if m == "chunks" else m] = cls.forward_chunks if m == "chunks" else True
        base.update(knobs)
        return cls(**base)

    @classmethod
    def parse(cls, spec: OverlapPolicy | bool | str | dict[str, Any] | None) -> OverlapPolicy:
        """A policy from ``True``/``None`` (all on), ``False`` or ``"off"``, ``"all"``, a
        comma-separated list of mechanisms (``"oag,chunks"``), a dict of fields, or a policy.

        A string may also set knobs: ``"all,oag_depth=3"``, ``"oag,ors,ors_inflight=2"``,
        ``"chunks=8"`` (the chunks mechanism with 8 chunks), ``"keep"`` (``oag_keep``). With no
        mechanism named, knobs tune the all-on policy; ``spec`` writes this form."""
        if isinstance(spec, OverlapPolicy):
            return spec
        if spec is None or spec is True or spec == "all":
            return cls()
        if spec is False or spec == "off":
            return cls.off()
        if isinstance(spec, dict):
            fields = {f.name for f in dataclasses.fields(cls)}
            unknown = set(spec) - fields
            if unknown:
                raise ValueError(f"unknown overlap options {sorted(unknown)}; options are {sorted(fields)}")
            return cls(**spec)
        if spec == AUTO:
            raise ValueError(
                "overlap='auto' is chosen by the planner for a model and batch: axon4d.init(overlap='auto', "
                "plan={'model': ..., 'batch': ...}) or axon4d.plan.tune_overlap; give 'all', 'off' or knobs here"
            )
        if isinstance(spec, str):
            return cls._from_string(spec)
        raise ValueError(f"overlap={spec!r}: give True/False, 'all', 'off', 'oag,oar,...', a dict or an OverlapPolicy")

    @classmethod
    def _from_string(cls, spec: str) -> OverlapPolicy:
        """See ``parse``: mechanisms, "all"/"off", "keep" and ``field=value`` knobs."""
        if not spec.strip():
            raise ValueError("overlap '': name 'all', 'off', mechanisms like 'oag,oar', or knobs like 'oag_depth=2'")
        fields = {f.name for f in dataclasses.fields(cls)}
        mechanisms: list[str] = []
        knobs: dict[str, Any] = {}
        base = None
        for item in filter(None, (t.strip() for t in spec.split(","))):
            key, eq, value = item.partition("=")
            if not eq:
                if key in ("all", "off"):
                    base = key
                elif key == "keep":
                    knobs["oag_keep"] = True
                elif key in MECHANISMS:
                    mechanisms.append(key)
                else:
                    raise ValueError(
                        f"unknown overlap mechanisms {[key]} in {spec!r}; choose from "
                        f"{MECHANISMS}, 'all', 'off', 'keep' or knobs like oag_depth=2"
                    )
                continue
            if key == "chunks":
                mechanisms.append("chunks")
                key = "forward_chunks"
            if key not in fields or key in MECHANISMS:
                knob_names = sorted(n for n in fields if n not in MECHANISMS)
                raise ValueError(f"overlap {spec!r}: {key!r} is not a knob; knobs are {knob_names} (and chunks=K)")
            kind, optional = _knob_type(cls, key)
            try:
                if optional and value.lower() == "none":
                    knobs[key] = None  # the knob's automatic choice
                elif kind is bool:
                    knobs[key] = value.lower() in ("1", "true", "yes")
                else:
                    knobs[key] = kind(value)
            except ValueError:
                what = {int: "an integer", float: "a number"}[kind] + (" or none" if optional else "")
                raise ValueError(f"overlap {spec!r}: {key}={value!r}, expected {what}") from None
        if mechanisms and base is None:
            return cls.only(*mechanisms, **knobs)
        if base == "off":
            if mechanisms or knobs:
                raise ValueError(f"overlap {spec!r}: 'off' takes no mechanisms or knobs")
            return cls.off()
        return cls(**knobs)

    def knob_variants(self) -> list[OverlapPolicy]:
        """This policy with its knobs varied over what the planner tries for ``overlap="auto"``:
        OAG depth 1–3 and keep-for-backward (when OAG is on), ORS in flight 1–3 (when ORS is on),
        and 1, 2, 4 or 8 forward chunks (when chunking is on). Mechanisms stay as they are."""
        depths = (1, 2, 3) if self.oag else (self.oag_depth,)
        keeps = (False, True) if self.oag else (self.oag_keep,)
        inflight = (1, 2, 3) if self.ors else (self.ors_inflight,)
        chunks = (1, 2, 4, 8) if self.forward_chunks > 1 else (1,)
        return [
            dataclasses.replace(self, oag_depth=d, oag_keep=k, ors_inflight=r, forward_chunks=c)
            for d in depths
            for k in keeps
            for r in inflight
            for c in chunks
        ]

    def __post_init__(self) -> None:
        rule = (
            f"overlap policy {self}: forward_chunks, ors_inflight and oag_depth must be >= 1 and "
            "bucket_mb, min_chunk_kb >= 0"
        )
        for name in ("forward_chunks", "ors_inflight", "oag_depth"):
            counts.whole(getattr(self, name), name, hint=rule)
        if any(v is not None and v < 0 for v in (self.bucket_mb, self.min_chunk_kb)):
            raise ValueError(rule)
        if self.chunk_rows is not None:
            counts.whole(
                self.chunk_rows, "chunk_rows", hint=f"overlap policy {self}: chunk_rows must be >= 1, e.g. 128"
            )

    def spec(self) -> str:
        """The mechanisms that are on and the knobs off their defaults that the planner prices, as
        ``parse`` reads them: e.g. "oag,oar,ors,odp,chunks=4" (the default), "oag,keep,oag_depth=2",
        "all,bucket_mb=25" is "oag,oar,ors,odp,chunks=4,bucket_mb=25", "off"."""
        on = [n for n in ("oag", "oar", "ors", "odp") if getattr(self, n)]
        if self.forward_chunks > 1:
            on.append(f"chunks={self.forward_chunks}")
        if self.oag_keep:
            on.append("keep")
        if self.oag and self.oag_depth > 1:
            on.append(f"oag_depth={self.oag_depth}")
        if self.ors and self.ors_inflight > 1:
            on.append(f"ors_inflight={self.ors_inflight}")
        # the knobs whose default is the device's choice, where set (the buckets, the chunks' floor)
        on += [
            f"{k}={getattr(self, k):g}"
            for k in ("bucket_mb", "min_chunk_kb", "chunk_rows")
            if getattr(self, k) is not None
        ]
        return ",".join(on) or "off"

    def chunking(self, accelerator: bool) -> tuple[int, int]:
        """(smallest forward chunk in bytes, rows a chunk is a multiple of) on a device that is an
        accelerator or not: the policy's knobs where set, else the device's (``DEVICE_CHUNKING``)."""
        floor_kb, rows = DEVICE_CHUNKING["accelerator" if accelerator else "host"]
        floor_kb = floor_kb if self.min_chunk_kb is None else self.min_chunk_kb
        return int(floor_kb * 1024), rows if self.chunk_rows is None else self.chunk_rows

    def bucket_bytes(self, accelerator: bool) -> int:
        """Bytes a bucket of ODP's data-axis reductions (E12, E13, the replicated gradients) and of
        ZeRO's all-gathers over data holds before it is issued, on a device that is an accelerator or
        not: the policy's ``bucket_mb`` where set, else the device's (``DEVICE_BUCKET_MB``); 0: one
        tensor per bucket. The scheduler, ``axon4d.zero`` and the planner read it here alike."""
        mb = DEVICE_BUCKET_MB["accelerator" if accelerator else "host"] if self.bucket_mb is None else self.bucket_mb
        return int(mb * 2**20)

    def chunk_count(self, tokens: int, row_bytes: int, group: int, accelerator: bool = False) -> int:
        """How many chunks ``chunk_sizes`` makes."""
        return len(self.chunk_sizes(tokens, row_bytes, group, accelerator))

    def chunk_sizes(self, tokens: int, row_bytes: int, group: int, accelerator: bool = False) -> list[int]:
        """Rows of each chunk a forward all-reduce of ``tokens`` rows of ``row_bytes`` over a group of
        ``group`` ranks is issued in (``geometry.forward_chunk_count`` and ``chunk_sizes``)."""
        floor, rows = self.chunking(accelerator)
        k = forward_chunk_count(tokens, row_bytes, self.forward_chunks, floor, group, rows)
        return chunk_sizes(tokens, k, rows)


def _knob_type(cls: type[OverlapPolicy], name: str) -> tuple[type, bool]:
    """The type of the knob ``name`` of ``cls`` (int, float or bool) and whether it may be None (the
    automatic choice), read from the field's annotation."""
    annotation = str(next(f.type for f in dataclasses.fields(cls) if f.name == name))
    parts = [p.strip() for p in annotation.split("|")]
    kinds = {"int": int, "float": float, "bool": bool}
    return kinds[next(p for p in parts if p in kinds)], "None" in parts
