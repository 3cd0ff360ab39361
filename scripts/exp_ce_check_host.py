"""Experiment for the next GPU session: the host time of cross-entropy's default (checked)
forward call at V = 32768, where the call is host-bound (bench run 12: 0.26 of copy checked,
0.47 unchecked, for 73 us of kernels; quack's anchor 0.68).

The check (pintail/cross_entropy.py, _TargetCheck) makes, per call: a one-element device
tensor, a launch of the one-program check kernel, a one-element pinned host tensor, an
async copy into it, a CUDA event and its record; after the forward's launches it waits for
the event and reads the count. Here a variant keeps the device count, the pinned count and
the event per (thread, device) and reuses them: the call before has waited for its event
before reading, so the next copy into the pinned word cannot overlap a read. Only the
allocations and the event's creation go; the launch, the copy, the record and the wait stay.

Per round, alternating in one process: the library's checked call, the kept-buffers
variant and the unchecked call (check_target=False), each as host time per call (a loop of
calls, one synchronisation) and as the protocol's fraction of copy (do_bench median, L2
flushed). Predicted: 10-25 us less host time per checked call, ~0.03-0.06 of copy at
V = 32768; no change past V = 128256 (not host-bound there).

    python scripts/exp_ce_check_host.py
"""

import importlib
import threading

import torch
from measure import copy_bandwidth, host_us, time_ms

import pintail

ce = importlib.import_module("pintail.cross_entropy")
launch = importlib.import_module("pintail._launch").launch
LibraryTargetCheck = ce._TargetCheck
kept = threading.local()


class KeptTargetCheck(LibraryTargetCheck):
    """_TargetCheck with its device count, pinned count and event made once per thread and
    device (GPU only: this experiment runs there)."""

    def __init__(self, target, C, ignore_index):
        self.target, self.C, self.ignore_index = target, C, ignore_index
        buffers = kept.__dict__.setdefault("by_device", {})
        index = target.device.index
        if index not in buffers:
            buffers[index] = (torch.empty(1, dtype=torch.int32, device=target.device),
                              torch.empty(1, dtype=torch.int32, pin_memory=True), torch.cuda.Event())
        device_count, self.count, self.done = buffers[index]
        launch(ce._target_check_kernel, (1,), target, device_count, target.numel(), C, ignore_index,
               BLOCK=ce.TARGET_CHECK_BLOCK, num_warps=4)
        self.count.copy_(device_count, non_blocking=True)
        self.done.record(torch.cuda.current_stream(target.device))


def check(variant=None):
    """A variant of the check (KeptTargetCheck unless given) raises on a bad target and agrees
    with the library on good ones, in turns."""
    x = torch.randn(64, 1000, device="cuda")
    t = torch.randint(0, 1000, (64,), device="cuda")
    want = pintail.cross_entropy(x, t)
    ce._TargetCheck = variant or KeptTargetCheck
    try:
        for round_ in range(3):
            assert torch.equal(pintail.cross_entropy(x, t), want)
            bad = t.clone()
            bad[17 + round_] = 1000 + round_
            try:
                pintail.cross_entropy(x, bad)
                raise AssertionError("a bad target did not raise")
            except IndexError as e:
                assert f"target[{17 + round_}]" in str(e), e
    finally:
        ce._TargetCheck = LibraryTargetCheck
    print(f"{(variant or KeptTargetCheck).__name__}: same losses, bad targets raise", flush=True)


def main():
    check()
    copy_bw = copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    for V in (32768, 131072):
        M = 4096
        x = torch.randn(M, V, device="cuda", dtype=torch.bfloat16)
        t = torch.randint(0, V, (M,), device="cuda")
        nbytes = M * V * 2
        variants = {"library checked": (LibraryTargetCheck, True), "kept checked": (KeptTargetCheck, True),
                    "unchecked": (LibraryTargetCheck, False)}
        for round_ in range(3):
            for name, (check_class, checked) in variants.items():
                ce._TargetCheck = check_class
                call = lambda: pintail.cross_entropy(x, t, check_target=checked)
                us = host_us(call)
                ms = time_ms(call)
                print(f"V={V} round {round_} {name}: host {us:.1f} us per call, {ms:.4f} ms, "
                      f"{nbytes / (ms * 1e-3) / copy_bw:.3f} of copy", flush=True)
        ce._TargetCheck = LibraryTargetCheck
        del x


if __name__ == "__main__":
    main()
