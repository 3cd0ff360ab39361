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


def quick_start_blocks():
    section = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


@pytest.mark.uses_reference
def test_quick_start_runs_as_pasted(device, tmp_path):
    gpu_block, cpu_block = quick_start_blocks()
    script = tmp_path / "quick_start.py"
    script.write_text(gpu_block if device.type == "cuda" else cpu_block)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=dict(os.environ),
                          cwd=README.parent, timeout=600)
    assert done.returncode == 0, done.stderr
    fused, composed = (float(v) for v in done.stdout.split())
    assert abs(fused - composed) <= (1e-2 if device.type == "cuda" else 1e-4) * abs(composed)  # bf16 logits on the GPU
