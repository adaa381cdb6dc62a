"""Calling a score function on a batch of samples: several at once, each call with a time limit, each failure kept
with its sample instead of stopping the batch.

Two ways, chosen by what the caller has:

- `ProcessScorer`: a function named by a spec (``reward.custom_function``'s ``module:function`` or
  ``path.py:function``; `BUILTIN_SPEC` for the built-in rewards) runs in worker processes (`pebble.ProcessPool`,
  ``num_workers`` of them). A call past ``timeout_s`` is really stopped: its process is killed (SIGTERM, SIGKILL 3 s
  later) and a fresh one takes its place, so an endless loop in a score function costs one sample, not the run nor
  a core. The processes start with the ``spawn`` method, a clean interpreter: none of the caller's threads, sockets,
  CUDA state or memory comes along (a rank's trained weights are not pinned by copy-on-write), and a child imports
  only `pebble`, this module and the function's module (~0.1 s; the built-in rewards' module imports no torch, and
  reasoning-gym, ~0.8 s, comes at the first call of one of its data sources). Each
  child loads the function once, before its first call (not counted in any call's time), and ends when the process
  that started it ends, even if killed (a watchdog thread waits on the parent).
- `score_in_process`: a plain callable (a closure, a test's lambda, the judge's verdict wrapper) is called in this
  process: in this thread, in order, when there is no time limit and one worker; otherwise on daemon threads,
  ``num_workers`` at once. A Python thread cannot be stopped, so a call past the limit is recorded as timed out
  and abandoned: it runs on in the background and its result is dropped.

Both return one `Outcome` per sample, in the samples' order, and stop early (the rest not scored) once more samples
have failed than the caller allows.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import os
import queue
import signal
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import pebble

from hybridflow.engine.imports import load_object

BUILTIN_SPEC = "hybridflow.engine.reward.rewards:default_compute_score"
"""The spec of the built-in score function (`hybridflow.engine.reward.rewards.default_compute_score`)."""

ERROR_CHARS = 300
"""The longest error text kept for a sample (longer messages are cut, with ``…``)."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """One sample's call: what the function returned (`value`), or why it has none (`error`: ``""`` when the call
    returned; e.g. ``"timeout after 30 s"``, ``"ValueError: ..."``); `timed_out`: the call ran past the limit."""

    value: Any = None
    error: str = ""
    timed_out: bool = False

    @property
    def failed(self) -> bool:
        return bool(self.error)


def error_text(error: BaseException) -> str:
    """``"<ExceptionType>: <message on one line>"``, at most `ERROR_CHARS` characters."""
    said = " ".join(str(error).split())
    text = f"{type(error).__name__}: {said}" if said else type(error).__name__
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 1] + "…"


def timeout_text(timeout_s: float) -> str:
    """The error text of a call stopped after `timeout_s` seconds: ``"timeout after 30 s"``."""
    return f"timeout after {timeout_s:g} s"


def check_limits(timeout_s: float | None, num_workers: int) -> None:
    """Raise ValueError (naming ``reward.timeout_s`` / ``reward.num_workers``) for `timeout_s` <= 0 or
    `num_workers` < 1."""
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"reward.timeout_s must be > 0 seconds, got {timeout_s}")
    if num_workers < 1:
        raise ValueError(f"reward.num_workers must be >= 1, got {num_workers}")


Inputs = Sequence[tuple[Any, ...]]
"""Each sample's arguments to the score function (``(data_source, solution_str, ground_truth, extra_info)``)."""


# ---------------------------------------------------------------------------------------------------- in the child
_FUNCTIONS: dict[tuple[str, str], Callable[..., Any]] = {}


def _function(spec: str, key: str) -> Callable[..., Any]:
    function = _FUNCTIONS.get((spec, key))
    if function is None:
        function = _FUNCTIONS[(spec, key)] = load_object(spec, key)
    return function


def _child_start(spec: str, key: str) -> None:
    """A worker process's start: the signals meant for its rank ignored (Slurm's preemption warnings SIGUSR1/2
    reach every process of a job step, Ctrl-C the whole process group: the rank handles them, a scorer must not
    die of them), a watchdog that ends it with its parent, and the function loaded (an error is left to the first
    call, which records it for its sample)."""
    for number in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT):
        signal.signal(number, signal.SIG_IGN)
    threading.Thread(target=_end_with_parent, name="end-with-parent", daemon=True).start()
    with contextlib.suppress(Exception):
        _function(spec, key)


def _end_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is not None:
        parent.join()  # returns when the parent has ended, however it ended
        os._exit(1)


def _call(spec: str, key: str, chunk: Sequence[tuple[Any, ...]]) -> list[tuple[bool, Any, float]]:
    """Each call of a chunk of samples, in order: ``(True, result, seconds)`` or ``(False, error text, seconds)``
    (the error travels as text, so that any exception does)."""
    out = []
    for args in chunk:
        started = time.perf_counter()
        try:
            result = True, _function(spec, key)(*args)
        except BaseException as error:  # noqa: BLE001 (SystemExit too: a sample's failure, not the worker's end)
            result = False, error_text(error)
        out.append((*result, time.perf_counter() - started))
    return out


