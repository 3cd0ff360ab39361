"""examples/train_causal_lm.py runs as the README says, and its two runs agree."""

import importlib.util
import os
import pathlib

import pytest

pytest.importorskip("transformers")
EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_causal_lm.py"


@pytest.mark.parametrize("mode", [[], ["--trainer", "--accumulate", "2"]], ids=["loop", "trainer"])
def test_train_causal_lm_runs(mode, device, tmp_path, capsys):
    if mode:
        pytest.importorskip("accelerate")
    spec = importlib.util.spec_from_file_location("train_causal_lm", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--model", "qwen3", "--steps", "3", "--batch", "2", "--seq", "16", "--device", device.type,
                         "--plot", str(tmp_path / "loss.png"), *mode]) == 0
    out = capsys.readouterr().out
    # the interpreter's tokens/s are said to be the interpreter's
    assert ("ran in the Triton interpreter" in out) == (os.environ.get("TRITON_INTERPRET") == "1"), out
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| torch") or line.startswith("| pintail")]
    assert len(rows) == 2
    first_losses, last_losses = {float(r[2]) for r in rows}, {float(r[3]) for r in rows}
    assert len(first_losses) == 1 and len(last_losses) == 1, rows  # the same to 4 decimals


def test_train_bench_rows(device, tmp_path):
    """tools/train_bench.py runs each provider in a process of its own and writes one JSON row
    each, whose losses after the same steps from the same weights agree."""
    import json
    import subprocess
    import sys

    tool = EXAMPLE.parents[1] / "tools" / "train_bench.py"
    out = tmp_path / "train.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(EXAMPLE.parents[1]),
                                                                    os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(tool), "--width", "tiny", "--device", device.type, "--models",
                           "llama-3.2-1b", "--providers", "eager,pintail", "--dtype", "fp32", "--batch", "2", "--seq",
                           "16", "--steps", "2", "--warmup", "1", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["provider"] for row in rows] == ["eager", "pintail"]
    assert {row["model"] for row in rows} == {"llama-3.2-1b-tiny"} and all(row["tokens_per_s"] > 0 for row in rows)
    assert abs(rows[0]["loss"] - rows[1]["loss"]) <= 1e-3, rows
