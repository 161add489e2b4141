"""What peft itself answers, greedy, one prompt at a time: the reference the transformers
engine's LoRA requests are compared against (and the plain base model's, for base rows)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


def greedy_texts(model_dir: Path, adapters: dict[str, Path], rows: Sequence[tuple[Sequence[int], str | None, int]]) -> list[str]:
    """Each row's (prompt ids, adapter or None, max_tokens) completion text: ``PeftModel.generate``
    with that adapter active, or the plain ``AutoModelForCausalLM`` (no peft) for None; cut
    at EOS and decoded as the engine decodes."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = base.generation_config.eos_token_id
    eos_ids = set(eos) if isinstance(eos, list) else {eos}
    (first, path), *rest = adapters.items()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), str(path), adapter_name=first)
    for name, path in rest:
        peft.load_adapter(str(path), adapter_name=name)
    peft.eval()
    texts = []
    with torch.inference_mode():
        for ids, adapter, max_tokens in rows:
            if adapter is not None:
                peft.set_adapter(adapter)
            model = base if adapter is None else peft
            prompt = torch.tensor([list(ids)])
            out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_tokens,
                                 do_sample=False, temperature=None, top_p=None, top_k=None,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)[0, prompt.shape[1]:].tolist()
            end = next((k for k, t in enumerate(out) if t in eos_ids), len(out))
            texts.append(tokenizer.decode(out[:end], skip_special_tokens=True))
    return texts
