"""LLM judge: a prompt built from the record and its result, and a robust verdict parser.

The judge call itself goes through the worker's engine and batcher like any inference;
this module only renders prompts and parses replies. Parsing never raises: a reply with
no verdict is ``Verdict(False, "unparseable_verdict")``.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import orjson

from batch_inference.engines.base import ChatPrompt, Completion, Prompt, ResponseFormat, SamplingParams
from batch_inference.judges.kinds import JudgeKind, register_judge_kind
from batch_inference.judges.templates import NullFields, PromptTemplate
from batch_inference.judges.verdicts import Verdict
from batch_inference.rows import ErrorKind

# "first verdict word wins"; "not approved" counts as a rejection
_KEYWORD = re.compile(r"\b(not\s+)?(approved?|rejected?)\b", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")

UNPARSEABLE = ErrorKind.UNPARSEABLE_VERDICT.value

# The machine-readable verdict a ``parse: json`` judge is constrained to (structured output).
VERDICT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"approved": {"type": "boolean"}, "reason": {"type": "string"}, "score": {"type": "number"}},
    "required": ["approved", "reason"],
    "additionalProperties": False,
}
VERDICT_FORMAT = ResponseFormat("json_schema", orjson.dumps(VERDICT_SCHEMA, option=orjson.OPT_SORT_KEYS).decode())


def parse_keyword(text: str) -> Verdict:
    """APPROVED/REJECTED anywhere (case, punctuation and markdown tolerated); first one wins."""
    m = _KEYWORD.search(text or "")
    if m is None:
        return Verdict(False, UNPARSEABLE)
    approved = m.group(2).lower().startswith("approve") and not m.group(1)
    return Verdict(approved, "judge_approved" if approved else "judge_rejected")


def parse_score(text: str, threshold: float) -> Verdict:
    """The first number in the reply is the score; approved when ``score >= threshold``."""
    m = _NUMBER.search(text or "")
    if m is None:
        return Verdict(False, UNPARSEABLE)
    score = float(m.group())
    approved = score >= threshold
    return Verdict(approved, f"score {score:g} {'>=' if approved else '<'} threshold {threshold:g}", score=score)


def parse_json_verdict(text: str) -> Verdict:
    """``{"approved": bool, "reason": str, "score"?: number}``; anything else is unparseable."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return Verdict(False, UNPARSEABLE)
    if not isinstance(value, dict) or not isinstance(value.get("approved"), bool):
        return Verdict(False, UNPARSEABLE)
    score = value.get("score")
    reason = value.get("reason")
    return Verdict(value["approved"], str(reason) if reason else ("judge_approved" if value["approved"] else "judge_rejected"),
                   score=float(score) if isinstance(score, (int, float)) and not isinstance(score, bool) else None)


class LLMJudge:
    """Renders judge prompts (``{result}`` is the inference result) and parses verdicts."""

    def __init__(
        self,
        template: str,
        *,
        parse: Literal["keyword", "score"] = "keyword",
        threshold: float = 0.5,
        sampling: SamplingParams | None = None,
        chat: bool = False,
        system: str | None = None,
        null_fields: NullFields = "error",
    ) -> None:
        self.template = PromptTemplate(template, nulls=null_fields)
        self.chat = chat
        self.system = system
        self.parse_mode = parse
        self.threshold = threshold
        self.sampling = sampling or SamplingParams(max_tokens=16, temperature=0.0)

    def prompt(self, record: dict[str, Any], result: str) -> Prompt:
        """Text, or a chat prompt (one user turn) for ``chat`` judges. Raises MissingFieldError
        for a record the template cannot fill."""
        text = self.template.render({**record, "result": result})
        if not self.chat:
            return text
        turns = ((("system", self.system),) if self.system is not None else ()) + (("user", text),)
        return ChatPrompt(turns)

    def parse(self, text: str) -> Verdict:
        if self.parse_mode == "json":
            return parse_json_verdict(text)
        return parse_keyword(text) if self.parse_mode == "keyword" else parse_score(text, self.threshold)

    def verdict(self, completion: Completion) -> Verdict:
        """The verdict for one judge completion (an engine error is a rejection with its reason)."""
        if completion.error is not None:
            return Verdict(False, ErrorKind.JUDGE_ERROR.tag(completion.error))
        return self.parse(completion.text)


def build_llm_judge(cfg: Any) -> LLMJudge:
    """``kind: llm``: a ``JudgeConfig``'s template, parse mode and sampling (``json``: the
    verdict constrained to ``VERDICT_FORMAT``)."""
    assert cfg.template is not None
    fmt = VERDICT_FORMAT if cfg.parse == "json" else None
    sampling = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, response_format=fmt, adapter=cfg.adapter)
    return LLMJudge(cfg.template, parse=cfg.parse, threshold=cfg.threshold, sampling=sampling,
                    chat=cfg.chat, system=cfg.system, null_fields=cfg.null_fields)


def _check_llm(cfg: Any) -> None:
    if not cfg.template:
        raise ValueError("an llm judge needs 'template' (use {result} for the inference result)")


LLM_KIND = register_judge_kind(JudgeKind("llm", build=build_llm_judge, check=_check_llm))
