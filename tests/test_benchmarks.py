"""The GPU session's scripts must run when a GPU comes: smoke tests of them on the CPU."""
import importlib.util
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_training_quick_runs_every_variant(capsys):
    pytest.importorskip("transformers")
    _load("bench_training").main(["--quick", "--models", "gpt2", "--device", "cpu", "--compile", "gpt2"])
    out = capsys.readouterr().out
    for variant in ("no hooks", "stats every step, jsonl flush/10", "stats every 10th step",
                    "seeds .item() hook", "sync check: skipped (CPU)"):
        assert variant in out


def test_profile_step_quick_runs_both_variants(capsys):
    pytest.importorskip("transformers")
    _load("profile_step").main(["--quick", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "no hooks" in out and "stats every step, jsonl flush/10" in out and "top host ops" in out


def test_gpu_check_script_is_valid_bash_and_refuses_unknown_stages():
    script = ROOT / "scripts" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    bad = subprocess.run(["bash", str(script), "nonsense"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_telemetry_breakdown_runs_every_layer(capsys):
    _load("telemetry_breakdown").main(["--models", "cnn", "--rounds", "1", "--steps", "1"])
    out = capsys.readouterr().out
    for kind in ("bare hook", "hook + op", "stats, jsonl flush/10", "the op itself"):
        assert kind in out


def test_bench_regional_compile_stats_compiles_the_graphs_of_no_hooks(capsys):
    """Six blocks compiled one by one: with stats on every Linear (outputs and gradients)
    the backend compiles as many graphs as without hooks (blocks share them); sessions
    attached again for one step compile nothing after the first."""
    res = _load("bench_regional_compile").main(["--blocks", "6", "--width", "32", "--seq", "8",
                                                "--steps", "2", "--windows", "3"])
    assert res["stats"]["graphs"] == res["no hooks"]["graphs"] <= 2
    assert res["windows"]["graphs_later"] == 0
    assert "no hooks" in capsys.readouterr().out


def test_bench_flops_counts_what_flop_counter_mode_counts(capsys):
    _load("bench_flops").main(["--rounds", "1", "--steps", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if "ms " in line]
    assert len(rows) == 3 and all(row.rstrip().endswith("True") for row in rows), rows