def _noop() -> None:
    """A first task: makes the pool start its processes now."""


# ---------------------------------------------------------------------------------------------------- processes
CHEAP_S = 0.005
"""A function whose slowest call of the last batch took less than this (seconds) is cheap: its calls go to the
processes in chunks (one message per chunk instead of per sample, ~0.1 ms each)."""

CHUNK_S = 0.05
"""Seconds of calls a chunk holds (by the last batch's slowest call), at most."""


class ProcessScorer:
    """The score function `spec` called in `num_workers` worker processes, each call stopped after `timeout_s`.

    Args:
        spec: ``"package.module:function"`` or ``"path/to/file.py:function"`` (see
            `hybridflow.engine.imports.load_object`), loaded in each child; the caller has checked that it loads.
        key: the config key it came from (named in errors), e.g. ``reward.custom_function``.
        timeout_s: seconds one call may take (> 0; None: no limit); the time a child takes to start and load the
            function does not count.
        num_workers: processes, i.e. samples scored at once (>= 1).

    The processes start at construction, in the background (the first batch finds them ready), and are replaced as
    they are killed; `close` ends them (so does the interpreter's exit, and the parent's death).

    A cheap function (slowest call of the last batch under `CHEAP_S`) has its samples sent in chunks of about
    `CHUNK_S` seconds of calls, run one after another in a process, each chunk allowed ``max(1 s, 20 x`` its
    expected time) (at most `timeout_s`). A chunk that runs past that, or whose process dies, is sent again one
    sample per call with the full `timeout_s`, so a hung call costs at most that second more than the timeout.
    Every process killed at once from outside (pebble then fails the whole pool) sends the unscored samples to a
    new pool, once per call; a second time, they fail with that error.

    Raises:
        ValueError: `timeout_s` <= 0 or `num_workers` < 1.
    """

    def __init__(self, spec: str, key: str, timeout_s: float | None, num_workers: int) -> None:
        check_limits(timeout_s, num_workers)
        self.spec, self.key, self.timeout_s, self.num_workers = spec, key, timeout_s, num_workers
        self.slowest_s: float | None = None  # the slowest call of the last batch (None: none measured yet)
        self._pool: pebble.ProcessPool | None = None
        self._finalizer: weakref.finalize | None = None
        self._start()

    def _start(self) -> pebble.ProcessPool:
        pool = pebble.ProcessPool(
            max_workers=self.num_workers,
            initializer=_child_start,
            initargs=(self.spec, self.key),
            context=multiprocessing.get_context("spawn"),
        )
        pool.schedule(_noop)  # pebble starts its processes with the first task
        self._pool = pool
        self._finalizer = weakref.finalize(self, _stop, pool)
        return pool

    def _chunking(self, n: int) -> tuple[int, float | None]:
        """``(samples per chunk, seconds a chunk may take)`` for a batch of `n`: ``(1, timeout_s)`` unless cheap."""
        slowest = self.slowest_s
        if slowest is None or slowest >= CHEAP_S or n < 2 * self.num_workers:
            return 1, self.timeout_s
        size = max(1, min(int(CHUNK_S / max(slowest, 1e-6)), -(-n // (2 * self.num_workers))))
        if size == 1:
            return 1, self.timeout_s
        allowed = max(1.0, 20 * size * slowest)
        return size, allowed if self.timeout_s is None else min(allowed, self.timeout_s)

    def __call__(self, inputs: Inputs, max_failures: int | None = None) -> list[Outcome | None]:
        """One `Outcome` per sample of `inputs`, in order; once more than `max_failures` samples failed (None: no
        limit) the calls not yet done are cancelled (their processes killed) and their places are None."""
        pool = self._pool
        if pool is None or not pool.active:  # closed, or broken (every process died at once): a new pool
            self.close()
            pool = self._start()
        size, chunk_timeout = self._chunking(len(inputs))

        def send(first: int, count: int) -> concurrent.futures.Future:  # a chunk its allowance, a sample timeout_s
            timeout = chunk_timeout if count > 1 else self.timeout_s
            future = pool.schedule(_call, args=(self.spec, self.key, inputs[first : first + count]), timeout=timeout)
            pending[future] = (first, count)
            return future

        pending: dict[concurrent.futures.Future, tuple[int, int]] = {}
        for first in range(0, len(inputs), size):
            send(first, min(size, len(inputs) - first))
        outcomes: list[Outcome | None] = [None] * len(inputs)
        failures, slowest, restarted = 0, 0.0, False
        while pending and (max_failures is None or failures <= max_failures):
            done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            if not restarted and any(isinstance(f.exception(), BrokenProcessPool) for f in done):
                # every process died while no task ran on one (killed from outside): pebble fails every task of
                # the pool, which no sample caused; a new pool, once, and the unscored samples sent to it
                restarted, unscored = True, list(pending.values())
                pending.clear()
                self.close()
                pool = self._start()
                for first, count in unscored:
                    send(first, count)
                continue
            for future in done:
                first, count = pending.pop(future)
                calls, failure = self._results(future, count)
                if calls is None and count > 1:  # the chunk as a whole failed: each sample again, on its own
                    for i in range(first, first + count):
                        send(i, 1)
                    continue
                for i, (outcome, seconds) in enumerate(calls or [(failure, 0.0)], start=first):
                    outcomes[i] = outcome
                    failures += outcome.failed
                    slowest = max(slowest, seconds)
        for future in pending:
            future.cancel()
        if any(o is not None and not o.failed for o in outcomes):
            self.slowest_s = slowest
        elif outcomes:  # nothing measured: the next batch one sample per call again
            self.slowest_s = None
        return outcomes

    def _results(
        self, future: concurrent.futures.Future, count: int
    ) -> tuple[list[tuple[Outcome, float]] | None, Outcome | None]:
        """A finished task's ``(outcome, seconds)`` per sample, or ``(None, outcome)``: the task as a whole failed
        (timed out, its process died, ...) with that outcome for a task of one sample."""
        try:
            calls = future.result()
        except concurrent.futures.TimeoutError:  # pebble's: the call ran past the limit; its process was killed
            return None, Outcome(error=timeout_text(self.timeout_s or 0.0), timed_out=True)
        except pebble.ProcessExpired as error:
            return None, Outcome(error=f"the scoring process died (exit code {error.exitcode}) during the call")
        except BrokenProcessPool as error:
            return None, Outcome(error=f"the scoring processes could not run: {error_text(error)}")
        except Exception as error:  # e.g. a result that cannot be pickled back
            return None, Outcome(error=error_text(error))
        if len(calls) != count:
            raise AssertionError(f"a chunk of {count} samples came back with {len(calls)} results")
        return [(Outcome(value=v) if ok else Outcome(error=v), seconds) for ok, v, seconds in calls], None

    def close(self) -> None:
        """End the worker processes (a call running is killed). The next call starts new ones."""
        if self._finalizer is not None:
            self._finalizer()
        self._pool = self._finalizer = None


def _stop(pool: pebble.ProcessPool) -> None:
    pool.stop()
    pool.join(timeout=10)


# ---------------------------------------------------------------------------------------------------- this process
def score_in_process(
    function: Callable[..., Any],
    inputs: Inputs,
    timeout_s: float | None = None,
    num_workers: int = 1,
    max_failures: int | None = None,
) -> list[Outcome | None]:
    """One `Outcome` per sample of `inputs`, in order, `function` called in this process.

    With no `timeout_s` and one worker, the calls run in this thread one after another (a stateful function, such
    as the judge's verdict wrapper that reads the verdicts in order, sees the samples in order). Otherwise each call
    runs on a daemon thread, `num_workers` at once, started in the samples' order; a call past `timeout_s` seconds is
    recorded as timed out and abandoned: it cannot be stopped, runs on in the background (on a core, if it spins)
    and its result is dropped. Once more than `max_failures` samples failed, no further call starts and the places
    of the samples not scored are None.

    Raises:
        ValueError: `timeout_s` <= 0 or `num_workers` < 1.
    """
    check_limits(timeout_s, num_workers)
    outcomes: list[Outcome | None] = [None] * len(inputs)
    if timeout_s is None and num_workers == 1:
        failures = 0
        for i, args in enumerate(inputs):
            outcomes[i] = _called(function, args)
            failures += outcomes[i].failed
            if max_failures is not None and failures > max_failures:
                break
        return outcomes
    finished: queue.SimpleQueue[tuple[int, Outcome]] = queue.SimpleQueue()

    def run(i: int) -> None:
        finished.put((i, _called(function, inputs[i])))

    running: dict[int, float] = {}  # sample -> its deadline (time.monotonic)
    started = failures = 0

    def more() -> bool:  # whether another call may start
        return started < len(inputs) and (max_failures is None or failures <= max_failures)

    while running or more():
        while more() and len(running) < num_workers:
            running[started] = time.monotonic() + timeout_s if timeout_s is not None else float("inf")
            threading.Thread(target=run, args=(started,), name=f"score-{started}", daemon=True).start()
            started += 1
        wait = min(running.values()) - time.monotonic()
        with contextlib.suppress(queue.Empty):
            i, outcome = finished.get(timeout=None if wait == float("inf") else max(wait, 0.0))
            if i in running:  # (a call abandoned earlier may end late: its result is dropped)
                del running[i]
                outcomes[i] = outcome
                failures += outcome.failed
        now = time.monotonic()
        for late in [j for j, deadline in running.items() if deadline <= now]:
            del running[late]
            outcomes[late] = Outcome(error=timeout_text(timeout_s or 0.0), timed_out=True)
            failures += 1
    return outcomes


def _called(function: Callable[..., Any], args: tuple[Any, ...]) -> Outcome:
    try:
        return Outcome(value=function(*args))
    except Exception as error:
        return Outcome(error=error_text(error))
