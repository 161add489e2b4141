"""The pipeline spec: one YAML/TOML file that says what a run reads, runs and writes.

Validation is strict (``extra="forbid"`` everywhere) because a typo in a spec is
otherwise a silently ignored setting in a run that costs GPU-days. Errors name the key
(``pool.replcas: unknown key``) and the file. Secrets (storage credentials) are kept out
of ``repr`` and out of :meth:`PipelineSpec.public_dict`, which is what the ledger stores.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from batch_inference import speckeys
from batch_inference.engines import EngineConfig
from batch_inference.pipeline.spec_sections import (
    REDACTED,
    CacheSpec,
    CrossoverRule,
    Duration,
    InputOptions,
    JudgePoolOverrides,
    JudgeSpec,
    LayoutSpec,
    OpenAIBatchOptions,
    PoolSpec,
    ReviewPolicy,
    SpecChanged,
    SpecError,
    Strategy,
    _Strict,
    engine_label,
    parse_duration,
)
from batch_inference.pool.protocol import InferConfig
from batch_inference.speckeys import DECIDES, PATH

__all__ = [  # the sections live in pipeline.spec_sections; callers import them from here as before
    "REDACTED", "CacheSpec", "CrossoverRule", "Duration", "InputOptions", "JudgePoolOverrides", "JudgeSpec",
    "LayoutSpec", "OpenAIBatchOptions", "PipelineSpec", "PoolSpec", "ReviewPolicy", "SpecChanged", "SpecError",
    "Strategy", "engine_label", "parse_duration", "result_changes",
]

def result_changes(recorded: dict[str, Any], current: dict[str, Any], *,
                   folders: tuple[dict[str, str], dict[str, str]] | None = None) -> list[str]:
    """The dotted keys (``infer.template``, ``engine.model``) whose result-deciding values differ
    between two specs as JSON (``PipelineSpec.public_dict``), in a stable order.

    Which keys decide results is declared on the models (``speckeys.Decides``); the rest
    (pools, strategy, limits, review policy, storage, an engine's tuning) only say how the
    run is carried out, and a resumed run may change them. ``folders`` (the recorded and the
    current ``PipelineSpec.folder_digests``) adds the folders whose files changed under the
    same path (``engine.model (its files)``); a folder without a digest on either side (or
    with one made another way: a ledger from before whole-file fingerprints) is compared by
    its path alone.
    """
    a, b = speckeys.decided(PipelineSpec, recorded), speckeys.decided(PipelineSpec, current)
    then, now = folders or ({}, {})
    changed = []
    for key in sorted(a.keys() | b.keys()):
        mark, before = a.get(key, (None, None))
        mark_now, value = b.get(key, (None, None))
        mark = mark or mark_now
        assert mark is not None
        if key not in a and mark.grows:
            continue  # an adapter the engine serves now: nothing named it when the run started
        if before != value:
            changed.append(key)
        elif (mark.folders and isinstance(value, str) and value in then and value in now and then[value] != now[value]
              and speckeys.comparable_digests(then[value], now[value])):
            changed.append(f"{key} (its files)")
    return changed


class PipelineSpec(_Strict):
    """Everything one pipeline run needs. ``PipelineSpec.load(path)`` reads YAML or TOML."""

    run: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", description="run name: the run's folder under output")
    input: Annotated[str, DECIDES, PATH] = Field(min_length=1, description="input: a JSONL(.zst) or Parquet file, or a folder (prefix) of them")
    input_options: InputOptions = Field(
        default_factory=InputOptions, description="written as `input: {url: ..., allow_empty: ...}`; recorded here")
    input_format: Annotated[Literal["auto", "jsonl", "openai_batch", "parquet"], DECIDES] = Field(
        "auto", description="auto: Parquet by its files; OpenAI Batch request lines from the first record (and logged)")
    openai_batch: Annotated[OpenAIBatchOptions, DECIDES] = Field(default_factory=OpenAIBatchOptions)
    id_field: Annotated[str, DECIDES] = Field(
        "id", min_length=1, description="the field (JSONL) or column (Parquet) holding each record's id; a record "
        "without one is left out, named by file and line (default id: a record without one gets its line's number)")
    preflight_records: int = Field(8, ge=0, description="records rendered through the infer and judge paths before the run (0: off)")
    output: Annotated[str, PATH] = Field(min_length=1, description="base URL; the run writes under <output>/<run>/")
    export: list[Literal["parquet", "openai_batch"]] = Field(
        default_factory=list, description="also write these when the run finishes: <run>/export/<format>/ (as `batch-inference export`)")
    engine: EngineConfig
    infer: Annotated[InferConfig, DECIDES]
    judge: JudgeSpec = Field(
        default_factory=lambda: JudgeSpec(kind="none"),
        description="none (the default): one inference per record, every success approved; else llm | rule | human")
    strategy: Strategy = "rounds"
    max_rounds: int = Field(3, ge=1, le=99)
    max_attempts: int = Field(5, ge=1)
    crossover: CrossoverRule = Field(default_factory=CrossoverRule)
    shard_records: int = Field(20_000, ge=1)
    chunk_size: int = Field(2_000, ge=1)
    dedup: bool = Field(True, description="identical deterministic requests of a phase run once per worker (pool.dedup)")
    cache: CacheSpec = Field(default_factory=CacheSpec)
    pool: PoolSpec = Field(default_factory=PoolSpec)
    review: ReviewPolicy = Field(default_factory=ReviewPolicy)
    layout: LayoutSpec = Field(default_factory=LayoutSpec)
    storage_options: dict[str, Any] = Field(default_factory=dict, repr=False)

    @model_validator(mode="before")
    @classmethod
    def _input_mapping(cls, data: Any) -> Any:
        """``input: {url: ..., allow_empty: true}`` is ``input: <url>`` plus its options."""
        if isinstance(data, dict) and isinstance(data.get("input"), dict):
            data = dict(data)
            options = dict(data.pop("input"))
            if "url" not in options:
                raise ValueError("input.url: missing required key (input: {url: <file or folder>, allow_empty: true})")
            data["input"] = options.pop("url")
            data["input_options"] = {**(data.get("input_options") or {}), **options}
        return data

    @model_validator(mode="after")
    def _check_embed(self) -> PipelineSpec:
        """``infer.task: embed`` runs the engine as an embedding model (``engine.task`` follows
        it unless set), and nothing judges a vector: a judge there is refused here, at validate."""
        if self.infer.task == "embed":
            if self.judged:
                raise ValueError(f"judge: a {self.judge.kind} judge reads generated text, and an embedding run (infer.task: embed) "
                                 "generates none; leave judge out (every vector is approved as computed)")
            if "task" not in self.engine.model_fields_set:
                self.engine = EngineConfig.model_validate({**self.engine.model_dump(exclude_unset=True), "task": "embed"})
            elif self.engine.task != "embed":
                raise ValueError("engine.task: 'generate' cannot embed; infer.task 'embed' needs engine.task 'embed' (or leave it out)")
        elif self.engine.task == "embed":
            raise ValueError("engine.task 'embed' only embeds: set infer.task: embed (an embedding engine generates no text)")
        return self

    @model_validator(mode="after")
    def _check_structured_output(self) -> PipelineSpec:
        """Constrained output only where the engine constrains: never a run labelled constrained that is not."""
        wants = [(key, engine_key, engine) for key, engine_key, engine, on in (
            ("infer.response_format", "engine", self.engine, self.infer.constrained),
            ("judge.parse", "judge.engine" if self.judge.engine else "engine", self.judge_engine,
             self.judge.kind == "llm" and self.judge.parse == "json")) if on and not engine.structured_output]
        if wants:
            keys = " and ".join(key for key, _, _ in wants)
            where = ", ".join(f"{engine_key} kind {engine.kind!r}" for _, engine_key, engine in wants)
            raise ValueError(f"{keys}: {where} cannot constrain generation "
                             "to a JSON schema (vLLM's structured outputs can: engine.kind vllm); "
                             "remove it, or check results with a json_valid rule judge instead")
        return self

    @model_validator(mode="after")
    def _check_review(self) -> PipelineSpec:
        if self.judge.kind == "human" and self.strategy == "in_place":
            raise ValueError("judge.kind 'human' needs a round boundary to review at: use strategy 'rounds' or 'hybrid' "
                             "(in-place retry loops on one record inside a worker; nobody can approve it there)")
        return self

    @model_validator(mode="after")
    def _check_model_path(self) -> PipelineSpec:
        for key, engine in (("engine", self.engine), ("judge.engine", self.judge.engine)):
            model = engine.model if engine is not None else None
            if engine is not None and engine.kind in ("transformers", "vllm") and model and "://" not in model \
                    and not Path(model).expanduser().is_dir():
                where = "" if Path(model).expanduser().is_absolute() else f", relative to the working directory {os.getcwd()}"
                raise ValueError(f"{key}.model: model directory {model!r} does not exist{where} (a spec file's relative "
                                 "paths resolve from its folder; build a tiny model with `batch-inference make-model DIR`)")
        return self

    @model_validator(mode="after")
    def _check_adapters(self) -> PipelineSpec:
        """Every adapter a phase or a record names is one its engine serves; records may name the infer engine's."""
        served = self.engine.adapters
        if unknown := sorted(set(self.infer.adapters) - set(served)):
            raise ValueError(f"infer.adapters: {unknown} not among {_lora_key('engine', self.engine)}.adapters ({_names(served)})")
        for key, adapter, engine_key, engine in (
                ("infer.adapter", self.infer.adapter, "engine", self.engine),
                ("judge.adapter", self.judge.adapter, "judge.engine" if self.judge.engine else "engine", self.judge_engine)):
            if adapter is not None and adapter not in engine.adapters:
                if not engine.adapters:
                    raise ValueError(f"{key}: {engine_key} kind {engine.kind!r} serves no LoRA adapters "
                                     f"(give it {_lora_key(engine_key, engine)})")
                raise ValueError(f"{key}: {adapter!r} is not one of {_lora_key(engine_key, engine)}.adapters ({_names(engine.adapters)})")
        return self

    @model_validator(mode="after")
    def _check_judge_pool(self) -> PipelineSpec:
        if self.judge.engine is not None and self.judge.kind != "llm":
            raise ValueError(f"judge.engine: a {self.judge.kind} judge runs no model; only an llm judge takes an engine")
        if self.judge.pool is not None and self.judge.engine is None:
            raise ValueError("judge.pool: a judge pool needs judge.engine (without it the judge runs on the infer engine and pool)")
        if self.judge.engine is not None:
            try:
                self.judge_pool  # noqa: B018 - the merged pool validates as a whole
            except ValidationError as exc:
                raise ValueError("judge.pool: " + "; ".join(_describe(e).strip() for e in exc.errors())) from None
            judge_pool = self.judge_pool
            assert judge_pool is not None
            if (self.strategy != "rounds" and judge_pool.launcher == "inprocess" and not judge_pool.endpoints
                    and (self.pool.launcher != "inprocess" or self.pool.endpoints)):
                raise ValueError("judge.pool.launcher: the in-place tail judges from the infer pool's workers, which cannot "
                                 "reach a judge pool inside this process; use judge.pool.launcher local (or endpoints)")
            given = self.judge.pool.model_fields_set if self.judge.pool is not None else set()
            if self.pool.endpoints and not given & {"endpoints", "launcher"}:
                raise ValueError("judge.pool.endpoints: the infer pool is given by endpoints (pool.endpoints); "
                                 "give the judge's running pool too, or a launcher (judge.pool.launcher)")
        return self

    # -- loading -------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike[str], **overrides: Any) -> PipelineSpec:
        """Read a ``.yaml``/``.yml``/``.toml`` spec; top-level ``overrides`` win (e.g. strategy)."""
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise SpecError(f"{p}: cannot read spec: {exc.strerror or exc}") from exc
        try:
            if p.suffix == ".toml":
                data = tomllib.loads(text)
            elif p.suffix in (".yaml", ".yml", ".json"):
                data = yaml.safe_load(text)
            else:
                raise SpecError(f"{p}: unknown spec format {p.suffix!r} (use .yaml, .yml or .toml)")
        except (yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
            raise SpecError(f"{p}: not valid {p.suffix.lstrip('.').upper()}: {exc}") from exc
        if not isinstance(data, dict):
            raise SpecError(f"{p}: a spec must be a mapping of keys, got {type(data).__name__}")
        data = speckeys.resolve_paths(cls, data, p.resolve().parent)
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.parse(data, source=str(p))

    @classmethod
    def parse(cls, data: dict[str, Any], *, source: str = "spec", base_dir: str | os.PathLike[str] | None = None) -> PipelineSpec:
        """Validate a mapping; a ``SpecError`` lists every bad key by its dotted path.

        ``base_dir``: where the mapping's relative local paths (``input``, ``output``,
        ``engine.model``, adapter folders, the pool's storage roots: the fields marked
        ``speckeys.PATH``) resolve from, as ``load`` resolves a file's from its folder;
        without it they stay relative to the process's working directory.
        """
        if base_dir is not None:
            data = speckeys.resolve_paths(cls, data, Path(base_dir).resolve())
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise SpecError(f"{source}: invalid spec:\n" + "\n".join(_describe(e) for e in exc.errors())) from None

    # -- views ---------------------------------------------------------------------

    @property
    def request_infer(self) -> InferConfig:
        """``infer`` as tasks and request builders use it: the adapters a record may name are
        the engine's unless the spec narrowed them (``infer`` itself stays as written)."""
        if self.infer.adapters or not self.engine.adapters:
            return self.infer
        return self.infer.model_copy(update={"adapters": self.engine.adapters})

    @property
    def result_cache_url(self) -> str | None:
        """Where the cross-run result cache lives (None: the spec turned it off)."""
        if not self.cache.enabled:
            return None
        return self.cache.url or self.output.rstrip("/") + "/_result_cache"

    def folder_digests(self) -> dict[str, str]:
        """Each local folder whose files decide results (models, adapters) -> its fingerprint
        (``speckeys.folder_digest``); folders absent here are left out."""
        out = {}
        for mark, value in speckeys.decided(PipelineSpec, self.public_dict()).values():
            if mark.folders and isinstance(value, str) and (digest := speckeys.folder_digest(value)) is not None:
                out[value] = digest
        return out

    def public_dict(self) -> dict[str, Any]:
        """The spec as JSON with secrets redacted: what the ledger and logs may show."""
        data = self.model_dump(mode="json")
        data["storage_options"] = {k: REDACTED for k in self.storage_options}
        return data

    @property
    def model_name(self) -> str:
        """The model name this run answers as (OpenAI Batch ``body.model``, exported ``model``)."""
        if self.openai_batch.model:
            return self.openai_batch.model
        if self.engine.model:
            return Path(self.engine.model.rstrip("/")).name or self.engine.model
        return self.engine.kind

    def accepted_models(self) -> frozenset[str] | None:
        """The ``body.model`` values OpenAI Batch requests may name (None: any)."""
        if not self.openai_batch.check_model:
            return None
        return frozenset({self.model_name, *self.openai_batch.model_aliases})

    def pool_token(self, pool: PoolSpec | None = None) -> str | None:
        """A pool's bearer token (default: the infer pool's), read from the environment (never stored in the spec)."""
        pool = pool or self.pool
        return os.environ.get(pool.token_env) if pool.token_env else None

    @property
    def judged(self) -> bool:
        """Whether anything judges the results. Without a judge (``judge`` left out, or ``kind:
        none``) every record is inferred once: a success is approved, a failure fails with its
        reason; no round or attempt follows (``pipeline.policy``, ``PipelineRun.tail``)."""
        return self.judge.kind != "none"

    # -- where each phase runs --------------------------------------------------------

    @property
    def judge_engine(self) -> EngineConfig:
        """The engine the judge phase runs on: the judge's own, else the infer engine."""
        return self.judge.engine or self.engine

    @property
    def judge_pool(self) -> PoolSpec | None:
        """The judge's own pool (``judge.pool`` over the infer pool's settings), or None: the
        judge shares the infer pool. Its own name (``<pool.name>-judge``) keeps a local
        judge pool apart from the infer pool; endpoints are never inherited."""
        if self.judge.engine is None:
            return None
        base = self.pool.model_dump(exclude={"endpoints"})
        base.update(name=f"{self.pool.name}-judge", k8s_name=f"{self.pool.k8s_name}-judge")
        if self.judge.pool is not None:
            base.update(self.judge.pool.model_dump(include=self.judge.pool.model_fields_set))
        return PoolSpec.model_validate(base)

    def placement(self, phase: str) -> dict[str, str | None]:
        """The pool, model and adapter a phase runs on (the ledger and Dagster metadata name them).

        ``infer`` and the tail's generation run on the infer pool; ``judge`` on the judge's
        pool when it has one; the tail (``tail``) names both.
        """
        infer = {"pool": self.pool.name, "model": engine_label(self.engine), "adapter": self.infer.adapter}
        judge_pool = self.judge_pool
        judge = {"pool": judge_pool.name if judge_pool is not None else self.pool.name,
                 "model": engine_label(self.judge_engine), "adapter": self.judge.adapter}
        if self.judge.kind != "llm":
            judge = {"pool": judge["pool"], "model": None, "adapter": None, "judge": self.judge.kind}
        if phase == "infer":
            return infer
        if phase == "judge":
            return judge
        return {**infer, **{f"judge_{k}": v for k, v in judge.items() if k != "judge"}}


def _lora_key(engine_key: str, engine: EngineConfig) -> str:
    return f"{engine_key}.{engine.kind}.lora"


def _names(names: tuple[str, ...]) -> str:
    return ", ".join(names) or "none"


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """The keys the model at ``loc`` (a path into a ``PipelineSpec``) takes, or none when it is no model."""
    models: list[type[BaseModel]] = [PipelineSpec]
    for part in loc:
        if not models:
            return []
        field = models[0].model_fields.get(str(part))
        if field is None:
            continue  # a mapping's key or a list's index: the same model goes on below it
        models = speckeys.submodels(field.annotation)
    return list(models[0].model_fields) if models else []


def _describe(err: Any) -> str:
    loc = ".".join(str(part) for part in err["loc"]) or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        close = difflib.get_close_matches(str(err["loc"][-1]), _fields_at(tuple(err["loc"][:-1])), n=1, cutoff=0.6)
        return f"  {loc}: unknown key" + (f" (did you mean `{close[0]}`?)" if close else "")
    if kind == "missing":
        return f"  {loc}: missing required key"
    msg = err["msg"].removeprefix("Value error, ")
    if kind == "value_error":
        return f"  {msg}" if not err["loc"] else f"  {loc}: {msg}"
    return f"  {loc}: {msg} (got {err.get('input')!r})"
