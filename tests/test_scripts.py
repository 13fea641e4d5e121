"""The torchrun-launched scripts run and check themselves (each exits non-zero when its
compiled results differ from eager DTensor's)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _torchrun(script: str, *args: str, ranks: int = 2) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    done = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node", str(ranks), str(SCRIPTS / script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_demo_prints_the_program_and_matches_eager():
    out = _torchrun("demo.py")
    assert "def computation(" in out and "reduce_scatter" in out
    assert "equal to eager DTensor's" in out


def test_training_losses_match_eager_with_processes_set_up_by_accelerate():
    out = _torchrun("train.py", "--steps", "4", "--accelerate")
    assert "processes set up by Accelerate: DistributedType.MULTI_CPU" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 4
    for _, eager, compiled, _ in rows:
        assert abs(float(eager) - float(compiled)) <= 1e-4 * abs(float(eager))
    assert "compiled 1 time(s)" in out


def test_gpu_check_script_dry_run_on_cpu_with_the_reference_backend():
    """scripts/gpu_check.py as the GPU runs it, on CPU through the reference backend: its
    comparisons and timings run here, so the GPU's few minutes go to nvFuser itself."""
    out = _torchrun(
        "gpu_check.py",
        *("--device", "cpu", "--fusion-backend", "reference", "--op-table-seconds", "15", "--no-inductor"),
        *("--batch", "2", "--seq", "32", "--dim", "64", "--heads", "4", "--hidden", "128", "--iters", "3"),
        ranks=1,
    )
    assert " 0 differ from eager" in out and "block checks: 0 differ from eager" in out
    assert "dtcompile nvFuser" in out and "fusions of" in out


def test_inference_benchmark_generates_eager_tokens_and_its_results_plot(tmp_path):
    results = tmp_path / "results.json"
    out = _torchrun(
        "benchmark_inference.py",
        *("--mode", "eager", "dtcompile", "--layers", "1", "--hidden-size", "64", "--heads", "4"),
        *("--kv-heads", "2", "--vocab", "128", "--input-length", "8", "--output-length", "6"),
        *("--num-iterations", "1", "--warmup-iterations", "0", "--json", str(results)),
    )
    assert "TBOT eager/x" in out and "per decode call prologue" in out and "target 2x" in out
    report = json.loads(results.read_text())
    assert report["setup"]["ranks"] == 2 and report["setup"]["kv_cache"] == "static"
    compiled = report["results"]["dtcompile"]
    assert compiled["tokens_equal_eager"] and report["results"]["eager"]["tokens_equal_eager"]
    assert compiled["compilations"] == 2  # the prefill, and every decode step
    assert compiled["prologue_us"] > 0 and compiled["epilogue_us"] > 0 and compiled["tbot_ms"] > 0

    plot = tmp_path / "plot.png"
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "plot_inference.py"), str(results), "--plot", str(plot)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "| 2 ranks (cpu) | dtcompile |" in done.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("training", [False, True], ids=["without gradients", "training"])
def test_compile_depth_benchmark_replays_the_traced_program(training):
    """scripts/bench_compile_depth.py exits non-zero where replayed blocks record another
    program than tracing every block, or a result (a gradient) differs from eager's."""
    args = ["--layers", "1", "3", "--cache", "constant values", "--repeat", "1"] + ["--training"] * training
    out = _torchrun("bench_compile_depth.py", *args)
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["1", "3"]
    assert "blocks called" in out and "blocks replayed" in out and "every block traced" in out
