"""The users' commands (`xpu-jobs files|fine-tune|batch|models|workers`) against the running stack, with
OPENAI_BASE_URL / OPENAI_API_KEY, their output checked: human (tables, progress bars) and --json."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import KEY_A
from test_fine_tune_e2e import training_jsonl


def xpu_jobs(api_url: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OPENAI_BASE_URL": api_url + "/v1", "OPENAI_API_KEY": KEY_A, "COLUMNS": "160"}
    done = subprocess.run([sys.executable, "-m", "worker.cli", *args], env=env, capture_output=True, text=True,
                          timeout=300)
    assert not check or done.returncode == 0, done.stdout + done.stderr
    return done


def test_fine_tune_follow_and_download_adapter(api_url, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_bytes(training_jsonl(8))
    run = xpu_jobs(api_url, "fine-tune", "create", "--model", "demo-tiny", "--training-file", str(data),
                   "--epochs", "2", "--batch-size", "4", "--suffix", "cli", "--follow")
    out = run.stdout
    assert "uploaded" in out and "started ftjob-" in out
    assert "step 4/4" in out and "loss " in out  # the progress bar's last state
    job_id = out.split("started ")[1].split()[0]
    assert f"{job_id} succeeded: ft:demo-tiny:cli:{job_id}" in out
    if os.environ.get("XPUJOBS_UI_SCREENSHOTS"):  # the README's example of the command's output
        transcript = f"$ xpu-jobs fine-tune create --model demo-tiny --training-file {data.name} --epochs 2 " \
                     f"--batch-size 4 --suffix cli --follow\n{out}"
        target = Path(os.environ["XPUJOBS_UI_SCREENSHOTS"])
        target.mkdir(parents=True, exist_ok=True)
        (target / "cli.txt").write_text(transcript)

    listed = json.loads(xpu_jobs(api_url, "fine-tune", "list", "--json").stdout)
    assert [j["status"] for j in listed["data"] if j["id"] == job_id] == ["succeeded"]
    adapter = tmp_path / "adapter.zip"
    xpu_jobs(api_url, "--json", "fine-tune", "download-adapter", job_id, "-o", str(adapter))
    assert "adapter_config.json" in zipfile.ZipFile(adapter).namelist()
    models = json.loads(xpu_jobs(api_url, "models", "--json").stdout)
    assert f"ft:demo-tiny:cli:{job_id}" in [m["id"] for m in models["data"]]


def test_batch_submit_follow_download_and_workers(api_url, tmp_path):
    lines = tmp_path / "batch.jsonl"
    lines.write_text("\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                           "body": {"model": "demo-tiny", "max_tokens": 3,
                                                    "messages": [{"role": "user", "content": f"hi {i}"}]}})
                               for i in range(3)))
    batch = json.loads(xpu_jobs(api_url, "batch", "submit", str(lines), "--follow", "--json").stdout)
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 3
    written = json.loads(xpu_jobs(api_url, "batch", "download", batch["id"], "-o", str(tmp_path / "out"),
                                  "--json").stdout)
    outputs = [json.loads(line) for line in open(written["output"])]
    assert sorted(o["custom_id"] for o in outputs) == ["c0", "c1", "c2"]

    human = xpu_jobs(api_url, "batch", "follow", batch["id"]).stdout
    assert "3/3 requests" in human and f"{batch['id']} completed: 3 completed, 0 failed" in human
    workers = xpu_jobs(api_url, "workers").stdout
    assert "wa@" in workers and "wb@" in workers and "GiB" in workers
    files = xpu_jobs(api_url, "files", "list").stdout
    assert "batch.jsonl" in files

    refused = xpu_jobs(api_url, "fine-tune", "cancel", "ftjob-nope", check=False)
    assert refused.returncode == 1 and "No fine-tuning job found" in refused.stderr
