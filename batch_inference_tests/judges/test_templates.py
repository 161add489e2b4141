"""Prompt templates: placeholders, nested access, missing fields."""

from __future__ import annotations

import pytest

from batch_inference.judges import MissingFieldError, PromptTemplate


def test_render_fields_nested_and_literal_braces() -> None:
    t = PromptTemplate("Translate to {meta[lang]}: {prompt} {{json}} {n:03d}")
    assert t.render({"id": "a", "prompt": "hello", "meta": {"lang": "fr"}, "n": 7}) == "Translate to fr: hello {json} 007"
    assert t.fields == ["meta[lang]", "prompt", "n"]


@pytest.mark.parametrize("record", [{"id": "r1"}, {"id": "r1", "prompt": "x"}, {"id": "r1", "prompt": "x", "meta": {}}])
def test_missing_field_names_field_and_record(record: dict) -> None:
    t = PromptTemplate("{prompt} {meta[lang]}")
    with pytest.raises(MissingFieldError) as info:
        t.render(record)
    assert info.value.record_id == "r1" and info.value.field in ("prompt", "meta[lang]")
    assert "r1" in str(info.value) and info.value.field in str(info.value)


@pytest.mark.parametrize("bad", ["{unclosed", "{}", "{0}", "close}"])
def test_invalid_templates_fail_at_construction(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid prompt template"):
        PromptTemplate(bad)
