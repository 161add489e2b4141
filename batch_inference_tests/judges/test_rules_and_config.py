"""Rule judges, built-in rules, JudgeConfig validation and the factory."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from batch_inference.judges import JudgeConfig, LLMJudge, RuleJudge, Verdict, build_judge


def returns_tuple(record: dict, result: str, *, word: str = "ok") -> tuple[bool, str]:
    return word in result, f"looked for {word}"


def explodes(record: dict, result: str) -> bool:
    return record["missing"] == result


def test_regex_rule() -> None:
    judge = build_judge({"kind": "rule", "callable": "regex", "kwargs": {"pattern": r"^\d+$"}})
    assert judge.judge({}, "123").approved and not judge.judge({}, "12a").approved
    on_field = RuleJudge("regex", {"pattern": "fr", "field": "lang", "ignore_case": True})
    assert on_field.judge({"lang": "FR"}, "").approved


def test_exact_match_normalises() -> None:
    judge = RuleJudge("exact_match", {"reference_field": "answer"})
    assert judge.judge({"answer": "Paris"}, "  paris. ").approved
    assert not judge.judge({"answer": "Paris"}, "Lyon").approved
    assert not RuleJudge("exact_match", {"reference_field": "answer", "normalise": False}).judge({"answer": "Paris"}, "paris").approved


def test_json_valid_with_required_keys() -> None:
    judge = RuleJudge("json_valid", {"required_keys": ["name"]})
    assert judge.judge({}, '{"name": "x"}') == Verdict(True, "json_valid")
    assert judge.judge({}, '{"other": 1}').reason == "json_missing_keys: name"
    assert judge.judge({}, "[1]").reason == "json_not_object"
    assert judge.judge({}, "{not json").reason.startswith("invalid_json")
    assert RuleJudge("json_valid").judge({}, "[1, 2]").approved


def test_min_length() -> None:
    judge = RuleJudge("min_length", {"min_chars": 3})
    assert judge.judge({}, " abc ").approved and not judge.judge({}, " ab ").approved


def test_custom_callable_by_import_path() -> None:
    judge = build_judge({"kind": "rule", "callable": f"{__name__}:returns_tuple", "kwargs": {"word": "yes"}})
    assert judge.judge({}, "oh yes") == Verdict(True, "looked for yes")


def test_rule_error_is_a_per_record_rejection() -> None:
    judge = RuleJudge(explodes)
    v = judge.judge({"id": "1"}, "x")
    assert not v.approved and v.reason.startswith("rule_error: KeyError")
    assert RuleJudge("exact_match").judge({"id": "2"}, "x").reason.startswith("rule_error: KeyError")


def test_bad_rule_configs_fail_at_build_time() -> None:
    with pytest.raises(ValueError, match="cannot be imported"):
        build_judge({"kind": "rule", "callable": "no_such_module_xyz:fn"})
    with pytest.raises(ValueError, match="built-in"):
        build_judge({"kind": "rule", "callable": "not_a_rule"})
    with pytest.raises(ValueError, match="does not accept kwargs"):
        build_judge({"kind": "rule", "callable": "regex", "kwargs": {"patern": "x"}})
    with pytest.raises(ValueError, match="invalid prompt template"):
        build_judge({"kind": "llm", "template": "{unclosed"})


def test_judge_config_validation() -> None:
    with pytest.raises(ValidationError, match="needs 'template'"):
        JudgeConfig(kind="llm")
    with pytest.raises(ValidationError, match="needs 'callable'"):
        JudgeConfig(kind="rule")
    with pytest.raises(ValidationError, match="extra"):
        JudgeConfig(kind="rule", callable="regex", kwarg={})
    judge = build_judge(JudgeConfig(kind="llm", template="{result}", parse="score", threshold=7))
    assert isinstance(judge, LLMJudge) and judge.parse("Score: 8").approved
