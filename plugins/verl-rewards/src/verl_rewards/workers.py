"""Running reward functions with a time limit, in worker processes that can be killed.

A reward is user code: it may raise, hang on a pathological answer, or loop forever. A thread cannot be
stopped from outside (a pure-Python ``while True`` would keep a core busy for the rest of the run), so
with ``reward.isolation = "process"`` (the default) rewards run in spawned worker processes. The
controller waits on each one with a deadline; a worker past its deadline is killed and replaced, the
row it was scoring is reported as timed out, and the rest of its rows are sent to the new worker.

Per-sample rewards report each row as soon as it is scored, so the deadline is per row
(``reward.timeout`` seconds) and a timeout pins the exact row. A batch reward gets ``reward.timeout``
for the whole call. ``async`` per-sample rewards run concurrently, each under ``asyncio.wait_for``,
with the process deadline as a backstop for coroutines that block the event loop.

With ``reward.isolation = "none"`` rewards run in the controller itself: no start-up cost and no
pickling, but a hanging synchronous reward cannot be interrupted.

The worker side imports nothing heavy (no torch), so a worker starts in well under a second.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Sequence

from verl_rewards.functions import (
    LoadedReward,
    RewardError,
    RewardInput,
    as_score,
    call_sample,
    gather_with_timeout,
    rebuild_reward,
)

__all__ = ["Outcome", "RewardWorkerPool", "score_inline"]

# The error of rows a fail-fast call left unscored after another row failed.
NOT_SCORED = "not scored: the call stopped at the first failure"
# How long a fresh worker may take to import itself and report ready, and to build a reward (import its
# module) before scoring; neither is counted against reward.timeout.
STARTUP_TIMEOUT_S = 120.0
# Extra time the controller allows async per-sample rewards beyond their own asyncio timeout.
ASYNC_GRACE_S = 2.0


@dataclass
class Outcome:
    """The result for one row: a score, or an error message (``timed_out`` when it hit the limit)."""

    score: float | None = None
    error: str | None = None
    timed_out: bool = False


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _score_or_error(value: Any) -> Outcome:
    if isinstance(value, TimeoutError):
        return Outcome(error=str(value), timed_out=True)
    if isinstance(value, BaseException):
        return Outcome(error=_describe(value))
    if isinstance(value, _Invalid):
        return Outcome(error=value.message)
    try:
        return Outcome(score=as_score(value))
    except (TypeError, ValueError) as exc:
        return Outcome(error=str(exc))


def _batch_outcomes(values: Any, n: int) -> list[Outcome]:
    try:
        values = list(values)
    except TypeError:
        return [Outcome(error=f"a batch reward must return a list of scores, got {type(values).__name__}")] * n
    if len(values) != n:
        return [Outcome(error=f"returned {len(values)} scores for {n} responses")] * n
    return [_score_or_error(v) for v in values]


# ----------------------------------------------------------------------------- in-process
def score_inline(reward: LoadedReward, inputs: RewardInput, *, timeout: float) -> list[Outcome]:
    """Score in the calling process. Only ``async`` rewards can be held to ``timeout`` here."""
    n = len(inputs)
    limit = timeout or None
    if reward.per_sample:
        if reward.is_async:
            calls = [call_sample(reward.fn, inputs, i, positional=reward.positional_response) for i in range(n)]
            return [_score_or_error(v) for v in asyncio.run(gather_with_timeout(calls, limit))]
        out = []
        for i in range(n):
            try:
                out.append(_score_or_error(call_sample(reward.fn, inputs, i, positional=reward.positional_response)))
            except Exception as exc:  # noqa: BLE001 - reported per row
                out.append(Outcome(error=_describe(exc)))
        return out
    try:
        values = reward.fn(inputs)
        if inspect.isawaitable(values):
            [values] = asyncio.run(gather_with_timeout([values], limit))
            if isinstance(values, BaseException):
                return [_score_or_error(values)] * n
    except Exception as exc:  # noqa: BLE001 - reported for the whole batch
        return [Outcome(error=_describe(exc))] * n
    return _batch_outcomes(values, n)


# ----------------------------------------------------------------------------- worker side
def _worker_main(conn: Connection) -> None:
    """Entry point of a reward worker process: score tasks until told to stop."""
    # Ctrl-C goes to the whole process group, and a scheduler's SIGTERM often does too; the controller
    # decides what happens (it finishes the step and saves, run.save_on_signal), not the workers. They
    # end when the controller stops them, when its end of the socket closes, or by SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    cache: dict[str, LoadedReward] = {}
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        _, key, payload, inputs, indices, timeout = msg
        try:
            reward = cache.get(key)
            if reward is None:
                target, options, label, spec = pickle.loads(payload)
                reward = cache[key] = rebuild_reward(target, options, label=label, spec=spec)
        except Exception:  # noqa: BLE001 - the controller reports it
            conn.send(("fatal", traceback.format_exc(limit=5)))
            continue
        # Building a reward may import heavy modules (math-verify, sympy): that is not the reward's time.
        conn.send(("loaded",))
        _run_task(conn, reward, inputs, indices, timeout)


def _run_task(conn: Connection, reward: LoadedReward, inputs: RewardInput, indices: Sequence[int],
              timeout: float) -> None:
    if reward.per_sample and not reward.is_async:
        for i in indices:
            try:
                value = call_sample(reward.fn, inputs, i, positional=reward.positional_response)
                conn.send(("item", i, _plain(value), None))
            except Exception as exc:  # noqa: BLE001 - reported per row
                conn.send(("item", i, None, _describe(exc)))
        conn.send(("done",))
        return
    if reward.per_sample:
        async def run_all() -> None:
            async def one(i: int) -> None:
                [value] = await gather_with_timeout(
                    [call_sample(reward.fn, inputs, i, positional=reward.positional_response)], timeout or None)
                error = _describe(value) if isinstance(value, BaseException) else None
                if isinstance(value, TimeoutError):
                    error = "TIMEOUT " + str(value)
                conn.send(("item", i, None if error else _plain(value), error))

            await asyncio.gather(*(one(i) for i in indices))

        try:
            asyncio.run(run_all())
        except Exception as exc:  # noqa: BLE001
            conn.send(("fatal", _describe(exc)))
            return
        conn.send(("done",))
        return
    sub = inputs.select(indices)
    try:
        values = reward.fn(sub)
        if inspect.isawaitable(values):
            [values] = asyncio.run(gather_with_timeout([values], timeout or None))
            if isinstance(values, BaseException):
                raise values
        conn.send(("batch", [_plain(v) for v in values] if isinstance(values, (list, tuple)) else _plain(values),
                   None))
    except TimeoutError as exc:
        conn.send(("batch", None, "TIMEOUT " + str(exc)))
    except Exception as exc:  # noqa: BLE001 - reported for the whole batch
        conn.send(("batch", None, _describe(exc)))


def _plain(value: Any) -> Any:
    """Make a reward's return value safe to send back (numbers stay numbers, the rest becomes a score)."""
    if isinstance(value, (int, float, bool, str)) or value is None:
        return value
    try:
        return as_score(value)
    except (TypeError, ValueError) as exc:
        return _Invalid(str(exc))


