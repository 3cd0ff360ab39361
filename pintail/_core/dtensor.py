"""DTensor arguments (torch.distributed.tensor: tensor and sequence parallelism). A row-wise
op runs on each rank's shard where every row is whole on it; other layouts, and the ops that
take no DTensor, raise an error that names the layout."""

import torch


def is_dtensor(t) -> bool:
    """Whether t is a DTensor (without importing torch.distributed where nothing is one)."""
    return isinstance(t, torch.Tensor) and type(t).__name__ == "DTensor" and hasattr(t, "placements")


def refuse_dtensors(name, **tensors):
    """A clear error for an op that takes no DTensor: which argument, its layout, what to pass."""
    for label, t in tensors.items():
        if is_dtensor(t):
            raise TypeError(f"{name}: {label} is a DTensor placed {tuple(t.placements)} on a mesh of shape "
                            f"{tuple(t.device_mesh.shape)}; this op takes plain tensors: pass each rank's "
                            f"{label}.to_local() (the vocabulary-parallel losses take process_group)")


def vocabulary_shard(name, input, weight, bias):
    """A head whose weight is a DTensor split over the vocabulary (tensor parallelism's
    ColwiseParallel): the whole input, this rank's rows of the weight (and bias) and the mesh's
    process group, for a loss's vocabulary-parallel path (no logits gathered)."""
    from torch.distributed.tensor import Shard
    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise NotImplementedError(f"{name}: linear_weight is a DTensor placed {tuple(weight.placements)} on a "
                                  f"{mesh.ndim}-D mesh; a head takes (Shard(0),) on a 1-D mesh (ColwiseParallel "
                                  f"over the vocabulary)")
    input = input.full_tensor() if is_dtensor(input) else input
    bias = bias.to_local() if is_dtensor(bias) else bias
    return input, weight.to_local(), bias, mesh.get_group()


def local_rows(name, fn, input, row_dims, same_layout=(), replicated=()):
    """fn(input, *same_layout, *replicated) on each rank's local shards, its output(s) DTensors
    placed as `input`. The layout must leave each row whole on a rank: no placement shards one
    of `row_dims` (the dims an op reduces over) or is Partial. `same_layout`: tensors placed as
    input (a residual); `replicated`: parameters Replicate on the same mesh (a norm's weight),
    whose gradient on each rank is then a partial sum (Partial), as DTensor's own ops give it."""
    from torch.distributed.tensor import DTensor, Partial

    def layout(t):
        return f"{tuple(t.placements)} on a mesh of shape {tuple(t.device_mesh.shape)}" if is_dtensor(t) \
            else "a plain tensor"

    if not is_dtensor(input):
        raise TypeError(f"{name}: input is a plain tensor beside DTensor arguments; pass a DTensor input, "
                        f"or each rank's local tensors")
    mesh, placements = input.device_mesh, tuple(input.placements)
    dims = {d % input.dim() for d in row_dims}
    if any(p.is_partial() or (p.is_shard() and p.dim % input.dim() in dims) for p in placements):
        raise ValueError(f"{name}: input is a DTensor placed {layout(input)}, which splits its rows (dims "
                         f"{sorted(dims)}) or leaves them partial sums; pintail takes each row whole on a rank: "
                         f"redistribute it, e.g. to Shard(0), or Shard(1) over the sequence")
    local = [input.to_local()]
    for label, t in same_layout:
        if t is not None and (not is_dtensor(t) or tuple(t.placements) != placements or t.device_mesh != mesh):
            raise ValueError(f"{name}: {label} must be placed as input ({layout(input)}), got {layout(t)}")
        local.append(t.to_local() if t is not None else None)
    for label, t in replicated:
        if t is not None and (not is_dtensor(t) or t.device_mesh != mesh
                              or not all(p.is_replicate() for p in t.placements)):
            raise ValueError(f"{name}: {label} must be a DTensor Replicate on input's mesh, got {layout(t)}")
        local.append(t.to_local(grad_placements=[Partial()] * mesh.ndim) if t is not None else None)
    out = fn(*local)
    sharded = {p.dim % input.dim() for p in placements if p.is_shard()}

    def wrap(y):  # a sharded dim keeps input's global size; the others are whole on each rank
        shape = torch.Size(input.shape[d] if d in sharded else y.shape[d] for d in range(y.dim()))
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(y, mesh, placements, run_check=False, shape=shape, stride=stride)

    return tuple(wrap(y) for y in out) if isinstance(out, tuple) else wrap(out)
