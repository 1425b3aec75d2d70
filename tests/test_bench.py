"""The benchmark script still runs end to end (a smoke run; no timing is asserted)."""

import json
import subprocess
import sys


def test_generation_benchmark_runs_every_kind_of_variant(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "-m", "bench.generation", "--model", "tiny", "--device", "cpu",
                             "--prompts", "8", "--min-prompt", "4", "--max-prompt", "16", "--new-tokens", "4",
                             "--variants", "generate-bs32,engine,service", "--out", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(out.read_text())
    for name in ("generate-bs32", "engine", "service"):
        assert report["variants"][name]["tokens"] == 8 * 4, (name, report["variants"][name])
