"""The users' commands of `xpu-jobs` (files, fine-tune, batch, models, workers), built on the official openai client
and rich: upload files, start a fine-tune and follow it with a progress bar (step, loss, ETA), submit a batch and
follow it, download outputs and adapters, list models and workers.

The server and key come from OPENAI_BASE_URL / OPENAI_API_KEY (or --base-url / --api-key). --json prints the
objects as JSON, for scripts. No torch here: this runs on any machine with the two libraries.
"""

import argparse
import json
import time
from pathlib import Path

import httpx
import openai
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

ENDED = {"succeeded", "failed", "cancelled", "completed", "expired"}

console = Console()
errors = Console(stderr=True)


def _connection_options(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument("--base-url", default=default, help="default: OPENAI_BASE_URL, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default=default, help="default: OPENAI_API_KEY")
    parser.add_argument("--json", action="store_true", default=default or False,
                        help="print objects as JSON (no tables, no progress bars)")


class _Subparsers:
    """add_subparsers' handle that gives every parser the connection options."""

    def __init__(self, handle, common):
        self.handle, self.common = handle, common

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        return self.handle.add_parser(name, parents=[self.common], **kwargs)

    def add_subparsers(self, parser, **kwargs) -> "_Subparsers":
        return _Subparsers(parser.add_subparsers(**kwargs), self.common)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xpu-jobs", description="xpu-jobs for its users: files, fine-tuning, "
                                     "batches, models and workers through the REST API")
    _connection_options(parser, None)
    # The same options after the command too (xpu-jobs models --json); there they only override what was given.
    common = argparse.ArgumentParser(add_help=False)
    _connection_options(common, argparse.SUPPRESS)
    sub = _Subparsers(parser.add_subparsers(dest="command", required=True), common)

    files = sub.add_subparsers(sub.add_parser("files", help="upload, list, download files"), dest="action",
                               required=True)
    upload = files.add_parser("upload", help="upload a JSONL file")
    upload.add_argument("path", type=Path)
    upload.add_argument("--purpose", choices=["fine-tune", "batch"], required=True)
    files.add_parser("list", help="the tenant's files")
    download = files.add_parser("download", help="a file's content")
    download.add_argument("file_id")
    download.add_argument("-o", "--output", type=Path, required=True)

    tune = sub.add_parser("fine-tune", help="start, follow, list, cancel fine-tuning jobs, download adapters")
    tune_sub = sub.add_subparsers(tune, dest="action", required=True)
    create = tune_sub.add_parser("create", help="start a fine-tuning job (a local training file is uploaded first)")
    create.add_argument("--model", required=True)
    create.add_argument("--training-file", required=True, help="a file id, or a local JSONL path to upload")
    create.add_argument("--validation-file", help="a file id, or a local JSONL path to upload")
    create.add_argument("--epochs", type=int)
    create.add_argument("--batch-size", type=int)
    create.add_argument("--learning-rate-multiplier", type=float)
    create.add_argument("--suffix")
    create.add_argument("--max-steps", type=int, help="extension: stop after this many optimizer steps")
    create.add_argument("--follow", action="store_true", help="then follow it until it ends")
    follow = tune_sub.add_parser("follow", help="a progress bar (step, loss, ETA) until the job ends")
    follow.add_argument("job_id")
    tune_sub.add_parser("list", help="the tenant's fine-tuning jobs")
    cancel = tune_sub.add_parser("cancel", help="cancel a job")
    cancel.add_argument("job_id")
    adapter = tune_sub.add_parser("download-adapter", help="the trained adapter as a zip of a PEFT directory")
    adapter.add_argument("job_id")
    adapter.add_argument("-o", "--output", type=Path, required=True)

    batch = sub.add_parser("batch", help="submit, follow, list, cancel batches, download their outputs")
    batch_sub = sub.add_subparsers(batch, dest="action", required=True)
    submit = batch_sub.add_parser("submit", help="upload a batch input file and start the batch")
    submit.add_argument("path", type=Path)
    submit.add_argument("--endpoint", default="/v1/chat/completions",
                        choices=["/v1/chat/completions", "/v1/completions", "/v1/responses"])
    submit.add_argument("--follow", action="store_true", help="then follow it until it ends")
    batch_follow = batch_sub.add_parser("follow", help="a progress bar until the batch ends")
    batch_follow.add_argument("batch_id")
    batch_sub.add_parser("list", help="the tenant's batches")
    batch_cancel = batch_sub.add_parser("cancel", help="cancel a batch")
    batch_cancel.add_argument("batch_id")
    batch_download = batch_sub.add_parser("download", help="the output and error files into a directory")
    batch_download.add_argument("batch_id")
    batch_download.add_argument("-o", "--output", type=Path, required=True, help="a directory")

    sub.add_parser("models", help="base models and the tenant's fine-tuned models")
    sub.add_parser("workers", help="live worker nodes, their devices and jobs")
    return parser


class Session:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=2, timeout=300)
        self.http = httpx.Client(base_url=str(self.client.base_url), timeout=300,
                                 headers={"Authorization": f"Bearer {self.client.api_key}"})

    def show(self, obj, table: Table | None = None) -> None:
        if self.args.json:
            print(json.dumps(obj.model_dump() if hasattr(obj, "model_dump") else obj, indent=2))
        elif table is not None:
            console.print(table)

    def file_id(self, value: str | None, purpose: str) -> str | None:
        """A file id as it is, or a local path uploaded first."""
        if value is None or not Path(value).is_file():
            return value
        uploaded = self.client.files.create(file=Path(value), purpose=purpose)
        if not self.args.json:
            console.print(f"uploaded {value} as {uploaded.id}")
        return uploaded.id

    def events(self, path: str):
        """A job's events as the server sends them (SSE), oldest first, until the job ends."""
        with self.http.stream("GET", path, params={"stream": "true"}) as response:
            if response.status_code != 200:
                response.read()
                raise openai.APIStatusError(response.text, response=response, body=None)
            data: list[str] = []
            for line in response.iter_lines():
                if line.startswith("data:"):
                    data.append(line[5:].strip())
                elif not line and data:
                    yield json.loads("\n".join(data))
                    data = []


