"""What every loss checks and how it reduces: the options as torch checks them, class
weights, class-index targets (on the host, or by a kernel the host waits for alone), and
the reduction of row losses to the returned loss."""

import torch

from .._core.launch import launch
from .kernels import target_check_kernel
from .plans import TARGET_CHECK_BLOCK

REDUCTIONS = ("none", "mean", "sum")


def check_loss_options(name, reduction, label_smoothing, z_loss, softcap):
    """The options every cross-entropy entry point takes, checked as torch checks them."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"{name}: {reduction!r} is not a valid value for reduction; expected one of {REDUCTIONS}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{name}: label_smoothing must be between 0.0 and 1.0, got {label_smoothing}")
    if z_loss < 0:
        raise ValueError(f"{name}: z_loss must be >= 0, got {z_loss}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{name}: softcap must be None or > 0, got {softcap}")


def check_class_weight(name, weight, C, device):
    """Class weights: None, or a floating point (C,) tensor on `device`."""
    if weight is None:
        return
    if not isinstance(weight, torch.Tensor) or weight.shape != (C,):
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"{name}: weight must have shape ({C},), one per class, got {shape}")
    if weight.device != device:
        raise ValueError(f"{name}: weight is on {weight.device}, expected input's device {device}")
    if not weight.dtype.is_floating_point:
        raise TypeError(f"{name}: weight must be floating point, got dtype {weight.dtype}")


def check_target_values(target, C, ignore_index, name):
    """Raise on a class index outside [0, C) that is not ignore_index, naming the function
    `name`. This reads the targets on the host: one synchronisation."""
    bad = (target != ignore_index) & ((target < 0) | (target >= C))
    if bad.any():
        position = int(bad.nonzero()[0, 0])
        raise IndexError(f"{name}: target[{position}] = {int(target[position])} is out of "
                         f"bounds: expected a class index in [0, {C}) or ignore_index ({ignore_index})")


class TargetCheck:
    """The eager check of class indices, in two steps around the forward launch: making one
    launches a one-program kernel that counts the bad targets and records an event; finish()
    waits for that event (the forward kernel, launched in between, keeps running) and, if a
    target is bad, names it. On a GPU the kernel writes the count straight into pinned host
    memory (mapped into the GPU's address space), so no copy follows it on the stream."""

    def __init__(self, target, C, ignore_index, name):
        self.target, self.C, self.ignore_index, self.name = target, C, ignore_index, name
        if target.is_cuda:
            self.count = torch.empty(1, dtype=torch.int32, pin_memory=True)
        else:
            self.count = torch.empty(1, dtype=torch.int32, device=target.device)
        launch(target_check_kernel, (1,), target, self.count, target.numel(), C, ignore_index,
               BLOCK=TARGET_CHECK_BLOCK, num_warps=4)
        self.done = None
        if target.is_cuda:
            self.done = torch.cuda.Event()
            self.done.record(torch.cuda.current_stream(target.device))

    def wait(self):
        """Until the kernel is done: also before the pinned count may be freed, since torch's
        host allocator does not know that a kernel writes into it."""
        if self.done is not None:
            self.done.synchronize()

    def bad_targets(self) -> int:
        self.wait()
        return self.count.item()

    def finish(self):
        if self.bad_targets():
            check_target_values(self.target, self.C, self.ignore_index, self.name)


def checked(target_check, compute):
    """compute() between a TargetCheck's launch and its finish (None: no check): the check is
    waited for also when compute raises (its pinned count must outlive the kernel)."""
    try:
        result = compute()
    except BaseException:
        if target_check is not None:
            target_check.wait()
        raise
    if target_check is not None:
        target_check.finish()
    return result


class Reduction:
    """How the per-row losses become the returned loss: none (the target's shape), sum, or
    mean (divided by the kept rows' summed class weights; by the row count for probability
    targets). Also the derivative of that step, for the eager backward."""

    def __init__(self, reduction, target, weight, ignore_index, prob_target, batch_shape, dtype, out_dtype):
        # dtype: the row losses'; out_dtype: the returned loss's
        self.reduction, self.batch_shape, self.dtype, self.out_dtype = reduction, batch_shape, dtype, out_dtype
        self.target, self.weight, self.ignore_index, self.prob_target = target, weight, ignore_index, prob_target
        self._denominator = None

    def denominator(self):
        """The mean's denominator, made when first asked (the eager kernels compute their own)."""
        if self._denominator is None:
            target, kept, dtype = self.target, self.target != self.ignore_index, self.dtype
            if self.prob_target:
                self._denominator = torch.full((), float(target.shape[0]), dtype=dtype, device=target.device)
            elif self.weight is None:
                self._denominator = kept.sum().to(dtype)
            else:
                safe = torch.where(kept, target, 0).long().clamp(0, self.weight.shape[0] - 1)  # bad rows: NaN anyway
                self._denominator = (self.weight.to(dtype)[safe] * kept).sum()
        return self._denominator

    def z_ratio(self, z_loss):
        """What the z-loss factor is multiplied by so that the z-loss term is a mean over the kept
        rows whatever the class weights' scale: (sum of the kept rows' weights / kept rows) for a
        weighted mean of class-index targets (0-d, on the device: no host wait), else None (1)."""
        if not (z_loss > 0 and self.reduction == "mean" and self.weight is not None and not self.prob_target):
            return None
        kept = (self.target != self.ignore_index).sum().to(self.dtype)
        return self.denominator() / kept.clamp_min(1)

    def __call__(self, rows):
        if self.reduction == "none":
            return rows.reshape(self.batch_shape)
        return rows.sum() if self.reduction == "sum" else rows.sum() / self.denominator()

    def row_gradients(self, grad, M):
        if self.reduction == "none":
            return grad.reshape(M)
        return (grad if self.reduction == "sum" else grad / self.denominator()).to(self.dtype).expand(M)


def check_target(name, target, expected_shape, device):
    """Class-index targets of the expected shape on the device."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{name}: target must be a tensor, got {type(target).__name__}")
    if target.dtype not in (torch.int64, torch.int32, torch.uint8):
        raise TypeError(f"{name}: target must hold class indices (int64, int32 or uint8), got {target.dtype}")
    if tuple(target.shape) != tuple(expected_shape):
        raise ValueError(f"{name}: target must have shape {tuple(expected_shape)}, got {tuple(target.shape)}")
    if target.device != device:
        raise ValueError(f"{name}: target is on {target.device}, expected {device}")


def check_head(name, input, linear_weight, linear_bias, input_name="input", weight_name="linear_weight",
               bias_name="linear_bias"):
    """input (*, K) floating point; the head (V, K) with V >= 1 and its bias (V,), in input's
    dtype (or a float32 head under autocast) and on its device."""
    for arg, value in ((input_name, input), (weight_name, linear_weight)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a tensor, got {type(value).__name__}")
    if not input.dtype.is_floating_point or input.dim() == 0:
        raise ValueError(f"{name}: {input_name} must be a floating point tensor of shape (*, hidden), got "
                         f"{input.dtype} of shape {tuple(input.shape)}")
    if linear_weight.dim() != 2 or linear_weight.shape[0] == 0:
        raise ValueError(f"{name}: {weight_name} must have shape (classes, hidden) with at least one class, got "
                         f"{tuple(linear_weight.shape)}")
    if input.shape[-1] != linear_weight.shape[1]:
        raise ValueError(f"{name}: {input_name}'s hidden size {input.shape[-1]} (its last dim) differs from "
                         f"{weight_name}'s {linear_weight.shape[1]} (shape {tuple(linear_weight.shape)})")
    for arg, value in ((weight_name, linear_weight), (bias_name, linear_bias)):
        if value is None:
            continue
        if value.device != input.device:
            raise ValueError(f"{name}: {arg} is on {value.device}, expected {input_name}'s device {input.device}")
        if value.dtype != input.dtype and not (value.dtype == torch.float32 and torch.is_autocast_enabled(
                input.device.type)):
            raise TypeError(f"{name}: {arg} has dtype {value.dtype}, expected {input_name}'s dtype {input.dtype}")
    if linear_bias is not None and tuple(linear_bias.shape) != (linear_weight.shape[0],):
        raise ValueError(f"{name}: {bias_name} must have shape ({linear_weight.shape[0]},), got "
                         f"{tuple(linear_bias.shape)}")


def check_temperature(name, temperature):
    """A softmax temperature: a number > 0."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"{name}: temperature must be a number > 0, got {temperature!r}")
