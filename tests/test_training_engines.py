"""The patched model inside PyTorch's training engines, two gloo ranks on this machine:
FSDP2 (`fully_shard`) with every wrapping a user or torchtitan makes (the output head and
the embedding as units of their own included), with mixed precision and with LoRA adapters
on the head and attention (PEFT); DDP; and a tensor-parallel head (the vocabulary split
over the ranks), norms, softmax and the gated activation on DTensor activations (sequence
parallelism). Under FSDP2 and DDP each rank
trains on its own shard of the batch; the loss and every gradient match the unpatched
model's in one process (the mean of the shards' gradients, which both engines produce)."""

import copy
import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import pintail
from conftest import round_bf16_as_the_gpu
from test_parallel import _cpu_ranks, _refuse_reference

transformers = pytest.importorskip("transformers")

WORLD, VOCAB, HIDDEN, SEQ = 2, 256, 64, 9
# FSDP2 wrappings: each names the modules given a unit of their own before the root's
WRAPPINGS = ["root", "layers", "layers+head", "layers+head+embedding", "layers+tied head and embedding"]


def tiny_llama(tied, lora):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    if lora:  # B initialised at random too, so that the adapters change the loss
        import peft
        peft.inject_adapter_in_model(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"],
                                                     init_lora_weights=False), model)
    return model


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
            if p.requires_grad:  # PEFT freezes what its adapters adapt
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


def check_rank(rank, engine, wrapping, tied, mixed_precision, patch_first, lora=False):
    reference = tiny_llama(tied, lora)
    model = copy.deepcopy(reference)
    if patch_first:
        pintail.patch(model)
    if engine == "fsdp":
        model = fsdp_wrapped(model, wrapping, mixed_precision)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    if not patch_first:
        pintail.patch(model.module if engine == "ddp" else model)
    losses, expected_grads = one_process(copy.deepcopy(reference))  # float32, one process
    expected_loss = losses[rank]
    ids, labels = shards()
    output = model(input_ids=ids[rank], labels=labels[rank])
    assert output.logits is None  # the fused loss ran
    output.loss.backward()
    case = (engine, wrapping, tied, mixed_precision, patch_first, lora)
    prefix = "module." if engine == "ddp" else ""
    trained = {name.removeprefix(prefix): full(p.grad).float() for name, p in model.named_parameters()
               if p.requires_grad}
    assert trained.keys() == expected_grads.keys(), case
    if mixed_precision:  # the same engine unpatched sets the bar: bf16 rounding is the policy's, not pintail's
        reference = fsdp_wrapped(reference, wrapping, mixed_precision)
        unpatched = reference(input_ids=ids[rank], labels=labels[rank]).loss
        unpatched.backward()
        unpatched_grads = {name: full(p.grad).float() for name, p in reference.named_parameters() if p.requires_grad}
    else:
        unpatched, unpatched_grads = expected_loss, expected_grads
    error = lambda got, want: (got.float() - want.float()).norm().item()
    floor = 2.0**-8 / 10 if mixed_precision else 1e-5  # a tenth of bf16's rounding, float32 rounding otherwise
    bar = lambda unpatched_error, want: 2 * unpatched_error + floor * want.norm().item() + 1e-7
    assert error(output.loss, expected_loss) <= bar(error(unpatched, expected_loss), expected_loss), \
        (case, output.loss, unpatched, expected_loss)
    for name, got in trained.items():
        want = expected_grads[name]
        assert error(got, want) <= bar(error(unpatched_grads[name], want), want), (case, name, error(got, want))

CASES = [("fsdp", wrapping, wrapping == "layers+tied head and embedding", False, True) for wrapping in WRAPPINGS] + [
    ("fsdp", "layers+head", False, False, False),  # patched after wrapping
    ("fsdp", "layers+head", False, True, True),    # mixed precision: bf16 parameters, float32 reduction
    ("fsdp", "layers", True, True, True),
    ("ddp", None, False, False, True),
    ("ddp", None, True, False, False),
]
if importlib.util.find_spec("peft"):  # LoRA on q_proj and the head, the head its own unit
    CASES += [("fsdp", "layers+head", False, False, True, True), ("fsdp", "layers+head", False, True, False, True)]