def _table(title: str, columns: list[str], rows: list[list]) -> Table:
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*["" if v is None else str(v) for v in row])
    return table


def _when(seconds: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds)) if seconds else ""


def _done(s: Session, obj: dict, message: str) -> None:
    if s.args.json:
        s.show(obj)
    else:
        console.print(message)


def cmd_files(s: Session) -> int:
    a = s.args
    if a.action == "upload":
        uploaded = s.client.files.create(file=a.path, purpose=a.purpose)
        s.show(uploaded, _table("file", ["id", "filename", "bytes"],
                                [[uploaded.id, uploaded.filename, uploaded.bytes]]))
    elif a.action == "list":
        page = s.client.files.list()
        s.show(page, _table("files", ["id", "filename", "purpose", "bytes", "created"],
                            [[f.id, f.filename, f.purpose, f.bytes, _when(f.created_at)] for f in page.data]))
    else:
        a.output.write_bytes(s.client.files.content(a.file_id).read())
        _done(s, {"file_id": a.file_id, "path": str(a.output)}, f"wrote {a.output}")
    return 0


def follow_job(s: Session, job_id: str) -> int:
    """Progress from the job's metrics events; the job's final state at the end (exit 1 unless it succeeded)."""
    if not s.args.json:
        columns = [TextColumn("[bold]{task.description}"), BarColumn(),
                   TextColumn("step {task.completed}/{task.total}"), TextColumn("{task.fields[loss]}"),
                   TimeRemainingColumn()]
        with Progress(*columns, console=console) as progress:
            task = progress.add_task(job_id, total=None, loss="")
            for event in s.events(f"fine_tuning/jobs/{job_id}/events"):
                data = event.get("data") or {}
                if event["type"] == "metrics":
                    progress.update(task, completed=data["step"], total=data["total_steps"],
                                    loss=f"loss {data['train_loss']:.4f}")
                elif data.get("status"):
                    progress.update(task, description=f"{job_id} {data['status']}")
    else:
        for _ in s.events(f"fine_tuning/jobs/{job_id}/events"):
            pass
    job = s.client.fine_tuning.jobs.retrieve(job_id)
    s.show(job)
    if not s.args.json:
        console.print(f"{job.id} {job.status}" + (f": {job.fine_tuned_model}" if job.fine_tuned_model else "")
                      + (f" ({job.error.message})" if job.error and job.error.message else ""))
    return 0 if job.status == "succeeded" else 1


def cmd_fine_tune(s: Session) -> int:
    a = s.args
    if a.action == "create":
        hyperparameters = {k: v for k, v in (("n_epochs", a.epochs), ("batch_size", a.batch_size),
                                             ("learning_rate_multiplier", a.learning_rate_multiplier)) if v}
        job = s.client.fine_tuning.jobs.create(
            model=a.model, training_file=s.file_id(a.training_file, "fine-tune"),
            validation_file=s.file_id(a.validation_file, "fine-tune") or openai.NOT_GIVEN,
            suffix=a.suffix or openai.NOT_GIVEN, hyperparameters=hyperparameters or openai.NOT_GIVEN,
            extra_body={"max_steps": a.max_steps} if a.max_steps else None)
        if a.follow:
            if not a.json:
                console.print(f"started {job.id}")
            return follow_job(s, job.id)
        s.show(job, _table("fine-tuning job", ["id", "model", "status"], [[job.id, job.model, job.status]]))
    elif a.action == "follow":
        return follow_job(s, a.job_id)
    elif a.action == "list":
        page = s.client.fine_tuning.jobs.list(limit=100)
        s.show(page, _table("fine-tuning jobs", ["id", "model", "status", "fine-tuned model", "created"],
                            [[j.id, j.model, j.status, j.fine_tuned_model, _when(j.created_at)] for j in page.data]))
    elif a.action == "cancel":
        job = s.client.fine_tuning.jobs.cancel(a.job_id)
        s.show(job, _table("fine-tuning job", ["id", "status"], [[job.id, job.status]]))
    else:
        response = s.http.get(f"fine_tuning/jobs/{a.job_id}/adapter")
        if response.status_code != 200:
            errors.print(response.json()["error"]["message"])
            return 1
        a.output.write_bytes(response.content)
        _done(s, {"job_id": a.job_id, "path": str(a.output)}, f"wrote {a.output}")
    return 0


