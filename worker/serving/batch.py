"""Runs one chunk of a batch: its input lines go to the generation engines together (lines may name different
bases and adapters), results are written to the chunk's own output and error files, and the last chunk to
settle finalises the batch."""

import contextlib
import json
import queue
import threading
import time
from collections import Counter
from concurrent.futures import Future
from typing import NamedTuple

from pydantic import ValidationError

from contract import batches, events
from contract.inference_outputs import BUILDERS, response
from contract.inference_requests import BODY_SCHEMAS
from contract.records import new_id, now
from worker.engine.messages import Submission
from worker.engine.requests import EngineProcessExited, Priority, RequestFailed
from worker.node import metrics
from worker.node.node import Node
from worker.serving.inference import cancel_watch_for, host_for, outcome, prepare, tokenizer_for

POLL_SECONDS = 0.2
# Lines handed to the engine process per message: one message per line costs the engine's GIL more, and a whole
# chunk per message makes the engine wait until every line is tokenized.
SEND_LINES = 16
# Times a line is given to the engines: once more after the engine process died under it (out of device memory,
# say), so one request that kills it costs the other lines a rerun, not a failure.
ATTEMPTS = 2


class _Running(NamedTuple):
    """A line handed to the engines."""
    custom_id: str | None
    number: int  # in the input file
    request: dict
    arguments: Submission  # EngineHost.generate's, from inference.prepare
    future: Future | None = None  # set when handed to the engine process
    attempts: int = 0

    @property
    def request_id(self) -> str:
        return self.arguments.request_id


