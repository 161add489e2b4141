"""Prove a spec runnable before any GPU time: ``preflight(spec)`` (run start, the Dagster
start job, ``batch-inference validate``).

It builds the judge and the request builder once (a rule judge with a wrong keyword, a
template that does not parse) and renders ``preflight_records`` records sampled across
the input (``inputs.sample_numbered``: a resumed run's laid-out shards, evenly spaced; a
full check, the whole input) through the infer and judge paths. What stops the run, as a
``SpecError`` naming the spec key and the record:

* the judge cannot be built (``judge.callable`` / ``judge.kwargs`` / ``judge.template``);
* a template placeholder (``infer.template``, ``infer.messages``, ``judge.template``), a
  prompt source (no template, and records have neither ``messages`` nor ``prompt``) or a
  rule judge's field (``KeyError``) that (nearly) every sampled record lacks
  (``census.SPEC_ERROR_SHARE``): a typo in the spec. When only some lack it, those records are
  bad, not the spec: each fails alone with its ``missing_field`` error (a warning here);
* a LoRA adapter folder that is not one (``engine.vllm.lora.adapters.<name>``,
  ``engine.transformers.lora.adapters.<name>``: no
  ``adapter_config.json``, not LORA, no weights, a rank over ``max_lora_rank``);
* a model folder neither engine can load (``engine.model``, ``judge.engine.model``: its
  config is read, no weights);
* ``infer.sampling.max_tokens`` (an llm judge's ``judge.max_tokens``) at or over the model's
  context (``engine.max_model_len``, else the config's ``max_position_embeddings``; the
  simulated engine's 4,096): no prompt could fit. Sampled prompts that with ``max_tokens``
  would not fit are counted in a warning (each fails ``prompt_too_long`` alone);
* chat prompts on a model whose tokenizer has no chat template (``engine.model``, or
  ``judge.engine.model`` for a chat judge with its own model);
* records asking for ``response_format`` on an engine that cannot constrain (``engine.kind``);
* an OpenAI Batch file's own problems (``prompting.openai_batch``) when ``full`` is set.

A record's own bad values (``bad_messages``, ``bad_sampling``) are that record's error at
run time, not a spec error: they are reported in ``Plan.record_errors`` and the run goes on.
So are template fields records lack or hold null (``missing_field`` unless ``null_fields:
empty``) and empty strings (legal, but suspicious): ``Plan.field_notes`` counts them over
every record read (the whole input for a full check, the sample otherwise), naming a few.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from batch_inference.engines.base import ChatPrompt
from batch_inference.judges import LLMJudge, MissingFieldError, RuleJudge, build_judge
from batch_inference.pipeline import inputs
from batch_inference.engines import EngineConfig
from batch_inference.pipeline.accounting import ID_CHECK_LIMIT, InputAccount
from batch_inference.pipeline.census import FIELD_EXAMPLES, FieldCensus, Misses
from batch_inference.pipeline.spec import PipelineSpec, SpecError, engine_label
from batch_inference.prompting import Request, RequestBuilder, RequestError
from batch_inference.prompting.openai_batch import OpenAIBatchReader, record_id
from batch_inference.rows import ErrorKind
from batch_inference.storage import ReshardReport, assigned_id
from batch_inference.storage.reshard import RefusedRecord, locate

SAMPLE_RESULT = "preflight result"  # what judge templates and rules see as {result}


@dataclass(frozen=True)
class Plan:
    """What a run of this spec would do (``batch-inference validate`` prints it)."""

    run: str
    input: str
    input_format: str
    format_detected: bool
    engine: str
    strategy: str
    prompt: str  # template | messages | record (the record's own messages/prompt)
    chat: bool  # at least one checked record is a chat prompt
    constrained: bool
    judge: str
    checked_records: int
    records: int | None = None  # counted only by a full check
    shards: int | None = None
    record_errors: list[str] = field(default_factory=list)
    account: InputAccount | None = None  # the whole input's lines (a full check only: ``pipeline.accounting``)
    field_notes: list[str] = field(default_factory=list)  # template fields missing, null or empty (``FieldCensus``)
    id_field: str = "id"  # the field or column holding each record's id (spec ``id_field``)

    def lines(self) -> list[str]:
        fmt = f"{self.input_format}{' (detected)' if self.format_detected else ''}"
        size = f"{self.records} records -> {self.shards} shard(s)" if self.records is not None else "not counted"
        if self.account is not None and self.account.malformed:
            size = f"{self.account.summary()} -> {self.shards} shard(s)"
        out = [
            f"run        {self.run}",
            f"input      {self.input} [{fmt}]: {size}",
            f"ids        {self._ids()}",
            f"engine     {self.engine}",
            f"prompt     {self.prompt}{' (chat template)' if self.chat else ''}{', constrained output' if self.constrained else ''}",
            f"judge      {self.judge}",
            f"strategy   {self.strategy}",
            f"checked    {self.checked_records} record(s) sampled across the input render through infer and judge",
        ]
        out += [f"warning    {e}" for e in (self.account.notes() if self.account is not None else [])]
        out += [f"warning    {e}" for e in self.field_notes]
        out += [f"warning    {e}" for e in self.record_errors]
        return out


    def _ids(self) -> str:
        if self.input_format == "openai_batch":
            where = "each line's custom_id"
        elif self.id_field == "id":
            where = "the records' 'id' (a record without one: its line's or row's number)"
        else:
            where = f"the {'column' if self.input_format == 'parquet' else 'field'} {self.id_field!r} (id_field; a record without one is left out)"
        if self.account is None:
            return where
        repeats = self.account.duplicate_ids
        return f"{where}: {repeats:,} id(s) repeated" if repeats else f"{where}: no id repeated"


def _build_judge(spec: PipelineSpec) -> LLMJudge | RuleJudge | None:
    if spec.judge.kind in ("human", "none"):  # people judge, or nothing does: nothing automated to build or try
        return None
    try:
        return build_judge(spec.judge)
    except ValueError as exc:
        text = str(exc)
        key = ("judge.kwargs" if "kwargs" in text else "judge.callable") if spec.judge.kind == "rule" else "judge.template"
        raise SpecError(f"{key}: {text}") from None


def _prompt_key(spec: PipelineSpec) -> str:
    return {"template": "infer.template", "messages": "infer.messages", "record": "infer"}[spec.infer.source]


def _engines(spec: PipelineSpec) -> list[tuple[str, EngineConfig]]:
    """Every engine the run loads, by the spec key that configures it."""
    return [("engine", spec.engine)] + ([("judge.engine", spec.judge.engine)] if spec.judge.engine is not None else [])


SIMULATED_CONTEXT = 4096  # the simulated engines' max_model_len when the spec sets none
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")  # config.json's names for it


@dataclass(frozen=True)
class Context:
    """The most tokens (prompt + output) one request to an engine may hold, and where that figure comes from."""

    tokens: int
    source: str


def _check_engine(key: str, engine: EngineConfig) -> Context | None:
    """An engine's model folder is one the engines can load: its config reads (no weights, no
    GPU). Returns the engine's context (None: not known here, e.g. a model on a URL)."""
    if engine.max_model_len is not None:
        context: Context | None = Context(engine.max_model_len, f"{key}.max_model_len")
    elif engine.kind == "simulated":
        context = Context(SIMULATED_CONTEXT, "the simulated engine's default max_model_len")
    else:
        context = None
    if engine.kind not in ("transformers", "vllm") or not engine.model or "://" in engine.model:
        return context
    try:
        from transformers import AutoConfig
    except ImportError:  # an environment without transformers: the worker's own load says what is wrong
        return context
    try:
        config = AutoConfig.from_pretrained(engine.model)
    except (OSError, ValueError) as exc:
        raise SpecError(f"{key}.model: {engine.model} is not a model folder the {engine.kind} engine can load "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
    if context is not None:
        return context
    text_config = getattr(config, "text_config", None) or config  # a multimodal config keeps the LM's apart
    for name in CONTEXT_KEYS:
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return Context(value, f"{engine.model}'s {name} (config.json)")
    return None


def _check_max_tokens(key: str, max_tokens: int, engine_key: str, context: Context | None) -> None:
    """A request's output alone fills the context: no prompt could fit (every record would fail prompt_too_long)."""
    if context is not None and max_tokens >= context.tokens:
        raise SpecError(f"{key}: {max_tokens} >= the {context.tokens:,}-token context of {engine_key} ({context.source}): "
                        f"no prompt fits beside it, every record would fail prompt_too_long; lower {key} "
                        f"(a prompt of n tokens needs n + max_tokens <= {context.tokens:,})")


def _check_adapters(key: str, engine: EngineConfig) -> None:
    """Every LoRA adapter folder the engine loads is one (config, weights, rank within max_lora_rank)."""
    if engine.kind == "simulated" or engine.lora is None:  # the simulated engine reads no folder
        return
    from batch_inference.engines.lora import check_adapters

    problems = check_adapters(engine.lora)
    if problems:
        raise SpecError("; ".join(f"{key}.{engine.kind}.lora.adapters.{name}: {why}" for name, why in problems.items()))


def _check_chat_template(key: str, engine: EngineConfig, what: str) -> None:
    """Chat needs the model's chat template: load the tokenizer only (no weights, no GPU)."""
    if engine.kind not in ("transformers", "vllm") or not engine.model:
        return
    try:
        from transformers import AutoTokenizer
    except ImportError:  # an environment without transformers: the engine will say so per record
        return
    from batch_inference.engines.chat import has_chat_template

    tokenizer = AutoTokenizer.from_pretrained(engine.model)
    if not has_chat_template(tokenizer):
        raise SpecError(f"{key}.model: {engine.model} has no chat template, but {what} are chat messages; "
                        "use a text template, or a model with one")


def preflight(spec: PipelineSpec, *, full: bool = False, sharded: str | None = None, cheap: bool = False) -> Plan:
    """Raise ``SpecError`` if the spec cannot run; else the ``Plan``. Blocking (reads the input's start).

    ``full`` also reads the whole input: counts records and shards, and runs the OpenAI Batch
    file checks the sharding pass would (duplicate custom_ids included). ``sharded``: a
    resumed run's committed shards (already native records) are checked instead of the input.
    ``cheap`` (Dagster definitions loading: ``dg check defs``): the checks that read no model
    file and no tokenizer, on the input's first ``preflight_records`` records only.
    """
    contexts: dict[str, Context | None] = {}
    for key, engine in _engines(spec) if not cheap else ():
        contexts[key] = _check_engine(key, engine)
        _check_adapters(key, engine)
    if not cheap:
        _check_max_tokens("infer.sampling.max_tokens", spec.infer.sampling.max_tokens, "engine", contexts["engine"])
    if spec.judge.kind == "llm" and not cheap:
        judge_key = "judge.engine" if spec.judge.engine is not None else "engine"
        _check_max_tokens("judge.max_tokens", spec.judge.max_tokens, judge_key, contexts[judge_key])
    judge = _build_judge(spec)
    try:
        builder = RequestBuilder(spec.request_infer)
    except ValueError as exc:
        raise SpecError(f"{_prompt_key(spec)}: {exc}") from None
    so = spec.storage_options or None
    source = sharded or spec.input
    head = inputs.first_numbered(source, 1, so)
    if not head and not sharded:
        inputs.check_records(spec, 0)
    fmt, detected = ("jsonl", False) if sharded else inputs.resolve_format(spec, [rec for _, rec in head])
    openai = fmt == "openai_batch"
    n_sample = spec.preflight_records
    census = FieldCensus.of(spec) if not openai else None
    if full and not sharded:  # one pass: the whole input counted, and the sample spread across all of it
        account, sample = _count(spec, inputs.openai_reader(spec) if openai else None, n_sample, census)
        n_records: int | None = account.records
    else:
        window = {"window": n_sample} if cheap else {}
        account, n_records, sample = None, None, inputs.sample_numbered(source, n_sample, so, **window)
        if census is not None:
            for line, rec in sample:
                census.add(line, rec)
    if openai:  # lines with file-level problems are the full check's to report (the file is refused)
        reader = inputs.openai_reader(spec)
        sample = [(line, typed.record()) for line, rec in sample if (typed := reader.line(rec, line)) is not None]
    elif (convert := inputs.record_reader(spec, fmt)) is not None:  # a registered record format: as sharding converts it
        sample = [(line, convert.convert(rec, line)) for line, rec in sample]
    record_errors: list[str] = []
    requests: list[tuple[str, Request]] = []  # the sample's built requests, by record id
    misses = Misses(len(sample))
    judge_chat = isinstance(judge, LLMJudge) and judge.chat
    chat = False
    as_sharded = None if sharded else inputs.record_transform(spec, fmt)  # as the shard step turns them into the run's
    for line, rec in sample:
        if as_sharded is not None:
            try:
                rec = as_sharded(rec, line)
            except RefusedRecord as exc:
                record_errors.append(f"record {line + 1}: {exc} (left out of the run)")
                continue
        rec.setdefault("id", assigned_id(line))  # as sharding assigns it
        try:
            request = builder.build(rec, 0)
        except MissingFieldError as exc:
            misses.add(_prompt_key(spec), str(exc))
            continue
        except RequestError as exc:
            if exc.kind is ErrorKind.BAD_REQUEST and spec.infer.source == "record":
                misses.add("infer", f"no template or messages, and record {exc.record_id!r} has neither 'messages' nor "
                                    "a string 'prompt' (set infer.template, e.g. 'Answer: {question}')")
            else:
                record_errors.append(str(exc))
            continue
        chat = chat or isinstance(request.prompt, ChatPrompt)
        requests.append((str(rec["id"]), request))
        if request.params.response_format is not None and not spec.engine.structured_output:
            raise SpecError(f"engine.kind: record {rec['id']!r} asks for response_format, but engine kind "
                            f"{spec.engine.kind!r} cannot constrain generation (vLLM's structured outputs can)")
        if judge is None:
            continue
        if isinstance(judge, LLMJudge):
            try:
                judge.prompt(rec, SAMPLE_RESULT)
            except MissingFieldError as exc:
                misses.add("judge.template", str(exc))
        else:
            verdict = judge.judge(rec, SAMPLE_RESULT)
            kind, detail = ErrorKind.parse(verdict.reason) or (None, "")
            if kind is ErrorKind.RULE_ERROR and detail.startswith("KeyError"):
                misses.add("judge.kwargs", f"rule {judge.name!r} needs a field record {rec['id']!r} lacks: {verdict.reason}")
    record_errors += misses.raise_or_list()
    if not cheap:
        record_errors += _too_long(spec, requests, contexts["engine"])
    if chat and not cheap:
        _check_chat_template("engine", spec.engine, "the prompts (infer.messages, or records with messages)")
    if judge_chat and not cheap:
        _check_chat_template("judge.engine" if spec.judge.engine else "engine", spec.judge_engine, "the judge's prompts (judge.chat)")
    n_shards = None if n_records is None else math.ceil(n_records / spec.shard_records) if n_records else 0
    judge_text = ("none (one inference per record; every success approved)" if spec.judge.kind == "none"
                  else "human (review queue)" if spec.judge.kind == "human"
                  else f"llm ({spec.judge.parse}{', chat' if spec.judge.chat else ''})" if spec.judge.kind == "llm"
                  else f"rule {spec.judge.callable} {spec.judge.kwargs or ''}".rstrip())
    if spec.judge.escalate is not None:
        judge_text += " + escalate to people"
    if (judge_pool := spec.judge_pool) is not None:
        judge_text += (f" on its own model {engine_label(spec.judge_engine)}, pool {judge_pool.name} "
                       f"({judge_pool.launcher}, {judge_pool.replicas} x {judge_pool.concurrency})")
    return Plan(
        run=spec.run, input=spec.input, input_format=fmt, format_detected=detected,
        engine=f"{spec.engine.kind}{':' + spec.engine.model if spec.engine.model else ''}",
        strategy=spec.strategy, prompt=spec.infer.source + (" -> one vector a record (infer.task: embed)" if spec.infer.task == "embed" else ""),
        chat=chat or judge_chat,
        constrained=spec.infer.constrained or (spec.judge.kind == "llm" and spec.judge.parse == "json"),
        judge=judge_text, checked_records=len(sample), records=n_records, shards=n_shards, record_errors=record_errors,
        account=account, field_notes=census.notes() if census is not None else [], id_field=spec.id_field,
    )


def _count(spec: PipelineSpec, reader: OpenAIBatchReader | None, n_sample: int,
           census: FieldCensus | None = None) -> tuple[InputAccount, list[tuple[int, dict[str, Any]]]]:
    """The whole input's account (records, malformed lines, duplicate ids: ``pipeline.accounting``)
    and ``n_sample`` records spread across it, in one pass; for OpenAI Batch the sharding
    pass's file checks too; ``census`` sees every record."""
    source = inputs.open_input(spec.input, spec.storage_options or None)
    account = InputAccount()
    report = ReshardReport()

    id_field = spec.id_field

    def typed(numbered: Iterator[tuple[int, dict[str, Any]]]) -> Iterator[tuple[int, dict[str, Any]]]:
        for line, rec in numbered:
            if reader is not None:  # the sharding pass's checks, on the typed line (no record built)
                reader.line(rec, line)
            elif id_field != "id" and rec.get(id_field) is None:  # left out at sharding, named by file and line
                file, at = locate(source, line)
                malformed({"file": file, "line": at})
                continue
            if census is not None:
                census.add(line, rec)
            yield line, rec

    def malformed(entry: dict[str, Any]) -> None:
        account.count_malformed(entry)
        report.count_malformed(entry)

    numbered = source.iter_numbered_sync(on_error="quarantine", quarantine=malformed)
    id_of = record_id if reader is not None else (lambda rec, line: rec.get(id_field)) if id_field != "id" else None
    sample = inputs.spread(account.counting(typed(numbered), id_of=id_of,
                                             max_ids=None if reader is not None else ID_CHECK_LIMIT), n_sample)
    if reader is not None:
        report.duplicate_ids = account.repeats
        inputs.check_openai_input(reader, report, spec.input, spec.storage_options or None)
    return account, sample


def _too_long(spec: PipelineSpec, requests: list[tuple[str, Request]], context: Context | None) -> list[str]:
    """A warning counting the sampled requests whose prompt tokens + max_tokens exceed the
    engine's context (each would fail ``prompt_too_long`` alone), tokenised as the layout
    signs them (``prompting.prefix``: the model's tokenizer, no weights); none when the
    context is unknown or the tokenizer cannot load here."""
    if context is None or not requests:
        return []
    from batch_inference.prompting.prefix import prefix_tokenizer

    try:
        packed = prefix_tokenizer(spec.engine, "tokens").pack([r.prompt for _, r in requests], None)
    except Exception:  # a tokenizer this machine cannot run: the engine still refuses each one alone
        return []
    over = [(rid, p.tokens, r.params.max_tokens) for (rid, r), p in zip(requests, packed)
            if p.tokens and p.tokens + r.params.max_tokens > context.tokens]
    if not over:
        return []
    examples = ", ".join(f"{rid!r} {n:,} + {m:,}" for rid, n, m in over[:FIELD_EXAMPLES])
    return [f"engine: {len(over)} of {len(requests)} sampled record(s) will not fit the {context.tokens:,}-token context "
            f"({context.source}) with max_tokens: prompt tokens + max_tokens > {context.tokens:,} (e.g. {examples}); "
            "each fails prompt_too_long alone"]
