"""The review gate behind a seam: the pipeline reaches human review only through the
``RoundGate`` it is handed, and never imports ``batch_inference.review``."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

import batch_inference.pipeline as pipeline_pkg
from batch_inference.pipeline import PipelineRun, run_pipeline
from batch_inference.pipeline.gate import ReviewPending, ReviewStatus, RoundGate
from batch_inference.pipeline.runner import open_runner
from batch_inference.pipeline.summaries import ReviewSummary

UP = "batch_inference.review"


def _imports(tree: ast.AST) -> list[str]:
    """Every module an ``import`` / ``from ... import`` names, in full (``from a import b``: ``a.b`` too)."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def test_no_module_of_the_pipeline_imports_review() -> None:
    root = Path(pipeline_pkg.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) > 20  # the walk found the package (steps/ included)
    found = [f"{f.relative_to(root)}: {name}" for f in files for name in _imports(ast.parse(f.read_text(), str(f)))
             if name == UP or name.startswith(UP + ".")]
    assert found == []


def test_the_walk_sees_an_import_inside_a_function() -> None:
    tree = ast.parse("def f():\n    from batch_inference import review\n    import batch_inference.review.lifecycle\n")
    assert [n for n in _imports(tree) if n == UP or n.startswith(UP + ".")] == [UP, "batch_inference.review.lifecycle"]


class RecordingGate:
    """A gate that lets every round through once opened: what the run asked of it is recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, Any]] = []

    def open(self, spec: Any, layout: Any, ledger: Any, r: int, records: int) -> None:
        self.calls.append(("open", r, records))

    def status(self, spec: Any, layout: Any, ledger: Any, r: int, *, now: float | None = None) -> ReviewStatus:
        self.calls.append(("status", r, None))
        return ReviewStatus(r, 0, 0, 0, 0, 0, {}, 0, 0.0, 0.0, "test", False, True, False)

    def resolve(self, spec: Any, layout: Any, ledger: Any, r: int, *, now: float | None = None) -> ReviewSummary:
        self.calls.append(("resolve", r, None))
        raise ReviewPending("the test gate never closes")


async def test_a_judge_that_sends_records_to_people_opens_the_gate_it_was_handed(make_spec) -> None:
    spec = make_spec(records=12, judge={"kind": "human"})
    gate = RecordingGate()
    typed: RoundGate = gate  # what the pipeline asks of a gate, and no more
    async with open_runner(spec) as runner:
        run = PipelineRun(spec, runner, gate=typed)
        await run.shard()
        await run.infer(0)
        await run.judge(0)
    assert gate.calls == [("open", 0, 12)]
    assert run.review_status(0).policy == "test" and gate.calls[-1] == ("status", 0, None)
    with pytest.raises(ReviewPending, match="never closes"):
        await run.resolve_review(0)
    # the ledger records no opening: the gate the run was handed owns the queue's state
    assert run.ledger.read("round-00-review-open") is None


async def test_run_pipeline_hands_its_gate_to_the_run(make_spec) -> None:
    spec = make_spec(records=6, judge={"kind": "human"}, review={"poll_s": 0.01})

    class Closing(RecordingGate):
        def resolve(self, spec: Any, layout: Any, ledger: Any, r: int, *, now: float | None = None) -> ReviewSummary:
            self.calls.append(("resolve", r, None))
            raise RuntimeError("closed by the test gate")

    gate = Closing()
    with pytest.raises(RuntimeError, match="closed by the test gate"):
        await run_pipeline(spec, gate=gate, retries=0)
    assert [c[0] for c in gate.calls] == ["open", "status", "resolve"]
