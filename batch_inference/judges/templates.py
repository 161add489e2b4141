"""Prompt templates: ``{field}`` placeholders filled from a record.

Uses ``str.format`` syntax, so nested access (``{meta[lang]}``), conversions and
format specs work and ``{{``/``}}`` are literal braces. A field the record lacks raises
``MissingFieldError`` naming the field and the record's id, so that one record fails
with a reason and the rest go on. A field that is null (JSON ``null``, a Parquet null) is
no value either: by default it fails its record the same way (``nulls="error"``) instead
of rendering as the string ``"None"``; ``nulls="empty"`` renders it as ``""`` (the spec's
``infer.null_fields`` / ``judge.null_fields``). An input field the run keeps aside because
the run writes a field of its name (``rows.INPUT``) fills a placeholder the record's own
fields do not.
"""

from __future__ import annotations

import string
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from batch_inference.rows import ErrorKind, input_fields

_FORMATTER = string.Formatter()

NullFields = Literal["error", "empty"]
MISSING = object()  # ``PromptTemplate.values``: the record has no such field


class MissingFieldError(KeyError):
    """A template placeholder the record cannot fill."""

    def __init__(self, field: str, record_id: Any, *, null: bool = False) -> None:
        super().__init__(field)
        self.field = field
        self.record_id = record_id
        self.null = null  # the field is there, but null

    def __str__(self) -> str:
        if self.null:
            return ErrorKind.MISSING_FIELD.tag(f"template field {{{self.field}}} is null in record {self.record_id!r} "
                                               "(null_fields: empty renders a null as '')")
        return ErrorKind.MISSING_FIELD.tag(f"template field {{{self.field}}} not found in record {self.record_id!r}")


class _Fields:
    """A record's fields as a template sees them: the run's own first (``{result}`` in a judge
    template is the answer), then the input's fields the shard step kept aside because the run
    writes fields of their names (``rows.input_fields``: an input column ``status``)."""

    def __init__(self, record: Mapping[str, Any]) -> None:
        self.record = record

    def __getitem__(self, key: str) -> Any:
        if key in self.record:
            return self.record[key]
        return input_fields(self.record)[key]


class PromptTemplate:
    """A validated template; ``render(record)`` gives the prompt. ``nulls``: what a null field
    renders as (``error``: its record fails ``missing_field``; ``empty``: ``""``)."""

    def __init__(self, template: str, *, nulls: NullFields = "error") -> None:
        try:
            parts = list(_FORMATTER.parse(template))
        except ValueError as exc:
            raise ValueError(f"invalid prompt template {template[:60]!r}: {exc}") from exc
        for _, field, _, _ in parts:
            if field is not None and (field == "" or field.isdigit()):
                raise ValueError(f"invalid prompt template {template[:60]!r}: positional field {{{field}}}; name a record field")
        self.template = template
        self.nulls = nulls
        self._parts = parts

    @property
    def fields(self) -> list[str]:
        """The placeholders, as written (e.g. ``meta[lang]``)."""
        return [f for _, f, _, _ in self._parts if f is not None]

    def values(self, record: dict[str, Any]) -> Iterator[tuple[str, Any]]:
        """Each placeholder and the record's value for it (``MISSING`` when it has none), as
        ``render`` would look it up: what ``validate`` counts missing, null and empty fields by."""
        for _, field, _, _ in self._parts:
            if field is not None:
                yield field, _lookup(field, record)

    def render(self, record: dict[str, Any]) -> str:
        out: list[str] = []
        for literal, field, spec, conversion in self._parts:
            out.append(literal)
            if field is None:
                continue
            value = _lookup(field, record)
            if value is MISSING:
                raise MissingFieldError(field, record.get("id"))
            if value is None:
                if self.nulls == "error":
                    raise MissingFieldError(field, record.get("id"), null=True)
                value = ""
            out.append(_FORMATTER.format_field(_FORMATTER.convert_field(value, conversion), spec or ""))
        return "".join(out)

    def __repr__(self) -> str:
        return f"PromptTemplate({self.template!r})"


def _lookup(field: str, record: dict[str, Any]) -> Any:
    """The record's value for a placeholder (``meta[lang]`` included), or ``MISSING``."""
    try:
        return _FORMATTER.get_field(field, (), _Fields(record))[0]
    except (KeyError, IndexError, AttributeError, TypeError):
        return MISSING
