"""Run the CUDA test suite on a GPU machine, a few test files at a time, saving as it goes.

    python tools/gpu_check.py [--part K/N] [--files a.py,b.py | --exclude c.py] [--workers W] [--sanitize] [--out DIR]
    python tools/gpu_check.py --sanitize --files none

Each costly test file runs in its own pytest, the part's small files in one more (starting
the workers costs ~25 s a pytest): `--device cuda`, W xdist workers, each taking a
contiguous share of the tests so that neighbouring tests, which build the same kernel
variants, compile them once, under a time limit; after each pytest the tool appends to DIR
(default ./gpu-check-out):
  failures.txt  one line per failed test: its id and the first line of its error (written as
                the failures happen, so a pytest stopped by its limit keeps them)
  summary.txt   one line per pytest: passed / failed / errors / skipped counts, seconds, and
                the kernel variants Triton compiled (and their seconds, summed over workers);
                each file's counts under it where it ran several
  junit.tar     the file's junit XML, appended to one archive
so that a run cut off midway still leaves what finished. `--part K/N` takes the K-th of N
parts of the files, balanced by their measured cost, so the suite fits in several calls;
the last part ends with the tests marked `large` (GBs of GPU memory each), one at a time.
`--budget` seconds bound the whole run: each stage gets what is left, so the last stage's
counts are written before a caller's own limit strikes.

--sanitize then runs `python -m pintail.bench --check` (every op's kernels, forward and
backward, at ragged sizes) under `compute-sanitizer --tool memcheck`, its report in
DIR/sanitizer.txt; the tool exits non-zero on any error it reports (`--files none`: the
sanitizer alone).

On a machine without pytest (a bare GPU image), carry its wheels in ./device-wheels and the
tool installs them into /tmp/pintail-site first. To fetch them (Python 3.12, x86-64):
    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux2014_x86_64 -d device-wheels \\
        pytest pluggy iniconfig pytest-xdist execnet
"""

import argparse
import os
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / "device-wheels"
SITE = Path("/tmp/pintail-site")

# Seconds each file took on an H100 with 16 workers and a cold Triton cache (test_norm.py and
# test_softmax.py extrapolated from the share they finished); unlisted: 40. A file under
# ALONE shares one pytest with the part's other small files: each pytest's workers take
# ~25 s to start, more than most small files' tests.
COST = {
    "test_norm.py": 500, "test_softmax.py": 200, "test_cross_entropy.py": 110, "test_compile.py": 90,
    "test_rotary.py": 60, "test_transformers.py": 50, "test_linear_cross_entropy.py": 35,
}
ALONE = 100


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="1/1", help="K/N: run the K-th of N parts of the files")
    parser.add_argument("--files", default="", help="comma-separated test files (default: all)")
    parser.add_argument("--exclude", default="", help="comma-separated test files to leave out of the default")
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1),
                        help="pytest-xdist workers a file (default: the cores, at most 16)")
    parser.add_argument("--timeout", type=int, default=420, help="seconds one pytest may take")
    parser.add_argument("--budget", type=int, default=570, help="seconds the whole run may take")
    parser.add_argument("--out", default=str(ROOT / "gpu-check-out"), help="folder for the results")
    parser.add_argument("--sanitize", action="store_true", help="then the kernel check under compute-sanitizer")
    parser.add_argument("pytest_args", nargs="*", help="more arguments for pytest (after --)")
    return parser.parse_args()


def install_wheels(env):
    """Put pytest and xdist on the path from the carried wheels when the image lacks them."""
    if subprocess.run([sys.executable, "-c", "import pytest, xdist"], env=env,
                      capture_output=True).returncode == 0:
        return env
    wheels = sorted(str(path) for path in WHEELS.glob("*.whl"))
    if not wheels:
        sys.exit(f"pytest or pytest-xdist is missing and {WHEELS} holds no wheels: see --help")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--target", str(SITE), *wheels], check=True)
    return dict(env, PYTHONPATH=os.pathsep.join(filter(None, [str(SITE), env.get("PYTHONPATH")])))


def choose_stages(args):
    """The part's pytest runs: (name, files), the costliest files alone, the small ones together."""
    if args.files == "none":
        return []
    left_out = set(args.exclude.split(","))
    files = [name for name in args.files.split(",") if name] or \
        sorted(path.name for path in (ROOT / "tests").glob("test_*.py") if path.name not in left_out)
    part, parts = (int(number) for number in args.part.split("/"))
    if not 1 <= part <= parts:
        sys.exit(f"--part {args.part}: expected K/N with 1 <= K <= N")
    loads = [[] for _ in range(parts)]  # greedy: the costliest file to the lightest part
    for name in sorted(files, key=lambda name: -COST.get(name, 40)):
        min(loads, key=lambda load: sum(COST.get(n, 40) for n in load)).append(name)
    mine = sorted(loads[part - 1], key=lambda name: -COST.get(name, 40))
    small = [name for name in mine if COST.get(name, 40) < ALONE]
    return [(name, [name]) for name in mine if COST.get(name, 40) >= ALONE] + \
        ([(f"{len(small)} small files" if len(small) > 1 else small[0], small)] if small else [])


def first_line(element):
    text = (element.get("message") or element.text or "").strip()
    return text.splitlines()[0][:300] if text else "(no message)"