class _Invalid:
    """A return value that is not a score, carried back as its error message."""

    def __init__(self, message: str) -> None:
        self.message = message


# ----------------------------------------------------------------------------- controller side
_KEEP = "keep"  # the job goes on
_DONE = "done"  # the job is over
class _Worker:
    """One worker process, started with ``subprocess`` rather than ``multiprocessing``.

    ``multiprocessing``'s spawn re-imports the parent's ``__main__``, which re-runs a user's training
    script that has no ``if __name__ == "__main__":`` guard; a fresh interpreter that imports only this
    module cannot. The two ends talk over a socket pair with ``multiprocessing``'s pickling
    :class:`~multiprocessing.connection.Connection`.
    """

    def __init__(self) -> None:
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        # The worker must find what the controller found: plugins on sys.path, reward files' imports.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        code = "from verl_rewards.workers import _worker_entry; _worker_entry()"
        self.process = subprocess.Popen([sys.executable, "-c", code, str(child_sock.fileno())],
                                        pass_fds=(child_sock.fileno(),), env=env, stdin=subprocess.DEVNULL)
        child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self.ready = False

    def wait_ready(self) -> None:
        if self.ready:
            return
        if not self.conn.poll(STARTUP_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"a reward worker process did not start within {STARTUP_TIMEOUT_S:.0f}s")
        try:
            msg = self.conn.recv()
        except EOFError:
            self.process.wait(timeout=10)
            raise RuntimeError(f"a reward worker process exited at start (exit code {self.process.returncode}); "
                               f"its error is on stderr above") from None
        if msg[0] != "ready":  # pragma: no cover - protocol error
            raise RuntimeError(f"reward worker sent {msg!r} before it was ready")
        self.ready = True

    @property
    def exitcode(self) -> int | None:
        return self.process.poll()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
            self.process.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


