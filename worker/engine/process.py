"""A worker node's models and generation engines, in a process of their own.

The engine's host loop is Python: it needs the GIL between device calls. In the worker process it would share the
GIL with Celery's consumer, the request threads and the heartbeat, and every moment one of them holds it, the
device waits (bench/gil.py: on an H200, two threads holding the GIL a fifth of the time each slowed the engine by
25-40%). So the node's requests go through a pipe to a child process that owns the models and engines, and their
results come back the same way (messages.py: one dataclass per kind). If the child dies (out of device memory, a
crash in a kernel), the requests it held fail with EngineProcessExited and the next request starts a new child.

Streaming: `EngineHost.generate(submission, on_delta=f)` marks the request as streaming; the child forwards each
GenerationDelta the engine reports as a Delta message, and f is called with it (from the host's reader thread,
in order, before the request's future resolves). Keep f quick: it holds up every other answer.

The child is spawned, not forked (a forked device runtime is unusable), and inherits the node's environment,
device mask included. It exits when the worker goes away: its end of the pipe then reads EOF.
"""

import dataclasses
import itertools
import multiprocessing
import os
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Callable

from worker.engine.messages import (
    Cancel,
    Close,
    Delta,
    Failed,
    Finished,
    Generate,
    Released,
    ReleaseIdle,
    Report,
    ReportRequest,
    Submission,
)
from worker.engine.requests import EngineProcessExited, GenerationDelta, GenerationResult, Priority, RequestFailed

# The heartbeat waits this long for the child's report, then publishes the last one it had: the heartbeat also
# keeps the node in the registry, and a child still starting (importing torch) answers only seconds later.
REPORT_TIMEOUT_SECONDS = 0.5
# How long a fine-tune waits for the engine process to evict its idle models before starting anyway.
RELEASE_TIMEOUT_SECONDS = 30.0
# Requests being prepared at once in the child (model load, adapter load) before they reach an engine; a load
# blocks only the requests that need that model. Live and batch requests have a pool each, so a live request never
# queues behind the lines of a batch (their adapter loads, their grammars compiled).
PREPARE_THREADS = 8


class _Pending:
    __slots__ = ("conn", "future", "on_delta")

    def __init__(self, conn: Connection, future: Future, on_delta: Callable[[GenerationDelta], None] | None):
        self.conn, self.future, self.on_delta = conn, future, on_delta


