"""LLM judge: prompts and robust verdict parsing."""

from __future__ import annotations

import pytest

from batch_inference.engines import Completion, SamplingParams
from batch_inference.engines.config import SimulatedOptions
from batch_inference.engines.simulated import LinearSimulatedEngine
from batch_inference.judges import LLMJudge, Verdict, build_judge, parse_keyword, parse_score


@pytest.mark.parametrize(
    ("text", "approved"),
    [
        ("APPROVED", True),
        ("approved.", True),
        ("**Approved**", True),
        ("Verdict: `APPROVE`", True),
        ("  \n> REJECTED!", False),
        ("Rejected: the answer is wrong", False),
        ("APPROVED, not REJECTED", True),
        ("REJECTED. (would have APPROVED if...)", False),
        ("Not approved.", False),
        ("The answer looks good.\nFinal: **APPROVED**", True),
    ],
)
def test_keyword_verdicts(text: str, approved: bool) -> None:
    v = parse_keyword(text)
    assert v.approved is approved and v.reason != "unparseable_verdict"


@pytest.mark.parametrize("text", ["", "maybe", "disapprovedly", "APPROVEDX", "\x00\xff garbage", "reapproved"])
def test_unparseable_is_a_rejection_not_a_crash(text: str) -> None:
    assert parse_keyword(text) == Verdict(False, "unparseable_verdict")


@pytest.mark.parametrize(
    ("text", "score", "approved"),
    [("8", 8.0, True), ("Score: 7.5/10", 7.5, True), ("**3**", 3.0, False), ("-1", -1.0, False)],
)
def test_score_verdicts(text: str, score: float, approved: bool) -> None:
    v = parse_score(text, threshold=7)
    assert v.score == score and v.approved is approved


def test_score_unparseable() -> None:
    assert parse_score("no number here", 5) == Verdict(False, "unparseable_verdict")


def test_prompt_includes_result_and_record_fields() -> None:
    judge = LLMJudge("Q: {prompt}\nA: {result}\nReply APPROVED or REJECTED.")
    record = {"id": "1", "prompt": "2+2?", "result": "old result"}
    assert judge.prompt(record, "4") == "Q: 2+2?\nA: 4\nReply APPROVED or REJECTED."


def test_verdict_from_engine_error() -> None:
    judge = LLMJudge("{result}")
    assert judge.verdict(Completion.failed("prompt_too_long: x")) == Verdict(False, "judge_error: prompt_too_long: x")
    assert judge.verdict(Completion("APPROVED", 1, 1, "stop")).approved


def test_judge_with_simulated_engine_rate_and_missing_field() -> None:
    engine = LinearSimulatedEngine(SimulatedOptions(latency_a_s=0, latency_b_s=0, approval_rate=0.25))
    judge = build_judge({"kind": "llm", "template": "{prompt} => {result}", "max_tokens": 4})
    assert isinstance(judge, LLMJudge) and judge.sampling == SamplingParams(max_tokens=4)
    records = [{"id": str(i), "prompt": f"p{i}"} for i in range(1000)] + [{"id": "nope"}]
    verdicts = []
    for record, result in zip(records, [f"r{i}" for i in range(1001)]):  # what a judge task does per record
        try:
            verdicts.append(judge.verdict(engine.generate([judge.prompt(record, result)], judge.sampling)[0]))
        except KeyError as exc:  # MissingFieldError
            verdicts.append(Verdict(False, str(exc)))
    assert len(verdicts) == 1001
    assert sum(v.approved for v in verdicts[:1000]) / 1000 == pytest.approx(0.25, abs=0.05)
    assert not verdicts[-1].approved and "missing_field" in verdicts[-1].reason and "nope" in verdicts[-1].reason


def test_json_verdict_judge_is_constrained_and_parsed() -> None:
    from batch_inference.engines import ChatPrompt
    from batch_inference.judges import JudgeConfig, build_judge
    from batch_inference.judges.llm import VERDICT_FORMAT, parse_json_verdict

    judge = build_judge(JudgeConfig(kind="llm", template="Judge: {result}", parse="json", chat=True, system="strict"))
    assert judge.sampling.response_format == VERDICT_FORMAT
    assert judge.prompt({"id": "a"}, "42") == ChatPrompt((("system", "strict"), ("user", "Judge: 42")))
    assert judge.parse('{"approved": true, "reason": "correct", "score": 0.9}') == Verdict(True, "correct", score=0.9)
    assert parse_json_verdict('{"approved": "yes"}') == Verdict(False, "unparseable_verdict")
    assert parse_json_verdict("APPROVED") == Verdict(False, "unparseable_verdict")
