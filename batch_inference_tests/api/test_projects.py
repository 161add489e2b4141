"""Keys belong to projects; a project sees only its own files and batches (issue 39 #4), and the
upload edge refuses what it cannot read (issue 39 #11): the official SDKs, and raw HTTP where
an SDK cannot send the bad bytes, against `batch-inference api serve`."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import openai
import pytest
from anthropic import Anthropic

from batch_inference_tests.api.helpers import (TOKEN, Server, chat_line, client, delivered, jsonl, serving, start, submit,
                                               wait_status, write_config)

pytestmark = [pytest.mark.process, pytest.mark.slow]  # a server in a child process, its pipeline runs inside

KEY_A, KEY_A2, KEY_B = "alpha-key-0123456789abcd", "alpha-key2-0123456789abc", "bravo-key-0123456789abcd"


def two_projects(tmp_path: Path) -> Path:
    config = write_config(tmp_path)
    (tmp_path / "api-tokens").write_text(f"# project key\nalpha {KEY_A}\nalpha {KEY_A2}\nbravo {KEY_B}\n")
    return config


def test_a_project_sees_only_its_own_files_and_batches(tmp_path: Path) -> None:
    """Before: key B listed A's batch and file, read A's input, cancelled A's batch and deleted
    A's file. Now every one of those is a 404 (another project's objects are not said to
    exist), lists hold only the project's own, and keys of one project share."""
    with serving(two_projects(tmp_path)) as server:
        a, a2, b = client(server, KEY_A), client(server, KEY_A2), client(server, KEY_B)
        batch = submit(a, [chat_line(f"q{i}", f"question {i}") for i in range(6)])
        done = wait_status(a, batch.id, ("completed",))
        files = [done.input_file_id, done.output_file_id]
        assert all(re.fullmatch(r"file_[A-Za-z0-9]{24}", f) for f in files), files  # opaque ids (issue 40 #10)
        for call in (lambda: b.batches.retrieve(batch.id), lambda: b.batches.cancel(batch.id),
                     *(lambda f=f: b.files.retrieve(f) for f in files), *(lambda f=f: b.files.content(f) for f in files),
                     lambda: b.files.delete(done.input_file_id)):
            with pytest.raises(openai.NotFoundError):
                call()
        assert [x.id for x in b.batches.list()] == [] and [f.id for f in b.files.list()] == []
        assert [x.id for x in a2.batches.list()] == [batch.id]  # the same project, another key
        assert sorted(f.id for f in a2.files.list()) == sorted(files)
        out, _ = delivered(a2, a2.batches.retrieve(batch.id))
        assert len(out) == 6
        # B's own work is B's alone
        mine = wait_status(b, submit(b, [chat_line("b0", "hello")]).id, ("completed",))
        assert [x.id for x in b.batches.list()] == [mine.id] and mine.id not in [x.id for x in a.batches.list()]
        anthropic_b = Anthropic(base_url=server.url, api_key=KEY_B, max_retries=0)
        created = Anthropic(base_url=server.url, api_key=KEY_A, max_retries=0).messages.batches.create(requests=[
            {"custom_id": "m0", "params": {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}}])
        import anthropic as anthropic_sdk
        with pytest.raises(anthropic_sdk.NotFoundError):
            anthropic_b.messages.batches.retrieve(created.id)
        assert [x.id for x in anthropic_b.messages.batches.list()] == []
    # ownership is kept in storage: after a restart B still sees nothing of A's
    server = start(two_projects(tmp_path))
    try:
        with pytest.raises(openai.NotFoundError):
            client(server, KEY_B).batches.retrieve(batch.id)
        assert client(server, KEY_A).batches.retrieve(batch.id).status == "completed"
    finally:
        server.stop()


def test_a_tokens_file_of_bare_keys_is_one_project(tmp_path: Path) -> None:
    """The tokens file of before (one key a line) still works: its keys share one project."""
    config = write_config(tmp_path)
    other = "second-key-0123456789abc"
    (tmp_path / "api-tokens").write_text(f"{TOKEN}\n{other}\n")
    with serving(config) as server:
        batch = submit(client(server), [chat_line("q0", "question")])
        assert wait_status(client(server, other), batch.id, ("completed",)).request_counts.completed == 1


