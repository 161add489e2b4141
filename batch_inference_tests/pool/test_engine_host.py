"""EngineHost.start() that fails releases what it made: the engine thread and the engine."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from batch_inference.engines import Completion, EngineOccupancy, SamplingParams, Tokens
from batch_inference.pool import engine_host as engine_host_module
from batch_inference.pool.engine_host import EngineHost

SIM = {"kind": "simulated"}


class StartFails:
    """A streaming engine whose start() raises, as vLLM's can after its core process is up."""

    name = "start-fails"
    max_model_len = 4096
    simulated = True

    def __init__(self) -> None:
        self.closed = 0

    def encode(self, prompts: list[str]) -> list[Tokens]:
        return [Tokens([1], p) for p in prompts]

    async def start(self) -> None:
        raise RuntimeError("engine core failed to bind")

    async def complete(self, prompt: str, params: SamplingParams) -> Completion:
        raise AssertionError("never reached")

    def capacity(self) -> int:
        return 4

    def occupancy(self) -> EngineOccupancy:
        return EngineOccupancy()

    async def aclose(self) -> None:
        self.closed += 1


def engine_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """The engine threads alive now that were not before, once they had 5 s to end."""
    deadline = time.monotonic() + 5
    while True:
        alive = [t for t in threading.enumerate() if t not in before and t.name.startswith("engine") and t.is_alive()]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.01)


async def test_a_streaming_engine_whose_start_fails_is_closed_and_its_thread_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = StartFails()
    monkeypatch.setattr(engine_host_module, "build_engine", lambda cfg: engine)
    before = set(threading.enumerate())
    host = EngineHost(SIM)
    with pytest.raises(RuntimeError, match="failed to bind"):
        await host.start()
    assert engine.closed == 1  # vLLM: its engine core process is shut down
    assert host.engine is None and host.gate is None
    assert engine_threads(before) == []


async def test_an_engine_that_fails_to_build_leaves_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    def build(cfg: object) -> object:
        raise OSError("model weights not found")

    monkeypatch.setattr(engine_host_module, "build_engine", build)
    before = set(threading.enumerate())
    host = EngineHost(SIM)
    with pytest.raises(OSError, match="weights not found"):
        await host.start()
    assert host.engine is None and host.loads == 0
    assert engine_threads(before) == []


async def test_a_batcher_that_fails_to_start_closes_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[bool] = []

    class Blocking:
        name, max_model_len, simulated = "blocking", 4096, True

        def encode(self, prompts: list[str]) -> list[Tokens]:
            return [Tokens([1], p) for p in prompts]

        def generate(self, prompts: list[str], params: object) -> list[Completion]:
            raise AssertionError("never reached")

        def close(self) -> None:
            closed.append(True)

    async def fail(self: object) -> None:
        raise RuntimeError("batcher could not start")

    monkeypatch.setattr(engine_host_module, "build_engine", lambda cfg: Blocking())
    monkeypatch.setattr(engine_host_module.TokenBatcher, "start", fail)
    before = set(threading.enumerate())
    host = EngineHost(SIM)
    with pytest.raises(RuntimeError, match="batcher could not start"):
        await host.start()
    assert closed == [True] and host.engine is None and host.batcher is None
    assert engine_threads(before) == []


async def test_a_start_cancelled_while_the_engine_builds_closes_the_engine_it_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build cannot be interrupted (vLLM's engine core process is up once it returns): a
    start cancelled meanwhile (the worker shutting down) closes the engine the build made."""
    engine = StartFails()
    building, release = threading.Event(), threading.Event()

    def build(cfg: object) -> StartFails:
        building.set()
        assert release.wait(10), "the test never released the build"
        return engine

    monkeypatch.setattr(engine_host_module, "build_engine", build)
    before = set(threading.enumerate())
    host = EngineHost(SIM)
    start = asyncio.create_task(host.start())
    assert await asyncio.to_thread(building.wait, 10)
    start.cancel()
    await asyncio.sleep(0)  # the cancellation reaches start() while the build still runs
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await start
    assert engine.closed == 1
    assert host.engine is None and host.gate is None
    assert engine_threads(before) == []


@pytest.mark.process
def test_an_engine_host_freezes_the_process_heap_once_its_engine_is_up() -> None:
    """The engine's long-lived objects are frozen out of the full GC's walks (pool.heap): in a
    fresh process, nothing is frozen before the first host starts, everything alive after;
    a second freeze leaves the frozen heap as it is, and cyclic garbage made later is still
    collected."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent('''
        import asyncio, gc, json
        from batch_inference.pool.engine_host import EngineHost

        class Cycle:
            pass

        async def main():
            before = gc.get_freeze_count()
            async with EngineHost({"kind": "simulated"}):
                first = gc.get_freeze_count()
            from batch_inference.pool.heap import freeze_static_heap
            second = freeze_static_heap()  # frozen already: left as it is
            a, b = Cycle(), Cycle()
            a.other, b.other = b, a
            del a, b
            return {"before": before, "first": first, "second": second, "collected": gc.collect()}

        print(json.dumps(asyncio.run(main())))
    ''')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    seen = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert seen["before"] == 0
    assert seen["first"] > 10_000  # the interpreter's and the libraries' objects
    assert seen["second"] is False
    assert seen["collected"] >= 2  # the cycle made after the freeze