class EngineHost:
    """The worker's side: hands requests to the child process and resolves their futures from its answers."""

    def __init__(self, backend: str):
        self._backend = backend
        # The state lock guards the fields below and is never held while waiting on the pipe: the reader thread
        # needs it to drain the child's answers, and a full pipe in both directions would otherwise deadlock.
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # one message at a time on the pipe
        self._conn: Connection | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._pending: dict[str, _Pending] = {}  # request id -> its child's pipe, its result, its delta callback
        self._reports: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._last_report: dict = {"models": [], "reclaimable_memory": {}}  # the current child's latest answer

    def start(self) -> None:
        with self._lock:
            self._ensure_child()

    def _send(self, conn: Connection, message) -> bool:
        """False when the child is gone."""
        try:
            with self._send_lock:
                conn.send(message)
            return True
        except OSError:
            return False

    def generate(self, submission: Submission, on_delta: Callable[[GenerationDelta], None] | None = None) -> Future:
        """The future of a GenerationResult; it raises RequestFailed when the model, the adapter or the prompt
        cannot be served. With on_delta, the request streams: on_delta gets each GenerationDelta first."""
        if on_delta is not None:
            submission = dataclasses.replace(submission, stream=True)
        return self.generate_many([submission], [on_delta])[0]

    def generate_many(self, submissions: list[Submission],
                      on_deltas: list[Callable[[GenerationDelta], None] | None] | None = None) -> list[Future]:
        """generate() for several requests in one message: the child's host loop shares its GIL with whatever
        receives them, so fewer, larger messages leave more of it to the engine."""
        futures: list[Future] = [Future() for _ in submissions]
        callbacks = on_deltas or [None] * len(submissions)
        for _ in range(2):  # a child found dead on sending is replaced once
            with self._lock:
                self._ensure_child()
                conn, proc = self._conn, self._proc
                for sub, future, callback in zip(submissions, futures, callbacks, strict=True):
                    self._pending[sub.request_id] = _Pending(conn, future, callback)
            if self._send(conn, Generate(submissions)):
                return futures
            with self._lock:
                for sub in submissions:
                    self._pending.pop(sub.request_id, None)
            proc.join(5)
        raise RequestFailed("server_error", "The worker's engine process could not be started.")

    def cancel(self, request_id: str) -> None:
        with self._lock:
            pending = self._pending.get(request_id)
        if pending is not None:
            self._send(pending.conn, Cancel(request_id))  # a dead child has nothing left to cancel

    def report(self) -> dict:
        """What the registry shows of the loaded models and their engines, and per device index the bytes evicting
        the idle ones would give back (nothing while no child runs). `engine_requests` is counted on this side:
        the requests handed to the current child and not answered yet, known also while it does not answer."""
        future: Future = Future()
        with self._lock:
            if self._conn is None:
                return {"models": [], "engine_pid": None, "engine_requests": 0}
            conn, pid, call_id = self._conn, self._proc.pid, next(self._call_ids)
            held = sum(1 for pending in self._pending.values() if pending.conn is conn)
            self._reports[call_id] = future
        try:
            if not self._send(conn, ReportRequest(call_id)):
                return {"models": [], "engine_pid": None, "engine_requests": 0}
            return {**future.result(timeout=REPORT_TIMEOUT_SECONDS), "engine_pid": pid, "engine_requests": held}
        except TimeoutError:
            with self._lock:
                last = self._last_report
            return {**last, "engine_pid": pid, "engine_process": "not answering", "engine_requests": held}
        finally:
            with self._lock:
                self._reports.pop(call_id, None)

    def release_idle(self) -> list[str]:
        """Evict the engine process's idle models (no request waiting or running), so that a fine-tune about to
        start has the device memory their engines held; busy ones stay. The bases evicted (none with no child)."""
        future: Future = Future()
        with self._lock:
            if self._conn is None:
                return []
            conn, call_id = self._conn, next(self._call_ids)
            self._reports[call_id] = future
        try:
            if not self._send(conn, ReleaseIdle(call_id)):
                return []
            return future.result(timeout=RELEASE_TIMEOUT_SECONDS)
        except TimeoutError:
            return []
        finally:
            with self._lock:
                self._reports.pop(call_id, None)

    def close(self) -> None:
        with self._lock:
            conn, proc = self._conn, self._proc
        if conn is not None:
            self._send(conn, Close())
        if proc is not None:
            proc.join(30)
            if proc.is_alive():
                proc.kill()

    def _ensure_child(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            return
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        proc = context.Process(target=serve, args=(theirs, self._backend), name="xpujobs-engines", daemon=True)
        proc.start()
        theirs.close()
        self._conn, self._proc, self._last_report = ours, proc, {"models": [], "reclaimable_memory": {}}
        threading.Thread(target=self._read, args=(ours, proc), name="xpujobs-engine-results", daemon=True).start()

    def _read(self, conn: Connection, proc) -> None:
        while True:
            try:
                answers = conn.recv()  # a list: the child sends what it has ready in one message
            except (EOFError, OSError):
                break
            for answer in answers:
                self._answer(answer)
        with self._lock:  # a new child may already be serving newer requests: fail only this one's
            if self._conn is conn:
                self._conn, self._proc = None, None
            lost = [self._pending.pop(rid).future for rid, p in list(self._pending.items()) if p.conn is conn]
        proc.join(5)
        for future in lost:
            future.set_exception(EngineProcessExited(proc.exitcode))

    def _answer(self, answer) -> None:
        if isinstance(answer, Report):
            report = {"models": [dataclasses.asdict(m) for m in answer.models],
                      "reclaimable_memory": answer.reclaimable_memory}
            with self._lock:
                self._last_report = report
                future = self._reports.get(answer.call_id)
            if future is not None:
                future.set_result(report)
            return
        if isinstance(answer, Released):
            with self._lock:
                future = self._reports.get(answer.call_id)
            if future is not None:
                future.set_result(answer.models)
            return
        if isinstance(answer, Delta):
            with self._lock:
                pending = self._pending.get(answer.delta.request_id)
            if pending is not None and pending.on_delta is not None:
                try:
                    pending.on_delta(answer.delta)
                except Exception as exc:  # one consumer's failure must not stop the other answers
                    print(f"xpu-jobs engine host: on_delta failed: {exc!r}", flush=True)
            return
        request_id = answer.result.request_id if isinstance(answer, Finished) else answer.request_id
        with self._lock:
            pending = self._pending.pop(request_id, None)
        if pending is None:
            return
        if isinstance(answer, Finished):
            pending.future.set_result(answer.result)
        else:
            pending.future.set_exception(RequestFailed(answer.code, answer.message, answer.param))


def serve(conn: Connection, backend: str) -> None:
    """The child: loads models, runs their engines, and answers the worker through `conn` until it closes."""
    from contract.settings import Settings
    from worker.engine.model_cache import ModelCache, freeze_heap, reclaimable_memory, submit

    cache = ModelCache(Settings(), backend)
    lock = threading.Lock()  # the two maps below
    engines = {}  # request id -> the engine running it
    preparing: dict[str, bool] = {}  # request id -> whether a cancel came before it reached its engine
    prepare = {priority: ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix=f"xpujobs-prepare-{priority.name}")
               for priority in Priority}
    # Answers go out from one thread, as many per message as are ready: the engine's thread, which finishes
    # requests, never waits on the pipe, and the worker unpickles fewer messages.
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    send = outbox.put

    def send_answers() -> None:
        closing = False
        while not closing:
            answers = [outbox.get()]
            while True:
                try:
                    answers.append(outbox.get_nowait())
                except queue.Empty:
                    break
            closing = None in answers  # the last answers, after the engines closed
            try:
                conn.send([answer for answer in answers if answer is not None])
            except OSError:  # the worker is gone
                return

    sender = threading.Thread(target=send_answers, name="xpujobs-answers", daemon=True)
    sender.start()

    def finished(request_id: str, result: GenerationResult) -> None:
        with lock:
            engines.pop(request_id, None)
        send(Finished(result))

    def start_all(submissions: list[Submission]) -> None:
        for submission in submissions:
            start(submission)

    def start(submission: Submission) -> None:
        request_id = submission.request_id
        try:
            engine, future = submit(cache, submission,
                                    (lambda delta: send(Delta(delta))) if submission.stream else None)
        except RequestFailed as exc:
            with lock:
                preparing.pop(request_id, None)
            send(Failed(request_id, exc.code, str(exc), exc.param))
            return
        except Exception as exc:  # one bad request must not take the engines down
            with lock:
                preparing.pop(request_id, None)
            send(Failed(request_id, "server_error", f"{type(exc).__name__}: {exc}"))
            return
        with lock:
            engines[request_id] = engine
            cancelled_early = preparing.pop(request_id, False)
        if cancelled_early:
            engine.cancel(request_id)
        future.add_done_callback(lambda done: finished(request_id, done.result()))

    freeze_heap()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the worker is gone
            break
        if isinstance(message, Generate):
            with lock:
                for submission in message.submissions:
                    preparing[submission.request_id] = False
            for priority in {submission.priority for submission in message.submissions}:
                prepare[priority].submit(start_all, [s for s in message.submissions if s.priority == priority])
        elif isinstance(message, Cancel):
            with lock:
                engine = engines.get(message.request_id)
                if engine is None and message.request_id in preparing:
                    preparing[message.request_id] = True
            if engine is not None:
                engine.cancel(message.request_id)
        elif isinstance(message, ReportRequest):
            models = cache.report()
            send(Report(message.call_id, models, reclaimable_memory(models)))
        elif isinstance(message, ReleaseIdle):
            send(Released(message.call_id, cache.release_idle()))
        elif isinstance(message, Close):
            break
    cache.close()
    outbox.put(None)
    sender.join(5)
    os._exit(0)  # the engines' and the pool's threads hold nothing that must outlive the process
