"""A decode-step model of a continuous-batching engine (vLLM-like), in virtual time.

Pure arithmetic, no clock and no asyncio: the simulated engines sleep what it says, and
the scale simulation advances a discrete-event clock by it. One model, two users.

A step costs what its ``DecodeProfile`` says (``engines.profiles``). Bounds, as vLLM keeps
them: at most ``max_num_seqs`` running sequences, at most ``max_num_batched_tokens`` tokens
(decodes + whole-prompt prefills) per step, and the KV cache (prompt + generated tokens of
every running sequence) never above ``kv_capacity_tokens``: when decoding would overflow
it, the most recently admitted sequence is preempted and later recomputed (its prompt and
generated tokens prefilled again), which is what vLLM does. With a ``PrefixCache``
(``engines.prefix_cache``) a prompt's cached leading blocks are not prefilled.

``DecodeScheduler`` runs that policy: ``add``/``abort`` requests, ``step()`` one step
(returns its duration and the requests that finished), ``run_until_idle()`` for a whole
blocking batch. A step costs O(finished + admitted) Python work, not O(running).
``run_continuous`` / ``run_blocking`` run whole workloads on it.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from batch_inference.engines.prefix_cache import PrefixCache
from batch_inference.engines.profiles import DecodeProfile


# -- the scheduler ---------------------------------------------------------------


@dataclass(slots=True)
class _Seq:
    rid: object
    prompt_tokens: int
    output_tokens: int
    generated: int = 0  # tokens generated before the current admission (kept across a preemption)
    admitted_step: int = -1  # step whose prefill admitted it; -1 while waiting
    order: int = 0  # admission order (preemption takes the newest)
    blocks: Sequence[bytes] = ()  # its cacheable prompt blocks' keys (the prefix cache's)
    cached_tokens: int | None = None  # prompt tokens its first prefill took from the cache
    preempted: bool = False


@dataclass
class StepResult:
    duration_s: float
    finished: list[object] = field(default_factory=list)
    decode_seqs: int = 0
    prefill_tokens: int = 0
    cached: dict[object, int] = field(default_factory=dict)  # finished -> prompt tokens its prefill took from the cache


class DecodeScheduler:
    """vLLM's scheduling policy over a ``DecodeProfile``, in virtual time (``now_s``).

    A request is prefilled in the step that admits it (which also yields its first
    token) and then decodes one token per step until it has ``output_tokens``.
    Admission is FIFO, bounded by ``max_num_seqs``, the step's token budget and the KV
    cache. Counters (``busy_s``, ``output_tokens``, ``steps``, ``preemptions``) feed reports.
    """

    def __init__(self, profile: DecodeProfile, cache: PrefixCache | None = None) -> None:
        self.profile = profile
        # with a prefix cache, a prompt's cached leading blocks are not prefilled again
        self.cache = cache
        self.now_s = 0.0
        self.steps = 0
        self.busy_s = 0.0
        self.output_tokens = 0
        self.prefill_tokens = 0
        self.preemptions = 0
        # sums over steps of each cost term's count: busy_s is linear in the profile's
        # coefficients, so a calibration can solve for them from these (bench/engine_model.py)
        self.decode_seq_steps = 0
        self.kv_token_steps = 0
        self._waiting: deque[_Seq] = deque()
        self._running: dict[object, _Seq] = {}  # insertion order = admission order
        self._seqs: dict[object, _Seq] = {}
        self._finish_heap: list[tuple[int, int, object]] = []  # (finish step, order, rid), lazy deletion
        self._kv_used = 0
        self._order = 0
        self.cached_prefill_tokens = 0  # prompt tokens admissions took from the prefix cache

    # -- requests ----------------------------------------------------------------

    def add(self, rid: object, prompt_tokens: int, output_tokens: int, blocks: Sequence[bytes] = ()) -> None:
        """Queue a request. Its prompt plus output must fit the KV cache on its own.

        ``blocks``: the keys of its cacheable prompt blocks (``engines.blocks``), for the
        prefix cache; without a cache (or without blocks) its whole prompt is prefilled.
        """
        if rid in self._seqs:
            raise ValueError(f"request {rid!r} is already in the scheduler")
        if prompt_tokens < 1 or output_tokens < 1:
            raise ValueError(f"request {rid!r}: prompt_tokens and output_tokens must be >= 1")
        if prompt_tokens + output_tokens > self.profile.kv_capacity_tokens:
            raise ValueError(
                f"request {rid!r}: {prompt_tokens} + {output_tokens} tokens exceed the KV cache "
                f"({self.profile.kv_capacity_tokens} tokens)"
            )
        seq = _Seq(rid, prompt_tokens, output_tokens, blocks=blocks if self.cache is not None else ())
        self._seqs[rid] = seq
        self._waiting.append(seq)

    def abort(self, rid: object) -> bool:
        """Drop a request wherever it is (its KV is freed); False if it is not here."""
        seq = self._seqs.pop(rid, None)
        if seq is None:
            return False
        if rid in self._running:
            del self._running[rid]
            self._kv_used -= seq.prompt_tokens + self._generated(seq)
            self._release(seq)
        else:
            self._waiting.remove(seq)
        return True

    # -- state -------------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_used(self) -> int:
        return self._kv_used

    @property
    def idle(self) -> bool:
        return not self._seqs

    def __contains__(self, rid: object) -> bool:
        return rid in self._seqs

    # -- stepping ----------------------------------------------------------------

    def step(self) -> StepResult:
        """One engine step: preempt on KV overflow, admit, decode; advances ``now_s``."""
        p = self.profile
        if self.idle:
            return StepResult(0.0)
        # Every running sequence decodes one token and needs one more KV slot.
        while self._running and self._kv_used + len(self._running) > p.kv_capacity_tokens:
            self._preempt_newest()
        self.steps += 1
        step = self.steps
        decode_seqs = len(self._running)
        self._kv_used += decode_seqs
        budget = p.max_num_batched_tokens - decode_seqs
        prefill = 0
        while self._waiting and len(self._running) < p.max_num_seqs:
            seq = self._waiting[0]
            need = seq.prompt_tokens + seq.generated  # a preempted sequence recomputes what it had
            hit = self.cache.lookup(seq.blocks) * self.cache.block_size if self.cache is not None and seq.blocks else 0
            compute = need - hit  # the step's budget counts the tokens it computes (vLLM's)
            if compute > budget and (prefill or decode_seqs):
                break  # over the step's token budget (a prompt alone may exceed it)
            if self._kv_used + need + 1 > p.kv_capacity_tokens:
                break
            self._waiting.popleft()
            if self.cache is not None:
                self.cache.admit(seq.blocks, seq.prompt_tokens, preempted=seq.preempted)
                if seq.cached_tokens is None:
                    seq.cached_tokens = hit
            self.cached_prefill_tokens += hit
            self._order += 1
            seq.order = self._order
            seq.admitted_step = step
            # its prefill yields the first new token: it holds need + 1 tokens after this step
            self._kv_used += need + 1
            self._running[seq.rid] = seq
            remaining = seq.output_tokens - seq.generated  # >= 1
            heapq.heappush(self._finish_heap, (step + remaining - 1, seq.order, seq.rid))
            budget -= compute
            prefill += compute
        kv_in_step = self._kv_used
        duration = p.step_time(decode_seqs, prefill, kv_in_step)
        new_tokens = len(self._running)  # one per decode, and each admission's first token
        finished: list[object] = []
        cached: dict[object, int] = {}
        heap = self._finish_heap
        while heap and heap[0][0] <= step:
            _, order, rid = heapq.heappop(heap)
            seq = self._running.get(rid)
            if seq is None or seq.order != order:
                continue  # aborted or preempted since
            del self._running[rid]
            del self._seqs[rid]
            self._kv_used -= seq.prompt_tokens + seq.output_tokens
            self._release(seq)
            finished.append(rid)
            if seq.cached_tokens is not None:
                cached[rid] = seq.cached_tokens
        if self.cache is not None:
            self.cache.evict_to((p.kv_capacity_tokens - self._kv_used) // self.cache.block_size)
        self.now_s += duration
        self.busy_s += duration
        self.output_tokens += new_tokens
        self.prefill_tokens += prefill
        self.decode_seq_steps += decode_seqs
        self.kv_token_steps += kv_in_step
        return StepResult(duration, finished, decode_seqs, prefill, cached)

    def run_until_idle(self) -> float:
        """Step until every request has finished; returns the virtual seconds it took."""
        start = self.now_s
        while not self.idle:
            self.step()
        return self.now_s - start

    def _generated(self, seq: _Seq) -> int:
        """Tokens this running sequence holds beyond its prompt (its own count so far)."""
        return seq.generated + (self.steps - seq.admitted_step + 1 if seq.admitted_step >= 1 else 0)

    def _release(self, seq: _Seq) -> None:
        if self.cache is not None and seq.blocks:
            self.cache.release(seq.blocks)

    def _preempt_newest(self) -> None:
        rid, seq = self._running.popitem()
        done = self._generated(seq)
        self._kv_used -= seq.prompt_tokens + done
        self._release(seq)
        seq.preempted = True
        seq.generated = min(done, seq.output_tokens - 1)
        seq.admitted_step = -1
        self._waiting.appendleft(seq)
        self.preemptions += 1


# -- whole workloads in virtual time (benches, the scale simulation, the planner) -------


@dataclass(frozen=True)
class WorkloadResult:
    """What one workload did on one engine, in virtual seconds."""

    seconds: float
    requests: int
    output_tokens: int
    steps: int
    mean_running: float  # sequences per step: how full the engine's batch was
    preemptions: int = 0
    prefill_tokens: int = 0  # prompt tokens prefilled (recomputation after preemption included)
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


Request = tuple[int, int] | tuple[int, int, Sequence[bytes]]  # prompt tokens, output tokens[, prefix block keys]


def run_continuous(profile: DecodeProfile, requests: Sequence[Request], *, max_in_flight: int | None = None,
                   cache: PrefixCache | None = None) -> WorkloadResult:
    """Continuous batching fed by admission control: at most ``max_in_flight`` requests in
    the engine at once (None: all at once, the engine's own ceiling), each replaced as
    soon as it finishes. ``requests`` are (prompt tokens, output tokens[, block keys]);
    with a ``cache``, a request's cached leading blocks are not prefilled."""
    sched = DecodeScheduler(profile, cache)
    limit = len(requests) if max_in_flight is None else max_in_flight
    pending = iter(enumerate(requests))
    in_flight = 0
    for rid, req in pending:
        sched.add(rid, *req)
        in_flight += 1
        if in_flight >= limit:
            break
    while not sched.idle:
        done = len(sched.step().finished)
        in_flight -= done
        while in_flight < limit:
            nxt = next(pending, None)
            if nxt is None:
                break
            sched.add(nxt[0], *nxt[1])  # type: ignore[arg-type]
            in_flight += 1
    return _result(sched, len(requests))


def run_blocking(profile: DecodeProfile, batches: Sequence[Sequence[Request]], *, cache: PrefixCache | None = None) -> WorkloadResult:
    """One blocking call per batch, one after another (a fresh scheduler each: the barrier;
    a ``cache`` outlives the calls, as the engine's does)."""
    seconds = 0.0
    tokens = steps = seq_steps = preempt = prefill = cached = 0
    for batch in batches:
        sched = DecodeScheduler(profile, cache)
        for rid, req in enumerate(batch):
            sched.add(rid, *req)
        seconds += sched.run_until_idle()
        tokens += sched.output_tokens
        steps += sched.steps
        seq_steps += sched.decode_seq_steps + len(batch)
        preempt += sched.preemptions
        prefill += sched.prefill_tokens
        cached += sched.cached_prefill_tokens
    n = sum(len(b) for b in batches)
    return WorkloadResult(seconds, n, tokens, steps, seq_steps / steps if steps else 0.0, preempt, prefill, cached)


def token_budget_batches(requests: list[tuple[int, int]], *, target_tokens: int, max_tokens: int, max_batch_size: int = 256) -> list[list[tuple[int, int]]]:
    """How the ``TokenBatcher`` cuts a stream (cost = prompt + ``max_tokens``; the crossing
    record is admitted in full), for modelling blocking token-budgeted batches (``run_blocking``) offline."""
    batches: list[list[tuple[int, int]]] = []
    cur: list[tuple[int, int]] = []
    cost = 0
    for r in requests:
        cur.append(r)
        cost += r[0] + max_tokens
        if cost >= target_tokens or len(cur) >= max_batch_size:
            batches.append(cur)
            cur, cost = [], 0
    if cur:
        batches.append(cur)
    return batches


def _result(sched: DecodeScheduler, n: int) -> WorkloadResult:
    # every decode-step sequence plus each admission's prefill step
    seq_steps = sched.decode_seq_steps + n
    return WorkloadResult(sched.now_s, n, sched.output_tokens, sched.steps, seq_steps / sched.steps if sched.steps else 0.0,
                          sched.preemptions, sched.prefill_tokens, sched.cached_prefill_tokens)
