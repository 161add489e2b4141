"""Judge configuration and the one judge factory (each kind registered in ``judges.kinds``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from batch_inference.judges.kinds import judge_kind, judge_kinds
from batch_inference.judges.llm import LLMJudge  # registers kind llm
from batch_inference.judges.rules import RuleJudge  # registers kind rule
from batch_inference.judges.verdicts import Verdict
from batch_inference.speckeys import DECIDES


class EscalateRule(BaseModel):
    """Which automated verdicts go to people instead of standing (any listed condition).

    ``score_between: [lo, hi]``: a score judge's score in the band (inclusive: unsure);
    ``reasons``: a verdict whose reason starts with one of these (e.g.
    ``unparseable_verdict``, ``judge_error``, ``rule_error``, a rule's own reason);
    ``rejected`` / ``approved``: every automated rejection / approval.
    """

    model_config = ConfigDict(extra="forbid")

    score_between: tuple[float, float] | None = None
    reasons: list[str] = Field(default_factory=list)
    rejected: bool = False
    approved: bool = False

    @model_validator(mode="after")
    def _check(self) -> EscalateRule:
        if self.score_between is not None and self.score_between[0] > self.score_between[1]:
            raise ValueError(f"escalate.score_between: low {self.score_between[0]} > high {self.score_between[1]}")
        if self.score_between is None and not self.reasons and not self.rejected and not self.approved:
            raise ValueError("escalate: name at least one of score_between, reasons, rejected, approved")
        return self

    def matches(self, verdict: Verdict) -> bool:
        """True when this verdict is one people decide."""
        if self.score_between is not None and verdict.score is not None:
            lo, hi = self.score_between
            if lo <= verdict.score <= hi:
                return True
        if any(verdict.reason.startswith(prefix) for prefix in self.reasons):
            return True
        return (self.rejected and not verdict.approved) or (self.approved and verdict.approved)


def _known_kind(kind: str) -> str:
    """A registered kind, refused as a ``Literal`` would refuse it (the same message)."""
    if kind not in judge_kinds():
        expected = ", ".join(repr(k) for k in judge_kinds()[:-1]) + f" or {judge_kinds()[-1]!r}"
        raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})
    return kind


JudgeKindName = Annotated[str, AfterValidator(_known_kind)]


class JudgeConfig(BaseModel):
    """``kind: llm`` needs ``template``; ``kind: rule`` needs ``callable`` (built-in name or ``module:fn``).

    ``kind: human`` sends every inferred record to the review queue (no automated
    judge); ``escalate`` on an llm or rule judge sends the verdicts it matches there.
    ``kind: none`` (what a spec without ``judge`` gets) judges nothing: every record whose
    inference succeeded is approved, one inference per record.
    Every key decides results (``speckeys.DECIDES``).
    """

    model_config = ConfigDict(extra="forbid")

    kind: Annotated[JudgeKindName, DECIDES]  # llm | rule | human | none | a kind registered in judges.kinds
    # llm
    template: Annotated[str | None, DECIDES] = Field(None, description="judge prompt; {field} from the record, {result} the inference result")
    parse: Annotated[Literal["keyword", "score", "json"], DECIDES] = Field(
        "keyword", description="json: a machine-readable verdict {approved, reason}, constrained by structured output (vLLM)")
    chat: Annotated[bool, DECIDES] = Field(False, description="send the judge prompt as a user turn through the model's chat template")
    system: Annotated[str | None, DECIDES] = Field(None, description="chat judges: the system turn")
    threshold: Annotated[float, DECIDES] = Field(0.5, description="score mode: approved when score >= threshold")
    max_tokens: Annotated[int, DECIDES] = Field(16, ge=1, description="judge reply length")
    temperature: Annotated[float, DECIDES] = Field(0.0, ge=0)
    null_fields: Annotated[Literal["error", "empty"], DECIDES] = Field(
        "error", description="llm: a template field that is null: error (missing_field) or empty ('')")
    adapter: Annotated[str | None, DECIDES] = Field(None, description="llm: the LoRA adapter the judge runs on (its engine's lora adapters); none: the base model")
    # rule
    callable: Annotated[str | None, DECIDES] = Field(None, description="regex | exact_match | json_valid | min_length | module:fn")
    kwargs: Annotated[dict[str, Any], DECIDES] = Field(default_factory=dict)
    # human review
    escalate: Annotated[EscalateRule | None, DECIDES] = Field(None, description="llm/rule: the verdicts people decide instead")

    @property
    def reviews(self) -> bool:
        """Whether some records of a round may wait for a human verdict."""
        return self.kind == "human" or self.escalate is not None

    @model_validator(mode="after")
    def _check(self) -> JudgeConfig:
        if self.kind == "none" and (given := sorted(
                name for name, f in JudgeConfig.model_fields.items()
                if name != "kind" and getattr(self, name) != f.get_default(call_default_factory=True))):
            raise ValueError(f"a judge of kind 'none' judges nothing: remove {', '.join(given)} (or name a kind that uses them)")
        if self.kind == "human" and self.escalate is not None:
            raise ValueError("a human judge reviews every record: 'escalate' is for llm and rule judges")
        if (check := judge_kind(self.kind).check) is not None:
            check(self)  # the kind's own requirements (llm: a template; rule: a callable)
        if self.system is not None and not self.chat:
            raise ValueError("'system' needs 'chat: true' (it is the chat judge's system turn)")
        if self.adapter is not None and self.kind != "llm":
            raise ValueError(f"'adapter' is for llm judges: a {self.kind} judge runs no model")
        return self


def build_judge(cfg: JudgeConfig | dict[str, Any]) -> LLMJudge | RuleJudge:
    """Build the judge a config names, by its kind (``judges.kinds``); bad templates, imports
    or kwargs fail here, not per record."""
    cfg = cfg if isinstance(cfg, JudgeConfig) else JudgeConfig.model_validate(cfg)
    kind = judge_kind(cfg.kind)
    if kind.build is None:
        raise ValueError(kind.no_build)
    return kind.build(cfg)  # type: ignore[no-any-return]
