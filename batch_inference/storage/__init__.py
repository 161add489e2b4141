"""Storage layer: streaming JSONL shards on any fsspec URL, plus the checkpoint store.

``JsonlFile`` / ``JsonlDir`` keep the reference design's names and semantics (streaming
reads in bounded chunks, rotation, sorted shards) and add atomic commits, a manifest,
clear errors and a quarantine sink. See docs/storage.md.
"""

from batch_inference.storage import urls
from batch_inference.storage.checkpoints import CheckpointStore
from batch_inference.storage.errors import ConcurrentWriteError, CorruptShardError, MalformedRecordError, UnreadableInputError
from batch_inference.storage.directory import DirManifest, JsonlDir, JsonlDirWriter, SyncJsonlDirWriter
from batch_inference.storage.file import JsonlFile, JsonlWriter, QuarantineSink, SyncJsonlWriter
from batch_inference.storage.reshard import ReshardReport, assigned_id, reshard
from batch_inference.storage.sources import input_format, open_source
from batch_inference.storage.urls import fs_for, is_under, join

__all__ = [
    "CheckpointStore",
    "ConcurrentWriteError",
    "CorruptShardError",
    "DirManifest",
    "JsonlDir",
    "JsonlDirWriter",
    "JsonlFile",
    "JsonlWriter",
    "MalformedRecordError",
    "QuarantineSink",
    "ReshardReport",
    "assigned_id",
    "SyncJsonlDirWriter",
    "SyncJsonlWriter",
    "UnreadableInputError",
    "fs_for",
    "input_format",
    "is_under",
    "join",
    "open_source",
    "reshard",
    "urls",
]
