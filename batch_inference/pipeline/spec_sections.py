"""The spec's sections: the small models a ``PipelineSpec`` is made of (pools, judge, layout,
review policy, cache, input options) and the errors a spec raises.

Kept apart from ``pipeline.spec`` (the whole spec, its loading and cross-section checks)
so a section reads on its own; ``pipeline.spec`` re-exports every name here.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model, field_serializer, model_validator
from pydantic.fields import FieldInfo

from batch_inference.engines import EngineConfig
from batch_inference.judges import JudgeConfig
from batch_inference.speckeys import PATH

Strategy = Literal["rounds", "in_place", "hybrid"]
REDACTED = "***"


class SpecError(ValueError):
    """A spec that cannot run; the message names the file and every bad key."""


class SpecChanged(SpecError):
    """A run resumed under a spec whose result-deciding keys differ from the ones it started with."""


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
                            "(vLLM's blocks exactly); text: every record by text, at the model's characters a token (measured once "
                            "on a sample of the run's prompts), no tokenizer per record")
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


def engine_label(engine: EngineConfig) -> str:
    """How the ledger names a model: its directory, or the engine kind when it has none."""
    if engine.model:
        return engine.model
    if engine.kind != "simulated":
        return engine.kind
    sim = engine.simulated
    return "simulated" + (f":{sim.profile}" if sim.cost_model == "decode" else "") + (f":seed{engine.seed}" if engine.seed else "")
