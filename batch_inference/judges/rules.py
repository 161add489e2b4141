"""Rule judges: a Python callable decides, no model involved.

A rule is ``fn(record, result, **kwargs)`` returning a ``Verdict``, a bool, or
``(approved, reason)``. It is named by import path ``"module:fn"`` or by a built-in name
(``regex``, ``exact_match``, ``json_valid``, ``min_length``). A rule that raises for a
record gives ``Verdict(False, "rule_error: ...")`` for that record only.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from batch_inference.judges.kinds import JudgeKind, register_judge_kind
from batch_inference.judges.verdicts import Verdict
from batch_inference.rows import ErrorKind

Rule = Callable[..., "Verdict | bool | tuple[bool, str]"]


def _text(record: dict[str, Any], result: str, field: str | None) -> str:
    return result if field is None else str(record[field])


def regex(record: dict[str, Any], result: str, *, pattern: str, field: str | None = None,
          ignore_case: bool = False, fullmatch: bool = False) -> Verdict:
    """The result (or ``record[field]``) matches ``pattern`` (search, or fullmatch)."""
    flags = re.IGNORECASE if ignore_case else 0
    text = _text(record, result, field)
    ok = (re.fullmatch if fullmatch else re.search)(pattern, text, flags) is not None
    return Verdict(ok, "regex_match" if ok else f"regex_no_match: {pattern}")


def _normalise(text: str) -> str:
    return " ".join(str(text).split()).casefold().strip(" .!?")


def exact_match(record: dict[str, Any], result: str, *, reference_field: str = "reference",
                normalise: bool = True) -> Verdict:
    """The result equals ``record[reference_field]`` (case, spacing and end punctuation ignored)."""
    reference = record[reference_field]
    ok = _normalise(result) == _normalise(reference) if normalise else result == reference
    return Verdict(ok, "exact_match" if ok else f"mismatch_with_{reference_field}")


def json_valid(record: dict[str, Any], result: str, *, required_keys: Sequence[str] = ()) -> Verdict:
    """The result parses as JSON (an object holding ``required_keys`` when given)."""
    try:
        value = orjson.loads(result)
    except orjson.JSONDecodeError as exc:
        return Verdict(False, f"invalid_json: {exc}")
    if required_keys:
        if not isinstance(value, dict):
            return Verdict(False, "json_not_object")
        missing = [k for k in required_keys if k not in value]
        if missing:
            return Verdict(False, f"json_missing_keys: {','.join(missing)}")
    return Verdict(True, "json_valid")


def min_length(record: dict[str, Any], result: str, *, min_chars: int = 1, field: str | None = None) -> Verdict:
    """The stripped result (or ``record[field]``) has at least ``min_chars`` characters."""
    n = len(_text(record, result, field).strip())
    return Verdict(n >= min_chars, "long_enough" if n >= min_chars else f"too_short: {n} < {min_chars} chars")


BUILTIN_RULES: dict[str, Rule] = {
    "regex": regex,
    "exact_match": exact_match,
    "json_valid": json_valid,
    "min_length": min_length,
}


def load_rule(name: str) -> Rule:
    """A built-in rule name or an import path ``"module:fn"``."""
    if name in BUILTIN_RULES:
        return BUILTIN_RULES[name]
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"rule {name!r}: use a built-in ({', '.join(BUILTIN_RULES)}) or an import path 'module:fn'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"rule {name!r} cannot be imported: {exc}") from exc
    if not callable(fn):
        raise ValueError(f"rule {name!r} is not callable")
    return fn


def _as_verdict(value: Any) -> Verdict:
    if isinstance(value, Verdict):
        return value
    if isinstance(value, bool):
        return Verdict(value, "rule_approved" if value else "rule_rejected")
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], bool):
        return Verdict(value[0], str(value[1]))
    raise TypeError(f"a rule must return Verdict, bool or (bool, reason), got {type(value).__name__}")


class RuleJudge:
    """Applies one rule to (record, result); never raises for a record."""

    def __init__(self, rule: str | Rule, kwargs: dict[str, Any] | None = None) -> None:
        self.fn = load_rule(rule) if isinstance(rule, str) else rule
        self.name = rule if isinstance(rule, str) else getattr(rule, "__name__", repr(rule))
        self.kwargs = dict(kwargs or {})
        try:  # bad kwargs are a config error, caught before any record is judged
            inspect.signature(self.fn).bind({}, "", **self.kwargs)
        except TypeError as exc:
            raise ValueError(f"rule {self.name!r} does not accept kwargs {sorted(self.kwargs)}: {exc}") from exc
        except ValueError:  # no signature (builtins): checked on first call instead
            pass

    def judge(self, record: dict[str, Any], result: str) -> Verdict:
        try:
            return _as_verdict(self.fn(record, result, **self.kwargs))
        except Exception as exc:
            return Verdict(False, ErrorKind.RULE_ERROR.tag(f"{type(exc).__name__}: {exc}"))


def build_rule_judge(cfg: Any) -> RuleJudge:
    """``kind: rule``: a ``JudgeConfig``'s ``callable`` (a built-in name or ``module:fn``) with its kwargs."""
    assert cfg.callable is not None
    return RuleJudge(cfg.callable, cfg.kwargs)


def _check_rule(cfg: Any) -> None:
    if not cfg.callable:
        raise ValueError("a rule judge needs 'callable' (a built-in rule name or 'module:fn')")


RULE_KIND = register_judge_kind(JudgeKind("rule", build=build_rule_judge, check=_check_rule))
