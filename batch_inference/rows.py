"""The row schema: the fields a result row carries, its statuses and its error kinds.

One module every layer reads (pool tasks write rows, pipeline passes repack and
classify them, the ledger counts them, reports show them), so the vocabulary is
defined once. It imports nothing of the project.

- A new **output field** a task writes goes into ``RESULT_FIELDS``: every task strips
  those from its input (a record re-inferred in a later round must not carry the
  previous round's value) and recompaction drops them before the next round.
- A new **error kind** goes into ``ErrorKind`` (and into ``PERMANENT`` when retrying the
  record cannot help): errors are strings tagged ``"<kind>: detail"``; ``ErrorKind.of``
  reads the tag back (``ErrorKind.parse`` with its detail), so nothing else parses
  prefixes and no other module spells a tag as a string literal
  (``batch_inference_tests/test_rows.py`` checks the package for them).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any


class Status(StrEnum):
    """A row's ``status`` field; the last four are the terminal states conservation counts."""

    APPROVED = "approved"  # the judge approved it (results/)
    ERROR = "error"  # tail: the record's own failure (tail/unfinished/, counted failed)
    MAX_ATTEMPTS = "max_attempts"  # tail: every attempt rejected (tail/unfinished/)
    EXHAUSTED = "exhausted"  # rounds: still rejected at max_rounds (exhausted/)
    FAILED = "failed"  # a permanent error (round-NN/failed-records/) or a quarantined shard
    # Not terminal: a terminal-state-to-be. The record waits in a round's review queue
    # (round-NN/review/queue/) for a human verdict; conservation counts it as awaiting.
    AWAITING_REVIEW = "awaiting_review"


TERMINAL_STATES: tuple[Status, ...] = (Status.APPROVED, Status.EXHAUSTED, Status.MAX_ATTEMPTS, Status.FAILED)


class ErrorKind(StrEnum):
    """The tag an error string starts with (``"prompt_too_long: 5000 prompt tokens ..."``)."""

    # engines, per item
    PROMPT_TOO_LONG = "prompt_too_long"
    EMPTY_PROMPT = "empty_prompt"
    TOKENIZER_ERROR = "tokenizer_error"
    CHAT_TEMPLATE_ERROR = "chat_template_error"
    ENGINE_ERROR = "engine_error"
    SIMULATED_ERROR = "simulated_error"
    UNSUPPORTED_RESPONSE_FORMAT = "unsupported_response_format"  # a constrained request, an engine that cannot
    TRUNCATED_OUTPUT = "truncated_output"  # constrained output cut by max_tokens: not schema-valid (retryable)
    SCHEMA_INVALID = "schema_invalid"  # constrained output that is not strict JSON or fails its schema (retryable)
    # a record that cannot become a request (prompting.RequestError)
    BAD_MESSAGES = "bad_messages"
    BAD_SAMPLING = "bad_sampling"
    BAD_REQUEST = "bad_request"
    # templates and judges
    MISSING_FIELD = "missing_field"
    JUDGE_ERROR = "judge_error"
    RULE_ERROR = "rule_error"
    UNPARSEABLE_VERDICT = "unparseable_verdict"
    # a judge task's rejection of a row whose inference failed
    INFERENCE_ERROR = "inference_error"

    def tag(self, detail: str) -> str:
        """``"<kind>: <detail>"``, the form every layer writes."""
        return f"{self.value}: {detail}"

    @property
    def permanent(self) -> bool:
        """Retrying fails the same record the same way: it ends ``failed`` at once."""
        return self in PERMANENT

    @classmethod
    def parse(cls, text: object) -> tuple[ErrorKind, str] | None:
        """``(kind, detail)`` of a tagged error; None for an untagged error (or not a string)."""
        if not isinstance(text, str):
            return None
        head, _, detail = text.partition(":")
        try:
            return cls(head.strip()), detail.strip()
        except ValueError:
            return None

    @classmethod
    def of(cls, text: object) -> ErrorKind | None:
        """The kind ``text`` is tagged with; None for an untagged error (or not a string)."""
        parsed = cls.parse(text)
        return parsed[0] if parsed is not None else None

    @classmethod
    def checked(cls, text: str) -> str:
        """``text`` when it is tagged with a kind, else ValueError: an error an engine or task
        reports for one item must say its kind, or a misspelt tag would read as untagged
        (retryable) instead of its own kind."""
        if cls.of(text) is None:
            raise ValueError(f"an item's error must start with an ErrorKind tag (ErrorKind.<KIND>.tag(...)), got {text[:80]!r}")
        return text


