"""LoRA adapter folders: what an adapter is (PEFT's layout), read without loading weights.

An adapter folder holds ``adapter_config.json`` (``peft_type: LORA``, its rank ``r``,
``target_modules``) and its weights (``adapter_model.safetensors``, or ``.bin``). The vLLM
engine reads the ranks to size ``max_lora_rank``; the preflight reads every adapter of a
spec the same way, so a bad folder is named before any inference.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batch_inference.engines.config import LoraOptions

WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


class AdapterError(ValueError):
    """An adapter folder that is not a LoRA adapter (the message says why)."""


@dataclass(frozen=True)
class AdapterInfo:
    path: str
    rank: int
    target_modules: tuple[str, ...]
    base_model: str | None


def read_adapter(path: str) -> AdapterInfo:
    """The adapter at ``path``; raises ``AdapterError`` naming what is missing or wrong."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise AdapterError(f"adapter folder {path!r} does not exist "
                           "(build a tiny one with `batch-inference make-model DIR --adapter-for MODEL`)")
    config_file = folder / "adapter_config.json"
    try:
        config: Any = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{path}: no adapter_config.json (not a PEFT adapter folder)") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{config_file}: unreadable ({exc})") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "")).upper() != "LORA":
        raise AdapterError(f"{config_file}: peft_type is {config.get('peft_type') if isinstance(config, dict) else None!r}, not LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{config_file}: rank 'r' is {rank!r}, not a positive integer")
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise AdapterError(f"{path}: no adapter weights ({' or '.join(WEIGHT_FILES)})")
    targets = config.get("target_modules") or ()
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    return AdapterInfo(str(folder), rank, targets, config.get("base_model_name_or_path"))


def max_rank(lora: LoraOptions) -> int:
    """``max_lora_rank`` as configured, else the largest rank among the adapters."""
    if lora.max_lora_rank is not None:
        return lora.max_lora_rank
    return max(read_adapter(path).rank for path in lora.adapters.values())


def check_adapters(lora: LoraOptions) -> dict[str, str]:
    """Every adapter's problem by name (empty: all usable): folder, config, rank within max_lora_rank."""
    problems: dict[str, str] = {}
    for name, path in lora.adapters.items():
        try:
            info = read_adapter(path)
        except AdapterError as exc:
            problems[name] = str(exc)
            continue
        if lora.max_lora_rank is not None and info.rank > lora.max_lora_rank:
            problems[name] = f"{path}: rank {info.rank} > max_lora_rank {lora.max_lora_rank}"
    return problems