def _error_line(custom_id: str | None, code: str, message: str) -> dict:
    return {"id": new_id("batch_request"), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def _body(endpoint: str, request_id: str, model: str, result: dict, request: dict) -> dict:
    if endpoint == "/v1/responses":
        return response(request_id, now(), model, "completed", result, request)
    return BUILDERS[endpoint](request_id, now(), model, result)


def run_chunk(node: Node, chunk_id: str) -> None:
    store, redis, settings = node.store, node.redis, node.settings
    chunk = node.claim("chunk", chunk_id, {"status": "in_progress", "node": node.name, "completed": 0, "failed": 0,
                                           "input_tokens": 0, "output_tokens": 0})
    if chunk is None:
        return
    timings = {"claimed": time.time()}  # wall-clock stamps, so a slow batch shows where its time went

    def superseded() -> bool:
        """Requeued while this run went on (its node froze past the lease) and maybe claimed again elsewhere: the
        chunk is the newer run's, so this one must neither count nor write."""
        current = store.get("chunk", chunk_id)
        return current is None or current["status"] != "in_progress" or current["attempts"] != chunk["attempts"]

    batch = store.get("batch", chunk["batch_id"])
    batch_id, tenant, endpoint = batch["id"], batch["tenant"], batch["endpoint"]
    mine = batches.read_chunk_input(settings.artifact_root, tenant, batch_id, chunk["index"])

    results: dict[int, dict] = {}  # position in chunk -> output or error line
    failed_positions: set[int] = set()
    pending: dict[int, _Running] = {}
    expired = now() > batch["expires_at"]

    progress: Counter[str] = Counter()  # flushed to the chunk record once per wake-up, not once per line

    def fail(position: int, custom_id: str | None, code: str, message: str) -> None:
        results[position] = _error_line(custom_id, code, message)
        failed_positions.add(position)
        progress["failed"] += 1
        metrics.observe("batch_line", "failed")

    finished: queue.SimpleQueue[int] = queue.SimpleQueue()  # positions, put by the engine as each one ends

    def hand_over(lines: list[tuple[int, _Running]]) -> None:
        """Give lines to the engine process in one message; each puts its position in `finished` when it ends."""
        try:
            futures = host_for(node).generate_many([line.arguments for _, line in lines])
        except RequestFailed as exc:
            for position, line in lines:
                fail(position, line.custom_id, exc.code, f"line {line.number}: {exc}")
            return
        for (position, line), future in zip(lines, futures, strict=True):
            pending[position] = line._replace(future=future, attempts=line.attempts + 1)
            future.add_done_callback(lambda _, position=position: finished.put(position))

    prepared: list[tuple[int, _Running]] = []  # lines tokenized and not yet handed over

    for position, (number, line) in enumerate(mine):
        custom_id, body, problem = batches.parse_line(line, number, endpoint)
        if problem:
            fail(position, custom_id, "invalid_request", problem)
            continue
        if expired:
            fail(position, custom_id, "batch_expired", "The batch's completion window ended before this request ran.")
            continue
        try:
            request = BODY_SCHEMAS[endpoint].model_validate(body).normal()
            prepared.append((position, _Running(custom_id, number, request,
                                                prepare(node, new_id("batch_request"), tenant, request,
                                                        Priority.BATCH))))
        except ValidationError as exc:
            first = exc.errors()[0]
            fail(position, custom_id, "invalid_request",
                 f"line {number}: {'.'.join(map(str, first['loc']))}: {first['msg']}")
        except RequestFailed as exc:
            fail(position, custom_id, exc.code, f"line {number}: {exc}")
        except Exception as exc:  # whatever else a line's preparation raises ends that line, not the chunk
            fail(position, custom_id, "server_error", f"line {number}: {type(exc).__name__}: {exc}")
        if len(prepared) == SEND_LINES:
            hand_over(prepared)
            prepared = []
    if prepared:
        hand_over(prepared)

    timings["submitted"] = time.time()
    cancelled = False
    store.add_counts("chunk", chunk_id, progress)
    progress.clear()
    cancel_asked = threading.Event()
    with cancel_watch_for(node).watching(batch_id, cancel_asked.set):
        while pending:
            ready = []
            with contextlib.suppress(queue.Empty):
                ready.append(finished.get(timeout=POLL_SECONDS))
                while True:
                    ready.append(finished.get_nowait())
            if cancel_asked.is_set() and not cancelled:
                cancelled = True
                host = host_for(node)
                for running in pending.values():
                    host.cancel(running.request_id)
            lost: list[tuple[int, _Running]] = []  # lines whose engine process died under them
            for position in ready:
                line = pending.pop(position)
                try:
                    result = line.future.result()
                    if result.finish_reason == "cancelled":
                        continue  # unfinished when the batch was cancelled: neither output nor error
                    done = outcome(result, line.request, tokenizer_for(line.arguments.model.base, node.settings))
                except EngineProcessExited as exc:
                    if cancelled:
                        continue  # unfinished, as a cancelled line
                    if line.attempts < ATTEMPTS:
                        lost.append((position, line))
                    else:
                        fail(position, line.custom_id, exc.code, f"line {line.number}: {exc}")
                    continue
                except RequestFailed as exc:
                    fail(position, line.custom_id, exc.code, f"line {line.number}: {exc}")
                    continue
                results[position] = {"id": new_id("batch_request"), "custom_id": line.custom_id, "error": None,
                                     "response": {"status_code": 200, "request_id": line.request_id,
                                                  "body": _body(endpoint, line.request_id, line.request["model"],
                                                                done, line.request)}}
                metrics.observe("batch_line", "completed", done)
                progress.update(completed=1, input_tokens=done["prompt_tokens"],
                                output_tokens=done["completion_tokens"])
            if lost:
                hand_over(lost)
            if progress:
                if superseded():
                    break
                store.add_counts("chunk", chunk_id, progress)
                progress.clear()
    if pending or superseded():  # left the loop with lines still running, or lost the chunk at its end
        host = host_for(node)
        for running in pending.values():
            host.cancel(running.request_id)
        node.job_finished(chunk_id)
        events.emit(redis, batch_id, f"Chunk {chunk['index'] + 1}/{batch['n_chunks']}: attempt {chunk['attempts']} "
                                     f"on {node.name} stopped, the chunk was requeued while it ran", level="warn",
                    data={"chunk": chunk["index"], "node": node.name})
        return
    timings["generated"] = time.time()
    out_path, err_path = batches.chunk_files(settings.artifact_root, tenant, batch_id, chunk["index"])
    ordered = sorted(results)

    batches.write_atomically(out_path, [json.dumps(results[p]) for p in ordered if p not in failed_positions])
    batches.write_atomically(err_path, [json.dumps(results[p]) for p in ordered if p in failed_positions])
    settled = store.transition("chunk", chunk_id, ["in_progress"], {
        "status": "cancelled" if cancelled else "completed", "expired": expired, "finished_at": now(),
        "timings": {**timings, "written": time.time()}})
    node.job_finished(chunk_id)
    if settled:
        store.untrack("chunk", chunk_id)
        events.emit(redis, batch_id, f"Chunk {chunk['index'] + 1}/{batch['n_chunks']} done",
                    data={"chunk": chunk["index"], "node": node.name})
        batches.chunk_settled(store, settings.artifact_root, batch_id)
