"""The judge kinds, one registry keyed by ``kind``: what ``JudgeConfig.kind`` accepts and how
``build_judge`` builds each one.

A kind is declared where its judge lives (``judges/llm.py``, ``judges/rules.py``) as a
``JudgeKind`` and registered with ``register_judge_kind``; the kinds that run no automated
judge (``none``, ``human``) are declared here. A new kind is one file in ``judges/`` that
registers itself, imported by ``judges/__init__.py``: the spec then accepts it and the
workers build it by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batch_inference.registry import Registry


@dataclass(frozen=True)
class JudgeKind:
    """One ``judge.kind``: its name, how a config of it becomes a judge, and what it requires.

    ``build(config)`` returns an object with ``judge(record, result) -> Verdict`` (``LLMJudge``
    additionally renders prompts; the pool tells the two apart by type); None: the kind runs
    no automated judge and ``no_build`` says why. ``check(config)`` raises ``ValueError`` for a
    config this kind cannot run (validated with the spec, before any record)."""

    name: str
    build: Callable[[Any], Any] | None = None
    check: Callable[[Any], None] | None = None
    no_build: str = ""


_KINDS: Registry[JudgeKind] = Registry("judge kind", keep_builtins=False)
_BUILTIN = ("llm", "rule", "human", "none")  # listed first, in this order (the spec's error names them so)


def register_judge_kind(kind: JudgeKind) -> JudgeKind:
    """Add ``kind`` (a name already taken is an error: two files would claim one spec word)."""
    return _KINDS.add(kind)


def unregister_judge_kind(name: str) -> None:
    """Remove a kind (tests that register one of their own)."""
    _KINDS.remove(name)


def judge_kind(name: str) -> JudgeKind:
    """The registered kind ``name`` (``KeyError`` naming the known kinds when there is none)."""
    try:
        return _KINDS[name]
    except KeyError:
        raise KeyError(f"unknown judge kind {name!r} (known: {', '.join(judge_kinds())})") from None


def judge_kinds() -> tuple[str, ...]:
    """Every registered kind's name: the built-in kinds, then the others in registration order."""
    return tuple(sorted(_KINDS, key=lambda name: _BUILTIN.index(name) if name in _BUILTIN else len(_BUILTIN)))


register_judge_kind(JudgeKind("human", no_build="a human judge has no automated judge to build: its records go to the review queue"))
register_judge_kind(JudgeKind("none", no_build="judge kind 'none' has no judge to build: every inferred record is approved"))
