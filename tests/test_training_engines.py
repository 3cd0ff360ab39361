"""The patched model inside PyTorch's training engines, two gloo ranks on this machine:
FSDP2 (`fully_shard`) with every wrapping a user or torchtitan makes (the output head and
the embedding as units of their own included), with mixed precision, and DDP. Each rank
trains on its own shard of the batch; the loss and every gradient match the unpatched
model's in one process (the mean of the shards' gradients, which both engines produce)."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pintail
from test_parallel import _cpu_ranks, _refuse_reference

transformers = pytest.importorskip("transformers")

WORLD, VOCAB, HIDDEN, SEQ = 2, 256, 64, 9
# FSDP2 wrappings: each names the modules given a unit of their own before the root's
WRAPPINGS = ["root", "layers", "layers+head", "layers+head+embedding", "layers+tied head and embedding"]


def tiny_llama(tied):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def shards():
    """Each rank's (input ids, labels): the same token count a rank, some labels ignored."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (WORLD, 2, SEQ), generator=generator)
    labels = ids.clone()
    labels[:, 0, :3] = -100
    return ids, labels


def one_process(model):
    """The unpatched model in this process: each shard's loss, and the mean of their gradients."""
    ids, labels = shards()
    losses, grads = [], {}
    for rank in range(WORLD):
        model.zero_grad()
        loss = model(input_ids=ids[rank], labels=labels[rank]).loss
        loss.backward()
        losses.append(loss.detach())
        for name, p in model.named_parameters():
            grads[name] = grads.get(name, 0) + p.grad / WORLD
    return losses, grads


def full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def fsdp_wrapped(model, wrapping, mixed_precision):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    options = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} \
        if mixed_precision else {}
    if wrapping != "root":
        for layer in model.model.layers:
            fully_shard(layer, **options)
    if wrapping in ("layers+head", "layers+head+embedding"):
        fully_shard(model.lm_head, **options)
    if wrapping == "layers+head+embedding":
        fully_shard(model.model.embed_tokens, **options)
    if wrapping == "layers+tied head and embedding":  # a shared weight goes in one unit (FSDP's rule)
        fully_shard([model.model.embed_tokens, model.lm_head], **options)
    return fully_shard(model, **options)


def check_rank(rank, engine, wrapping, tied, mixed_precision, patch_first):
    reference = tiny_llama(tied)
    model = copy.deepcopy(reference)
    if patch_first:
        pintail.patch(model)
    if engine == "fsdp":
        model = fsdp_wrapped(model, wrapping, mixed_precision)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    if not patch_first:
        pintail.patch(model.module if engine == "ddp" else model)
    if mixed_precision:  # the same engine unpatched: bf16 rounding is the policy's, not pintail's
        reference = fsdp_wrapped(reference, wrapping, mixed_precision)
        ids, labels = shards()
        expected_loss = reference(input_ids=ids[rank], labels=labels[rank]).loss
        expected_loss.backward()
        expected_grads = {name: full(p.grad) for name, p in reference.named_parameters()}
        rtol, atol = 2e-2, 2e-3
    else:
        losses, expected_grads = one_process(reference)
        expected_loss, rtol, atol = losses[rank], 1e-5, 1e-6
    ids, labels = shards()
    output = model(input_ids=ids[rank], labels=labels[rank])
    assert output.logits is None  # the fused loss ran
    output.loss.backward()
    case = (engine, wrapping, tied, mixed_precision, patch_first)
    assert torch.allclose(output.loss.float(), expected_loss.float(), rtol=rtol), (case, output.loss, expected_loss)
    prefix = "module." if engine == "ddp" else ""
    for name, p in model.named_parameters():
        got, want = full(p.grad).float(), expected_grads[name.removeprefix(prefix)].float()
        assert torch.allclose(got, want, rtol=rtol * 10, atol=atol), (case, name, (got - want).abs().max())


CASES = [("fsdp", wrapping, wrapping == "layers+tied head and embedding", False, True) for wrapping in WRAPPINGS] + [
    ("fsdp", "layers+head", False, False, False),  # patched after wrapping
    ("fsdp", "layers+head", False, True, True),    # mixed precision: bf16 parameters, float32 reduction
    ("fsdp", "layers", True, True, True),
    ("ddp", None, False, False, True),
    ("ddp", None, True, False, False),
]


def _worker(rank, store_path, kernels):
    if kernels:
        _refuse_reference()
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    try:
        for case in CASES:
            check_rank(rank, *case)
    finally:
        dist.destroy_process_group()


def test_fsdp2_and_ddp_match_one_process(tmp_path, on_reference, device):
    _cpu_ranks(device)
    mp.spawn(_worker, args=(str(tmp_path / "store"), not on_reference), nprocs=WORLD, join=True)