def _worker_entry() -> None:
    """``python -c`` entry point of a worker process: the socket's file descriptor is ``argv[1]``."""
    _worker_main(Connection(int(sys.argv[1])))


@dataclass
class _Job:
    worker: _Worker
    rows: list[int]          # the caller's row index of each row sent (the worker numbers them 0..k-1)
    pending: list[int]       # the worker's rows not reported yet, in the order it scores them
    deadline: float
    slack: float = 0.0       # extra time past reward.timeout (async rewards time themselves out first)


class RewardWorkerPool:
    """``workers`` spawned processes that score rewards with a deadline; killed and replaced on timeout.

    Args:
        workers: number of processes; each call's rows are split evenly across them.
    """

    def __init__(self, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError("reward.workers: must be at least 1 process")
        self._size = workers
        self._workers: list[_Worker] = []
        self.restarts = 0

    def start(self) -> None:
        """Launch the processes now (they import while the caller does other work)."""
        while len(self._workers) < self._size:
            self._workers.append(_Worker())

    def close(self) -> None:
        """Stop every worker process."""
        for w in self._workers:
            w.stop()
        self._workers = []

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = _Worker()
        self._workers[self._workers.index(worker)] = fresh
        self.restarts += 1
        return fresh

    def score(self, reward: LoadedReward, inputs: RewardInput, *, timeout: float,
              fail_fast: bool = False) -> list[Outcome]:
        """Score every row of ``inputs``; never takes much longer than the time limits allow.

        With ``fail_fast`` the call ends at the first row that fails or times out (the run stops on
        it anyway, ``reward.on_error = "fail"``): a reward that hangs on every row costs one
        ``timeout``, not one per row. Rows left unscored then carry :data:`NOT_SCORED`.
        """
        n = len(inputs)
        if n == 0:
            return []
        self.start()
        key = f"{reward.spec}|{sorted(reward.options.items())!r}"
        try:
            payload = pickle.dumps((reward.target, reward.options, reward.label, reward.spec))
        except Exception as exc:  # noqa: BLE001
            raise RuntimeError(f"reward {reward.spec!r} cannot be sent to a worker process ({_describe(exc)}); "
                               f"set reward.isolation = \"none\" to run it in the controller") from exc
        outcomes: list[Outcome | None] = [None] * n
        limit = timeout if timeout and timeout > 0 else None
        per_row = reward.per_sample and not reward.is_async
        slack = ASYNC_GRACE_S if reward.is_async else 0.0

        def send(worker: _Worker, rows: list[int]) -> _Job:
            worker.wait_ready()
            local = list(range(len(rows)))
            worker.conn.send(("task", key, payload, inputs.select(rows), local, timeout))
            # Until the worker says the reward is built ("loaded"), building gets STARTUP_TIMEOUT_S of its own.
            deadline = time.monotonic() + STARTUP_TIMEOUT_S + limit + slack if limit else float("inf")
            return _Job(worker, list(rows), local, deadline, slack)

        size = -(-n // min(n, len(self._workers)))
        jobs = [send(w, list(range(s, min(n, s + size)))) for w, s in zip(self._workers, range(0, n, size))]
        try:
            while jobs:
                soonest = min(j.deadline for j in jobs)
                ready = wait([j.worker.conn for j in jobs],
                             timeout=None if soonest == float("inf") else max(0.0, soonest - time.monotonic()))
                still: list[_Job] = []
                for job in jobs:
                    if job.worker.conn in ready:
                        follow = self._on_message(job, outcomes, per_row, limit)
                    elif time.monotonic() >= job.deadline:
                        follow = self._on_timeout(job, outcomes, per_row, limit)
                    else:
                        follow = _KEEP  # still busy, within its deadline
                    if follow is _KEEP:
                        still.append(job)
                    elif follow is not _DONE:
                        still.append(send(job.worker, [job.rows[i] for i in follow]))
                jobs = still
                if fail_fast and any(o is not None and o.error is not None for o in outcomes):
                    for job in jobs:  # busy with rows nobody will read: replace them, as below
                        self._replace(job.worker)
                    return [o if o is not None else Outcome(error=NOT_SCORED) for o in outcomes]
        except BaseException:
            # Interrupted mid-call (Ctrl-C, a broken worker): busy workers would answer the next call
            # with this call's results, so replace them.
            for job in jobs:
                if job.worker in self._workers:
                    self._replace(job.worker)
            raise
        return [o if o is not None else Outcome(error="the reward returned no result") for o in outcomes]

    def _on_message(self, job: _Job, outcomes: list[Outcome | None], per_row: bool,
                    limit: float | None) -> Any:
        """Handle one message: returns ``_KEEP``, ``_DONE``, or the rows to send to a replacement worker."""
        try:
            msg = job.worker.conn.recv()
        except (EOFError, OSError):
            job.worker.process.wait(timeout=5)
            message = (f"the reward worker process died (exit code {job.worker.exitcode}) while "
                       f"scoring this row")
            return self._fail_current(job, outcomes, per_row, message, timed_out=False)
        kind = msg[0]
        if kind == "loaded":  # the clock starts once the reward is built
            if limit:
                job.deadline = time.monotonic() + limit + job.slack
            return _KEEP
        if kind == "item":
            _, i, value, error = msg
            outcomes[job.rows[i]] = self._outcome(value, error)
            if i in job.pending:
                job.pending.remove(i)
            if per_row and limit:
                job.deadline = time.monotonic() + limit
            return _KEEP  # the "done" message still follows
        if kind == "batch":
            _, values, error = msg
            if error is not None:
                for i in job.pending:
                    outcomes[job.rows[i]] = self._outcome(None, error)
            else:
                values = values if isinstance(values, list) else [values]
                for i, o in zip(job.pending, _batch_outcomes(values, len(job.pending))):
                    outcomes[job.rows[i]] = o
            return _DONE
        if kind == "done":
            return _DONE
        if kind == "fatal":
            raise RewardError(f"the reward worker process could not run the reward:\n{msg[1]}")
        raise RuntimeError(f"unexpected message from a reward worker: {msg!r}")  # pragma: no cover

    def _on_timeout(self, job: _Job, outcomes: list[Outcome | None], per_row: bool,
                    limit: float | None) -> Any:
        message = f"exceeded reward.timeout={limit:g}s; the reward worker process was killed"
        return self._fail_current(job, outcomes, per_row, message, timed_out=True)

    def _fail_current(self, job: _Job, outcomes: list[Outcome | None], per_row: bool, message: str, *,
                      timed_out: bool) -> Any:
        """Mark the row being scored (a per-row job) or every pending row as failed; replace the worker.

        Returns the rows still to score (sent to the replacement), or ``_DONE``.
        """
        failed, rest = (job.pending[:1], job.pending[1:]) if per_row else (job.pending, [])
        for i in failed:
            outcomes[job.rows[i]] = Outcome(error=message, timed_out=timed_out)
        job.worker = self._replace(job.worker)
        return rest or _DONE

    @staticmethod
    def _outcome(value: Any, error: str | None) -> Outcome:
        if error is not None:
            if error.startswith("TIMEOUT "):
                return Outcome(error=error[len("TIMEOUT "):], timed_out=True)
            return Outcome(error=error)
        return _score_or_error(value)
