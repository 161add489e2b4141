"""Judge configuration and the one judge factory."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from batch_inference.engines.base import SamplingParams
from batch_inference.judges.llm import VERDICT_FORMAT, LLMJudge
from batch_inference.judges.rules import RuleJudge


class JudgeConfig(BaseModel):
    """``kind: llm`` needs ``template``; ``kind: rule`` needs ``callable`` (built-in name or ``module:fn``)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["llm", "rule"]
    # llm
    template: str | None = Field(None, description="judge prompt; {field} from the record, {result} the inference result")
    parse: Literal["keyword", "score", "json"] = Field(
        "keyword", description="json: a machine-readable verdict {approved, reason}, constrained by structured output (vLLM)")
    chat: bool = Field(False, description="send the judge prompt as a user turn through the model's chat template")
    system: str | None = Field(None, description="chat judges: the system turn")
    threshold: float = Field(0.5, description="score mode: approved when score >= threshold")
    max_tokens: int = Field(16, ge=1, description="judge reply length")
    temperature: float = Field(0.0, ge=0)
    # rule
    callable: str | None = Field(None, description="regex | exact_match | json_valid | min_length | module:fn")
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> JudgeConfig:
        if self.kind == "llm" and not self.template:
            raise ValueError("an llm judge needs 'template' (use {result} for the inference result)")
        if self.system is not None and not self.chat:
            raise ValueError("'system' needs 'chat: true' (it is the chat judge's system turn)")
        if self.kind == "rule" and not self.callable:
            raise ValueError("a rule judge needs 'callable' (a built-in rule name or 'module:fn')")
        return self


def build_judge(cfg: JudgeConfig | dict[str, Any]) -> LLMJudge | RuleJudge:
    """Build the judge a config names; bad templates, imports or kwargs fail here, not per record."""
    cfg = cfg if isinstance(cfg, JudgeConfig) else JudgeConfig.model_validate(cfg)
    if cfg.kind == "llm":
        assert cfg.template is not None
        fmt = VERDICT_FORMAT if cfg.parse == "json" else None
        sampling = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, response_format=fmt)
        return LLMJudge(cfg.template, parse=cfg.parse, threshold=cfg.threshold, sampling=sampling,
                        chat=cfg.chat, system=cfg.system)
    assert cfg.callable is not None
    return RuleJudge(cfg.callable, cfg.kwargs)
