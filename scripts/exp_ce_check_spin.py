"""Experiment: cross-entropy's checked path at V = 32768 waiting for its target check by a
spin on the pinned count instead of `Event.synchronize()` (GPU).

Why: the same code measured the checked forward at 0.35 / 0.59 / 0.67 / 0.73 of copy and
forward+backward at 0.38 / 0.51 / 0.83 / 0.83 in four bench runs (session 13), against
0.58-0.77 / 0.75-0.86 unchecked. The checked call's only host wait is on the check kernel's
event; if its wake-up is what varies, a spin on the count itself (the host sets it to -1
before the launch, the kernel writes a count >= 0 into the pinned word) should take the
checked rows to the unchecked ones and hold them there from round to round. The spin gives
up after 50 ms and waits on the event, so that a kernel that never ran surfaces its error.

Per round, alternating in one process, each variant: host time a call (a loop of calls, one
synchronisation) and the protocol's fraction of copy, forward and forward+backward (the
backward on the calling thread, as the bench). Predicted: spin within 0.02 of unchecked in
every round; the event's rounds spread as in the bench.

Got (session 13, fraction of copy, forward | forward+backward): rounds 1-3 event 0.730-0.735
| 0.844-0.846, spin 0.729-0.733 | 0.844-0.846, unchecked 0.768-0.769 | 0.857-0.858; host
100-110 / 107-111 / 72-74 us a forward call. Round 0 (the first in the process): event 0.729
| 0.589, spin 0.381 | 0.846, unchecked 0.769 | 0.858. So the wait's kind changes nothing;
the spread is one-off slow measurements in a process's first rounds, which the checked
path cannot absorb (it waits every call) and the unchecked one can (it runs ahead).

    python scripts/exp_ce_check_spin.py
"""

import importlib
import time

import torch
from exp_ce_check_host import check
from measure import copy_bandwidth, host_us, time_ms

import pintail

ce = importlib.import_module("pintail.cross_entropy")
EventCheck = ce._TargetCheck
SPIN_LIMIT_S = 0.05


class SpinCheck(EventCheck):
    """_TargetCheck whose wait spins on the pinned count (GPU only: this experiment runs there)."""

    def __init__(self, target, C, ignore_index):
        self.target, self.C, self.ignore_index = target, C, ignore_index
        self.count = torch.full((1,), -1, dtype=torch.int32, pin_memory=True)
        ce.launch(ce._target_check_kernel, (1,), target, self.count, target.numel(), C, ignore_index,
                  BLOCK=ce.TARGET_CHECK_BLOCK, num_warps=4)
        self.done = torch.cuda.Event()
        self.done.record(torch.cuda.current_stream(target.device))

    def wait(self):
        deadline = time.perf_counter() + SPIN_LIMIT_S
        while self.count.item() < 0:
            if time.perf_counter() > deadline:
                break
        self.done.synchronize()  # done by now; after the limit: the kernel's error, if any


def main():
    check(SpinCheck)
    copy_bw = copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    M, V = 4096, 32768
    x = torch.randn(M, V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, V, (M,), device="cuda")
    variants = {"event (library)": (EventCheck, True), "spin": (SpinCheck, True), "unchecked": (EventCheck, False)}
    with torch.autograd.set_multithreading_enabled(False):
        for round_ in range(4):
            for name, (check_class, checked) in variants.items():
                ce._TargetCheck = check_class
                forward = lambda: pintail.cross_entropy(x, t, check_target=checked)
                step = lambda: torch.autograd.grad(pintail.cross_entropy(x, t, check_target=checked), x)
                cells = []
                for label, fn, nbytes in (("fwd", forward, M * V * 2), ("fwd+bwd", step, 3 * M * V * 2)):
                    us = host_us(fn, calls=200)
                    ms = time_ms(fn)
                    cells.append(f"{label} host {us:.0f} us, {nbytes / (ms * 1e-3) / copy_bw:.3f}")
                print(f"round {round_} {name}: " + " | ".join(cells), flush=True)
    ce._TargetCheck = EventCheck


if __name__ == "__main__":
    main()
