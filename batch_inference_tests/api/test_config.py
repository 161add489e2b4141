"""``api.yaml`` and its tokens file as an operator writes them: typos named with a suggestion,
keys mapped to projects (and a file of keys alone still one project)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from batch_inference.api.config import ApiConfig, ApiConfigError

DEFAULT_PROJECT = "default"  # the project of keys listed before any [project] line
SIMULATED = {"kind": "simulated", "simulated": {"output_tokens": 4}}


def config_at(tmp_path: Path, tokens: str = "key-0123456789abcdef\n", **keys: object) -> Path:
    (tmp_path / "api-tokens").write_text(tokens)
    data = {"storage": "./api-data", "tokens_file": "./api-tokens", "models": {"tiny": {"engine": SIMULATED}}, **keys}
    path = tmp_path / "api.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_a_misspelt_key_is_named_with_its_line_and_the_key_it_likely_meant(tmp_path: Path) -> None:
    path = tmp_path / "api.yaml"
    (tmp_path / "api-tokens").write_text("key-0123456789abcdef\n")
    path.write_text(
        "storage: ./api-data\n"
        "tokens_file: ./api-tokens\n"
        "tick_ss: 3\n"
        "limits:\n"
        "  max_file_byte: 10\n"
        "models:\n"
        "  tiny:\n"
        "    engine: {kind: simulated, simulated: {latncy_a_s: 0.1}}\n"
        "    shard_record: 10\n"
        "    pool: {concurency: 2}\n"
        "    frobnicate: 1\n"
    )
    with pytest.raises(ApiConfigError) as info:
        ApiConfig.load(path)
    message = str(info.value)
    assert message.startswith(f"{path}: invalid config")
    for line in ("tick_ss (line 3): unknown key (did you mean `tick_s`?)",
                 "limits.max_file_byte (line 5): unknown key (did you mean `max_file_bytes`?)",
                 "models.tiny.engine.simulated.latncy_a_s (line 8): unknown key (did you mean `latency_a_s`?)",
                 "models.tiny.shard_record (line 9): unknown key (did you mean `shard_records`?)",
                 "models.tiny.pool.concurency (line 10): unknown key (did you mean `concurrency`?)",
                 "models.tiny.frobnicate (line 11): unknown key"):
        assert f"  {line}" in message.splitlines(), (line, message)
    assert "frobnicate (line 11): unknown key (did" not in message  # nothing close: no guess


def test_keys_map_to_projects_and_a_file_of_keys_alone_is_one_project(tmp_path: Path) -> None:
    old = ApiConfig.load(config_at(tmp_path, "# the keys\nkey-0123456789abcdef\n\nkey-fedcba9876543210\n"))
    assert old.tokens() == {"key-0123456789abcdef": DEFAULT_PROJECT, "key-fedcba9876543210": DEFAULT_PROJECT}
    projects = ApiConfig.load(config_at(tmp_path, "legacy-0123456789abcdef\n[team-a]\na1-0123456789abcdef\n"
                                                  "a2-0123456789abcdef\n# b's\n[ team.b ]\nb1-0123456789abcdef\n"))
    assert projects.tokens() == {"legacy-0123456789abcdef": DEFAULT_PROJECT, "a1-0123456789abcdef": "team-a",
                                 "a2-0123456789abcdef": "team-a", "b1-0123456789abcdef": "team.b"}


@pytest.mark.parametrize(("tokens", "error"), [
    ("[team-a]\nkey-0123456789abcdef\n[team-b]\nkey-0123456789abcdef\n", ":4: this key is also project 'team-a''s (line 2)"),
    ("[team a]\nkey-0123456789abcdef\n", ":1: project name 'team a'"),
    ("[team-a]\nshort\n", ":2: a key shorter than 16 characters"),
    ("# nothing\n[team-a]\n", ": no keys"),
])
def test_a_tokens_file_the_server_cannot_serve_is_refused_with_its_line(tmp_path: Path, tokens: str, error: str) -> None:
    config = ApiConfig.load(config_at(tmp_path, tokens))
    with pytest.raises(ApiConfigError, match="tokens_file") as info:
        config.tokens()
    assert error in str(info.value), str(info.value)