def raw(server: Server, method: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    """One HTTP request with exactly these bytes (header values as Latin-1: any byte)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
        sock.sendall(head.encode() + b"".join(f"{k}: ".encode() + v.encode("latin-1") + b"\r\n" for k, v in headers.items())
                     + b"\r\n" + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in data else b""


def multipart(parts: list[tuple[str, bytes, str | None]]) -> tuple[bytes, str]:
    boundary = "testboundary0123456789"
    out = b""
    for name, value, filename in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n"
    return out + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def stored_files(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "api-data").rglob("*") if p.is_file() and "files" in p.parts]


def test_uploads_refuse_what_they_cannot_read_and_leave_nothing_behind(tmp_path: Path) -> None:
    """Before: a truncated body answered 500, two ``file`` parts left an orphan and a ``bytes``
    that was not the stored size, a negative ``expires_after[seconds]`` was taken, and a
    non-UTF-8 byte in the key answered 500 with a traceback."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    content = jsonl([chat_line("q0", "question")])
    with serving(write_config(tmp_path)) as server:
        body, ctype = multipart([("purpose", b"batch", None), ("file", content, "a.jsonl")])
        status, text = raw(server, "POST", "/v1/files", body[:len(body) - 40], {**auth, "Content-Type": ctype})  # cut mid-part
        assert status == 400, (status, text)
        body, ctype = multipart([("purpose", b"batch", None), ("file", content, "a.jsonl"), ("file", content * 3, "b.jsonl")])
        status, text = raw(server, "POST", "/v1/files", body, {**auth, "Content-Type": ctype})
        assert status == 400 and b"more than one 'file'" in text, (status, text)
        for seconds in (b"-5", b"60", b"99999999"):
            body, ctype = multipart([("purpose", b"batch", None), ("expires_after[anchor]", b"created_at", None),
                                     ("expires_after[seconds]", seconds, None), ("file", content, "a.jsonl")])
            status, text = raw(server, "POST", "/v1/files", body, {**auth, "Content-Type": ctype})
            assert status == 400 and b"expires_after" in text, (seconds, status, text)
        assert stored_files(tmp_path) == [], "a refused upload left bytes behind"
        status, text = raw(server, "GET", "/v1/files", b"", {"Authorization": "Bearer t\xe9st-key-0123456789abcdef"})
        assert status == 401 and b"Traceback" not in text, (status, text)
        status, text = raw(server, "GET", "/v1/files", b"", {"x-api-key": "\xff\xfe" * 10})
        assert status == 401, (status, text)
        # an upload that is whole is taken, its bytes the stored size, its expiry honoured
        f = client(server).files.create(file=("a.jsonl", content), purpose="batch",
                                        expires_after={"anchor": "created_at", "seconds": 7200})
        stored = [p for p in stored_files(tmp_path) if p.name == "content"]
        assert len(stored) == 1 and f.bytes == stored[0].stat().st_size == len(content)
        assert f.expires_at is not None and 7100 <= f.expires_at - f.created_at <= 7300


def test_a_tokens_file_line_names_what_is_wrong(tmp_path: Path) -> None:
    from batch_inference.api.config import ApiConfig, ApiConfigError

    config = write_config(tmp_path)
    (tmp_path / "api-tokens").write_text("alpha beta 0123456789abcdef0\n")
    with pytest.raises(ApiConfigError, match="line 1: expected KEY or PROJECT KEY"):
        ApiConfig.load(config).projects()
    (tmp_path / "api-tokens").write_text(f"alpha {KEY_A}\nbravo {KEY_A}\n")
    with pytest.raises(ApiConfigError, match="line 2: the same key in projects 'alpha' and 'bravo'"):
        ApiConfig.load(config).projects()


def test_a_typo_in_api_yaml_says_what_was_meant(tmp_path: Path) -> None:
    """Issue 40 #10: an unknown key in api.yaml got no suggestion."""
    from batch_inference.api.config import ApiConfig, ApiConfigError

    config = write_config(tmp_path, tick_secs=0.2)
    with pytest.raises(ApiConfigError, match=r"tick_secs: unknown key \(did you mean 'tick_s'\?\)"):
        ApiConfig.load(config)
