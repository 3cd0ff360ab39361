"""pintail.hub: pintail's layers on Hugging Face's kernel path. A tiny Llama loaded with
from_pretrained(use_kernels=True, kernel_config=pintail.hub.kernel_config()), or kernelized by
the `kernels` package with pintail.hub.layer_mapping(), trains as the same model loaded without
kernels (loss and every gradient) and runs pintail's code for each norm and rotary call, with
no network access."""

import copy
import importlib
import socket

import pytest
import torch

kernels = pytest.importorskip("kernels")
transformers = pytest.importorskip("transformers")

import pintail.hub  # noqa: E402
import pintail.reference  # noqa: E402
from pintail.hub import layers  # noqa: E402

VOCAB, NORMS, ATTENTIONS = 128, 5, 2  # the tiny Llama: 2 layers of 2 norms, a final norm


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """A connection attempt fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=VOCAB)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # not all ones: the weight's place in the rule shows
                p.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    return tmp_path_factory.mktemp("hub")


def load(path, device, **kwargs):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **kwargs)
    return model.to(device)


def bound(model):
    """(norm modules running pintail's RMSNorm, rotary functions running pintail's)."""
    def ours(module, layer):
        return getattr(module.forward, "__func__", None) is layer.forward
    norms = [m for m in model.modules() if isinstance(m, transformers.models.llama.modeling_llama.LlamaRMSNorm)]
    rotary = [f for m in model.modules() for f in getattr(m, "_kernel_funcs", {}).values()]
    assert len(norms) == NORMS and len(rotary) == ATTENTIONS
    return sum(ours(m, layers.RMSNorm) for m in norms), sum(ours(f, layers.ApplyRotaryPosEmb) for f in rotary)


def record_pintail(monkeypatch):
    """(op, kernel) of each pintail kernel launched, or (None, function) of each call of pintail's
    torch reference (its path on a CPU without Triton's interpreter)."""
    calls = []
    for op in ("norm", "rotary"):
        api = importlib.import_module(f"pintail.{op}.api")

        def launch(kernel, grid, *args, real=api.launch, op=op, **kwargs):
            calls.append((op, kernel.__name__))
            real(kernel, grid, *args, **kwargs)
        monkeypatch.setattr(api, "launch", launch)
    for name in ("norm_forward", "norm_backward", "rotary"):
        def call(*args, real=getattr(pintail.reference, name), name=name, **kwargs):
            calls.append((None, name))
            return real(*args, **kwargs)
        monkeypatch.setattr(pintail.reference, name, call)
    return calls


def loss_and_grads(model, device):
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 9), device=device)
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def assert_trains_as(ours, plain, device, on_reference, monkeypatch):
    expected, expected_grads = loss_and_grads(plain, device)
    calls = record_pintail(monkeypatch)
    loss, grads = loss_and_grads(ours, device)
    torch.testing.assert_close(loss, expected)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], msg=lambda m: f"{name}: {m}")
    if on_reference:
        assert sorted(calls) == sorted([(None, "norm_forward")] * NORMS + [(None, "norm_backward")] * NORMS
                                       + [(None, "rotary")] * 2 * 2 * ATTENTIONS)  # q and k, each way
    else:
        kinds = [(op, kernel.split("_")[1]) for op, kernel in calls]  # _forward_rows_kernel: forward
        assert kinds.count(("norm", "forward")) == kinds.count(("norm", "backward")) == NORMS, calls
        assert kinds.count(("rotary", "rotary")) == 2 * ATTENTIONS, calls  # q and k in one launch, each way


def test_from_pretrained_trains_as_without_kernels(checkpoint, repository, device, on_reference, monkeypatch):
    plain = load(checkpoint, device, use_kernels=False).train()
    ours = load(checkpoint, device, use_kernels=True, kernel_config=pintail.hub.kernel_config(root=repository))
    assert bound(plain) == (0, 0)
    assert not ours.training and bound(ours) == (NORMS, ATTENTIONS)  # loaded for inference
    ours.train()  # kernelized again, for training
    assert ours.kernels_mode == kernels.Mode.TRAINING and bound(ours) == (NORMS, ATTENTIONS)
    assert_trains_as(ours, plain, device, on_reference, monkeypatch)


@pytest.mark.parametrize("compiled", [False, True])
def test_kernelize_with_layer_mapping(checkpoint, repository, device, on_reference, monkeypatch, compiled):
    """kernels' own path; compiled: Mode.TORCH_COMPILE, then torch.compile(fullgraph=True)."""
    plain = load(checkpoint, device, use_kernels=False).train()
    ours = load(checkpoint, device, use_kernels=False).train()
    mode = kernels.Mode.TRAINING | kernels.Mode.TORCH_COMPILE if compiled else kernels.Mode.TRAINING
    with kernels.use_kernel_mapping(pintail.hub.layer_mapping(root=repository), inherit_mapping=False):
        kernels.kernelize(ours, mode=mode, device=device.type)
    assert bound(ours) == (NORMS, ATTENTIONS)
    if compiled:  # aot_eager: the graph without inductor's code generation (slow on a CPU)
        ours.compile(fullgraph=True, backend="aot_eager" if device.type == "cpu" else "inductor")
    assert_trains_as(ours, plain, device, on_reference, monkeypatch)


