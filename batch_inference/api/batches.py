"""A batch's life: validate its requests, run them as a pipeline run, deliver its files.

``BatchManager`` owns every batch of the server. A batch is a state object in storage
(``Store``: ``batches/<id>/state.json``, a ``BatchRecord`` of ``api.protocol``)
and, once validated, one ``PipelineRun`` of the batch's model (``spec_for``): sharding, the
prefix-aware layout, dedup, the model's pool (shared by every batch of that model through
``FairShare``) and the ledger's conservation check are the pipeline's own. The state moves
``validating -> in_progress -> finalizing -> completed`` (or ``failed``; ``cancelling ->
cancelled``; ``expired``), each step saved before the next begins, so a server killed at any
moment picks every batch up where its state says (``resume_all``), and the pipeline's own
resume skips what its ledger says is committed.

This module is the state machine (states, transitions, counts); validation is
``api.intake``'s and the files are ``api.delivery``'s. A delivery never rewrites a file: it
writes the output and error files whole under fresh ids (``delivering`` in the state names
them first), then publishes the ids with the ended status. A reader of a published id gets the same bytes for as long as the file lives; the
files of a delivery killed before it published are removed by the next one.

Each batch (and each file it delivers) records the ``project`` of the key that made it.

Stopping (cancel, expiry) cancels the batch's driver (no new shard task is dispatched; the
tasks in flight are abandoned) and exports what reached a terminal state; every other
request is an error line (``batch_cancelled`` / ``batch_expired``), so every ``custom_id``
is in exactly one of the two files.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Any

from batch_inference.api.admission import estimate_moved, finish_estimates
from batch_inference.api.config import DEFAULT_PROJECT, ApiConfig
from batch_inference.api.delivery import STOPPED, Delivery, delete_file, now
from batch_inference.api.endpoints import ENDPOINTS
from batch_inference.api.intake import Checked, split_requests
from batch_inference.api.protocol import ACTIVE, TERMINAL, BatchRecord
from batch_inference.api.fair import FairShare
from batch_inference.api.runs import BatchRuns
from batch_inference.api.store import Store, new_id
from batch_inference.api.usage import UsageBook
from batch_inference.pipeline.layout import RunLayout
from batch_inference.pipeline.spec import PipelineSpec, SpecError

__all__ = ["ACTIVE", "STOPPED", "TERMINAL", "BatchError", "BatchManager", "Checked", "delete_file", "new_id", "now"]

log = logging.getLogger(__name__)

FAULT_ENV = "BATCH_INFERENCE_API_FAULT"


def fault_point(name: str) -> None:
    """A crash on demand at a named moment (tests): with ``BATCH_INFERENCE_API_FAULT=<name>`` the
    server SIGKILLs itself here, as a node lost at the worst moment would stop it."""
    if os.environ.get(FAULT_ENV) == name:
        log.warning("%s=%s: killing this server (SIGKILL)", FAULT_ENV, name)
        os.kill(os.getpid(), signal.SIGKILL)


class BatchError(ValueError):
    """A request the server refuses (HTTP 400/404/409); ``status`` is the HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def _counts(checked: Checked) -> dict[str, int]:
    return {"total": checked.total, "completed": 0, "failed": checked.rejected}


