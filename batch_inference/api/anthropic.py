"""Anthropic's Message Batches on the same batches: requests in, results out.

A Message Batch's requests (``{custom_id, params}``) become OpenAI chat request lines
(``to_openai_line``) and run as any batch does; its results are the batch's output and error
lines read back as Anthropic's (``result_line``): ``succeeded`` with a ``message`` (its
``stop_reason`` ``stop_sequence`` and the string when one of the request's stop sequences
ended it: the output line's ``stop_reason``, as vLLM's server writes it),
``errored`` with the reason, ``canceled`` / ``expired`` for the requests a cancel or the
window stopped. ``batch_object`` is the ``message_batch`` object of a batch's state.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

PARAMS = ("model", "max_tokens", "messages", "system", "temperature", "top_p", "stop_sequences", "metadata")
CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def _text(content: Any, where: str) -> tuple[str | None, str | None]:
    """A content string or list of text blocks as one string, or the reason it is not one."""
    if isinstance(content, str):
        return content, None
    if isinstance(content, list):
        parts = []
        for block in content:
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                kind = block.get("type") if isinstance(block, dict) else type(block).__name__
                return None, f"{where}: only text content blocks are supported (got {kind!r})"
            parts.append(block["text"])
        return "".join(parts), None
    return None, f"{where}: content must be a string or a list of text blocks"


def to_openai_line(request: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The OpenAI chat request line of one Message Batch request, and the reason it is refused
    alone (None when it can run). Messages are checked by the pipeline like any chat request's."""
    cid = str(request.get("custom_id"))
    line: dict[str, Any] = {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": {}}
    params = request.get("params")
    if not isinstance(params, dict):
        return line, "params: must be an object"
    if unknown := sorted(set(params) - set(PARAMS)):
        return line, f"params {unknown} not supported by this server (supported: {', '.join(PARAMS)})"
    if not isinstance(params.get("model"), str):
        got = type(params["model"]).__name__ if "model" in params else "nothing"
        return line, f"params.model: required, a string (got {got})"
    if not isinstance(params.get("max_tokens"), int) or isinstance(params.get("max_tokens"), bool):
        return line, "params.max_tokens: required, an integer"
    messages: list[dict[str, Any]] = []
    if (system := params.get("system")) is not None:
        text, why = _text(system, "params.system")
        if why:
            return line, why
        messages.append({"role": "system", "content": text})
    raw = params.get("messages")
    if isinstance(raw, list):
        for i, m in enumerate(raw):
            if not isinstance(m, dict):
                return line, f"params.messages.{i}: must be an object"
            text, why = _text(m.get("content"), f"params.messages.{i}.content")
            if why:
                return line, why
            messages.append({"role": m.get("role"), "content": text})
    elif raw is not None:
        return line, "params.messages: must be a list"
    body: dict[str, Any] = {"model": params.get("model"), "messages": messages, "max_tokens": params["max_tokens"]}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("stop", "stop_sequences")):
        if params.get(theirs) is not None:
            body[ours] = params[theirs]
    line["body"] = body
    return line, None


def result_line(line: dict[str, Any]) -> dict[str, Any]:
    """One results line (``{custom_id, result}``) from an OpenAI output or error line."""
    cid = line["custom_id"]
    response = line.get("response")
    if response and response.get("status_code") != 200:  # a request refused alone (request_error_line)
        error = (response.get("body") or {}).get("error") or {}
        return {"custom_id": cid, "result": {"type": "errored", "error": {
            "type": "error", "error": {"type": "invalid_request_error", "message": str(error.get("message"))}}}}
    if response:
        body = response["body"]
        choice = body["choices"][0]
        usage = body.get("usage") or {}
        stop_sequence = choice.get("stop_reason") if isinstance(choice.get("stop_reason"), str) else None
        reason = "max_tokens" if choice.get("finish_reason") == "length" else "stop_sequence" if stop_sequence is not None else "end_turn"
        message = {
            "id": "msg_" + str(body["id"]).split("-", 1)[-1], "type": "message", "role": "assistant", "model": body["model"],
            "content": [{"type": "text", "text": choice["message"]["content"] or ""}],
            "stop_reason": reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": int(usage.get("prompt_tokens") or 0), "output_tokens": int(usage.get("completion_tokens") or 0)},
        }
        out = {"custom_id": cid, "result": {"type": "succeeded", "message": message}}
        if "judge" in line:  # the model has a judge: which attempt it approved (beyond Anthropic's fields)
            out["judge"] = line["judge"]
        return out
    error = line.get("error") or {}
    code = error.get("code")
    if code == "batch_cancelled":
        return {"custom_id": cid, "result": {"type": "canceled"}}
    if code == "batch_expired":
        return {"custom_id": cid, "result": {"type": "expired"}}
    kind = "not_found_error" if code == "model_not_found" else "invalid_request_error" if code != "shard_quarantined" else "api_error"
    return {"custom_id": cid, "result": {"type": "errored", "error": {
        "type": "error", "error": {"type": kind, "message": f"{code}: {error.get('message')}"}}}}


def _iso(t: int | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def batch_object(state: dict[str, Any], results_url: str) -> dict[str, Any]:
    """The ``message_batch`` object of a batch's state."""
    status = state["status"]
    ended = status in ("completed", "failed", "expired", "cancelled")
    counts = state["request_counts"]
    stopped = int(state.get("stopped") or 0)
    if status == "failed":  # the requests could not run as a whole: each is errored
        succeeded, errored = 0, counts["total"]
    else:
        succeeded, errored = counts["completed"], counts["failed"] - (stopped if ended else 0)
    return {
        "id": state["id"], "type": "message_batch",
        "processing_status": "ended" if ended else "canceling" if status == "cancelling" else "in_progress",
        "request_counts": {
            "processing": 0 if ended else max(0, counts["total"] - counts["completed"] - counts["failed"]),
            "succeeded": succeeded, "errored": errored,
            "canceled": stopped if status == "cancelled" else 0, "expired": stopped if status == "expired" else 0,
        },
        "created_at": _iso(state["created_at"]), "expires_at": _iso(state["expires_at"]),
        "ended_at": _iso(state.get(f"{status}_at")) if ended else None,
        "cancel_initiated_at": _iso(state.get("cancelling_at")), "archived_at": None,
        "results_url": results_url if ended else None,
    }
