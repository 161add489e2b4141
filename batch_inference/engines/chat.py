"""Prompts to token ids with a Hugging Face tokenizer: text as is, chat through the model's template.

One helper for every engine that holds a tokenizer (transformers, vLLM blocking and
streaming), so a chat record becomes exactly the tokens ``apply_chat_template`` gives
(with ``add_generation_prompt=True``): the template already carries the model's special
tokens, so none are added on top (vLLM's own chat path does the same).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from typing import Any

from batch_inference.engines.base import ChatPrompt, Completion, Prompt, Tokens
from batch_inference.rows import ErrorKind


class ChatTemplateError(ValueError):
    """The model cannot render chat messages (no chat template, or the template raised)."""


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_chat(tokenizer: Any, prompt: ChatPrompt) -> list[int]:
    """Token ids of ``prompt`` rendered by the tokenizer's chat template (generation prompt added)."""
    return encode_prompts(tokenizer, [prompt])[0]


def render_chat(tokenizer: Any, prompt: ChatPrompt) -> str:
    """``prompt`` rendered by the tokenizer's chat template (generation prompt added), as text."""
    if not has_chat_template(tokenizer):
        raise ChatTemplateError(ErrorKind.CHAT_TEMPLATE_ERROR.tag("the model's tokenizer has no chat template "
                                                              "(chat messages need one; use a text `template` instead)"))
    try:
        return tokenizer.apply_chat_template(prompt.as_dicts(), add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # a template that raises for these messages fails this prompt only
        raise ChatTemplateError(ErrorKind.CHAT_TEMPLATE_ERROR.tag(f"{type(exc).__name__}: {exc}")) from exc


def encode_prompts(tokenizer: Any, prompts: Sequence[Prompt]) -> list[list[int]]:
    """Token ids per prompt, in one batched tokenizer call: text with special tokens added,
    chats rendered by the chat template first and added none (the template carries them:
    the ids ``apply_chat_template(tokenize=True)`` gives, and vLLM's chat path). One call for
    a chunk, not one a prompt: a Hugging Face tokenizer's per-call overhead is most of a
    short prompt's encoding (bench/batch_api.py; docs/pipeline.md).

    Raises for the whole list; ``encode_each`` fails one prompt alone.
    """
    texts = [(i, p) for i, p in enumerate(prompts) if isinstance(p, str)]
    chats = [(i, render_chat(tokenizer, p)) for i, p in enumerate(prompts) if isinstance(p, ChatPrompt)]
    out: list[list[int] | None] = [None] * len(prompts)
    for group, special_tokens in ((texts, True), (chats, False)):
        if group:
            for (i, _), ids in zip(group, tokenizer([t for _, t in group], add_special_tokens=special_tokens)["input_ids"]):
                out[i] = list(ids)
    return out  # type: ignore[return-value]


def encode_error(exc: Exception) -> Completion:
    """The failed Completion of a prompt the tokenizer (or its chat template) rejects."""
    text = str(exc) if isinstance(exc, ChatTemplateError) else ErrorKind.TOKENIZER_ERROR.tag(f"{type(exc).__name__}: {exc}")
    return Completion.failed(text)


def encode_each(tokenizer: Any, prompts: Sequence[Prompt]) -> list[Tokens | Completion]:
    """``Tokens`` per prompt in one batched call; per prompt only if that call raises, so a
    prompt the tokenizer (or chat template) rejects fails alone."""
    try:
        return [Tokens(ids, p) for ids, p in zip(encode_prompts(tokenizer, prompts), prompts)]
    except Exception:
        out: list[Tokens | Completion] = []
        for p in prompts:
            try:
                out.append(Tokens(encode_prompts(tokenizer, [p])[0], p))
            except Exception as exc:
                out.append(encode_error(exc))
        return out


def prompt_text(prompt: Prompt) -> str:
    """A plain-text view of a prompt (engines without a tokenizer, logs): chat turns as
    ``role: content`` lines ending in ``assistant: ``."""
    if isinstance(prompt, str):
        return prompt
    return "".join(f"{role}: {content}\n" for role, content in prompt.messages) + "assistant: "


class TokenizerCopy:
    """``encode``'s own copy of an engine's tokenizer, used by one thread at a time.

    ``encode`` runs on worker threads (``asyncio.to_thread``, one per concurrent task)
    while ``generate`` runs on the engine's thread (and a streaming engine detokenizes on
    the event loop); a Hugging Face fast tokenizer keeps padding/truncation state in Rust
    and fails ("Already borrowed") or mixes settings when two threads use it at once. So
    encoding never touches the tokenizer the engine runs with, and encoding calls take
    turns on the copy.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = copy.deepcopy(tokenizer)
        self._lock = threading.Lock()

    def __enter__(self) -> Any:
        self._lock.acquire()
        return self.tokenizer

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