class BatchManager:
    """Every batch of one server: create, drive, cancel, expire, resume after a restart."""

    def __init__(self, config: ApiConfig, store: Store) -> None:
        self.config, self.store = config, store
        self.delivery = Delivery(config, store)
        self.usage = UsageBook(store)  # usage per project and model; what /metrics reads
        self.runs = BatchRuns(config, store, on_result=self.usage.task_done)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._save_lock: dict[str, asyncio.Lock] = {}

    # -- state ---------------------------------------------------------------------

    def state_url(self, batch_id: str) -> str:
        return self.store.url("batches", batch_id, "state.json")

    async def get(self, batch_id: str) -> BatchRecord | None:
        data = await asyncio.to_thread(self.store.read_json, self.state_url(batch_id))
        return None if data is None else BatchRecord.load(data)

    async def save(self, record: BatchRecord) -> None:
        await asyncio.to_thread(self.store.write_json, self.state_url(record.id), record.to_json())
        await self.usage.observe(record.to_json())

    async def update(self, batch_id: str, **changes: Any) -> BatchRecord:
        """Read, change and save a batch's state (one writer at a time per batch)."""
        record = await self.update_if(batch_id, None, **changes)
        assert record is not None
        return record

    async def update_if(self, batch_id: str, expect: dict[str, Any] | None, **changes: Any) -> BatchRecord | None:
        """``update`` when the state still holds ``expect``'s values; None (nothing saved) when it does not."""
        lock = self._save_lock.setdefault(batch_id, asyncio.Lock())
        async with lock:
            record = await self.get(batch_id)
            assert record is not None, batch_id
            if expect and any(getattr(record, k) != v for k, v in expect.items()):
                return None
            record = record.changed(**changes)
            # a cancelled caller still waits for its write: the next writer must come after it
            write = asyncio.ensure_future(self.save(record))
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                await write
                raise
            return record

    async def all(self) -> list[BatchRecord]:
        """Every batch, newest first."""
        ids = await asyncio.to_thread(self.store.children, self.store.url("batches"))
        records = [r for r in await asyncio.gather(*(self.get(i) for i in ids)) if r is not None]
        return sorted(records, key=lambda r: (r.created_ns, r.id), reverse=True)

    # -- create --------------------------------------------------------------------

    async def create(self, *, api: str, endpoint: str, source_url: str, input_file_id: str | None, window: str,
                     window_s: float, metadata: dict[str, Any] | None, output_expires_after: dict[str, Any] | None,
                     batch_id: str | None = None, project: str = DEFAULT_PROJECT) -> BatchRecord:
        """Save a new batch (``validating``) of ``project`` and start driving it."""
        if endpoint not in ENDPOINTS:
            raise BatchError(f"endpoint {endpoint!r} is not supported (supported: {', '.join(ENDPOINTS)})", param="endpoint")
        t = now()
        record = BatchRecord(id=batch_id or new_id("batch"), api=api, endpoint=endpoint, input_file_id=input_file_id,  # type: ignore[arg-type]
                             source_url=source_url, completion_window=window, created_at=t, created_ns=time.time_ns(),
                             expires_at=t + int(window_s), metadata=metadata, output_expires_after=output_expires_after, project=project)
        await self.save(record)
        self.start(record.id)
        return record

    def start(self, batch_id: str) -> None:
        task = asyncio.create_task(self._drive(batch_id), name=f"batch {batch_id}")
        self._tasks[batch_id] = task
        task.add_done_callback(lambda t: self._tasks.pop(batch_id, None) if self._tasks.get(batch_id) is t else None)

    async def resume_all(self) -> list[str]:
        """After a (re)start: drive every batch that had not ended; finish a stop that was under way."""
        resumed = []
        records = await self.all()
        await self.usage.open([r.to_json() for r in records])
        for record in records:
            if record.status == "cancelling":
                asyncio.create_task(self._stop(record.id, "cancelled"))
            elif record.status in ACTIVE:
                self.start(record.id)
            else:
                continue
            resumed.append(record.id)
        if resumed:
            log.info("resumed %d batch(es): %s", len(resumed), ", ".join(resumed))
        return resumed

    # -- drive ---------------------------------------------------------------------

    async def _drive(self, batch_id: str) -> None:
        try:
            record = await self.get(batch_id)
            if record is None or record.status not in ("validating", "in_progress", "finalizing"):
                return
            if record.status == "validating":
                record = await self._validate(record)
                if record.status != "in_progress":
                    return
            if record.status == "in_progress" and record.run_model:
                await self.runs.run(record)
            await self._finish(batch_id, None)
        except asyncio.CancelledError:
            raise
        except SpecError as exc:  # the pipeline refused the requests as a file (unsupported fields...): OpenAI's validation failure
            log.warning("batch %s failed: %s", batch_id, exc)
            await self.update(batch_id, status="failed", failed_at=now(), errors=_errors(self.public(str(exc))))
        except Exception as exc:
            log.exception("batch %s failed", batch_id)
            await self.update(batch_id, status="failed", failed_at=now(),
                              errors=_errors(self.public(f"the batch could not run: {type(exc).__name__}: {exc}"), code="server_error"))

    def public(self, message: str) -> str:
        """``message`` without the server's storage location (``Delivery.public``)."""
        return self.delivery.public(message)

    async def _validate(self, record: BatchRecord) -> BatchRecord:
        """Read the requests once: the batch's model, its pipeline input, the lines refused alone."""
        checked = await asyncio.to_thread(split_requests, self.config, self.store, record)
        if checked.problems:
            return await self.update(record.id, status="failed", failed_at=now(), errors={"object": "list", "data": checked.problems})
        return await self.update(record.id, status="in_progress", in_progress_at=now(), model=checked.model,
                                 run_model=checked.model if checked.runnable else None, request_counts=_counts(checked))

    def spec_for(self, record: BatchRecord) -> PipelineSpec:
        """The pipeline spec of a batch (``BatchRuns.spec_for``)."""
        return self.runs.spec_for(record)

    def check_models(self) -> None:
        """Every model's spec builds: a config error stops the server at start (``BatchRuns.check_models``)."""
        self.runs.check_models()

    @property
    def open_shares(self) -> dict[str, FairShare]:
        """The pools opened so far, by model (what /metrics reads)."""
        return self.runs.open_shares

    async def _finish(self, batch_id: str, stopped: str | None) -> None:
        """Export the run (all of it, or what finished before a stop) into new files, then publish them and end the batch.

        The files are written whole under fresh ids before the state names them, and never
        rewritten: a batch that another driver ended already is left as it is, and a delivery
        killed before it published is replaced by a new one (its files removed)."""
        record = await self.get(batch_id)
        assert record is not None
        if record.ended:  # delivered already: its published files stay as they are
            log.warning("batch %s is %s already: not delivered again", batch_id, record.status)
            return
        if stale := record.delivering:  # a delivery killed before it published: nobody was given its files
            await asyncio.to_thread(self.delivery.remove, record, stale)
        delivery = {"output_file_id": new_id("file"), "error_file_id": new_id("file")}
        moment = {"status": "finalizing", "finalizing_at": now()} if stopped is None else {}
        record = await self.update(batch_id, delivering=delivery, **moment)
        spec = await asyncio.to_thread(self.spec_for, record) if record.run_model else None
        work = asyncio.ensure_future(asyncio.to_thread(self.delivery.deliver, record, stopped, delivery, spec))
        try:
            files = await asyncio.shield(work)
        except asyncio.CancelledError:  # a stop: its delivery starts only once this one's thread has stopped writing
            await asyncio.gather(work, return_exceptions=True)
            raise
        fault_point("before_publish")
        counts = {"total": record.request_counts.total, "completed": files.completed, "failed": files.failed}
        end = stopped or "completed"
        published = await self.update_if(batch_id, {"delivering": delivery, "status": record.status}, status=end,
                                         **{f"{end}_at": now()}, request_counts=counts, stopped=files.stopped, delivering=None,
                                         output_file_id=files.output_file_id, error_file_id=files.error_file_id, usage=files.usage)
        if published is None:  # another driver took the batch over meanwhile: these files were never given to anyone
            log.warning("batch %s: another delivery took over: this one's files are removed", batch_id)
            await asyncio.to_thread(self.delivery.remove, record, delivery)

    # -- cancel, expiry --------------------------------------------------------------

    async def cancel(self, batch_id: str) -> BatchRecord:
        """Stop dispatching the batch's requests; it ends ``cancelled`` with what finished delivered."""
        record = await self.get(batch_id)
        if record is None:
            raise BatchError(f"no batch {batch_id!r}", status=404)
        if record.status in ("cancelling", "cancelled"):
            return record
        if record.status not in ("validating", "in_progress"):
            raise BatchError(f"batch {batch_id} is {record.status}: only a validating or in-progress batch can be cancelled",
                             status=409)
        task = self._tasks.get(batch_id)
        if task is not None:
            task.cancel()  # before the state changes: the driver saves nothing after this
        record = await self.update(batch_id, status="cancelling", cancelling_at=now())
        asyncio.create_task(self._stop(batch_id, "cancelled", task))
        return record

    async def _stop(self, batch_id: str, end: str, task: asyncio.Task[None] | None = None) -> None:
        """Cancel the batch's driver, wait for it, then deliver what finished and end the batch ``end``."""
        task = task or self._tasks.get(batch_id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        try:
            record = await self.get(batch_id)
            if record is None or record.ended:
                return
            if record.stopped_at_validation():  # read the requests first
                checked = await asyncio.to_thread(split_requests, self.config, self.store, record)
                await self.update(batch_id, in_progress_at=now(), model=checked.model,
                                  run_model=checked.model if checked.runnable else None, request_counts=_counts(checked),
                                  errors={"object": "list", "data": checked.problems} if checked.problems else None)
                if checked.problems:
                    await self.update(batch_id, status="failed", failed_at=now())
                    return
            await self._finish(batch_id, end)
        except Exception:
            log.exception("batch %s: could not finish its %s", batch_id, end)
            raise

    async def tick(self) -> None:
        """Move request_counts of the running batches, expire the overdue ones, delete expired files."""
        t = now()
        finish = finish_estimates(self.usage.states.values(), {m: s.throughput.rate() for m, s in self.open_shares.items()},
                                  t, self.config.limits.deadline_slack)
        for batch_id in list(self._tasks):
            record = await self.get(batch_id)
            if record is None or record.status not in ("validating", "in_progress"):
                continue
            if record.expires_at is not None and record.expires_at <= t:
                log.info("batch %s: completion window %s passed: expiring it", batch_id, record.completion_window)
                asyncio.create_task(self._stop(batch_id, "expired", self._tasks.pop(batch_id, None)))
                continue
            if record.status == "in_progress" and record.run_model:
                counts = await asyncio.to_thread(self.live_counts, record)
                estimate = finish.get(batch_id)  # api/admission.py: expected_finish_at, from the pool's measured rate
                old = getattr(record, "expected_finish_at", None)
                if counts != record.request_counts.model_dump() or estimate_moved(old, estimate):
                    # not over the final counts of a batch that ended meanwhile
                    await self.update_if(batch_id, {"status": "in_progress"}, request_counts=counts, expected_finish_at=estimate)
        for file_id in await asyncio.to_thread(self.delivery.expire_files, t):
            log.info("file %s expired: deleted", file_id)

    def live_counts(self, record: BatchRecord) -> dict[str, int]:
        """request_counts of a running batch (blocking): what its run's ledger says has settled
        (``LedgerView.settled``: finished shards, and the records running tasks have committed,
        chunk by chunk) plus the lines refused at validation. A cancel now would deliver as many
        (the final counts come from the export)."""
        from batch_inference.pipeline.ledger import Ledger

        settled = Ledger(RunLayout(self.store.runs, record.id), self.config.storage_options).view().settled()
        return {"total": record.request_counts.total, "completed": settled["approved"],
                "failed": settled["failed"] + self._rejected_count(record)}

    def _rejected_count(self, record: BatchRecord) -> int:
        url = f"{self.store.batch_dir(record.id)}/rejected.jsonl"
        return sum(1 for raw in self.store.lines(url) if raw.strip()) if self.store.size(url) is not None else 0

    def delete(self, record: BatchRecord) -> None:
        """Remove an ended batch: its state, its run and its files (blocking)."""
        self.delivery.delete_batch(record)
        self.usage.states.pop(record.id, None)  # gone from /metrics' batches; its usage record stays

    async def close(self) -> None:
        """Stop driving (batches stay as saved: the next start resumes them) and close the pools."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.runs.close()


def _errors(message: str, code: str = "invalid_request") -> dict[str, Any]:
    """OpenAI's ``errors`` list of a failed batch, one entry per line of ``message``."""
    lines = [x.strip() for x in message.splitlines() if x.strip()] or [message]
    return {"object": "list", "data": [{"code": code, "message": m, "param": None, "line": None} for m in lines[:100]]}
