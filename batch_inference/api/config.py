"""The API server's configuration (``api.yaml``): where it keeps its state, who may call it,
and the models it serves.

``storage``, ``tokens_file`` and ``models: {name: {engine, pool?, judge?, limits?}}`` are a
contract (clients' operators write them); every other key has a default. An unknown key is
named with its line and the closest known key. The tokens file maps keys to projects
(``ApiConfig.tokens``). Relative paths
(storage, tokens file, a model's folder) resolve from the config file's folder, so the
server can be started from anywhere.
"""

from __future__ import annotations

import difflib
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from batch_inference.engines import EngineConfig
from batch_inference.pipeline.spec import Duration, JudgeSpec, PoolSpec, parse_duration
from batch_inference.prompting.config import SamplingConfig, SamplingLimits


DEFAULT_PROJECT = "default"  # the project of a key listed before any [project] line, and of state that names none
PROJECT_HEADER = re.compile(r"^\[(.*)\]$")
PROJECT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class ApiConfigError(ValueError):
    """A config the server cannot start with; the message names the file and the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Strict):
    """One model clients name (``body.model`` / ``params.model``), and how its batches run.

    ``pool``: the spec's ``pool`` keys (default: in this process). ``judge``: a spec
    ``judge`` (default: none, every answer is accepted as the hosted APIs do); with one, a
    batch runs ``rounds`` of ``max_rounds`` (or in-place retry, ``strategy``) and an answer
    the judge rejected every time is an error line. ``limits``: the most a request may ask
    for (``max_tokens``, ``temperature``, ``stop``); ``sampling``: the defaults of what a
    request leaves out.
    """

    engine: EngineConfig
    pool: PoolSpec = Field(default_factory=PoolSpec)
    judge: JudgeSpec | None = None
    limits: SamplingLimits = Field(default_factory=SamplingLimits)
    sampling: SamplingConfig = Field(default_factory=lambda: SamplingConfig(max_tokens=256))
    strategy: str = Field("in_place", pattern="^(rounds|in_place|hybrid)$", description="with a judge: how rejected answers are retried")
    max_rounds: int = Field(3, ge=1, le=99, description="with a judge: rounds (strategy rounds/hybrid)")
    max_attempts: int = Field(3, ge=1, description="with a judge: attempts per request (in-place retry)")
    @model_validator(mode="after")
    def _default_max_tokens(self) -> ModelConfig:
        """A request that names no max_tokens gets 256, or the model's cap when it is lower."""
        if "sampling" not in self.model_fields_set and self.sampling.max_tokens > self.limits.max_tokens:
            self.sampling = self.sampling.model_copy(update={"max_tokens": self.limits.max_tokens})
        return self

    shard_records: int = Field(1000, ge=1, description="requests a shard holds: the unit of dispatch, progress, cancel and resume")
    chunk_size: int = Field(250, ge=1, description="requests a worker submits to its engine together")


class Limits(_Strict):
    """What one client may send."""

    max_file_bytes: int = Field(200 << 20, ge=1, description="largest upload (OpenAI's: 200 MB)")
    max_lines: int = Field(50_000, ge=1, description="most requests in one batch (OpenAI's and Anthropic's: 50,000 / 100,000)")
    max_request_bytes: int = Field(32 << 20, ge=1, description="largest JSON request body (an Anthropic batch's requests)")
    completion_windows: list[str] = Field(default_factory=lambda: ["24h"],
                                          description="completion_window values a batch may ask for (durations: 24h, 30m, 5s)")
    deadline_slack: Duration = Field(3600.0, description="batches of a model whose deadlines (created_at + completion_window) lie "
                                     "within this of the earliest waiting one share its pool fairly; earlier deadlines go first")
    anthropic_window: Duration = Field(86400.0, gt=0, description="how long an Anthropic batch may run before it expires")
    min_output_expiry_s: float = Field(3600.0, ge=0, description="smallest output_expires_after.seconds (OpenAI's: 3600)")

    @field_validator("completion_windows")
    @classmethod
    def _durations(cls, value: list[str]) -> list[str]:
        for w in value:
            parse_duration(w)
        if not value:
            raise ValueError("name at least one window (e.g. 24h)")
        return value


class DagsterConfig(_Strict):
    """A Dagster instance the batches run on, as the pipeline's Dagster runs."""

    home: str = Field(min_length=1, description="a DAGSTER_HOME (its dagster.yaml, else a sqlite instance in it): the one `dagster dev` uses")