def check_tensor_parallel_head(rank):
    """The head split over the vocabulary (ColwiseParallel, its logits' layout Shard(-1)) as in
    the loss_parallel recipe: the fused loss takes this rank's rows and the mesh's group, and
    every rank gets the one-process loss and gradients on the same batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module
    reference = tiny_llama(False, False)
    model = pintail.patch(copy.deepcopy(reference))
    ids, labels = (t[0] for t in shards())
    expected = reference(input_ids=ids, labels=labels).loss
    expected.backward()
    mesh = init_device_mesh("cpu", (WORLD,))
    parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    with loss_parallel():
        output = model(input_ids=ids, labels=labels)
        output.loss.backward()
    assert output.logits is None and model.lm_head.weight.to_local().shape[0] == VOCAB // WORLD
    assert torch.allclose(output.loss, expected, rtol=1e-5), (output.loss, expected)
    for (name, p), want in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(full(p.grad), want.grad, rtol=1e-4, atol=1e-6), name


def check_dtensor_activations(rank):
    """Sequence parallelism's activations, DTensors split over the sequence: the norms, softmax
    and the gated activation run on each rank's rows (a replicated weight's gradient summed over
    the ranks, as DTensor's own ops give it); a layout that splits rows, and the ops that take
    no DTensor, raise errors that name the layout."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (WORLD,))
    generator = torch.Generator().manual_seed(3)
    x, r, g = (torch.randn(2, 6, 16, generator=generator) for _ in range(3))
    w = torch.randn(16, generator=generator)
    upstream = torch.randn(2, 6, 16, generator=generator)
    whole = [t.clone().requires_grad_() for t in (x, r, w)]
    split = [distribute_tensor(t, mesh, [Shard(1)]).requires_grad_() for t in (x, r)] + \
        [distribute_tensor(w, mesh, [Replicate()]).requires_grad_()]
    for ours_of, torch_of in [
        (lambda x, r, w: pintail.rms_norm(x, (16,), w, residual=r)[0], lambda x, r, w: F.rms_norm(x + r, (16,), w)),
        (lambda x, r, w: pintail.layer_norm(x, (16,), w), lambda x, r, w: F.layer_norm(x, (16,), w)),
        (lambda x, r, w: pintail.softmax(x * w, -1), lambda x, r, w: torch.softmax(x * w, -1)),
        (lambda x, r, w: pintail.swiglu(x, r), lambda x, r, w: F.silu(x) * r),
    ]:
        ours = ours_of(*split)
        assert tuple(ours.placements) == (Shard(1),)
        want = torch_of(*whole)
        assert torch.allclose(ours.full_tensor(), want, rtol=1e-5, atol=1e-6)
        got_grads = torch.autograd.grad(ours, split, distribute_tensor(upstream, mesh, [Shard(1)]), allow_unused=True)
        want_grads = torch.autograd.grad(want, whole, upstream, allow_unused=True)
        for got, expected in zip(got_grads, want_grads):
            assert (got is None) == (expected is None)
            if got is not None:
                assert torch.allclose(got.full_tensor(), expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"Shard\(dim=2\).*splits its rows"):
        pintail.rms_norm(distribute_tensor(x, mesh, [Shard(2)]), (16,))
    with pytest.raises(TypeError, match="pintail.rotary: x is a DTensor placed"):
        pintail.rotary(split[0].unsqueeze(2), torch.ones(6, 16), torch.zeros(6, 16))


def _worker(rank, store_path, kernels):
    if kernels:
        _refuse_reference()
        round_bf16_as_the_gpu()  # as conftest does for the test process
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    try:
        for case in CASES:
            check_rank(rank, *case)
        check_tensor_parallel_head(rank)
        check_dtensor_activations(rank)
    finally:
        dist.destroy_process_group()


def test_fsdp2_ddp_and_tensor_parallelism_match_one_process(tmp_path, on_reference, device):
    _cpu_ranks(device)
    mp.spawn(_worker, args=(str(tmp_path / "store"), not on_reference), nprocs=WORLD, join=True)
