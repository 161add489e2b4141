"""A simulated engine for benchmarks and scale tests (never the default).

Cost model: each ``generate`` call sleeps ``a + b x batch_tokens`` seconds in the
calling thread (the worker calls it via ``asyncio.to_thread``), where batch_tokens is
the sum of prompt + output tokens, or ``n x max(prompt + output)`` in padded mode.
Outputs are deterministic pseudo-random words from hash(prompt, seed); the first word
is APPROVED with probability ``approval_rate`` (else REJECTED), so as an LLM judge it
approves at that rate, and attempts with different seeds are independent.
Token counting is a cheap documented rule: ``max(1, ceil(len(text) / 4))``; chat prompts
count (and hash) as their plain-text view (``engines.chat.prompt_text``).
"""

from __future__ import annotations

import hashlib
import math
import random
import threading
import time

from batch_inference.engines.base import Completion, Prompt, SamplingParams, expand_params, too_long_error, truncate_at_stop
from batch_inference.engines.chat import prompt_text
from batch_inference.engines.config import EngineConfig, SimulatedOptions

_WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()


def simulated_token_count(text: str) -> int:
    """The simulated tokenizer: one token per 4 characters, at least one."""
    return max(1, math.ceil(len(text) / 4))


class SimulatedBatchError(RuntimeError):
    """Raised for a whole batch by ``fail_batch_every`` (fault injection)."""


class SimulatedEngine:
    """Sleeps like a GPU would, answers deterministically. ``simulated = True``."""

    simulated = True

    def __init__(self, options: SimulatedOptions | None = None, *, max_model_len: int = 4096, seed: int = 0) -> None:
        self.options = options or SimulatedOptions()
        self.max_model_len = max_model_len
        self.seed = seed
        self.name = f"simulated(a={self.options.latency_a_s}s, b={self.options.latency_b_s}s/token{', padded' if self.options.padded else ''})"
        self.calls = 0
        self.busy_s = 0.0  # total simulated model time, for reports
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> SimulatedEngine:
        return cls(cfg.simulated, max_model_len=cfg.max_model_len or 4096, seed=cfg.seed)

    def count_tokens(self, prompts: list[Prompt]) -> list[int]:
        return [simulated_token_count(prompt_text(p)) for p in prompts]

    def cost_s(self, prompt_tokens: list[int], output_tokens: list[int]) -> float:
        """Seconds one batch takes under the cost model."""
        totals = [p + o for p, o in zip(prompt_tokens, output_tokens)]
        if not totals:
            return 0.0
        batch_tokens = len(totals) * max(totals) if self.options.padded else sum(totals)
        return self.options.latency_a_s + self.options.latency_b_s * batch_tokens

    def generate(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        per_item = expand_params(prompts, params)
        with self._lock:
            self.calls += 1
            call = self.calls
        if self.options.fail_batch_every and call % self.options.fail_batch_every == 0:
            raise SimulatedBatchError(f"simulated batch failure (call {call}, every {self.options.fail_batch_every})")
        started = time.perf_counter()
        out = [self._one(prompt_text(prompt), p) for prompt, p in zip(prompts, per_item)]
        ran = [c for c in out if c.error is None]
        cost = self.cost_s([c.prompt_tokens for c in ran], [c.completion_tokens for c in ran])
        with self._lock:
            self.busy_s += cost
        # The modelled cost is the whole call: building the outputs is part of it,
        # so a batch takes `cost` seconds of wall time, not cost + our own CPU.
        time.sleep(max(0.0, cost - (time.perf_counter() - started)))
        return out

    def _one(self, prompt: str, p: SamplingParams) -> Completion:
        n_prompt = simulated_token_count(prompt)
        if self.options.fail_on is not None and self.options.fail_on in prompt:
            return Completion.failed(f"simulated_error: prompt contains {self.options.fail_on!r}", prompt_tokens=n_prompt)
        if err := too_long_error(n_prompt, p.max_tokens, self.max_model_len):
            return Completion.failed(err, prompt_tokens=n_prompt)
        digest = hashlib.blake2b(f"{self.seed}\x00{p.seed}\x00{prompt}".encode(), digest_size=8).digest()
        rng = random.Random(int.from_bytes(digest, "big"))
        verdict = "APPROVED" if rng.random() < self.options.approval_rate else "REJECTED"
        n_words = max(p.min_tokens, min(self.options.output_tokens, p.max_tokens))
        text = " ".join([verdict, *(rng.choice(_WORDS) for _ in range(n_words - 1))])
        text, stopped = truncate_at_stop(text, p.stop)
        # one word = one output token; "length" when max_tokens capped the output
        reason = "stop" if stopped or n_words < p.max_tokens else "length"
        return Completion(text=text, prompt_tokens=n_prompt, completion_tokens=len(text.split()), finish_reason=reason)

    def close(self) -> None:
        """Nothing to release."""
