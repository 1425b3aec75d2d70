"""The benchmark script still runs end to end (a smoke run; no timing is asserted)."""

import json
import subprocess
import sys


def test_generation_benchmark_runs_every_kind_of_variant(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "-m", "bench.generation", "--model", "tiny", "--device", "cpu",
                             "--prompts", "8", "--min-prompt", "4", "--max-prompt", "16", "--new-tokens", "4",
                             "--variants",
                             "generate-bs4,generate-static-bs8,engine,engine-stop,engine-stream,engine-sample,"
                             "engine-adapters,engine-live,service",
                             "--chats", "3", "--chat-tokens", "4", "--out", str(out)],
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(out.read_text())
    variants = report["workloads"]["current"]["variants"]
    for name in ("generate-bs4", "generate-static-bs8", "engine", "engine-stop", "engine-stream", "engine-sample",
                 "engine-adapters", "engine-live", "service"):
        assert variants[name]["tokens"] == 8 * 4, (name, variants[name])
    assert variants["engine-live"]["batch_priority"]["tokens"] == 8 * 4
    assert variants["engine-adapters"]["path"] == "native"
    chats = report["chats"]
    assert chats["sequential_tokens"] == chats["concurrent_tokens"] == 3 * 4, chats
    assert chats["latency"]["concurrent"]["latency"]["p50"] > 0


def test_qlora_serving_benchmark_serves_the_adapter_both_ways(tmp_path):
    out = tmp_path / "qlora.json"
    result = subprocess.run([sys.executable, "-m", "bench.qlora_serving", "--model", "tiny", "--device", "cpu",
                             "--steps", "2", "--new-tokens", "3", "--out", str(out)],
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["paths"] == {"4bit": "xpu-jobs-hf-sdpa-bnb-4bit", "unquantized": "xpu-jobs-native-torch"}
    assert report["greedy_served"]["all"]["sequences"] == 16
    assert report["logits_with_adapter"]["all"]["positions"] == 16 * 3


def test_training_benchmark_runs_its_three_variants(tmp_path):
    """A smoke run of bench/training.py (3 steps, 1 timed): the plain script, the job and the packed job all train
    and count the same examples' tokens (packing drops padding only)."""
    out = tmp_path / "training.json"
    result = subprocess.run([sys.executable, "-m", "bench.training", "--model", "tiny", "--device", "cpu",
                             "--steps", "3", "--warmup", "2", "--rounds", "1", "--examples", "24", "--longest", "64",
                             "--out", str(out)], capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"plain", "job", "job_packing"}
    assert all(r["steps_timed"] == 1 and r["tokens_per_second"] > 0 for r in results.values())
    assert results["job"]["tokens_timed"] == results["job_packing"]["tokens_timed"]


def test_detokenize_benchmark_times_both_ways(tmp_path):
    out = tmp_path / "detokenize.json"
    result = subprocess.run([sys.executable, "-m", "bench.detokenize", "--rows", "4", "--new-tokens", "16",
                             "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 2 and all(r["whole_decode_ms_per_step"] > 0 and r["incremental_ms_per_step"] > 0 for r in rows)
