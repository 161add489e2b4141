"""The typed edge of the Batch API (as vLLM's ``entrypoints/openai/.../batch`` protocol): a
request line of an input file, the batch record the server keeps and the batch and file
objects it answers with.

``BatchRecord`` is a batch's state in storage (``batches/<id>/state.json``): OpenAI's batch
fields plus the server's own (``HIDDEN``). Its JSON form is stable: every key keeps the name
it had when the state was a plain dict (the batch's model as ``run``), a key an older server
did not write takes its default (state from before projects is project ``default``'s), and a
key this version does not know is kept as it was (``extra``), so a newer server's state
survives a round trip through an older one.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from batch_inference.api.config import DEFAULT_PROJECT

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL = ("completed", "failed", "expired", "cancelled")
Status = Literal["validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled"]
HIDDEN = ("api", "source_url", "stopped", "run", "created_ns", "project", "delivering")  # the server's keys, not OpenAI's batch fields
FILE_HIDDEN = ("url", "created_ns", "project")  # a file's meta keys that are the server's, not OpenAI's file fields


class RequestLine(BaseModel):
    """One line of a batch input file: ``{custom_id, method, url, body}``. The body is read by
    the line's endpoint (``api.endpoints``), so it stays a mapping here."""

    model_config = ConfigDict(extra="allow")

    custom_id: Annotated[str, Field(min_length=1, strict=True)]
    method: Literal["POST"] = "POST"
    url: Annotated[str, Field(strict=True)]
    body: dict[str, Any]


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


def _usage() -> dict[str, Any]:
    return {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
            "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}


class BatchRecord(BaseModel):
    """A batch as the server keeps it (module docstring: its JSON form is stable)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, validate_assignment=False)

    id: str
    object: Literal["batch"] = "batch"
    api: Literal["openai", "anthropic"] = "openai"
    endpoint: str
    input_file_id: str | None = None
    source_url: str
    completion_window: str
    status: Status = "validating"
    created_at: int
    created_ns: int = 0
    expires_at: int | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    model: str | None = None
    output_expires_after: dict[str, Any] | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    stopped: int = 0  # requests a cancel or the window stopped (error lines batch_cancelled / batch_expired)
    run_model: str | None = Field(None, alias="run")  # the model whose pipeline runs the batch; None: nothing to run
    project: str = DEFAULT_PROJECT
    usage: dict[str, Any] = Field(default_factory=_usage)
    delivering: dict[str, Any] | None = None  # the file ids of a delivery under way (named before its files are written)

    @classmethod
    def load(cls, data: dict[str, Any]) -> BatchRecord:
        """A record from its JSON form, any version's (a ``project`` of null is the default one)."""
        if data.get("project") is None:
            data = {**data, "project": DEFAULT_PROJECT}
        return cls.model_validate(data)

    def to_json(self) -> dict[str, Any]:
        """The stable JSON form, as stored."""
        return self.model_dump(mode="json", by_alias=True)

    def changed(self, **changes: Any) -> BatchRecord:
        """A copy with ``changes`` (field names; ``request_counts`` may be a mapping), validated."""
        return BatchRecord.load({**self.to_json(), **{("run" if k == "run_model" else k): v for k, v in changes.items()}})

    def stopped_at_validation(self) -> bool:
        return self.in_progress_at is None

    def public(self) -> dict[str, Any]:
        """The OpenAI ``batch`` object."""
        return {k: v for k, v in self.to_json().items() if k not in HIDDEN}

    @property
    def ended(self) -> bool:
        return self.status in TERMINAL


def file_object(meta: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI ``file`` object of a file's stored meta."""
    return {k: v for k, v in meta.items() if k not in FILE_HIDDEN}


def owner(item: dict[str, Any] | BatchRecord) -> str:
    """The project a file or batch belongs to: the one recorded, else (made before projects) the default one."""
    if isinstance(item, BatchRecord):
        return item.project
    return str(item.get("project") or DEFAULT_PROJECT)