# Batch-level exceptions and engine_error stay retryable (the next round / attempt may pass).
PERMANENT: frozenset[ErrorKind] = frozenset({
    ErrorKind.PROMPT_TOO_LONG, ErrorKind.EMPTY_PROMPT, ErrorKind.MISSING_FIELD, ErrorKind.TOKENIZER_ERROR,
    ErrorKind.SIMULATED_ERROR, ErrorKind.BAD_MESSAGES, ErrorKind.BAD_SAMPLING, ErrorKind.BAD_REQUEST,
    ErrorKind.CHAT_TEMPLATE_ERROR, ErrorKind.UNSUPPORTED_RESPONSE_FORMAT,
})


# Fields a task writes (infer: result, error, finish_reason, stop_sequence, usage; judge: verdict,
# rejection, status, round; retry: status, result, error, verdict; human review: review).
# ``id`` and ``attempts`` travel with the record across rounds and are never stripped.
RESULT_FIELDS: tuple[str, ...] = ("result", "error", "finish_reason", "usage", "verdict", "rejection", "status", "round", "review",
                                   "cached", "stop_sequence")


# The input's own view of a record, kept by the shard step under one key the run never writes
# otherwise: ``{"row": <0-based position in the input>, "fields": {<input fields named as the
# run's>}}``. A field of the input named as one the run writes (``RUN_FIELDS``: a Parquet column
# ``status``, a JSONL field ``usage``) is moved under ``fields`` instead of being overwritten by
# the run, so the exports give it back as it was; ``row`` lets the Parquet export write the
# input's order back.
INPUT = "_input"
RUN_FIELDS: frozenset[str] = frozenset(RESULT_FIELDS) | {"attempts", "reason", "failed_round", "last_error", INPUT}


def from_input(record: Mapping[str, Any], row: int, reserved: frozenset[str] = RUN_FIELDS) -> dict[str, Any]:
    """An input record as the run carries it: its fields named in ``reserved`` moved under
    ``INPUT["fields"]``, its position ``row`` recorded (``INPUT["row"]``)."""
    clash = {k: v for k, v in record.items() if k in reserved}
    out = {k: v for k, v in record.items() if k not in reserved} if clash else dict(record)
    out[INPUT] = {"row": row, "fields": clash} if clash else {"row": row}
    return out


def input_fields(row: Mapping[str, Any]) -> Mapping[str, Any]:
    """The input fields ``from_input`` moved aside (empty for a record that had none)."""
    kept = row.get(INPUT)
    return kept.get("fields") or {} if isinstance(kept, Mapping) else {}


def input_value(row: Mapping[str, Any], name: str) -> Any:
    """The input's value of field ``name``: the one kept aside when the run writes a field of that name."""
    kept = input_fields(row)
    return kept[name] if name in kept else row.get(name)


def input_row(row: Mapping[str, Any]) -> int | None:
    """The record's 0-based position in the input, when the shard step recorded it."""
    kept = row.get(INPUT)
    return kept.get("row") if isinstance(kept, Mapping) else None


def strip_results(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record without any previous round's result fields (``RESULT_FIELDS``)."""
    return {k: v for k, v in record.items() if k not in RESULT_FIELDS}


def permanent_error(row: Mapping[str, Any]) -> str | None:
    """The row's inference error when retrying it cannot help, else None."""
    error = row.get("error")
    kind = ErrorKind.of(error)
    return error if kind is not None and kind.permanent else None  # type: ignore[return-value]


def error_text(exc: BaseException) -> str:
    """An exception as a row's error: a tagged message as is, else ``Type: message``."""
    text = str(exc)
    return text if ErrorKind.of(text) is not None else f"{type(exc).__name__}: {text}"


__all__ = ["INPUT", "PERMANENT", "RESULT_FIELDS", "RUN_FIELDS", "TERMINAL_STATES", "ErrorKind", "Status", "error_text",
           "from_input", "input_fields", "input_row", "input_value", "permanent_error", "strip_results"]
