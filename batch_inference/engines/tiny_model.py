"""A real, tiny Llama model built offline: seeded random weights and a byte-level BPE
tokenizer trained locally on a built-in text. Nothing is downloaded.

Saved with ``save_pretrained`` (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json, chat template), so both
``AutoModelForCausalLM`` and vLLM can load the directory. Random weights mean the text
is gibberish, but the compute path (tokenise, batch, pad, generate, decode) is real.
"""

from __future__ import annotations

from pathlib import Path

VOCAB_SIZE = 512
MAX_POSITIONS = 2048
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)

# Training text for the tokenizer: varied English and JSON-ish text so that prompts in
# tests and demos tokenise into a realistic mix of merges and bytes.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A batch of prompts is tokenised, padded on
the left and run through the model together; the results come back in the same order.
Translate the following sentence into French. Summarise the article in one paragraph.
Question: what is the capital of France? Answer: Paris. Question: how many legs does a
spider have? Answer: eight. Is the answer correct? Reply APPROVED or REJECTED.
{"id": "000000000001", "prompt": "Write a haiku about the sea", "result": "waves fold"}
Large language models generate text one token at a time. Throughput grows with batch
size until the accelerator is saturated; latency grows with the number of tokens.
def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * i)\n
0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' " # @ $ % & _ ~
Streaming sharded JSONL keeps memory flat; a persistent worker keeps the model warm.
"""


def _train_tokenizer():  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)  # deterministic: single text, fixed order
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        padding_side="left",
        model_max_length=MAX_POSITIONS,
        chat_template=CHAT_TEMPLATE,
    )


def make_tiny_model(out_dir: str | Path, *, seed: int = 0, layers: int = 2) -> Path:
    """Write the tiny model to ``out_dir`` and return it. Same seed => same weights. More
    ``layers`` make a larger weights file (~0.6 MB a layer; 2: ~1.7 MB)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=MAX_POSITIONS,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a 2 MB write needs no progress bar in CLI and test output
    try:
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
    return out


ADAPTER_TARGETS = ("q_proj", "v_proj")


def make_tiny_adapter(base_dir: str | Path, out_dir: str | Path, *, rank: int = 8, seed: int = 1, alpha: int = 16) -> Path:
    """Write a LoRA adapter for the tiny model at ``base_dir`` to ``out_dir`` (PEFT's layout:
    ``adapter_config.json`` + ``adapter_model.safetensors``), seeded random A and B on
    every layer's ``q_proj`` and ``v_proj``. B is not zero (PEFT initialises it so), so the
    adapter changes the model's outputs: a request on it answers unlike the base model.
    Same seed => same files."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    base = Path(base_dir)
    cfg = AutoConfig.from_pretrained(base)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    out_features = {"q_proj": cfg.num_attention_heads * head_dim, "v_proj": cfg.num_key_value_heads * head_dim}
    tensors: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(seed)
    for layer in range(cfg.num_hidden_layers):
        for module in ADAPTER_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, cfg.hidden_size, generator=gen) / cfg.hidden_size**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features[module], rank, generator=gen) / rank**0.5
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base.resolve()),
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": list(ADAPTER_TARGETS), "modules_to_save": None, "inference_mode": True,
        "use_rslora": False, "use_dora": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


EMBED_DIMENSIONS = (32, 64, 128)  # the Matryoshka sizes the tiny embedding model declares (its hidden size last)


def make_tiny_embedding_model(out_dir: str | Path, *, seed: int = 0, layers: int = 2) -> Path:
    """Write a tiny embedding model to ``out_dir``: the tiny Llama's base model (``LlamaModel``,
    no LM head; vLLM serves that architecture as an embedding model) with the tiny tokenizer,
    and sentence-transformers' pooling files (``modules.json``: mean pooling, then
    ``Normalize``), which vLLM and ``engines.pooling`` both read as the model's own pooling.
    ``matryoshka_dimensions`` lets a request ask for fewer ``dimensions`` (one of
    ``EMBED_DIMENSIONS``). Same seed => same weights. Nothing is downloaded."""
    import json

    import torch
    from transformers import LlamaConfig, LlamaModel
    from transformers.utils import logging as hf_logging

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=EMBED_DIMENSIONS[-1], intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=MAX_POSITIONS,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False, torch_dtype="float32", matryoshka_dimensions=list(EMBED_DIMENSIONS),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaModel(config)
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (out / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": EMBED_DIMENSIONS[-1], "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
         "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}, indent=2) + "\n")
    (out / "2_Normalize").mkdir(exist_ok=True)
    return out
