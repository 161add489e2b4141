"""``/v1/responses``: a Responses request as the pipeline's chat request; the body of an
answer is OpenAI's ``response`` object.

Honoured: ``model``; ``input``, a string (one user message) or a list of messages (``role``
user, assistant, system or developer, a developer message read as system; ``content`` a string or
``input_text`` / ``output_text`` parts); ``instructions`` (a system message before the
input); ``max_output_tokens``; ``temperature``; ``top_p``; ``text.format`` (``text``,
``json_object``, ``json_schema`` -> the chat request's ``response_format``: structured
output where the engine constrains, the line refused where it does not). Accepted at the
values that ask for nothing: ``tools`` ``[]``, ``tool_choice`` ``none``/``auto``,
``parallel_tool_calls``, ``stream``/``background`` false, ``include`` ``[]``,
``top_logprobs`` 0, ``reasoning`` null, ``truncation`` ``disabled``, ``text.verbosity``
``medium``; ``metadata``, ``user``, ``store``, ``service_tier``, ``prompt_cache_key``,
``prompt_cache_retention`` and ``safety_identifier`` are accepted and ignored. Any other field
or value (``previous_response_id``, ``conversation``, tools, images, files...) refuses the
line alone.
"""

from __future__ import annotations

from typing import Any

from batch_inference.api.endpoints.base import Answered, Endpoint, Refused, keep_unless

OFF = {"tools": ([], None), "tool_choice": ("none", "auto", None), "parallel_tool_calls": (True, False, None),
       "stream": (False, None), "background": (False, None), "include": ([], None), "top_logprobs": (0, None),
       "reasoning": (None,), "truncation": ("disabled", None), "prompt_cache_retention": (None, "in-memory", "24h")}
IGNORED = ("metadata", "user", "store", "service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier")
HONOURED = ("model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text")
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text")


def _content(content: Any, where: str) -> str | Refused:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return Refused(f"{where}: a string or a list of input_text parts", param="input")
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            return Refused(f"{where}.{i}: only text parts are supported (got {kind!r})", param="input")
        parts.append(part["text"])
    return "".join(parts)


def _messages(value: Any) -> list[dict[str, Any]] | Refused:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        return Refused("input: a string or a list of messages", param="input")
    messages = []
    for i, item in enumerate(value):
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            kind = item.get("type") if isinstance(item, dict) else type(item).__name__
            return Refused(f"input.{i}: only messages are supported (got {kind!r})", param="input")
        role = ROLES.get(item.get("role"))  # type: ignore[arg-type]
        if role is None:
            return Refused(f"input.{i}.role: {item.get('role')!r} (user, assistant, system or developer)", param="input")
        content = _content(item.get("content"), f"input.{i}.content")
        if isinstance(content, Refused):
            return content
        messages.append({"role": role, "content": content})
    return messages


def _format(text: Any) -> dict[str, Any] | None | Refused:
    """``text.format`` as the chat request's ``response_format`` (None: plain text)."""
    if not isinstance(text, dict):
        return Refused("text: an object", param="text")
    if unknown := sorted(set(text) - {"format", "verbosity"}):
        return Refused(f"text: unsupported fields {unknown}", param="text")
    if text.get("verbosity") not in (None, "medium"):
        return Refused(f"text.verbosity: {text['verbosity']!r} is not supported (medium only)", param="text")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return Refused(f"text.format: {fmt!r} (text, json_object or json_schema)", param="text")


def _request(body: dict[str, Any]) -> dict[str, Any] | Refused:
    kept = keep_unless(body, OFF)
    if unknown := sorted(set(kept) - set(HONOURED) - set(IGNORED)):
        return Refused(f"unsupported body field {unknown[0]!r} for /v1/responses", param=unknown[0])
    if "input" not in kept:
        return Refused("input: required", param="input")
    messages = _messages(kept["input"])
    if isinstance(messages, Refused):
        return messages
    if (instructions := kept.get("instructions")) is not None:
        if not isinstance(instructions, str):
            return Refused("instructions: a string", param="instructions")
        messages = [{"role": "system", "content": instructions}, *messages]
    chat: dict[str, Any] = {"messages": messages}
    for ours, theirs in (("model", "model"), ("max_tokens", "max_output_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
        if theirs in kept:
            chat[ours] = kept[theirs]
    if "text" in kept:
        fmt = _format(kept["text"])
        if isinstance(fmt, Refused):
            return fmt
        if fmt is not None:
            chat["response_format"] = fmt
    return chat


def _response(body: dict[str, Any], answered: Answered) -> dict[str, Any]:
    """A ``chat.completion`` body as a ``response`` object."""
    choice = body["choices"][0]
    usage = body.get("usage") or {}
    suffix = str(body["id"]).split("-", 1)[-1]
    cut = choice.get("finish_reason") == "length"
    text = choice["message"].get("content") or ""
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    return {
        "id": f"resp_{suffix}", "object": "response", "created_at": body["created"], "model": body["model"],
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
        "output": [{"type": "message", "id": f"msg_{suffix}", "status": "incomplete" if cut else "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}],
        "output_text": text,
        "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                  "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion},
        "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
    }


ENDPOINT = Endpoint(url="/v1/responses", pipeline_url="/v1/chat/completions", request=_request, response=_response)
