"""Judges: prompt templates, the LLM judge's verdict parsing, rule judges, and the factory.

Each ``judge.kind`` is registered in ``judges.kinds`` by the file of its judge (``llm.py``,
``rules.py``); a new kind is one more such file, imported here."""

from __future__ import annotations

from batch_inference.judges.config import EscalateRule, JudgeConfig, build_judge
from batch_inference.judges.kinds import JudgeKind, judge_kind, judge_kinds, register_judge_kind
from batch_inference.judges.llm import LLMJudge, parse_keyword, parse_score
from batch_inference.judges.rules import BUILTIN_RULES, RuleJudge
from batch_inference.judges.templates import MissingFieldError, PromptTemplate
from batch_inference.judges.verdicts import Verdict

__all__ = [
    "BUILTIN_RULES",
    "EscalateRule",
    "JudgeConfig",
    "JudgeKind",
    "LLMJudge",
    "MissingFieldError",
    "PromptTemplate",
    "RuleJudge",
    "Verdict",
    "build_judge",
    "judge_kind",
    "judge_kinds",
    "parse_keyword",
    "parse_score",
    "register_judge_kind",
]
