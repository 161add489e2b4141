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

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from batch_inference.api.endpoints.base import Answered, Endpoint, Refused, keep_unless

OFF = {"tools": ([], None), "tool_choice": ("none", "auto", None), "parallel_tool_calls": (True, False, None),
       "stream": (False, None), "background": (False, None), "include": ([], None), "top_logprobs": (0, None),
       "reasoning": (None,), "truncation": ("disabled", None)}
IGNORED = frozenset({"metadata", "user", "store", "service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier"})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["input_text", "output_text"]
    text: Annotated[str, Field(strict=True)]
    annotations: list[Any] | None = None  # an output_text part of an earlier turn may carry them


class InputMessage(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[str, Field(strict=True)] | list[TextPart]
    id: str | None = None  # an output message of an earlier turn, given back as input
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class TextFormat(_Strict):
    type: Literal["text", "json_object"]


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    name: str
    schema_: Annotated[dict[str, Any], Field(alias="schema")]
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Strict):
    format: Annotated[TextFormat | JsonSchemaFormat, Field(discriminator="type")] | None = None
    verbosity: Literal["medium"] | None = None

    def response_format(self) -> dict[str, Any] | None:
        """The chat request's ``response_format`` (None: plain text)."""
        fmt = self.format
        if isinstance(fmt, JsonSchemaFormat):
            return {"type": "json_schema", "json_schema": fmt.model_dump(by_alias=True, exclude_none=True, exclude={"type"})}
        return {"type": "json_object"} if fmt is not None and fmt.type == "json_object" else None


class ResponsesBody(BaseModel):
    """The body of a ``/v1/responses`` line: the fields this server honours, typed; the ignored
    ones pass (``IGNORED``); any other refuses the line."""

    model_config = ConfigDict(extra="allow")

    model: Annotated[str, Field(strict=True)] | None = None
    input: Annotated[str, Field(strict=True)] | list[InputMessage]
    instructions: Annotated[str, Field(strict=True)] | None = None
    max_output_tokens: Any = None  # sampling values are checked by the pipeline within the model's limits
    temperature: Any = None
    top_p: Any = None
    text: TextConfig | None = None

    def chat(self) -> dict[str, Any]:
        """The pipeline's chat request body."""
        turns = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else \
            [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.input]
        if self.instructions is not None:
            turns.insert(0, {"role": "system", "content": self.instructions})
        chat: dict[str, Any] = {"messages": turns}
        given = self.model_fields_set
        for ours, theirs in (("model", "model"), ("max_tokens", "max_output_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
            if theirs in given:
                chat[ours] = getattr(self, theirs)
        if self.text is not None and (fmt := self.text.response_format()) is not None:
            chat["response_format"] = fmt
        return chat


def _refusal(exc: ValidationError) -> Refused:
    """A body's validation error as the line's 400 (its param: the top-level field): the deepest
    one, where a union (``input``: a string or messages) says what was wrong in the branch the
    value took, with the union's branch names left out of the place it names."""
    errors = exc.errors(include_url=False)
    error = max(errors, key=lambda e: len(e["loc"]))
    loc = [str(x) for x in error["loc"] if not (isinstance(x, str) and (x == "str" or "[" in x))]
    given = error.get("input")
    shown = f" (got {given!r})" if isinstance(given, str | int | float | bool) else ""
    return Refused(f"{'.'.join(loc)}: {error['msg']}{shown}", param=loc[0] if loc else None)


def _request(body: dict[str, Any]) -> dict[str, Any] | Refused:
    try:
        typed = ResponsesBody.model_validate(keep_unless(body, OFF))
    except ValidationError as exc:
        return _refusal(exc)
    if unknown := sorted(set(typed.model_extra or {}) - IGNORED):
        return Refused(f"unsupported body field {unknown[0]!r} for /v1/responses", param=unknown[0])
    return typed.chat()


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
