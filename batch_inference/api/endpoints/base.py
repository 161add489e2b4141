"""What a Batch API endpoint is to the server: its url, how a line's body becomes the
pipeline's request, and how the pipeline's answer becomes the endpoint's response body.

The pipeline reads OpenAI request lines of the urls it knows (``prompting.openai_batch``:
``/v1/chat/completions``, ``/v1/completions``); an endpoint maps its own body onto one of
those (``pipeline_url``) and maps the pipeline's response body (a ``chat.completion`` or
``text_completion``) back to its own. Validation happens once: the endpoint's ``request``
refuses what it cannot express, and the pipeline's typed line (``check_line``) refuses the
rest, each as that line's 400 alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Refused:
    """A request its endpoint answers 400 (an error-file line; the batch's other lines run)."""

    message: str
    param: str | None = None


@dataclass(frozen=True)
class Answered:
    """What ``response`` gets of an answered request besides the pipeline's body."""

    custom_id: str
    batch_id: str


Request = Callable[[dict[str, Any]], "dict[str, Any] | Refused"]
Response = Callable[[dict[str, Any], Answered], dict[str, Any]]


@dataclass(frozen=True)
class Endpoint:
    """One Batch API endpoint (a file of ``api/endpoints/`` and a line of its registry).

    ``url``: the ``endpoint`` a batch names and each of its lines' ``url``.
    ``pipeline_url``: the pipeline request the body maps to (``openai_batch.LINES``).
    ``request``: a line's body -> the pipeline request's body, or ``Refused``.
    ``response``: the pipeline's response body -> this endpoint's; None: the pipeline's as it is.
    ``spec``: keys the batch's pipeline spec takes beside the model's (e.g. a task).
    """

    url: str
    pipeline_url: str
    request: Request
    response: Response | None = None
    spec: Mapping[str, Any] = field(default_factory=dict)


def keep_unless(body: dict[str, Any], harmless: Mapping[str, tuple[Any, ...]]) -> dict[str, Any]:
    """``body`` without the fields whose value asks for nothing (``harmless[name]``: the values
    that are OpenAI's defaults), so the pipeline's check refuses only the ones that ask."""
    return {k: v for k, v in body.items() if not (k in harmless and v in harmless[k])}