def follow_batch(s: Session, batch_id: str) -> int:
    def poll(update) -> "openai.types.Batch":
        while True:
            batch = s.client.batches.retrieve(batch_id)
            update(batch)
            if batch.status in ENDED:
                return batch
            time.sleep(1)

    if s.args.json:
        batch = poll(lambda _: None)
    else:
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                      TextColumn("{task.completed}/{task.total} requests"), TimeRemainingColumn(),
                      console=console) as progress:
            task = progress.add_task(batch_id, total=None)

            def update(b):
                counts = b.request_counts
                progress.update(task, description=f"{batch_id} {b.status}", total=counts.total or None,
                                completed=counts.completed + counts.failed)
            batch = poll(update)
    s.show(batch)
    if not s.args.json:
        counts = batch.request_counts
        console.print(f"{batch.id} {batch.status}: {counts.completed} completed, {counts.failed} failed "
                      f"(output {batch.output_file_id}, errors {batch.error_file_id})")
    return 0 if batch.status == "completed" else 1


def cmd_batch(s: Session) -> int:
    a = s.args
    if a.action == "submit":
        uploaded = s.client.files.create(file=a.path, purpose="batch")
        batch = s.client.batches.create(input_file_id=uploaded.id, endpoint=a.endpoint, completion_window="24h")
        if a.follow:
            if not a.json:
                console.print(f"started {batch.id}")
            return follow_batch(s, batch.id)
        s.show(batch, _table("batch", ["id", "status"], [[batch.id, batch.status]]))
    elif a.action == "follow":
        return follow_batch(s, a.batch_id)
    elif a.action == "list":
        page = s.client.batches.list(limit=100)
        s.show(page, _table("batches", ["id", "endpoint", "status", "done", "total", "created"],
                            [[b.id, b.endpoint, b.status, b.request_counts.completed + b.request_counts.failed,
                              b.request_counts.total, _when(b.created_at)] for b in page.data]))
    elif a.action == "cancel":
        batch = s.client.batches.cancel(a.batch_id)
        s.show(batch, _table("batch", ["id", "status"], [[batch.id, batch.status]]))
    else:
        batch = s.client.batches.retrieve(a.batch_id)
        a.output.mkdir(parents=True, exist_ok=True)
        written = {}
        for name, file_id in (("output", batch.output_file_id), ("errors", batch.error_file_id)):
            if file_id:
                path = a.output / f"{a.batch_id}.{name}.jsonl"
                path.write_bytes(s.client.files.content(file_id).read())
                written[name] = str(path)
        _done(s, written, "\n".join(f"wrote {p}" for p in written.values()))
    return 0


def cmd_models(s: Session) -> int:
    page = s.client.models.list()
    s.show(page, _table("models", ["id", "owned by", "created"], [[m.id, m.owned_by, _when(m.created)]
                                                                   for m in page.data]))
    return 0


def cmd_workers(s: Session) -> int:
    response = s.http.get("workers")
    response.raise_for_status()
    workers = response.json()
    rows = []
    for w in workers["data"]:
        for d in w.get("devices", []):
            used = d["total_memory"] - d["free_memory"] if d.get("free_memory") is not None else None
            rows.append([w["node"], w["backend"], f"{d['index']}: {d['name']}",
                         f"{(used or 0) / 2**30:.1f} / {d['total_memory'] / 2**30:.1f} GiB",
                         " ".join(w.get("current_jobs") or [])])
    s.show(workers, _table("workers", ["node", "backend", "device", "memory used", "current jobs"], rows))
    return 0


HANDLERS = {"files": cmd_files, "fine-tune": cmd_fine_tune, "batch": cmd_batch, "models": cmd_models,
            "workers": cmd_workers}


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        return HANDLERS[args.command](Session(args))
    except openai.OpenAIError as exc:
        errors.print(f"xpu-jobs: {exc}")
        return 1