def record(out, name, xml_path, seconds, returncode, compiled, progress, failure_log):
    """Append the stage's counts and failures; 1 if anything failed, else 0."""
    counts = dict(passed=0, failed=0, errors=0, skipped=0)
    failures = []
    per_file = {}
    if xml_path.exists():
        for case in ElementTree.parse(xml_path).iter("testcase"):
            test_id = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            file_counts = per_file.setdefault(test_id.split("::")[0], dict(passed=0, failed=0, errors=0, skipped=0))
            outcome = "passed"
            for tag, kind in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
                found = case.find(tag)
                if found is not None:
                    outcome = kind
                    if kind != "skipped":
                        failures.append(f"{test_id}: {first_line(found)}")
                    break
            counts[outcome] += 1
            file_counts[outcome] += 1
        with tarfile.open(out / "junit.tar", "a") as archive:
            archive.add(xml_path, arcname=xml_path.name)
    else:
        failures.append(f"tests/{name}: no junit XML (pytest exit {returncode}: timed out or crashed); "
                        f"the failures it reported as they happened:")
        if failure_log.exists():
            failures.extend(failure_log.read_text(errors="replace").splitlines())
        for mark, kind in ((".", "passed"), ("F", "failed"), ("E", "errors"), ("s", "skipped")):
            counts[kind] = progress.count(mark)  # what pytest's progress line showed before the end
    with open(out / "failures.txt", "a") as stream:
        stream.writelines(line + "\n" for line in failures)
    line = (f"{name:32s} passed {counts['passed']:5d}  failed {counts['failed']:4d}  errors "
            f"{counts['errors']:4d}  skipped {counts['skipped']:4d}  {seconds:6.0f} s  exit {returncode}"
            f"{'  ' + compiled if compiled else ''}")
    if len(per_file) > 1:  # a stage of several files: each one's counts under it
        line += "".join(f"\n  {path.removeprefix('tests/'):30s} passed {c['passed']:5d}  failed {c['failed']:4d}  "
                        f"errors {c['errors']:4d}  skipped {c['skipped']:4d}" for path, c in sorted(per_file.items()))
    with open(out / "summary.txt", "a") as stream:
        stream.write(line + "\n")
    print(line, flush=True)
    return int(bool(failures))


def sanitize(out, seconds):
    command = ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "3", "--print-limit", "50",
               "--log-file", str(out / "sanitizer.txt"), sys.executable, "-m", "pintail.bench", "--check"]
    start = time.time()
    with open(out / "log.txt", "a") as log:
        log.write("\n==== compute-sanitizer memcheck: python -m pintail.bench --check\n")
        log.flush()
        returncode = run_group(command, log, seconds)
    line = (f"{'sanitizer (memcheck)':32s} exit {returncode} (0: no error, every check passed; 3: memcheck "
            f"found errors)  {time.time() - start:6.0f} s")
    with open(out / "summary.txt", "a") as stream:
        stream.write(line + "\n")
    print(line, flush=True)
    return 0 if returncode == 0 else 1


def run_group(command, log, seconds, env=None):
    """Run command (and whatever it starts) for at most `seconds`; its exit code or "timeout"."""
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        return process.wait(timeout=max(seconds, 1))
    except subprocess.TimeoutExpired:  # the xdist workers too: the whole group
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return "timeout"


def main():
    args = parse_args()
    deadline = time.time() + args.budget
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # inductor's compile pool would start a process a core in each of the xdist workers
    # and torch's CPU thread pool one a core: 16 workers x 16 threads oversubscribe the host
    env = install_wheels(dict(os.environ, PYTHONUNBUFFERED="1", TORCHINDUCTOR_COMPILE_THREADS="1",
                              OMP_NUM_THREADS="1"))
    scratch = Path("/tmp/pintail-junit")
    scratch.mkdir(exist_ok=True)
    stages = [(name, [*(f"tests/{file}" for file in files), "-m", "not large", "-n", str(args.workers),
                      "--dist", "worksteal"]) for name, files in choose_stages(args)]
    if args.part.split("/")[0] == args.part.split("/")[1] and not args.files:
        stages.append(("large", ["tests", "-m", "large", "-p", "no:xdist"]))  # GBs each: one at a time
    status = 0
    for name, selection in stages:
        stem = name.removesuffix(".py").replace(" ", "-")
        xml_path = scratch / f"{stem}.xml"
        xml_path.unlink(missing_ok=True)
        output = scratch / f"{stem}.log"
        failure_log = scratch / f"{stem}.failures"
        failure_log.unlink(missing_ok=True)
        env["PINTAIL_FAILURE_LOG"] = str(failure_log)
        command = [sys.executable, "-m", "pytest", *selection, "--device", "cuda", "-o", "addopts=",
                   "-q", "-p", "no:cacheprovider", f"--junitxml={xml_path}", *args.pytest_args]
        start = time.time()
        with open(output, "w") as log:
            returncode = run_group(command, log, min(args.timeout, deadline - start), env)
        text = output.read_text(errors="replace")
        with open(out / "log.txt", "a") as log:
            log.write(f"\n==== {name}\n{text}")
        compiled = [line for line in text.splitlines() if line.startswith("Triton compiled")]
        marks = [line.split(" [")[0] for line in text.splitlines()]
        progress = "".join(mark for mark in marks if mark.strip() and set(mark) <= set(".sFExX"))
        status |= record(out, name, xml_path, time.time() - start, returncode, compiled[-1] if compiled else "",
                         progress, failure_log)
    if args.sanitize:
        status |= sanitize(out, deadline - time.time())
    return status


if __name__ == "__main__":
    sys.exit(main())
