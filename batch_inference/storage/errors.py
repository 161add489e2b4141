"""Storage errors: each names the file (and line) so bad input is found, not guessed."""

from __future__ import annotations


class MalformedRecordError(ValueError):
    """A line that is not a JSON object (bad JSON, bad UTF-8, not an object)."""

    def __init__(self, url: str, line: int, reason: str) -> None:
        self.url, self.line, self.reason = url, line, reason
        super().__init__(f"{url}:{line}: malformed record: {reason}")


class CorruptShardError(ValueError):
    """A compressed shard that cannot be decompressed (bad or truncated zstd frame)."""

    def __init__(self, url: str, reason: str) -> None:
        self.url, self.reason = url, reason
        super().__init__(f"{url}: corrupt shard: {reason}")


class ConcurrentWriteError(RuntimeError):
    """Another writer holds (or took over) the directory this writer is writing."""

    def __init__(self, url: str, holder: dict | None, reason: str) -> None:
        self.url, self.holder = url, holder
        super().__init__(f"{url}: {reason} (lock holder: {holder})")


class UnreadableInputError(ValueError):
    """An input of no format the readers know (a folder of ``.csv`` files): refused, never read as empty."""

    def __init__(self, url: str, reason: str) -> None:
        self.url, self.reason = url, reason
        super().__init__(f"{url}: {reason}")