@pytest.mark.parametrize("family, marked", [("phi3", ["RMSNorm"]), ("gemma", ["rotary_pos_emb"]), ("gpt2", [])])
def test_families_marking_fewer_layers(family, marked, repository, tmp_path, device):
    """Phi-3 marks only its norm, Gemma only its rotary function, GPT-2 neither (which raises)."""
    small = {"gpt2": dict(n_embd=64, n_layer=1, n_head=4)}.get(family, dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, pad_token_id=0))
    config = transformers.AutoConfig.for_model(family, vocab_size=VOCAB, **small)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    if not marked:
        with pytest.raises(ValueError, match="pintail.hub: GPT2LMHeadModel marks none of"):
            load(tmp_path, device, use_kernels=True, kernel_config=pintail.hub.kernel_config(root=repository))
        return
    model = load(tmp_path, device, use_kernels=True, kernel_config=pintail.hub.kernel_config(root=repository))
    modules = [*model.modules(), *(f for m in model.modules() for f in getattr(m, "_kernel_funcs", {}).values())]
    ours = (layers.RMSNorm.forward, layers.ApplyRotaryPosEmb.forward)
    assert {m.kernel_layer_name for m in modules if getattr(m.forward, "__func__", None) in ours} == set(marked)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_dtypes_as_llama(repository, device, weight_dtype):
    """bfloat16 input: the output in the dtype Llama's rule gives it (float32 with a float32 weight),
    and its values: with a float32 weight, the product of the rounded normalised row."""
    original = transformers.models.llama.modeling_llama.LlamaRMSNorm(64, eps=1e-5).to(device, weight_dtype)
    with torch.no_grad():
        original.weight.uniform_(0.5, 1.5)
    ours = copy.deepcopy(original)
    with kernels.use_kernel_mapping(pintail.hub.layer_mapping(["RMSNorm"], root=repository), inherit_mapping=False):
        kernels.kernelize(ours, mode=kernels.Mode.INFERENCE, device=device.type)
    x = torch.randn(3, 7, 64, device=device, dtype=torch.bfloat16)
    got, expected = ours(x), original(x)
    assert got.dtype == expected.dtype
    # bfloat16 weight: Llama rounds twice (normalised(x), then the product), pintail once. Float32
    # weight: both round normalised(x) to bfloat16 first; a sum of squares in another order may
    # move an entry that sits on a rounding boundary by one bfloat16 step, no more
    torch.testing.assert_close(got, expected, rtol=1.6e-2, atol=1e-5)
    if weight_dtype == torch.float32:
        apart = (got - expected).abs() > 1e-6 * expected.abs()
        assert apart.float().mean() <= 0.01, apart.sum()


def test_rotary_of_another_form_runs_the_models_own(repository, device, monkeypatch):
    """gpt-oss's apply_rotary_pos_emb (cos and sin half the head wide) keeps its torch code."""
    original = importlib.import_module("transformers.models.gpt_oss.modeling_gpt_oss").apply_rotary_pos_emb

    @transformers.integrations.use_kernelized_func(original)
    class Attention(torch.nn.Module):
        def forward(self, q, k, cos, sin):
            return original(q, k, cos, sin)

    attention = Attention()
    with kernels.use_kernel_mapping(pintail.hub.layer_mapping(["rotary_pos_emb"], root=repository),
                                    inherit_mapping=False):
        kernels.kernelize(attention, mode=kernels.Mode.TRAINING, device=device.type)
    assert next(iter(attention._kernel_funcs.values())).forward.__func__ is layers.ApplyRotaryPosEmb.forward
    q, k = torch.randn(2, 4, 9, 16, device=device), torch.randn(2, 2, 9, 16, device=device)
    cos, sin = torch.randn(2, 9, 8, device=device), torch.randn(2, 9, 8, device=device)
    calls = record_pintail(monkeypatch)
    for got, expected in zip(attention(q, k, cos, sin), original(q, k, cos, sin)):
        torch.testing.assert_close(got, expected)
    assert calls == []


def test_repository_layout(tmp_path):
    """What `kernels` loads: build/torch-universal/ with metadata.json and an __init__.py whose
    `layers` are pintail.hub.layers; the same path again on a second call."""
    path = pintail.hub.repository(tmp_path)
    assert pintail.hub.repository(tmp_path) == path
    assert sorted(p.name for p in (path / "build" / "torch-universal").iterdir()) == ["__init__.py", "metadata.json"]
    module = kernels.get_local_kernel(path)
    assert module.layers is layers
