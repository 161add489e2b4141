"""Prompt templates: ``{field}`` placeholders filled from a record.

Uses ``str.format`` syntax, so nested access (``{meta[lang]}``), conversions and
format specs work and ``{{``/``}}`` are literal braces. A field the record lacks raises
``MissingFieldError`` naming the field and the record's id, so that one record fails
with a reason and the rest go on. An input field the run keeps aside because the run
writes a field of its name (``rows.INPUT``) fills a placeholder the record's own fields do not.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any

from batch_inference.rows import ErrorKind, input_fields

_FORMATTER = string.Formatter()


class MissingFieldError(KeyError):
    """A template placeholder the record cannot fill."""

    def __init__(self, field: str, record_id: Any) -> None:
        super().__init__(field)
        self.field = field
        self.record_id = record_id

    def __str__(self) -> str:
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
    """A validated template; ``render(record)`` gives the prompt."""

    def __init__(self, template: str) -> None:
        try:
            parts = list(_FORMATTER.parse(template))
        except ValueError as exc:
            raise ValueError(f"invalid prompt template {template[:60]!r}: {exc}") from exc
        for _, field, _, _ in parts:
            if field is not None and (field == "" or field.isdigit()):
                raise ValueError(f"invalid prompt template {template[:60]!r}: positional field {{{field}}}; name a record field")
        self.template = template
        self._parts = parts

    @property
    def fields(self) -> list[str]:
        """The placeholders, as written (e.g. ``meta[lang]``)."""
        return [f for _, f, _, _ in self._parts if f is not None]

    def render(self, record: dict[str, Any]) -> str:
        out: list[str] = []
        for literal, field, spec, conversion in self._parts:
            out.append(literal)
            if field is None:
                continue
            try:
                value, _ = _FORMATTER.get_field(field, (), _Fields(record))
            except (KeyError, IndexError, AttributeError, TypeError):
                raise MissingFieldError(field, record.get("id")) from None
            out.append(_FORMATTER.format_field(_FORMATTER.convert_field(value, conversion), spec or ""))
        return "".join(out)

    def __repr__(self) -> str:
        return f"PromptTemplate({self.template!r})"
