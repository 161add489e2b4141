"""A judge kind is one registration (``judges.kinds``): the spec accepts it, ``build_judge``
builds it, and a task's ``Judging`` runs it like a rule judge, with nothing else edited."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from batch_inference.judges import JudgeConfig, JudgeKind, Verdict, build_judge, judge_kinds, register_judge_kind
from batch_inference.judges.kinds import unregister_judge_kind
from batch_inference.pool.judging import Judging


class LengthJudge:
    """Approves a result of at least ``min`` characters."""

    def __init__(self, min: int) -> None:
        self.min = min

    def judge(self, record: dict[str, Any], result: str) -> Verdict:
        return Verdict(len(result) >= self.min, "long_enough" if len(result) >= self.min else "too_short")


def _check(cfg: Any) -> None:
    if "min" not in cfg.kwargs:
        raise ValueError("a length judge needs kwargs.min")


@pytest.fixture
def length_kind() -> Iterator[JudgeKind]:
    kind = register_judge_kind(JudgeKind("length", build=lambda cfg: LengthJudge(**cfg.kwargs), check=_check))
    yield kind
    unregister_judge_kind("length")


def test_an_unregistered_kind_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="Input should be 'llm', 'rule', 'human' or 'none'"):
        JudgeConfig.model_validate({"kind": "length", "kwargs": {"min": 3}})


async def test_a_registered_kind_validates_builds_and_judges(length_kind: JudgeKind) -> None:
    assert judge_kinds()[-1] == "length"
    cfg = JudgeConfig.model_validate({"kind": "length", "kwargs": {"min": 3}})
    judge = build_judge(cfg)
    assert isinstance(judge, LengthJudge) and judge.min == 3
    with pytest.raises(ValueError, match="a length judge needs kwargs.min"):  # the kind's own check, with the spec
        JudgeConfig.model_validate({"kind": "length"})
    verdicts = await Judging(None, cfg).verdicts([{"id": "a"}, {"id": "b"}], ["four", "no"])  # type: ignore[arg-type]
    assert [(v.approved, v.reason) for v in verdicts] == [(True, "long_enough"), (False, "too_short")]


def test_a_name_is_registered_once(length_kind: JudgeKind) -> None:
    with pytest.raises(ValueError, match="registered already"):
        register_judge_kind(JudgeKind("length"))


def test_kinds_without_a_judge_say_why() -> None:
    with pytest.raises(ValueError, match="review queue"):
        build_judge({"kind": "human"})
    with pytest.raises(ValueError, match="every inferred record is approved"):
        build_judge({"kind": "none"})
