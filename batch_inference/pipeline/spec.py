"""The pipeline spec: one YAML/TOML file that says what a run reads, runs and writes.

Validation is strict (``extra="forbid"`` everywhere) because a typo in a spec is
otherwise a silently ignored setting in a run that costs GPU-days. Errors name the key
(``pool.replcas: unknown key``) and the file. Secrets (storage credentials) are kept out
of ``repr`` and out of :meth:`PipelineSpec.public_dict`, which is what the ledger stores.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model, field_serializer, model_validator
from pydantic.fields import FieldInfo

from batch_inference import speckeys
from batch_inference.engines import EngineConfig
from batch_inference.judges import JudgeConfig
from batch_inference.pool.protocol import InferConfig
from batch_inference.speckeys import DECIDES, PATH

Strategy = Literal["rounds", "in_place", "hybrid"]
REDACTED = "***"


class SpecError(ValueError):
    """A spec that cannot run; the message names the file and every bad key."""


class SpecChanged(SpecError):
    """A run resumed under a spec whose result-deciding keys differ from the ones it started with."""


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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CrossoverRule(_Strict):
    """When the hybrid hands the pending set from rounds to in-place retry.

    After each round (from ``min_rounds`` on) the hybrid switches when the pending set
    shrank by less than ``min_shrink`` (a fraction of the round's input; 0 = off), or,
    with ``compare_cost``, when the projected wall time of finishing by rounds exceeds
    the projected wall time of in-place retry; both projections use the round's own
    measured figures (see ``pipeline.policy``).
    """

    min_shrink: float = Field(0.0, ge=0.0, le=1.0)
    compare_cost: bool = True
    min_rounds: int = Field(1, ge=1)
    in_place_cost_factor: float = Field(1.0, gt=0, description="in-place cost of a record-attempt relative to a round's")


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(d|h|m|s)")
_UNIT_S = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}


def parse_duration(value: Any) -> float:
    """Seconds from ``90``, ``"90s"``, ``"30m"``, ``"48h"``, ``"2d"`` or ``"1h30m"``."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    text = str(value).strip().lower()
    parts = _DURATION.findall(text)
    if not parts or _DURATION.sub("", text).strip():
        raise ValueError(f"not a duration: {value!r} (use seconds or e.g. '90s', '30m', '48h', '2d')")
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


Duration = Annotated[float, BeforeValidator(parse_duration), Field(ge=0)]


class ReviewPolicy(_Strict):
    """Human review at the round boundary (a ``kind: human`` judge, or ``judge.escalate``).

    A round whose judge sent records to people waits until its review queue is empty,
    or until ``after`` has passed since the queue opened; then ``then`` decides the
    records still waiting (``reject``: they go to the next round like any rejection,
    ``approve``: they are approved as the automated judge left them, ``keep_waiting``:
    the round goes on waiting). A reviewer holds a record for ``lease`` at most.
    """

    after: Duration | None = Field(None, description="timeout of a round's review queue (e.g. 48h); none: wait for people")
    then: Literal["reject", "approve", "keep_waiting"] = "keep_waiting"
    lease: Duration = Field(600.0, gt=0, description="how long a reviewer holds a record before another may take it")
    warn_after: Duration = Field(86400.0, description="the review-age check warns when the oldest waiting record is older")
    poll_s: float = Field(5.0, gt=0, description="run_pipeline / `batch-inference run`: how often a waiting round looks again")
    url: str = Field("http://127.0.0.1:8765", description="where `batch-inference review` serves the page (linked from Dagster)")


class PoolSpec(_Strict):
    """Where shard tasks run: in this process, local worker processes, or Kubernetes."""

    launcher: Literal["inprocess", "local", "k8s"] = "inprocess"
    replicas: int = Field(1, ge=1)
    concurrency: int = Field(10, ge=1)
    retries: int = Field(3, ge=0)
    timeout_s: float = Field(3600.0, gt=0)
    endpoints: list[str] = Field(default_factory=list, description="workers of a running pool (skips the launcher)")
    token_env: str | None = Field(None, description="name of the env var holding the workers' bearer token")
    storage_options_ref: str | None = Field(None, description="storage profile name in the workers' own config")
    batcher: dict[str, Any] = Field(default_factory=dict, description="batcher options for the workers")
    checkpoint_interval_s: float = Field(5.0, gt=0, description="in-place retry: checkpoint flush period within a chunk")
    affinity: bool = Field(True, description="several workers: a shard's prefix family goes to its worker within that worker's share of the load")
    # local launcher
    name: str = Field("default", description="local pool name: a run attaches to the pool up under it when that fits the spec (docs/pool.md)")
    idle_ttl_s: float | None = Field(600.0, description="local pool shuts down after this long idle")
    storage_roots: Annotated[list[str], PATH] = Field(default_factory=list, description="worker storage roots (default: input and output)")
    storage_profiles_file: Annotated[str | None, PATH] = Field(None, description="workers' storage profiles (credentials stay there)")
    rule_modules: list[str] = Field(default_factory=list, description="modules local workers may import rule judges from")
    # k8s launcher: the ready pods of a deployed pool are discovered (deploy/k8s/, `pool up`)
    k8s_name: str = Field("batch-inference-worker", description="k8s: the workers' Deployment/Service name")
    namespace: str = Field("default", description="k8s: the workers' namespace")
    ready_timeout_s: float = Field(900.0, gt=0, description="k8s: wait this long for `replicas` ready workers")

    @model_validator(mode="after")
    def _k8s_needs_a_token(self) -> PoolSpec:
        if self.launcher == "k8s" and not self.endpoints and not self.token_env:
            raise ValueError("launcher 'k8s' needs 'token_env' (the env var holding the workers' token, "
                             "e.g. from the Secret <k8s_name>-token): workers off loopback require it")
        return self


# ``judge.pool``: any PoolSpec key, each optional; the keys it sets override the infer pool's
# (``PipelineSpec.judge_pool``), so a judge pool says only what differs.
JudgePoolOverrides = create_model(
    "JudgePoolOverrides", __base__=_Strict, __doc__="The judge's own pool: PoolSpec keys that differ from the infer pool's.",
    **{name: (f.annotation | None, FieldInfo.merge_field_infos(f, default=None, default_factory=None))  # type: ignore[call-overload]
       for name, f in PoolSpec.model_fields.items()},
)


class JudgeSpec(JudgeConfig):
    """The spec's ``judge``: a ``JudgeConfig`` plus where an llm judge runs.

    ``engine`` (the top-level engine schema) gives the judge a model of its own, run on
    a pool of its own (``pool``: the infer pool's settings with these keys overridden;
    its name defaults to ``<pool.name>-judge``). Without ``engine`` the judge runs on the
    infer engine. Tasks carry only the ``JudgeConfig`` part (``task_config``).
    """

    engine: EngineConfig | None = Field(None, description="the judge's own model (default: the infer engine)")
    pool: JudgePoolOverrides | None = Field(None, description="the judge's own pool: keys that differ from the infer pool's")  # type: ignore[valid-type]

    @field_serializer("pool")
    def _dump_pool(self, pool: Any) -> dict[str, Any] | None:
        """Only the keys the spec set: a re-parsed spec (the ledger's, Dagster's) inherits the rest again."""
        return None if pool is None else pool.model_dump(mode="json", include=pool.model_fields_set)

    def task_config(self) -> JudgeConfig:
        """What a judge or retry task carries: the judge without its placement."""
        return JudgeConfig.model_validate(self.model_dump(include=set(JudgeConfig.model_fields)))


class LayoutSpec(_Strict):
    """Order and placement of records (docs/pipeline.md "Order and placement").

    With ``prefix`` on, sharding lays the input out in prefix order: records whose
    rendered requests share a long prefix land in the same shard, next to each other, so
    the engine's prefix cache computes the prefix once; workers submit each chunk's
    requests sorted by prompt and admit one chunk at a time, so requests sharing a prefix
    go into the engine together. Off, records keep their input order (the order is never
    a promise to users either way: results carry ids).
    """

    prefix: bool = Field(True, description="prefix-aware layout at sharding + cache-friendly submission order in workers")
    signature: Literal["auto", "tokens", "text"] = Field(
        "auto", description="auto: plain prompts by text, chat by the model's tokenizer; tokens: the model's tokenizer "
                            "(vLLM's blocks exactly); text: 4 characters a token, no tokenizer")
    block_size: int | None = Field(None, ge=1, description="tokens a block (default: the engine's, vLLM 16 on GPU, 128 on CPU)")
    prefix_tokens: int = Field(2048, ge=1, description="tokens of each request its signature covers")
    min_gain: float = Field(0.01, ge=0.0, le=1.0,
                            description="rewrite in prefix order only when it shares at least this fraction of blocks more")
    run_bytes: int = Field(128 << 20, ge=1 << 20, description="records held in memory per sorted run of the layout pass")
    workers: int | None = Field(
        None, ge=1, description="processes the layout pass signs in (default: the driver's cores; one per 100,000 records at most)")
    stream: bool = Field(
        True, description="round 0 starts on each laid-out shard as the layout pass writes it, not after the last "
                          "(a whole run: the CLI, the API, run_pipeline; Dagster's steps run the shard step first)")


class OpenAIBatchOptions(_Strict):
    """OpenAI Batch input: which ``body.model`` values this run answers."""

    model: str | None = Field(None, description="the model name requests name (default: the engine model's folder name)")
    model_aliases: list[str] = Field(default_factory=list, description="other body.model values mapped to this run's model")
    check_model: bool = Field(True, description="refuse requests naming another model (false: answer them all)")


class CacheSpec(_Strict):
    """The cross-run result cache (``pool.result_cache``, docs/cache.md).

    Deterministic requests (temperature 0, or an explicit seed) a run computed are kept,
    keyed by the model's identity (its files' fingerprint), adapter, rendered prompt,
    sampling and attempt; a later run answers identical requests from it. It decides no
    result (a hit is the completion the engine computed for the same request), so a
    resumed run may turn it on or off.
    """

    enabled: bool = Field(True, description="reuse and keep deterministic results across runs (false: compute every request)")
    url: Annotated[str | None, PATH] = Field(None, description="the cache's folder (default: <output>/_result_cache; shared by runs)")
    max_bytes: int = Field(10 << 30, ge=1 << 20, description="the store is trimmed to this size at each run's end (oldest first)")


class InputOptions(_Strict):
    """How the input is read, beyond its URL (``input: {url: ..., allow_empty: true}``)."""

    allow_empty: bool = Field(False, description="an input with no records runs as an empty run (default: refused)")


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


def engine_label(engine: EngineConfig) -> str:
    """How the ledger names a model: its directory, or the engine kind when it has none."""
    if engine.model:
        return engine.model
    if engine.kind != "simulated":
        return engine.kind
    sim = engine.simulated
    return "simulated" + (f":{sim.profile}" if sim.cost_model == "decode" else "") + (f":seed{engine.seed}" if engine.seed else "")


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
