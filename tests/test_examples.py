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
