"""A batch's life: validate its requests, run them as a pipeline run, deliver its files.

``BatchManager`` owns every batch of the server. A batch is a state object in storage
(``Store``: ``batches/<id>/state.json``, OpenAI's batch fields plus what the server needs)
and, once validated, one ``PipelineRun`` of the batch's model (``spec_for``): sharding, the
prefix-aware layout, dedup, the model's pool (shared by every batch of that model through
``FairShare``) and the ledger's conservation check are the pipeline's own. The state moves
``validating -> in_progress -> finalizing -> completed`` (or ``failed``; ``cancelling ->
cancelled``; ``expired``), each step saved before the next begins, so a server killed at any
moment picks every batch up where its state says (``resume_all``), and the pipeline's own
resume skips what its ledger says is committed.

A delivery never rewrites a file: it writes the output and error files whole under fresh
ids (``delivering`` in the state names them first), then publishes the ids with the ended
status. A reader of a published id gets the same bytes for as long as the file lives; the
files of a delivery killed before it published are removed by the next one.

Each batch (and each file it delivers) records the ``project`` of the key that made it.

Stopping (cancel, expiry) cancels the batch's driver (no new shard task is dispatched; the
tasks in flight are abandoned) and exports what reached a terminal state; every other
request is an error line (``batch_cancelled`` / ``batch_expired``), so every ``custom_id``
is in exactly one of the two files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from typing import Any

import orjson

from typing import TYPE_CHECKING

from batch_inference.api import embeddings_endpoint
from batch_inference.api.config import DEFAULT_PROJECT, ApiConfig
from batch_inference.api.fair import FairShare
from batch_inference.api.store import Store, new_id
from batch_inference.pipeline.layout import RunLayout
from batch_inference.pipeline.spec import PipelineSpec, SpecError
from batch_inference.prompting.openai_batch import ENDPOINTS, body_refusal, error_line, escape_line_breaks, jsonl_line, request_error_line
from batch_inference.storage.urls import fs_for

if TYPE_CHECKING:
    from batch_inference.api.dagster_runs import DagsterBatches

log = logging.getLogger(__name__)

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL = ("completed", "failed", "expired", "cancelled")
NO_JUDGE = {"kind": "none"}  # every answer accepted, as hosted APIs do: one inference per request
STOPPED = {"cancelled": ("batch_cancelled", "This request was not executed: the batch was cancelled."),
           "expired": ("batch_expired", "This request could not be executed before the completion window expired.")}
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


def now() -> int:
    return int(time.time())


class BatchManager:
    """Every batch of one server: create, drive, cancel, expire, resume after a restart."""

    def __init__(self, config: ApiConfig, store: Store) -> None:
        self.config, self.store = config, store
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._shares: dict[str, FairShare] = {}
        self._open_lock = asyncio.Lock()
        self._exit = contextlib.AsyncExitStack()
        self._save_lock: dict[str, asyncio.Lock] = {}
        self.dagster: DagsterBatches | None = None
        if config.dagster is not None:
            from batch_inference.api.dagster_runs import DagsterBatches

            self.dagster = DagsterBatches(config.dagster.home)

    # -- state ---------------------------------------------------------------------

    def state_url(self, batch_id: str) -> str:
        return self.store.url("batches", batch_id, "state.json")

    async def get(self, batch_id: str) -> dict[str, Any] | None:
        return await asyncio.to_thread(self.store.read_json, self.state_url(batch_id))

    async def save(self, state: dict[str, Any]) -> None:
        await asyncio.to_thread(self.store.write_json, self.state_url(state["id"]), state)

    async def update(self, batch_id: str, **changes: Any) -> dict[str, Any]:
        """Read, change and save a batch's state (one writer at a time per batch)."""
        state = await self.update_if(batch_id, None, **changes)
        assert state is not None
        return state

    async def update_if(self, batch_id: str, expect: dict[str, Any] | None, **changes: Any) -> dict[str, Any] | None:
        """``update`` when the state still holds ``expect``'s values; None (nothing saved) when it does not."""
        lock = self._save_lock.setdefault(batch_id, asyncio.Lock())
        async with lock:
            state = await self.get(batch_id)
            assert state is not None, batch_id
            if expect and any(state.get(k) != v for k, v in expect.items()):
                return None
            state.update(changes)
            # a cancelled caller still waits for its write: the next writer must come after it
            write = asyncio.ensure_future(self.save(state))
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                await write
                raise
            return state

    async def all(self) -> list[dict[str, Any]]:
        """Every batch, newest first."""
        ids = await asyncio.to_thread(self.store.children, self.store.url("batches"))
        states = [s for s in await asyncio.gather(*(self.get(i) for i in ids)) if s is not None]
        return sorted(states, key=lambda s: (s.get("created_ns", 0), s["id"]), reverse=True)

    # -- create --------------------------------------------------------------------

    async def create(self, *, api: str, endpoint: str, source_url: str, input_file_id: str | None, window: str,
                     window_s: float, metadata: dict[str, Any] | None, output_expires_after: dict[str, Any] | None,
                     batch_id: str | None = None, project: str = DEFAULT_PROJECT) -> dict[str, Any]:
        """Save a new batch (``validating``) of ``project`` and start driving it."""
        if endpoint not in ENDPOINTS:
            raise BatchError(f"endpoint {endpoint!r} is not supported (supported: {', '.join(ENDPOINTS)})", param="endpoint")
        t = now()
        state: dict[str, Any] = {
            "id": batch_id or new_id("batch"), "object": "batch", "api": api, "endpoint": endpoint,
            "input_file_id": input_file_id, "source_url": source_url, "completion_window": window,
            "status": "validating", "created_at": t, "created_ns": time.time_ns(), "expires_at": t + int(window_s), "in_progress_at": None,
            "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None,
            "cancelled_at": None, "output_file_id": None, "error_file_id": None, "errors": None,
            "metadata": metadata, "model": None, "output_expires_after": output_expires_after,
            "request_counts": {"total": 0, "completed": 0, "failed": 0}, "stopped": 0, "run": None, "project": project,
            "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
                      "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}},
        }
        await self.save(state)
        self.start(state["id"])
        return state

    def start(self, batch_id: str) -> None:
        task = asyncio.create_task(self._drive(batch_id), name=f"batch {batch_id}")
        self._tasks[batch_id] = task
        task.add_done_callback(lambda t: self._tasks.pop(batch_id, None) if self._tasks.get(batch_id) is t else None)

    async def resume_all(self) -> list[str]:
        """After a (re)start: drive every batch that had not ended; finish a stop that was under way."""
        resumed = []
        for state in await self.all():
            if state["status"] == "cancelling":
                asyncio.create_task(self._stop(state["id"], "cancelled"))
            elif state["status"] in ACTIVE:
                self.start(state["id"])
            else:
                continue
            resumed.append(state["id"])
        if resumed:
            log.info("resumed %d batch(es): %s", len(resumed), ", ".join(resumed))
        return resumed

    # -- drive ---------------------------------------------------------------------

    async def _drive(self, batch_id: str) -> None:
        try:
            state = await self.get(batch_id)
            if state is None or state["status"] not in ("validating", "in_progress", "finalizing"):
                return
            if state["status"] == "validating":
                state = await self._validate(state)
                if state["status"] != "in_progress":
                    return
            if state["status"] == "in_progress" and state["run"]:
                await self._run(state)
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

    def _storage_forms(self) -> list[str]:
        """How the storage root can appear in a message: as configured, as its filesystem path,
        as a ``file://`` URL; longest first, so a longer form is replaced before its part."""
        root = self.store.root
        path = fs_for(root, self.store.storage_options)[1].rstrip("/")
        return sorted({root, path, f"file://{path}"} - {""}, key=len, reverse=True)

    def public(self, message: str) -> str:
        """``message`` without the server's storage location: what a client reads never names
        where the server keeps its files (a path inside storage stays, relative to it)."""
        for form in self._storage_forms():
            message = message.replace(form + "/", "").replace(form, "<storage>")
        return message

    def _public_line(self, raw: bytes) -> bytes:
        """An error line (JSON bytes) without the storage location (``public``): its strings
        name the location JSON-escaped, so the escaped forms are replaced."""
        for form in self._storage_forms():
            escaped = orjson.dumps(form)[1:-1]
            if escaped in raw:
                raw = raw.replace(escaped + b"/", b"").replace(escaped, b"<storage>")
        return raw

    async def _validate(self, state: dict[str, Any]) -> dict[str, Any]:
        """Read the requests once: the batch's model, its pipeline input, the lines refused alone."""
        checked = await asyncio.to_thread(self._split_requests, state)
        if checked.problems:
            return await self.update(state["id"], status="failed", failed_at=now(), errors={"object": "list", "data": checked.problems})
        return await self.update(state["id"], status="in_progress", in_progress_at=now(), model=checked.model,
                                 run=checked.model if checked.runnable else None,
                                 request_counts={"total": checked.total, "completed": 0, "failed": checked.rejected})

    def _split_requests(self, state: dict[str, Any]) -> Checked:
        """Write ``input.jsonl`` (the requests of the batch's model) and ``rejected.jsonl`` (error
        lines of the requests refused alone: a model not configured, another model than the
        batch's, a body field the pipeline cannot honour or a ``model`` that is no string,
        each as OpenAI's HTTP 400 of that request); file-level problems (a line that is no
        JSON object, too many lines, another endpoint, a repeated custom_id) fail the batch
        with the lines named, as OpenAI's validation does. Blocking."""
        from batch_inference.api.anthropic import to_openai_line

        batch_dir = self.store.batch_dir(state["id"])
        configured = sorted(self.config.models)
        out = Checked()
        first_line: dict[str, int] = {}  # custom_id -> the line it was first seen on
        max_lines = self.config.limits.max_lines
        inp, rej = self.store.open_writer(f"{batch_dir}/input.jsonl"), self.store.open_writer(f"{batch_dir}/rejected.jsonl")
        try:
            for n, raw in enumerate(self.store.lines(state["source_url"]), start=1):
                if not raw.strip():
                    continue
                out.total += 1
                if out.total > max_lines:
                    out.problem("too_many_requests", f"the batch has more than {max_lines} requests (limits.max_lines)", n)
                    break
                try:
                    line = orjson.loads(raw)
                except orjson.JSONDecodeError as exc:
                    out.problem("invalid_json_line", f"line {n} is not valid JSON: {exc}", n)
                    continue
                if not isinstance(line, dict):
                    out.problem("invalid_request", f"line {n} is not a JSON object", n)
                    continue
                cid = line.get("custom_id")
                if isinstance(cid, str) and cid:
                    if cid in first_line:
                        out.problem("duplicate_custom_id", f"line {n}: custom_id {cid!r} is a duplicate of line {first_line[cid]}'s: "
                                    "each request's custom_id must be unique in a batch", n)
                        continue
                    first_line[cid] = n
                if state["api"] == "anthropic":
                    line, refused = to_openai_line(line)
                    if refused is not None:
                        rej.write(jsonl_line(error_line(line["custom_id"], run=state["id"], code="invalid_request", message=refused)))
                        out.rejected += 1
                        continue
                if line.get("url") != state["endpoint"]:
                    out.problem("invalid_url", f"line {n}: url {line.get('url')!r} is not the batch's endpoint {state['endpoint']!r}", n)
                    continue
                body = line.get("body")
                refusal = body_refusal(body, state["endpoint"])
                if refusal is not None and isinstance(cid, str) and cid:
                    param, why = refusal
                    rej.write(jsonl_line(request_error_line(cid, run=state["id"], message=why, param=param)))
                    out.rejected += 1
                    continue
                model = body.get("model") if isinstance(body, dict) else None
                if isinstance(model, str) and model not in self.config.models:
                    message = f"model {model!r} is not configured on this server (configured: {', '.join(configured)})"
                elif isinstance(model, str) and (why := embeddings_endpoint.endpoint_mismatch(state["endpoint"], self.config.models[model].engine, model)):
                    message = why
                elif out.model is not None and isinstance(model, str) and model != out.model:
                    message = f"model {model!r}: a batch runs one model, and this batch's is {out.model!r} (its first request's)"
                else:
                    if out.model is None and isinstance(model, str):
                        out.model = model
                    out.runnable += 1
                    inp.write((orjson.dumps(line) if state["api"] == "anthropic" else raw) + b"\n")
                    continue
                if not isinstance(cid, str) or not cid:
                    out.problem("missing_custom_id", f"line {n} has no custom_id", n)
                    continue
                rej.write(jsonl_line(error_line(cid, run=state["id"], code="model_not_found", message=message)))
                out.rejected += 1
            if out.total == 0:
                out.problem("empty_file", "the input file has no requests", None)
            if out.model is None:
                out.model = next(iter(self.config.models)) if len(self.config.models) == 1 else None
                if out.model is None and out.runnable:
                    out.problem("missing_model", "no request names a model, and the server serves several: "
                                f"name one of {', '.join(configured)} in body.model", None)
            inp.commit()
            rej.commit()
        except BaseException:
            inp.discard()
            rej.discard()
            raise
        return out

    def spec_for(self, state: dict[str, Any]) -> PipelineSpec:
        """The pipeline spec of a batch: its model's engine, pool and judge over its ``input.jsonl``."""
        return PipelineSpec.parse(self.spec_data(state), source=f"model {state['run']!r} of the API config")

    def spec_data(self, state: dict[str, Any]) -> dict[str, Any]:
        """``spec_for``'s keys, before parsing (the Dagster start job parses them with the batch's run and input)."""
        name = state["run"]
        m = self.config.models[name]
        pool = m.pool if "name" in m.pool.model_fields_set else m.pool.model_copy(update={"name": f"api-{name}"})
        data: dict[str, Any] = {
            "run": state["id"], "input": f"{self.store.batch_dir(state['id'])}/input.jsonl", "input_format": "openai_batch",
            "openai_batch": {"model": name}, "output": self.store.runs, "engine": m.engine,
            "infer": {"sampling": m.sampling.model_dump(), "limits": m.limits.model_dump(), **embeddings_endpoint.infer_keys(m.engine)},
            "judge": m.judge if m.judge is not None else NO_JUDGE,
            "strategy": m.strategy if m.judge is not None else "in_place",
            "max_rounds": m.max_rounds, "max_attempts": m.max_attempts if m.judge is not None else 1,
            "shard_records": m.shard_records, "chunk_size": m.chunk_size, "pool": pool,
            "storage_options": self.config.storage_options,
        }
        return data

    def check_models(self) -> None:
        """Every model's spec builds (engine folder, judge, pool): a config error stops the server at start."""
        from batch_inference.api.config import ApiConfigError

        for name in self.config.models:
            try:
                self.spec_for({"id": "batch_check", "run": name})
            except SpecError as exc:
                raise ApiConfigError(str(exc)) from None

    async def share(self, name: str) -> FairShare:
        """The model's pool (opened at its first batch, kept for the next), shared fairly."""
        async with self._open_lock:
            if name not in self._shares:
                from batch_inference.pipeline.runner import open_runner

                template = self.spec_for({"id": "batch_pool", "run": name})
                runner = await self._exit.enter_async_context(open_runner(template))
                self._shares[name] = FairShare(runner)
            return self._shares[name]

    async def _run(self, state: dict[str, Any]) -> None:
        from batch_inference.pipeline.driver import run_pipeline

        spec = await asyncio.to_thread(self.spec_for, state)
        share = await self.share(state["run"])
        if self.dagster is not None and await self._run_in_dagster(state, spec, share):
            return
        await run_pipeline(spec, runner=share.for_batch(state["id"]))

    async def _run_in_dagster(self, state: dict[str, Any], spec: PipelineSpec, share: FairShare) -> bool:
        """The batch's steps as Dagster runs of its model's pipeline (``api.dagster_runs``), in a
        thread; a cancel of this task stops the batch's tasks and waits for the thread to end, so
        nothing writes to the run after the stop delivers it. False: finish in process."""
        from batch_inference.api.dagster_runs import ThreadBridge

        assert self.dagster is not None
        bridge = ThreadBridge(share.for_batch(state["id"]), asyncio.get_running_loop())
        data = self.spec_data(state)
        work = asyncio.ensure_future(asyncio.to_thread(self.dagster.run, state["id"], state["run"], data, spec.input, bridge))
        try:
            done = await asyncio.shield(work)
        except asyncio.CancelledError:
            bridge.stop()
            await asyncio.gather(work, return_exceptions=True)
            raise
        if not done:
            log.warning("batch %s: its Dagster runs did not reach results (a run a killed server left unfinished?): "
                        "finishing it in this process", state["id"])
        return done

    async def _finish(self, batch_id: str, stopped: str | None) -> None:
        """Export the run (all of it, or what finished before a stop) into new files, then publish them and end the batch.

        The files are written whole under fresh ids before the state names them, and never
        rewritten: a batch that another driver ended already is left as it is, and a delivery
        killed before it published is replaced by a new one (its files removed)."""
        state = await self.get(batch_id)
        assert state is not None
        if state["status"] in TERMINAL:  # delivered already: its published files stay as they are
            log.warning("batch %s is %s already: not delivered again", batch_id, state["status"])
            return
        if stale := state.get("delivering"):  # a delivery killed before it published: nobody was given its files
            await asyncio.to_thread(self._remove_delivery, state, stale)
        delivery = {"output_file_id": new_id("file"), "error_file_id": new_id("file")}
        moment = {"status": "finalizing", "finalizing_at": now()} if stopped is None else {}
        state = await self.update(batch_id, delivering=delivery, **moment)
        work = asyncio.ensure_future(asyncio.to_thread(self._deliver, state, stopped, delivery))
        try:
            files = await asyncio.shield(work)
        except asyncio.CancelledError:  # a stop: its delivery starts only once this one's thread has stopped writing
            await asyncio.gather(work, return_exceptions=True)
            raise
        fault_point("before_publish")
        counts = {"total": state["request_counts"]["total"], "completed": files["completed"], "failed": files["failed"]}
        end = stopped or "completed"
        published = await self.update_if(batch_id, {"delivering": delivery, "status": state["status"]}, status=end,
                                         **{f"{end}_at": now()}, request_counts=counts, stopped=files["stopped"], delivering=None,
                                         output_file_id=files["output_file_id"], error_file_id=files["error_file_id"], usage=files["usage"])
        if published is None:  # another driver took the batch over meanwhile: these files were never given to anyone
            log.warning("batch %s: another delivery took over: this one's files are removed", batch_id)
            await asyncio.to_thread(self._remove_delivery, state, delivery)

    def _delivery_dir(self, state: dict[str, Any], delivery: dict[str, Any]) -> str:
        """Where one delivery writes: a folder of its own, so no delivery ever rewrites another's files."""
        return f"{self.store.batch_dir(state['id'])}/deliveries/{delivery['output_file_id']}"

    def _remove_delivery(self, state: dict[str, Any], delivery: dict[str, Any]) -> None:
        """Remove an unpublished delivery's file objects and bytes (blocking)."""
        for file_id in (delivery.get("output_file_id"), delivery.get("error_file_id")):
            if file_id:
                self.store.remove(self.store.file_dir(file_id))
        self.store.remove(self._delivery_dir(state, delivery))

    def _deliver(self, state: dict[str, Any], stopped: str | None, delivery: dict[str, Any]) -> dict[str, Any]:
        """Write the output and error files of a batch (blocking): the pipeline's export plus the
        lines the server refused itself, each whole (atomic) before it is registered as a
        ``batch_output`` file under ``delivery``'s id."""
        from batch_inference.pipeline import PipelineRun
        from batch_inference.pipeline.export import export_openai_batch

        batch_dir = self.store.batch_dir(state["id"])
        export_dir = self._delivery_dir(state, delivery)
        output_url, errors_url = f"{export_dir}/output.jsonl", f"{export_dir}/errors.jsonl"
        got = {"completed": 0, "failed": 0, "stopped": 0, "prompt": 0, "completion": 0}
        if state.get("run"):
            run = PipelineRun(self.spec_for(state))
            if run.ledger.read(RunLayout.SHARD) is not None:
                summary = export_openai_batch(run, export_dir, unfinished=STOPPED[stopped] if stopped else None,
                                              judged=self.config.models[state["run"]].judge is not None)
                got.update(completed=summary.output, failed=summary.errors, prompt=summary.prompt_tokens,
                           completion=summary.completion_tokens,
                           stopped=summary.errors_by_code.get(STOPPED[stopped][0], 0) if stopped else 0)
            else:  # stopped before its run sharded the input: none of its requests ran
                assert stopped is not None, "a finished run has sharded its input"
                got["stopped"] = got["failed"] = self._write_unrun(state, errors_url, *STOPPED[stopped])
        # the server's own error lines join the pipeline's in one error file
        final_errors = f"{export_dir}/batch_errors.jsonl"
        w = self.store.open_writer(final_errors)
        try:
            for url in (errors_url, f"{batch_dir}/rejected.jsonl"):
                if self.store.size(url) is None:
                    continue
                for raw in self.store.lines(url):
                    if raw.strip():
                        if url != errors_url:
                            got["failed"] += 1
                        w.write(escape_line_breaks(self._public_line(raw)) + b"\n")
            w.commit()
        except BaseException:
            w.discard()
            raise
        expires = None
        if (after := state.get("output_expires_after")) is not None:
            expires = int(state["created_at"]) + int(after["seconds"])
        output_id = self._register(state, delivery["output_file_id"], output_url, "batch_output.jsonl", expires) \
            if got["completed"] else None
        error_id = self._register(state, delivery["error_file_id"], final_errors, "batch_errors.jsonl", expires) \
            if got["failed"] else None
        return {"completed": got["completed"], "failed": got["failed"], "stopped": got["stopped"],
                "output_file_id": output_id, "error_file_id": error_id,
                "usage": {"input_tokens": got["prompt"], "output_tokens": got["completion"],
                          "total_tokens": got["prompt"] + got["completion"],
                          "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}}

    def _write_unrun(self, state: dict[str, Any], url: str, code: str, message: str) -> int:
        """An error line (``code``) for every request of ``input.jsonl`` (blocking)."""
        n = 0
        w = self.store.open_writer(url)
        try:
            for raw in self.store.lines(f"{self.store.batch_dir(state['id'])}/input.jsonl"):
                if raw.strip():
                    w.write(jsonl_line(error_line(str(orjson.loads(raw)["custom_id"]), run=state["id"], code=code, message=message)))
                    n += 1
            w.commit()
        except BaseException:
            w.discard()
            raise
        return n

    def _register(self, state: dict[str, Any], file_id: str, url: str, filename: str, expires_at: int | None) -> str:
        """A file object of the batch's project for bytes the server wrote whole (an output or error file)."""
        meta = {"id": file_id, "object": "file", "bytes": self.store.size(url) or 0, "created_at": now(), "created_ns": time.time_ns(),
                "filename": filename, "purpose": "batch_output", "status": "processed", "expires_at": expires_at,
                "status_details": None, "url": url, "project": state.get("project") or DEFAULT_PROJECT}
        self.store.write_json(f"{self.store.file_dir(file_id)}/meta.json", meta)
        return file_id

    # -- cancel, expiry --------------------------------------------------------------

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        """Stop dispatching the batch's requests; it ends ``cancelled`` with what finished delivered."""
        state = await self.get(batch_id)
        if state is None:
            raise BatchError(f"no batch {batch_id!r}", status=404)
        if state["status"] in ("cancelling", "cancelled"):
            return state
        if state["status"] not in ("validating", "in_progress"):
            raise BatchError(f"batch {batch_id} is {state['status']}: only a validating or in-progress batch can be cancelled",
                             status=409)
        task = self._tasks.get(batch_id)
        if task is not None:
            task.cancel()  # before the state changes: the driver saves nothing after this
        state = await self.update(batch_id, status="cancelling", cancelling_at=now())
        asyncio.create_task(self._stop(batch_id, "cancelled", task))
        return state

    async def _stop(self, batch_id: str, end: str, task: asyncio.Task[None] | None = None) -> None:
        """Cancel the batch's driver, wait for it, then deliver what finished and end the batch ``end``."""
        task = task or self._tasks.get(batch_id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        try:
            state = await self.get(batch_id)
            if state is None or state["status"] in TERMINAL:
                return
            if state["in_progress_at"] is None:  # stopped while validating: read the requests first
                checked = await asyncio.to_thread(self._split_requests, state)
                await self.update(batch_id, in_progress_at=now(), model=checked.model, run=checked.model if checked.runnable else None,
                                  request_counts={"total": checked.total, "completed": 0, "failed": checked.rejected},
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
        for batch_id in list(self._tasks):
            state = await self.get(batch_id)
            if state is None or state["status"] not in ("validating", "in_progress"):
                continue
            if state["expires_at"] is not None and state["expires_at"] <= t:
                log.info("batch %s: completion window %s passed: expiring it", batch_id, state["completion_window"])
                asyncio.create_task(self._stop(batch_id, "expired", self._tasks.pop(batch_id, None)))
                continue
            if state["status"] == "in_progress" and state["run"]:
                counts = await asyncio.to_thread(self._live_counts, state)
                if counts != state["request_counts"]:  # not over the final counts of a batch that ended meanwhile
                    await self.update_if(batch_id, {"status": "in_progress"}, request_counts=counts)
        await asyncio.to_thread(self._expire_files, t)

    def _live_counts(self, state: dict[str, Any]) -> dict[str, int]:
        """request_counts of a running batch (blocking): what its run's ledger says has settled
        (``LedgerView.settled``: finished shards, and the records running tasks have committed,
        chunk by chunk) plus the lines refused at validation. A cancel now would deliver as many
        (the final counts come from the export)."""
        from batch_inference.pipeline.ledger import Ledger

        settled = Ledger(RunLayout(self.store.runs, state["id"]), self.config.storage_options).view().settled()
        return {"total": int(state["request_counts"]["total"]), "completed": settled["approved"],
                "failed": settled["failed"] + self._rejected_count(state)}

    def _rejected_count(self, state: dict[str, Any]) -> int:
        url = f"{self.store.batch_dir(state['id'])}/rejected.jsonl"
        return sum(1 for raw in self.store.lines(url) if raw.strip()) if self.store.size(url) is not None else 0

    def _expire_files(self, t: int) -> None:
        """Delete the files whose ``expires_at`` has passed (blocking)."""
        for file_id in self.store.children(self.store.url("files")):
            meta = self.store.read_json(f"{self.store.file_dir(file_id)}/meta.json")
            if meta is not None and meta.get("expires_at") is not None and meta["expires_at"] <= t:
                log.info("file %s expired: deleted", file_id)
                delete_file(self.store, meta)

    def delete(self, state: dict[str, Any]) -> None:
        """Remove an ended batch: its state, its run and its files (blocking)."""
        for file_id in (state.get("output_file_id"), state.get("error_file_id")):
            if file_id and (meta := self.store.read_json(f"{self.store.file_dir(file_id)}/meta.json")) is not None:
                delete_file(self.store, meta)
        self.store.remove(f"{self.store.runs}/{state['id']}")
        self.store.remove(self.store.batch_dir(state["id"]))

    async def close(self) -> None:
        """Stop driving (batches stay as saved: the next start resumes them) and close the pools."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._exit.aclose()


def delete_file(store: Store, meta: dict[str, Any]) -> None:
    """Remove a file object and its bytes (blocking)."""
    store.remove(meta["url"])
    store.remove(store.file_dir(meta["id"]))


class Checked:
    """What validating a batch's requests found."""

    def __init__(self) -> None:
        self.total = self.runnable = self.rejected = 0
        self.model: str | None = None
        self.problems: list[dict[str, Any]] = []

    def problem(self, code: str, message: str, line: int | None) -> None:
        if len(self.problems) < 100:
            self.problems.append({"code": code, "message": message, "param": None, "line": line})


def _errors(message: str, code: str = "invalid_request") -> dict[str, Any]:
    """OpenAI's ``errors`` list of a failed batch, one entry per line of ``message``."""
    lines = [x.strip() for x in message.splitlines() if x.strip()] or [message]
    return {"object": "list", "data": [{"code": code, "message": m, "param": None, "line": None} for m in lines[:100]]}
