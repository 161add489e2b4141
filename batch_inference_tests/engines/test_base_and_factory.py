"""SamplingParams, helpers, EngineConfig validation and the lazy factory."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from batch_inference.engines import EngineConfig, SamplingParams, build_engine
from batch_inference.engines.base import expand_params, group_by_params, too_long_error, truncate_at_stop


def test_sampling_params_hashable_and_stop_normalised() -> None:
    a = SamplingParams(stop=["\n", "END"])
    b = SamplingParams(stop=("\n", "END"))
    assert a == b and hash(a) == hash(b) and a.stop == ("\n", "END")
    assert SamplingParams(stop="x").stop == ("x",)
    assert len({SamplingParams(seed=1), SamplingParams(seed=1), SamplingParams(seed=2)}) == 2


@pytest.mark.parametrize(
    "kwargs", [{"max_tokens": 0}, {"min_tokens": 5, "max_tokens": 4}, {"temperature": -1}, {"top_p": 0}]
)
def test_sampling_params_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_expand_and_group_params() -> None:
    p1, p2 = SamplingParams(seed=1), SamplingParams(seed=2)
    assert expand_params(["a", "b"], p1) == [p1, p1]
    assert group_by_params([p1, p2, p1]) == {p1: [0, 2], p2: [1]}
    assert group_by_params([p1, p2, SamplingParams(max_tokens=3)], ignore_seed=True) == {
        SamplingParams(): [0, 1],
        SamplingParams(max_tokens=3): [2],
    }
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        expand_params(["a", "b", "c"], [p1, p2])


def test_truncate_at_stop_takes_earliest() -> None:
    assert truncate_at_stop("abc END def\nx", ("\n", "END")) == ("abc ", True)
    assert truncate_at_stop("abc", ("z",)) == ("abc", False)
    assert truncate_at_stop("abc", None) == ("abc", False)


def test_too_long_error() -> None:
    assert too_long_error(10, 5, 15) is None
    assert "prompt_too_long" in (too_long_error(11, 5, 15) or "")


def test_config_requires_model_for_real_engines() -> None:
    for kind in ("transformers", "vllm"):
        with pytest.raises(ValidationError, match="needs 'model'"):
            EngineConfig(kind=kind)
    EngineConfig(kind="simulated")


def test_config_forbids_unknown_fields_and_kinds() -> None:
    with pytest.raises(ValidationError, match="extra"):
        EngineConfig(kind="simulated", modle="x")
    with pytest.raises(ValidationError):
        EngineConfig(kind="tensorrt", model="x")
    with pytest.raises(ValidationError):
        EngineConfig(kind="simulated", simulated={"approval_rate": 1.5})


def test_factory_builds_simulated_from_dict() -> None:
    engine = build_engine({"kind": "simulated", "max_model_len": 100, "simulated": {"latency_a_s": 0}})
    assert engine.simulated and "simulated" in engine.name and engine.max_model_len == 100


@pytest.mark.process
def test_factory_imports_lazily() -> None:
    """The simulated engine (and the judges) never import torch; vllm only when asked."""
    code = (
        "import sys; from batch_inference.engines import build_engine; import batch_inference.judges;"
        "build_engine({'kind': 'simulated'}).generate(['x'], __import__('batch_inference.engines', fromlist=['x']).SamplingParams());"
        "print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
