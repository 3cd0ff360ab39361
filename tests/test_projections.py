"""pintail.patch's joined gate / up projections: one GEMM for both where their weights share
a storage, the parameters, names and state dict unchanged, and the projections run apart
wherever the weights are not joined (moved, cast, or not plain nn.Linears)."""

import copy

import pytest
import torch

import pintail
from helpers import GemmFlops
from test_transformers import batch, tiny_model

transformers = pytest.importorskip("transformers")


def loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def mlp_gemms(model, device):
    """The matrix products of one MLP's forward and backward."""
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 5, mlp.gate_proj.in_features, device=device, requires_grad=True)
    with GemmFlops() as counter:
        mlp(x).sum().backward()
    return counter.calls


def adjacent(mlp):
    gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
    return gate.untyped_storage().data_ptr() == up.untyped_storage().data_ptr() and \
        up.storage_offset() == gate.storage_offset() + gate.numel()


def test_joined_gate_up_is_one_gemm(device):
    model = tiny_model("llama").to(device)
    patched = copy.deepcopy(model)
    state = {name: t.clone() for name, t in patched.state_dict().items()}
    parameters = dict(patched.named_parameters())
    pintail.patch(patched)
    assert patched.pintail_summary["joined"] == {"LlamaMLP": "gate_proj + up_proj"}
    assert all(adjacent(layer.mlp) for layer in patched.model.layers)
    assert dict(patched.named_parameters()) == parameters  # the same Parameter objects
    after = patched.state_dict()
    assert list(after) == list(state) and all(torch.equal(after[name], t) for name, t in state.items())
    ids, labels = batch(device)
    loss, grads = loss_and_grads(model, ids, labels)
    loss_patched, grads_patched = loss_and_grads(patched, ids, labels)
    torch.testing.assert_close(loss_patched, loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_patched[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # forward: gate + up, down; backward: the joined weights', the input's, down's two
    assert (mlp_gemms(model, device), mlp_gemms(patched, device)) == (9, 6)


def test_projections_apart_where_not_joined(device):
    model = tiny_model("llama").to(device)
    ids, labels = batch(device)
    loss, grads = loss_and_grads(model, ids, labels)
    apart = pintail.patch(copy.deepcopy(model), join_projections=False)
    assert apart.pintail_summary["joined"] == {} and not adjacent(apart.model.layers[0].mlp)
    moved = pintail.patch(copy.deepcopy(model)).to(torch.float64).to(torch.float32)  # cast: new storages
    assert not adjacent(moved.model.layers[0].mlp)
    for patched in (apart, moved):
        assert mlp_gemms(patched, device) == 9
        loss_patched, grads_patched = loss_and_grads(patched, ids, labels)
        torch.testing.assert_close(loss_patched, loss, rtol=1e-5, atol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grads_patched[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_joined_model_saves_and_loads(tmp_path, device):
    patched = pintail.patch(tiny_model("llama").to(device))
    patched.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).to(device)
    for name, t in patched.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name


def test_hooked_projection_runs_apart(device):
    """A forward hook added after the patch still sees its module's call."""
    patched = pintail.patch(tiny_model("llama").to(device))
    seen = []
    patched.model.layers[0].mlp.up_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    ids, labels = batch(device)
    patched(input_ids=ids, labels=labels)
    assert seen == [(*ids.shape, patched.config.intermediate_size)]
