"""The README's quick start runs as pasted: the CPU block on a CPU (the interpreter's
kernels, or plain torch on the reference path, as the environment says), the GPU block on a
GPU; each prints the fused loss beside the composition's."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def blocks(heading):
    section = README.read_text().split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def importable():
    """The environment with this checkout's pintail importable, installed or not."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(README.parent), os.environ.get("PYTHONPATH")])))


def run(block, tmp_path):
    """What the block prints, as numbers, run in a fresh interpreter from the README's folder."""
    script = tmp_path / "block.py"
    script.write_text(block)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=importable(),
                          cwd=README.parent, timeout=600)
    assert done.returncode == 0, done.stderr
    return [float(v) for v in done.stdout.split()]


@pytest.mark.uses_reference
def test_quick_start_runs_as_pasted(device, tmp_path):
    gpu_block, cpu_block = blocks("Quick start")
    fused, composed = run(gpu_block if device.type == "cuda" else cpu_block, tmp_path)
    assert abs(fused - composed) <= (1e-2 if device.type == "cuda" else 1e-4) * abs(composed)  # bf16 logits on the GPU


@pytest.mark.uses_reference
def test_log_probs_and_distillation_block_runs_as_pasted(tmp_path):
    """The RL and distillation snippet (on the GPU where there is one, else the CPU): the
    fused KL beside torch's kl_div of the same rows."""
    (block,) = blocks("Log-probabilities, entropy and distillation from hidden states")
    fused, composed = run(block, tmp_path)
    assert abs(fused - composed) <= 1e-4 * abs(composed)


@pytest.mark.uses_reference
def test_preference_losses_block_runs_as_pasted(tmp_path):
    """The DPO snippet: the fused loss beside the composition on the whole logits."""
    (block,) = blocks("Preference and policy losses")
    fused, composed = run(block, tmp_path)
    assert abs(fused - composed) <= 1e-4 * abs(composed)


def test_family_table_is_the_registry():
    """The README's table of model families is what tools/family_table.py prints from
    pintail.transformers.FAMILIES."""
    pytest.importorskip("transformers")
    tool = pathlib.Path(__file__).resolve().parent.parent / "tools" / "family_table.py"
    result = subprocess.run([sys.executable, str(tool), "--check"], capture_output=True, text=True, env=importable())
    assert result.returncode == 0, result.stdout + result.stderr
