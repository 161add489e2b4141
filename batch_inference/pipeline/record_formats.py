"""The record formats an input's records may be in, one registry: native records, OpenAI
Batch request lines, or a format registered here.

A stored format (``storage.sources``: JSONL, Parquet) says how records are read from files;
a record format says what those records are. Each is recognised by the input's first record
(``looks_like``: its magic) and turned into the run's records in the one sharding pass by a
reader built for the run (``reader(spec).convert(raw, line)``); every later step sees native
records only. ``pipeline.inputs.resolve_format`` picks one (``input_format: auto``), the
shard step and the preflight convert through it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from batch_inference.pipeline.spec import PipelineSpec
from batch_inference.prompting.openai_batch import OpenAIBatchReader, looks_like_openai_batch
from batch_inference.registry import Registry


class RecordReader(Protocol):
    """Converts one input record (0-based ``pos``: its line) into a native record."""

    def convert(self, raw: dict[str, Any], pos: int) -> dict[str, Any]: ...


@dataclass(frozen=True)
class RecordFormat:
    """One record format: its name (``input_format``), how its first record is recognised,
    and the reader that converts its records for a run (None: native, read as they are)."""

    name: str
    looks_like: Callable[[Any], bool] | None = None  # None: never detected (the default, native)
    reader: Callable[[PipelineSpec], RecordReader] | None = None
    own_ids: bool = False  # the format names each record's id (OpenAI's custom_id): ``id_field`` is refused


def openai_reader(spec: PipelineSpec) -> OpenAIBatchReader:
    """The converter for this run: the models it answers, whether its engine constrains output."""
    return OpenAIBatchReader(models=spec.accepted_models(), constrains=spec.engine.structured_output,
                             embeds=spec.infer.task == "embed")


NATIVE = RecordFormat("jsonl")
OPENAI_BATCH = RecordFormat("openai_batch", looks_like=looks_like_openai_batch, reader=openai_reader, own_ids=True)

_FORMATS: Registry[RecordFormat] = Registry("record format", (NATIVE, OPENAI_BATCH))


def register_record_format(fmt: RecordFormat) -> RecordFormat:
    """Add a record format (a name already taken is an error)."""
    return _FORMATS.add(fmt)


def unregister_record_format(name: str) -> None:
    """Remove a format (tests that register one of their own); the built-in ones stay."""
    _FORMATS.remove(name)


def record_format(name: str) -> RecordFormat:
    """The format ``name``; a stored format's name (``parquet``) reads native records."""
    return _FORMATS.get(name, NATIVE)


def detect(first: dict[str, Any] | None) -> RecordFormat:
    """The format whose ``looks_like`` knows the input's first record, else native."""
    if first is not None:
        for fmt in _FORMATS.values():
            if fmt.looks_like is not None and fmt.looks_like(first):
                return fmt
    return NATIVE
