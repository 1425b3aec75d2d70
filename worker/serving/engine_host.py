"""A worker node's models and generation engines, in a process of their own.

The engine's host loop is Python: it needs the GIL between device calls. In the worker process it would share the
GIL with Celery's consumer, the request threads and the heartbeat, and every moment one of them holds it, the
device waits (bench/gil.py: on an H200, two threads holding the GIL a fifth of the time each slowed the engine by
25-40%). So the node's requests go through a pipe to a child process that owns the models and engines, and their
results come back the same way. If the child dies (out of device memory, a crash in a kernel), the requests it
held fail and the next request starts a new child.

The child is spawned, not forked (a forked device runtime is unusable), and inherits the node's environment,
device mask included. It exits when the worker goes away: its end of the pipe then reads EOF.
"""

import itertools
import multiprocessing
import os
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path

from worker.engine.engine import GenerationResult
from worker.serving.inference import EngineProcessExited, RequestFailed

# The heartbeat waits this long for the child's report, then publishes the last one it had: the heartbeat also
# keeps the node in the registry, and a child still starting (importing torch) answers only seconds later.
REPORT_TIMEOUT_SECONDS = 0.5
# Requests being prepared at once in the child (model load, adapter load) before they reach an engine; a load
# blocks only the requests that need that model.
PREPARE_THREADS = 8


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
        self._pending: dict[str, tuple[Connection, Future]] = {}  # request id -> its child's pipe, its result
        self._reports: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._last_report: dict = {"models": []}  # the current child's latest answer

    def start(self) -> None:
        with self._lock:
            self._ensure_child()

    def _send(self, conn: Connection, message: tuple) -> bool:
        """False when the child is gone."""
        try:
            with self._send_lock:
                conn.send(message)
            return True
        except OSError:
            return False

    def generate(self, request_id: str, base: str, adapter: tuple[str, Path] | None, request: dict,
                 prompt_ids: list[int]) -> Future:
        """The future of a GenerationResult; it raises RequestFailed when the model, the adapter or the prompt
        cannot be served."""
        return self.generate_many([(request_id, base, adapter, request, prompt_ids)])[0]

    def generate_many(self, requests: list[tuple[str, str, tuple[str, Path] | None, dict, list[int]]]) -> list[Future]:
        """generate() for several requests in one message: the child's host loop shares its GIL with whatever
        receives them, so fewer, larger messages leave more of it to the engine."""
        futures: list[Future] = [Future() for _ in requests]
        for _ in range(2):  # a child found dead on sending is replaced once
            with self._lock:
                self._ensure_child()
                conn, proc = self._conn, self._proc
                for (request_id, *_), future in zip(requests, futures, strict=True):
                    self._pending[request_id] = (conn, future)
            if self._send(conn, ("generate", requests)):
                return futures
            with self._lock:
                for request_id, *_ in requests:
                    self._pending.pop(request_id, None)
            proc.join(5)
        raise RequestFailed("server_error", "The worker's engine process could not be started.")

    def cancel(self, request_id: str) -> None:
        with self._lock:
            conn = self._pending.get(request_id, (None, None))[0]
        if conn is not None:
            self._send(conn, ("cancel", request_id))  # a dead child has nothing left to cancel

    def report(self) -> dict:
        """What the registry shows of the loaded models and their engines (nothing while no child runs)."""
        future: Future = Future()
        with self._lock:
            if self._conn is None:
                return {"models": [], "engine_pid": None}
            conn, pid, call_id = self._conn, self._proc.pid, next(self._call_ids)
            self._reports[call_id] = future
        try:
            if not self._send(conn, ("report", call_id)):
                return {"models": [], "engine_pid": None}
            return {**future.result(timeout=REPORT_TIMEOUT_SECONDS), "engine_pid": pid}
        except TimeoutError:
            with self._lock:
                last = self._last_report
            return {**last, "engine_pid": pid, "engine_process": "not answering"}
        finally:
            with self._lock:
                self._reports.pop(call_id, None)

    def close(self) -> None:
        with self._lock:
            conn, proc = self._conn, self._proc
        if conn is not None:
            self._send(conn, ("close",))
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
        self._conn, self._proc, self._last_report = ours, proc, {"models": []}
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
            lost = [self._pending.pop(rid)[1] for rid, (c, _) in list(self._pending.items()) if c is conn]
        proc.join(5)
        for future in lost:
            future.set_exception(EngineProcessExited(proc.exitcode))

    def _answer(self, answer: tuple) -> None:
        kind = answer[0]
        if kind == "report":
            with self._lock:
                self._last_report = answer[2]
                future = self._reports.get(answer[1])
            if future is not None:
                future.set_result(answer[2])
            return
        with self._lock:
            _, future = self._pending.pop(answer[1], (None, None))
        if future is None:
            return
        if kind == "result":
            future.set_result(answer[2])
        else:  # "failed"
            future.set_exception(RequestFailed(answer[2], answer[3]))


def serve(conn: Connection, backend: str) -> None:
    """The child: loads models, runs their engines, and answers the worker through `conn` until it closes."""
    from contract.settings import Settings
    from worker.serving.inference import ModelCache, freeze_heap, submit

    cache = ModelCache(Settings(), backend)
    lock = threading.Lock()  # the two maps below
    engines = {}  # request id -> the engine running it
    preparing: dict[str, bool] = {}  # request id -> whether a cancel came before it reached its engine
    prepare = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="xpujobs-prepare")
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
        send(("result", request_id, result))

    def start_all(requests: list[tuple]) -> None:
        for request in requests:
            start(*request)

    def start(request_id: str, base: str, adapter, request: dict, prompt_ids: list[int]) -> None:
        try:
            engine, future = submit(cache, request_id, base, adapter, request, prompt_ids)
        except RequestFailed as exc:
            with lock:
                preparing.pop(request_id, None)
            send(("failed", request_id, exc.code, str(exc)))
            return
        except Exception as exc:  # one bad request must not take the engines down
            with lock:
                preparing.pop(request_id, None)
            send(("failed", request_id, "server_error", f"{type(exc).__name__}: {exc}"))
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
        kind = message[0]
        if kind == "generate":
            with lock:
                for request_id, *_ in message[1]:
                    preparing[request_id] = False
            prepare.submit(start_all, message[1])
        elif kind == "cancel":
            with lock:
                engine = engines.get(message[1])
                if engine is None and message[1] in preparing:
                    preparing[message[1]] = True
            if engine is not None:
                engine.cancel(message[1])
        elif kind == "report":
            send(("report", message[1], cache.report()))
        elif kind == "close":
            break
    cache.close()
    outbox.put(None)
    sender.join(5)
    os._exit(0)  # the engines' and the pool's threads hold nothing that must outlive the process
