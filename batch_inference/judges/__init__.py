"""Judges: prompt templates, the LLM judge's verdict parsing, rule judges, and the factory."""

from __future__ import annotations

from batch_inference.judges.config import EscalateRule, JudgeConfig, build_judge
from batch_inference.judges.llm import LLMJudge, parse_keyword, parse_score
from batch_inference.judges.rules import BUILTIN_RULES, RuleJudge
from batch_inference.judges.templates import MissingFieldError, PromptTemplate
from batch_inference.judges.verdicts import Verdict

__all__ = [
    "BUILTIN_RULES",
    "EscalateRule",
    "JudgeConfig",
    "LLMJudge",
    "MissingFieldError",
    "PromptTemplate",
    "RuleJudge",
    "Verdict",
    "build_judge",
    "parse_keyword",
    "parse_score",
]
