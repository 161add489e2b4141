"""What every step of a run reads: the spec, its layout and ledger, and the layout's signer.

Nothing here changes over a run but the signer's lazy load (one tokenizer a run), so steps
may share one ``RunContext``; what a retry must not reuse (a drained feed, a finished
future) lives in the one step that owns it, never here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from batch_inference.pipeline import affinity, placement
from batch_inference.pipeline.fanout import FanOut, Item, NullReporter, Phase, Reporter
from batch_inference.pipeline.layout import RunLayout
from batch_inference.pipeline.ledger import Ledger
from batch_inference.pipeline.resume import Resume
from batch_inference.pipeline.runner import PoolPair
from batch_inference.pipeline.spec import PipelineSpec
from batch_inference.pipeline.summaries import PhaseSummary
from batch_inference.pool.protocol import SubmitOrder, TaskRunner
from batch_inference.prompting.prefix import PrefixSigner
from batch_inference.storage import JsonlDir, JsonlFile


class StepOrderError(RuntimeError):
    """A step was called before the step that produces its input."""


@dataclass
class RunContext:
    """The read-only things a step needs (blocking helpers: call them off the event loop)."""

    spec: PipelineSpec
    reporter: Reporter = field(default_factory=NullReporter)
    layout: RunLayout = field(init=False)
    ledger: Ledger = field(init=False)
    resume: Resume = field(init=False)
    _signer_made: PrefixSigner | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.layout = RunLayout(self.spec.output, self.spec.run)
        self.ledger = Ledger(self.layout, self.spec.storage_options)
        self.resume = Resume(self.spec, self.layout, self.ledger)

    @property
    def storage_options(self) -> dict[str, Any] | None:
        return self.spec.storage_options or None

    @property
    def order(self) -> SubmitOrder:
        """How tasks submit a chunk's requests (``layout.prefix``: sorted, admitted together)."""
        return "prefix" if self.spec.layout.prefix else "input"

    def dir(self, url: str) -> JsonlDir:
        return JsonlDir(url, storage_options=self.storage_options)

    def file(self, url: str) -> JsonlFile:
        return JsonlFile(url, storage_options=self.storage_options)

    def require(self, name: str, hint: str) -> dict[str, Any]:
        data = self.ledger.read(name)
        if data is None:
            raise StepOrderError(f"run {self.spec.run!r}: ledger/{name}.json is missing: {hint}")
        return data

    def phase_done(self, name: str) -> PhaseSummary | None:
        data = self.ledger.read(name)
        return PhaseSummary.from_dict(data) if data is not None else None

    def pending_items(self, r: int) -> tuple[list[Item], dict[int, int]]:
        """Round ``r``'s pending shards by index, and their record counts (from the manifest)."""
        d = self.dir(self.layout.pending(r))
        man = d.manifest()
        if man is None:
            step = "shard()" if r == 0 else f"recompact({r - 1})"
            raise StepOrderError(f"run {self.spec.run!r}: {d.url} is not committed yet: run {step} first")
        by_name = {s["name"]: int(s["records"]) for s in man.shards}
        items = list(enumerate(d.shards()))
        return items, {i: by_name.get(f.name, 0) for i, f in items}

    def instance(self) -> str:
        """The run instance every task id of this run carries (drawn at sharding); every
        step that sends tasks asks for it, so each also checks the spec it resumes under."""
        instance = str(self.require(RunLayout.SHARD, "run shard() first").get("instance", ""))
        self.resume.check_spec()
        return instance

    def fanout(self, phase: Phase, runner: TaskRunner | None) -> FanOut:
        """The fan-out of ``phase`` over ``runner`` (a judge with its own model: its own pool)."""
        if runner is None:
            raise StepOrderError(f"{phase.kind} needs a TaskRunner: PipelineRun(spec, runner)")
        phase = replace(phase, ran_on=self.spec.placement(phase.kind))
        runner = runner.for_phase(phase.kind) if isinstance(runner, PoolPair) else runner
        return FanOut(phase, runner, self.ledger, self.reporter, self.storage_options)

    # -- the layout's signer: the shard step's, recompaction's and the dispatch's -------------

    def signer(self) -> PrefixSigner:
        """The layout's signer (its tokenizer loaded once a run)."""
        if self._signer_made is None:
            self._signer_made = self.resume.signer()
        return self._signer_made

    def layout_common(self, signer: PrefixSigner) -> int | None:
        """The blocks every input record shares, as the shard step's layout pass counted them
        with this signer (None: no pass, or one that signed otherwise)."""
        laid = (self.ledger.read(RunLayout.SHARD) or {}).get("layout") or {}
        if laid.get("signature") != signer.tokenizer.name or laid.get("block_size") != signer.block_size:
            return None
        return int(laid.get("common_blocks", 0))

    def family_cuts(self) -> placement.FamilyCuts | None:
        """How recompaction cuts its shards: between families when the shard step laid the
        records out in prefix order (the rejected records keep that order), else by count."""
        if not self.spec.layout.prefix:
            return None
        shard = self.ledger.read(RunLayout.SHARD) or {}
        if not (shard.get("layout") or {}).get("applied"):
            return None
        signer = self.signer()
        return placement.FamilyCuts(signer, self.spec.request_infer, common=self.layout_common(signer) or 0)

    def routes_by_family(self) -> bool:
        """Whether tasks carry their shard's prefix family: a pool of several workers with
        affinity on; not in process, where one engine serves every task."""
        pool = self.spec.pool
        return pool.affinity and not (pool.launcher == "inprocess" and not pool.endpoints)

    def families(self, items: list[Item]) -> dict[int, str]:
        """Each shard's prefix family for a pool of several workers (``pipeline.affinity``);
        none in process or with affinity off."""
        if not self.routes_by_family():
            return {}
        signer = self.signer()
        return affinity.shard_families(items, self.spec.request_infer, signer, common=self.layout_common(signer))