class ApiConfig(_Strict):
    """``api.yaml``."""

    storage: str = Field(min_length=1, description="local folder or s3://...: uploaded files, batch state, runs, output files")
    tokens_file: str = Field(min_length=1, description="accepted API keys, one a line; a [project] line starts a project's keys")
    models: dict[str, ModelConfig] = Field(min_length=1)
    storage_options: dict[str, Any] = Field(default_factory=dict, repr=False, description="fsspec options for storage (s3 endpoint...)")
    limits: Limits = Field(default_factory=Limits)
    tick_s: float = Field(5.0, gt=0, description="how often batch progress, expiry and file expiry are looked at")
    base_url: str | None = Field(None, description="the URL clients reach this server at (Anthropic results_url); default: the request's own")
    admin_project: str | None = Field(None, description="a project whose keys read every project's usage and /metrics; "
                                      "default: /metrics is open (as /health) and a key reads its own project's usage")
    dagster: DagsterConfig | None = Field(None, description="each batch runs as Dagster runs of its model's pipeline on this instance; default: in this process, no Dagster")

    @field_validator("models")
    @classmethod
    def _names(cls, value: dict[str, ModelConfig]) -> dict[str, ModelConfig]:
        for name in value:
            if not name or len(name) > 256 or any(c.isspace() for c in name):
                raise ValueError(f"model name {name!r}: 1-256 characters, no spaces")
        return value

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ApiConfig:
        """Read ``api.yaml``; relative paths resolve from its folder."""
        p = Path(path)
        try:
            data = yaml.safe_load(p.read_text())
        except OSError as exc:
            raise ApiConfigError(f"{p}: cannot read config: {exc.strerror or exc}") from exc
        except yaml.YAMLError as exc:
            raise ApiConfigError(f"{p}: not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise ApiConfigError(f"{p}: the config must be a mapping of keys")
        base = p.resolve().parent

        def here(value: Any) -> Any:
            if isinstance(value, str) and "://" not in value and not os.path.isabs(os.path.expanduser(value)):
                return str(base / value)
            return value

        data["storage"], data["tokens_file"] = here(data.get("storage")), here(data.get("tokens_file"))
        if isinstance(data.get("dagster"), dict) and isinstance(data["dagster"].get("home"), str):
            data["dagster"]["home"] = here(os.path.expanduser(data["dagster"]["home"]))
        for m in (data.get("models") or {}).values():
            if isinstance(m, dict):
                for engine in (m.get("engine"), (m.get("judge") or {}).get("engine") if isinstance(m.get("judge"), dict) else None):
                    if isinstance(engine, dict) and isinstance(engine.get("model"), str) and engine.get("kind") in ("transformers", "vllm"):
                        if (base / engine["model"]).is_dir():
                            engine["model"] = str(base / engine["model"])
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            tree = _compose(p)
            lines = [_describe(e, tree) for e in exc.errors()]
            raise ApiConfigError(f"{p}: invalid config:\n" + "\n".join(lines)) from None

    def tokens(self) -> dict[str, str]:
        """Each accepted key and the project it belongs to (a tenant: it sees only its project's files and batches).

        One key a line, 16+ characters; blank lines and ``#`` comments skipped. A ``[name]``
        line starts a project: the keys below it are that project's. Keys before any such line
        belong to project ``default``, so a file of keys alone (the format before projects)
        loads as one project, as it always served.
        """
        try:
            text = Path(self.tokens_file).read_text()
        except OSError as exc:
            raise ApiConfigError(f"tokens_file {self.tokens_file}: cannot read: {exc.strerror or exc}") from exc
        where = f"tokens_file {self.tokens_file}"
        keys: dict[str, str] = {}
        first_line: dict[str, int] = {}
        project = DEFAULT_PROJECT
        for n, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if header := PROJECT_HEADER.match(line):
                project = header.group(1).strip()
                if not PROJECT_NAME.match(project):
                    raise ApiConfigError(f"{where}:{n}: project name {project!r}: 1-64 letters, digits, '_', '.' or '-'")
                continue
            if len(line) < 16:
                raise ApiConfigError(f"{where}:{n}: a key shorter than 16 characters")
            if keys.get(line, project) != project:
                raise ApiConfigError(f"{where}:{n}: this key is also project {keys[line]!r}'s (line {first_line[line]}): "
                                     "a key belongs to one project")
            keys.setdefault(line, project)
            first_line.setdefault(line, n)
        if not keys:
            raise ApiConfigError(f"{where}: no keys (one a line): the server serves no one without a key")
        return keys

    def window_s(self, window: str) -> float | None:
        """Seconds of an allowed ``completion_window``; None when it is not one of ``limits.completion_windows``."""
        return parse_duration(window) if window in self.limits.completion_windows else None


def _describe(err: Any, tree: yaml.Node | None) -> str:
    """One validation error: its dotted key, the line it is on, and for an unknown key the closest known one."""
    loc = tuple(err["loc"])
    where = ".".join(str(x) for x in loc) or "(top level)"
    line = _line_of(tree, loc)
    where += f" (line {line})" if line is not None else ""
    if err["type"] != "extra_forbidden":
        return f"  {where}: {err['msg'].removeprefix('Value error, ')}"
    close = difflib.get_close_matches(str(loc[-1]), _keys_at(loc[:-1]), n=1, cutoff=0.6)
    return f"  {where}: unknown key" + (f" (did you mean `{close[0]}`?)" if close else "")


def _types(annotation: Any) -> list[Any]:
    """The types an annotation may hold (``X | None`` -> X; ``Annotated[X, ...]`` -> X)."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return [t for arg in typing.get_args(annotation) for t in _types(arg)]
    if origin is typing.Annotated:
        return _types(typing.get_args(annotation)[0])
    return [annotation]


def _keys_at(loc: tuple[Any, ...]) -> list[str]:
    """The keys the config takes at ``loc`` (a path into ``api.yaml``): what a misspelt key there may have meant."""
    current: list[Any] = [ApiConfig]
    for part in loc:
        below: list[Any] = []
        for t in (t for c in current for t in _types(c)):
            if isinstance(t, type) and issubclass(t, BaseModel):
                if (field := t.model_fields.get(str(part))) is not None:
                    below.append(field.annotation)
            elif typing.get_origin(t) is dict:  # a mapping's key (a model's name): its value's type goes on
                below.append(typing.get_args(t)[1])
            elif typing.get_origin(t) is list and isinstance(part, int):
                below.append(typing.get_args(t)[0])
        current = below
    return sorted({k for c in current for t in _types(c) if isinstance(t, type) and issubclass(t, BaseModel) for k in t.model_fields})


def _compose(path: Path) -> yaml.Node | None:
    try:
        return yaml.compose(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def _line_of(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """The 1-based line of the key (or item) ``loc`` names in the YAML tree, when it is there."""
    line = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if str(k.value) == str(part)), None)
            if match is None:
                return line
            line, node = match[0].start_mark.line + 1, match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line
