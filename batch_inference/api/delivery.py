"""A batch's output and error files: written whole under fresh ids, never rewritten.

A delivery writes into a folder of its own (``batches/<id>/deliveries/<output id>``): the
pipeline's export (``export_openai_batch``), each answer's body mapped to the batch's
endpoint's (``api.endpoints``: a Responses batch's lines hold ``response`` objects), and one
error file of the pipeline's error lines and the lines the server refused itself
(``rejected.jsonl``), each file registered as a ``batch_output`` file of the batch's
project once it is whole. The state machine (``api.batches``) names the ids before the
files are written and publishes them after; a delivery nobody was given is removed
(``remove``). No message or line a client reads names where the server keeps its files
(``public``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson

from batch_inference.api.config import DEFAULT_PROJECT, ApiConfig
from batch_inference.api.endpoints import ENDPOINTS, Answered
from batch_inference.api.protocol import BatchRecord
from batch_inference.api.store import Store
from batch_inference.pipeline.layout import RunLayout
from batch_inference.prompting.openai_batch import error_line, escape_line_breaks, jsonl_line
from batch_inference.storage.urls import fs_for

STOPPED = {"cancelled": ("batch_cancelled", "This request was not executed: the batch was cancelled."),
           "expired": ("batch_expired", "This request could not be executed before the completion window expired.")}


def now() -> int:
    return int(time.time())


@dataclass
class Delivered:
    """What a delivery wrote: the counts and files the batch publishes."""

    completed: int
    failed: int
    stopped: int
    output_file_id: str | None
    error_file_id: str | None
    usage: dict[str, Any]


def usage(prompt: int, completion: int) -> dict[str, Any]:
    """A batch's ``usage`` (OpenAI's batch object field)."""
    return {"input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion,
            "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}


def delete_file(store: Store, meta: dict[str, Any]) -> None:
    """Remove a file object and its bytes (blocking)."""
    store.remove(meta["url"])
    store.remove(store.file_dir(meta["id"]))


class Delivery:
    """Writes, registers and removes the files of the server's batches (blocking methods)."""

    def __init__(self, config: ApiConfig, store: Store) -> None:
        self.config, self.store = config, store

    # -- what a client may read ---------------------------------------------------------

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

    def public_line(self, raw: bytes) -> bytes:
        """An error line (JSON bytes) without the storage location (``public``): its strings
        name the location JSON-escaped, so the escaped forms are replaced."""
        for form in self._storage_forms():
            escaped = orjson.dumps(form)[1:-1]
            if escaped in raw:
                raw = raw.replace(escaped + b"/", b"").replace(escaped, b"<storage>")
        return raw

    # -- writing -------------------------------------------------------------------------

    def folder(self, record: BatchRecord, delivery: dict[str, Any]) -> str:
        """Where one delivery writes: a folder of its own, so no delivery ever rewrites another's files."""
        return f"{self.store.batch_dir(record.id)}/deliveries/{delivery['output_file_id']}"

    def remove(self, record: BatchRecord, delivery: dict[str, Any]) -> None:
        """Remove an unpublished delivery's file objects and bytes."""
        for file_id in (delivery.get("output_file_id"), delivery.get("error_file_id")):
            if file_id:
                self.store.remove(self.store.file_dir(file_id))
        self.store.remove(self.folder(record, delivery))

    def deliver(self, record: BatchRecord, stopped: str | None, delivery: dict[str, Any], spec: Any) -> Delivered:
        """Write the output and error files of a batch: the pipeline's export (``spec``: its run's
        spec, None when nothing ran) plus the lines the server refused itself, each whole
        (atomic) before it is registered under ``delivery``'s id."""
        from batch_inference.pipeline import PipelineRun
        from batch_inference.pipeline.export import export_openai_batch

        batch_dir = self.store.batch_dir(record.id)
        export_dir = self.folder(record, delivery)
        output_url, errors_url = f"{export_dir}/output.jsonl", f"{export_dir}/errors.jsonl"
        got = {"completed": 0, "failed": 0, "stopped": 0, "prompt": 0, "completion": 0}
        if spec is not None:
            run = PipelineRun(spec)
            if run.ledger.read(RunLayout.SHARD) is not None:
                assert record.run_model is not None
                summary = export_openai_batch(run, export_dir, unfinished=STOPPED[stopped] if stopped else None,
                                              judged=self.config.models[record.run_model].judge is not None)
                got.update(completed=summary.output, failed=summary.errors, prompt=summary.prompt_tokens,
                           completion=summary.completion_tokens,
                           stopped=summary.errors_by_code.get(STOPPED[stopped][0], 0) if stopped else 0)
                output_url = self._map_answers(record, output_url, f"{export_dir}/batch_output.jsonl")
            else:  # stopped before its run sharded the input: none of its requests ran
                assert stopped is not None, "a finished run has sharded its input"
                got["stopped"] = got["failed"] = self._write_unrun(record, errors_url, *STOPPED[stopped])
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
                        w.write(escape_line_breaks(self.public_line(raw)) + b"\n")
            w.commit()
        except BaseException:
            w.discard()
            raise
        expires = None
        if (after := record.output_expires_after) is not None:
            expires = int(record.created_at) + int(after["seconds"])
        output_id = self._register(record, delivery["output_file_id"], output_url, "batch_output.jsonl", expires) \
            if got["completed"] else None
        error_id = self._register(record, delivery["error_file_id"], final_errors, "batch_errors.jsonl", expires) \
            if got["failed"] else None
        return Delivered(completed=got["completed"], failed=got["failed"], stopped=got["stopped"], output_file_id=output_id,
                         error_file_id=error_id, usage=usage(got["prompt"], got["completion"]))

    def _map_answers(self, record: BatchRecord, url: str, mapped_url: str) -> str:
        """The output file with each answer's body as the batch's endpoint answers (``url``
        itself when the endpoint answers with the pipeline's body)."""
        respond = ENDPOINTS[record.endpoint].response
        if respond is None or self.store.size(url) is None:
            return url
        w = self.store.open_writer(mapped_url)
        try:
            for raw in self.store.lines(url):
                if raw.strip():
                    line = orjson.loads(raw)
                    response = line.get("response")
                    if response and response.get("status_code") == 200:
                        response["body"] = respond(response["body"], Answered(custom_id=line["custom_id"], batch_id=record.id))
                    w.write(jsonl_line(line))
            w.commit()
        except BaseException:
            w.discard()
            raise
        return mapped_url

    def _write_unrun(self, record: BatchRecord, url: str, code: str, message: str) -> int:
        """An error line (``code``) for every request of ``input.jsonl``."""
        n = 0
        w = self.store.open_writer(url)
        try:
            for raw in self.store.lines(f"{self.store.batch_dir(record.id)}/input.jsonl"):
                if raw.strip():
                    w.write(jsonl_line(error_line(str(orjson.loads(raw)["custom_id"]), run=record.id, code=code, message=message)))
                    n += 1
            w.commit()
        except BaseException:
            w.discard()
            raise
        return n

    def _register(self, record: BatchRecord, file_id: str, url: str, filename: str, expires_at: int | None) -> str:
        """A file object of the batch's project for bytes the server wrote whole (an output or error file)."""
        meta = {"id": file_id, "object": "file", "bytes": self.store.size(url) or 0, "created_at": now(), "created_ns": time.time_ns(),
                "filename": filename, "purpose": "batch_output", "status": "processed", "expires_at": expires_at,
                "status_details": None, "url": url, "project": record.project or DEFAULT_PROJECT}
        self.store.write_json(f"{self.store.file_dir(file_id)}/meta.json", meta)
        return file_id

    # -- removing ------------------------------------------------------------------------

    def expire_files(self, t: int) -> list[str]:
        """Delete the files whose ``expires_at`` has passed; their ids."""
        gone = []
        for file_id in self.store.children(self.store.url("files")):
            meta = self.store.read_json(f"{self.store.file_dir(file_id)}/meta.json")
            if meta is not None and meta.get("expires_at") is not None and meta["expires_at"] <= t:
                delete_file(self.store, meta)
                gone.append(file_id)
        return gone

    def delete_batch(self, record: BatchRecord) -> None:
        """Remove an ended batch: its state, its run and its files."""
        for file_id in (record.output_file_id, record.error_file_id):
            if file_id and (meta := self.store.read_json(f"{self.store.file_dir(file_id)}/meta.json")) is not None:
                delete_file(self.store, meta)
        self.store.remove(f"{self.store.runs}/{record.id}")
        self.store.remove(self.store.batch_dir(record.id))
