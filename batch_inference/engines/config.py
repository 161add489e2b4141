"""Engine configuration: one pydantic model for every engine kind.

The keys that decide results (kind, model and its files, dtype, seed, max_model_len, each
adapter's folder, vLLM's ``extra`` and structured outputs backend, the simulated engine's
answers) are marked ``speckeys.DECIDES``; the rest, marked ``speckeys.INERT``, only say how
the engine runs. Every field carries one or the other (``speckeys.undecided``, tested): the
result cache keys an engine's answers by the first kind, so a new field nobody decided
would let a changed engine answer with an old one's results.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from batch_inference.speckeys import DECIDES, FOLDER, INERT, NAMED_FOLDERS, PATH


class DecodeOverrides(BaseModel):
    """Per-field overrides of a ``DecodeProfile`` preset (None keeps the preset's value)."""

    model_config = ConfigDict(extra="forbid")

    step_s: float | None = Field(None, ge=0, description="fixed cost of one engine step, seconds")
    decode_token_s: float | None = Field(None, ge=0, description="cost per sequence decoded in a step")
    prefill_token_s: float | None = Field(None, ge=0, description="cost per prompt token prefilled")
    kv_token_s: float | None = Field(None, ge=0, description="cost per token resident in the KV cache, per step")
    kv_capacity_tokens: int | None = Field(None, ge=1)
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    block_size: int | None = Field(None, ge=1, description="KV block size: the prefix cache's unit")


ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class LoraOptions(BaseModel):
    """LoRA adapters served on the engine's one base model (``engine.vllm.lora``,
    ``engine.transformers.lora``).

    A request names an adapter (``infer.adapter``, ``judge.adapter``, or a record's own
    ``adapter`` field among these names) or none: the base model. ``adapters`` maps each
    name to its folder (PEFT's layout: ``adapter_config.json`` + ``adapter_model.safetensors``;
    ``batch-inference make-model DIR --adapter-for MODEL`` builds a tiny one).
    """

    model_config = ConfigDict(extra="forbid")

    adapters: Annotated[dict[Annotated[str, StringConstraints(pattern=ADAPTER_NAME)], str], NAMED_FOLDERS, PATH] = Field(
        min_length=1, description="adapter name -> adapter folder")
    max_loras: Annotated[int, INERT] = Field(1, ge=1, description="adapters one engine step (vLLM max_loras) or one generate call (transformers) may mix")
    max_lora_rank: Annotated[int | None, INERT] = Field(None, ge=1, description="largest adapter rank (default: read from the adapters)")


class SimulatedOptions(BaseModel):
    """Cost model and fault injection of the simulated engine (benchmarks and scale tests).

    ``cost_model: linear`` (the default) sleeps ``a + b x batch
    tokens`` per ``generate`` call, as if every batch were perfectly packed.
    ``cost_model: decode`` runs a decode-step model of a continuous-batching engine
    (``engines/decode_model.py``: a calibrated ``profile`` from ``engines/profiles.py`` plus ``decode`` overrides),
    either one blocking call per batch (``scheduling: blocking``, the batch lasts as long
    as its longest decode) or continuous batching (``scheduling: continuous``, the
    ``StreamingEngine`` protocol).
    """

    model_config = ConfigDict(extra="forbid")

    # What it answers (simulated_completion): the approval rate, output lengths and greedy rule
    # decide; its costs, its fault injection (errors are never kept as results) do not.
    cost_model: Annotated[Literal["linear", "decode"], INERT] = Field("linear", description="linear: a + b x tokens per call; decode: step model")
    scheduling: Annotated[Literal["blocking", "continuous"], INERT] = Field("continuous", description="decode model: one call per batch, or streaming")
    profile: Annotated[str, INERT] = Field("vllm-cpu-tiny", description="decode model preset (engines.profiles.PROFILES)")
    decode: Annotated[DecodeOverrides, INERT] = Field(default_factory=DecodeOverrides)
    latency_a_s: Annotated[float, INERT] = Field(0.002, ge=0, description="linear model: fixed cost per generate() call, seconds")
    latency_b_s: Annotated[float, INERT] = Field(1e-5, ge=0, description="linear model: cost per batch token, seconds")
    padded: Annotated[bool, INERT] = Field(False, description="linear model: cost n x max(prompt+output tokens) instead of the sum")
    output_tokens: Annotated[int, DECIDES] = Field(16, ge=1, description="mean output tokens (words) per completion, capped by max_tokens")
    output_lengths: Annotated[Literal["fixed", "geometric", "pareto"], DECIDES] = Field(
        "fixed", description="distribution of output lengths, drawn per record from (engine seed, request seed, prompt)"
    )
    pareto_alpha: Annotated[float, DECIDES] = Field(1.5, gt=1, description="shape of the pareto (heavy-tailed) lengths")
    approval_rate: Annotated[float, DECIDES] = Field(0.5, ge=0, le=1, description="P(output starts with APPROVED)")
    greedy: Annotated[Literal["seeded", "prompt"], DECIDES] = Field(
        "seeded", description="temperature 0: seeded (the request seed still varies the output, so a retry "
                              "draws anew) or prompt (the output depends on the prompt alone, as a real "
                              "engine's greedy decoding; identical requests then merge, pool.dedup)"
    )
    fail_on: Annotated[str | None, INERT] = Field(None, description="prompts containing this substring come back as errors")
    fail_batch_every: Annotated[int | None, INERT] = Field(None, ge=1, description="every Nth generate() call raises")
    die_after_requests: Annotated[int | None, INERT] = Field(
        None, ge=0, description="continuous: the engine dies (EngineDeadError) once this many requests have completed"
    )
    prefix_cache: Annotated[bool, INERT] = Field(
        False, description="decode model: vLLM's automatic prefix cache (block-level LRU in the KV the running "
                           "sequences leave free; a prompt's cached leading blocks are not prefilled)"
    )
    lora: LoraOptions | None = Field(None, description="adapter names it answers for (outputs salted by the name; folders unread)")

    @model_validator(mode="after")
    def _known_profile(self) -> SimulatedOptions:
        from batch_inference.engines.profiles import PROFILES

        if self.profile not in PROFILES:
            raise ValueError(f"unknown simulated engine profile {self.profile!r}; known: {sorted(PROFILES)}")
        if self.prefix_cache and self.cost_model != "decode":
            raise ValueError("prefix_cache models the decode engine's KV cache: it needs cost_model 'decode'")
        return self


class VllmOptions(BaseModel):
    """Options passed to vLLM's engine arguments; ``extra`` goes through verbatim."""

    model_config = ConfigDict(extra="forbid")

    gpu_memory_utilization: Annotated[float, INERT] = Field(0.9, gt=0, le=1)
    tensor_parallel_size: Annotated[int, INERT] = Field(1, ge=1)
    enforce_eager: Annotated[bool, INERT] = False
    streaming: Annotated[bool, INERT] = Field(True, description="continuous batching through AsyncLLM (false: one blocking LLM.generate per batch)")
    max_in_flight: Annotated[int | None, INERT] = Field(None, ge=1, description="streaming: requests kept in the engine (default 2 x max_num_seqs)")
    # guidance (llguidance) keeps raw control characters out of JSON strings; xgrammar 0.2.8
    # admits them in length-bounded strings ("maxLength"), which strict parsers refuse.
    structured_outputs_backend: Annotated[Literal["guidance", "auto", "xgrammar", "outlines", "lm-format-enforcer"], DECIDES] = Field(
        "guidance", description="vLLM's structured outputs backend (extra.structured_outputs_config overrides it)")
    lora: LoraOptions | None = Field(None, description="LoRA adapters on the base model (vLLM LoRARequest per request)")
    # Anything vLLM takes (quantization, revision, tokenizer, hf_overrides, ...): all of it
    # decides, as nothing here can tell vLLM's result-deciding arguments from its tuning.
    extra: Annotated[dict[str, Any], DECIDES] = Field(default_factory=dict)


class TransformersOptions(BaseModel):
    """How the transformers engine batches one ``generate`` call (docs/engines.md, measured in
    bench/reports/transformers_batching.md).

    ``static``: one padded ``model.generate`` per distinct SamplingParams (seeds aside), so
    records asking for different output lengths run in separate calls. ``bucketed``: records
    that differ only in their output length share a call, sorted by (output, prompt) length
    and cut into buckets whose padding stays small; each row is trimmed to its own length
    (greedy results are identical to ``static``). ``continuous``: transformers' own continuous
    batching (``ContinuousBatchingManager``, paged KV cache) with per-request output lengths.
    """

    model_config = ConfigDict(extra="forbid")

    batching: Annotated[Literal["static", "bucketed", "continuous"], INERT] = Field("bucketed", description="see the class docstring")
    bucket_padding: Annotated[float, INERT] = Field(1.25, ge=1, description="bucketed: a bucket closes before padded tokens exceed this x real tokens")
    max_batch_tokens: Annotated[int, INERT] = Field(1024, ge=16, description="continuous: tokens per forward step (transformers' max_batch_tokens)")
    lora: LoraOptions | None = Field(None, description="LoRA adapters on the base model (peft; adapters per row of a generate call)")


class EmbeddingOptions(BaseModel):
    """How an embedding engine (``engine.task: embed``) pools a prompt's hidden states into one
    vector. None keeps the model's own choice: its sentence-transformers files
    (``modules.json``, ``1_Pooling/config.json``, a ``Normalize`` module) as vLLM reads them,
    else last-token pooling for a decoder and CLS for an encoder, normalised (vLLM's default)."""

    model_config = ConfigDict(extra="forbid")

    pooling: Annotated[Literal["mean", "last", "cls"] | None, DECIDES] = Field(None, description="none: the model's own")
    normalize: Annotated[bool | None, DECIDES] = Field(None, description="L2-normalise each vector; none: the model's own (default true)")


# Engine kinds whose engines set ``structured_output = True``.
STRUCTURED_OUTPUT_KINDS = frozenset({"vllm"})


class EngineConfig(BaseModel):
    """Which engine to build and how. ``build_engine(EngineConfig(...))`` is the one factory."""

    model_config = ConfigDict(extra="forbid")

    kind: Annotated[Literal["transformers", "vllm", "simulated"], DECIDES]
    # generate: a causal LM decodes text; embed: the model pools each prompt into one vector
    # (engines.pooling; set for you by a spec's ``infer.task: embed``)
    task: Annotated[Literal["generate", "embed"], DECIDES] = "generate"
    embedding: EmbeddingOptions = Field(default_factory=EmbeddingOptions)
    model: Annotated[str | None, FOLDER, PATH] = Field(None, description="model directory (transformers, vllm)")
    dtype: Annotated[Literal["auto", "float32", "float16", "bfloat16"], DECIDES] = "auto"
    # the device the engine runs on decides (auto dtype: float32 on CPU, bfloat16 on GPU), but
    # as resolved, not as written: the result cache keys by the engine's own (engine_identity)
    device: Annotated[Literal["auto", "cpu", "cuda"], INERT] = "auto"
    num_threads: Annotated[int | None, INERT] = Field(1, ge=1, description="torch.set_num_threads on CPU; None leaves torch's default")
    max_model_len: Annotated[int | None, DECIDES] = Field(None, ge=1, description="default: the model's max_position_embeddings (4096 simulated)")
    seed: Annotated[int, DECIDES] = Field(0, description="engine-level seed (vLLM; simulated output salt)")
    simulated: SimulatedOptions = Field(default_factory=SimulatedOptions)
    vllm: VllmOptions = Field(default_factory=VllmOptions)
    transformers: TransformersOptions = Field(default_factory=TransformersOptions)

    @property
    def structured_output(self) -> bool:
        """Whether this engine kind constrains decoding to a response format (vLLM's
        structured outputs); known before the engine is built, so a spec can be refused."""
        return self.kind in STRUCTURED_OUTPUT_KINDS

    @property
    def lora(self) -> LoraOptions | None:
        """The adapters this engine serves (its kind's ``lora`` options), or None."""
        options: VllmOptions | TransformersOptions | SimulatedOptions = getattr(self, self.kind)
        return options.lora

    @property
    def adapters(self) -> tuple[str, ...]:
        """The adapter names a request on this engine may name."""
        return tuple(self.lora.adapters) if self.lora is not None else ()

    @model_validator(mode="after")
    def _needs_model(self) -> EngineConfig:
        if self.kind in ("transformers", "vllm") and not self.model:
            raise ValueError(f"engine kind {self.kind!r} needs 'model' (a model directory, e.g. from `batch-inference make-model DIR`)")
        if self.task == "embed" and self.kind == "simulated":
            raise ValueError("engine.task 'embed' needs a model that embeds: kind transformers or vllm "
                             "(`batch-inference make-model DIR --embed` builds a tiny one)")
        if self.task == "embed" and self.lora is not None:
            raise ValueError(f"engine.{self.kind}.lora: adapters are served on generating engines, not on task 'embed'")
        return self
