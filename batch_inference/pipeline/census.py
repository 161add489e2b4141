"""What preflight counts over the sampled records, apart from the checks that use it.

``Misses``: the sampled records that lack what a spec key needs, and whether that is the
spec's error (nearly all lack it) or those records' own. ``FieldCensus``: template fields
missing, null or empty over the records read, for ``validate`` to print.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from batch_inference.judges.templates import MISSING, PromptTemplate
from batch_inference.pipeline.spec import PipelineSpec, SpecError
from batch_inference.storage import assigned_id

SPEC_ERROR_SHARE = 0.9  # a field missing from at least this share of the sample is the spec's error


@dataclass
class Misses:
    """Sampled records that lack what a spec key needs (a template's field, a rule's field, a
    prompt). When (nearly) every sampled record lacks it, the spec is wrong (a typo'd
    placeholder): a ``SpecError``. When only some do, those records are bad: each fails
    alone at run time with its ``missing_field`` error, and the run goes on."""

    sampled: int
    by_key: dict[str, list[str]] = field(default_factory=dict)

    def add(self, key: str, message: str) -> None:
        self.by_key.setdefault(key, []).append(message)

    def raise_or_list(self) -> list[str]:
        """Raise the ``SpecError`` of a key (nearly) every sampled record misses; else the misses, as warnings."""
        bar = max(1, math.ceil(SPEC_ERROR_SHARE * self.sampled))
        for key, messages in self.by_key.items():
            if len(messages) >= bar:
                share = "all" if len(messages) == self.sampled else f"{len(messages)} of the"
                raise SpecError(f"{key}: {messages[0]} (so do {share} {self.sampled} record(s) sampled across the input: "
                                "a typo in the spec?)")
        return [f"{key}: {m} (that record fails alone, the run goes on)" for key, ms in self.by_key.items() for m in ms]


FIELD_EXAMPLES = 3  # records named per field in a census note


@dataclass
class FieldCount:
    """One template field's records that lack it, hold null, or hold an empty string (a few ids each)."""

    missing: int = 0
    null: int = 0
    empty: int = 0
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, what: str, rid: str) -> None:
        setattr(self, what, getattr(self, what) + 1)
        named = self.examples.setdefault(what, [])
        if len(named) < FIELD_EXAMPLES:
            named.append(rid)


@dataclass
class FieldCensus:
    """Template fields over the records read: how many records would fail ``missing_field``
    (a field missing, or null under ``null_fields: error``) and which fields are empty
    strings (legal: the prompt renders without them, which is rarely what was meant). A
    count per spec key and field, with a few record ids, for ``validate`` to print."""

    templates: dict[str, tuple[PromptTemplate, ...]]
    fields: dict[tuple[str, str], FieldCount] = field(default_factory=dict)
    failing: dict[str, int] = field(default_factory=dict)  # spec key -> records that would fail on it
    records: int = 0

    @classmethod
    def of(cls, spec: PipelineSpec) -> FieldCensus | None:
        """The census of the spec's templates (None when the prompt is the record's own and no llm judge has one)."""
        infer = spec.request_infer
        templates: dict[str, tuple[PromptTemplate, ...]] = {}
        try:
            if infer.template is not None:
                templates["infer.template"] = (PromptTemplate(infer.template, nulls=infer.null_fields),)
            elif infer.messages:
                templates["infer.messages"] = tuple(PromptTemplate(m.content, nulls=infer.null_fields) for m in infer.messages)
            if spec.judge.kind == "llm" and spec.judge.template:
                templates["judge.template"] = (PromptTemplate(spec.judge.template, nulls=spec.judge.null_fields),)
        except ValueError:  # a template that does not parse: the builder says so, naming its key
            return None
        return cls(templates) if templates else None

    def add(self, line: int, rec: dict[str, Any]) -> None:
        self.records += 1
        rid = str(rec.get("id", assigned_id(line)))
        for key, templates in self.templates.items():
            fails = False
            for template in templates:
                for name, value in template.values(rec):
                    if key == "judge.template" and name.split("[")[0].split(".")[0] == "result":
                        continue  # the inference result, not a record field
                    if value is MISSING:
                        what = "missing"
                    elif value is None:
                        what = "null"
                    elif isinstance(value, str) and not value.strip():
                        what = "empty"
                    else:
                        continue
                    self.fields.setdefault((key, name), FieldCount()).add(what, rid)
                    fails = fails or what == "missing" or (what == "null" and template.nulls == "error")
            if fails:
                self.failing[key] = self.failing.get(key, 0) + 1

    def notes(self) -> list[str]:
        """One line per spec key with failing records, one per field with empty strings."""
        out = []
        for key, n in self.failing.items():
            parts = []
            for (k, name), c in self.fields.items():
                if k != key:
                    continue
                for what in ("missing", "null"):
                    if getattr(c, what) and (what == "missing" or self.templates[key][0].nulls == "error"):
                        parts.append(f"{{{name}}} {what} in {getattr(c, what):,} (e.g. {quoted_ids(c.examples[what])})")
            out.append(f"{key}: {n:,} of {self.records:,} record(s) read would fail missing_field: {'; '.join(parts)} "
                       f"(each fails alone, the run goes on{'; null_fields: empty renders a null as an empty string' if any('null in' in p for p in parts) else ''})")
        for (key, name), c in self.fields.items():
            if c.empty:
                out.append(f"{key}: {{{name}}} is an empty string in {c.empty:,} of {self.records:,} record(s) read "
                           f"(e.g. {quoted_ids(c.examples['empty'])}): legal, but each prompt renders without it")
            if c.null and self.templates[key][0].nulls == "empty":
                out.append(f"{key}: {{{name}}} is null in {c.null:,} of {self.records:,} record(s) read "
                           f"(e.g. {quoted_ids(c.examples['null'])}): rendered empty (null_fields: empty)")
        return out


def quoted_ids(ids: list[str]) -> str:
    return ", ".join(repr(i) for i in ids)
