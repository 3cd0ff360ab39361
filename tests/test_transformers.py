"""pintail.patch on tiny, randomly initialised Hugging Face models of every supported family:
patched against unpatched on the same batch (loss and every parameter's gradient), with
pintail's kernels counted; training steps, gradient accumulation, packed sequences,
generate(), evaluation with logits, and the loud failures."""

import copy
import importlib

import pytest
import torch

import pintail

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN = 256, 64


def tiny_model(family, dtype=torch.float32):
    small = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    config = {
        "llama": lambda: transformers.LlamaConfig(**small),
        "mistral": lambda: transformers.MistralConfig(**small),
        "qwen2": lambda: transformers.Qwen2Config(**small),
        "qwen3": lambda: transformers.Qwen3Config(**small, head_dim=16),
        "phi3": lambda: transformers.Phi3Config(**small, pad_token_id=0),
        "olmo2": lambda: transformers.Olmo2Config(**small),
        "gemma2": lambda: transformers.Gemma2Config(**small, head_dim=16, final_logit_softcapping=5.0,
                                                    query_pre_attn_scalar=16),
        "gemma3": lambda: transformers.Gemma3TextConfig(**small, head_dim=16, final_logit_softcapping=5.0,
                                                        query_pre_attn_scalar=16),
        "gpt_neox": lambda: transformers.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
        "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=64),
    }[family]()
    classes = {"gemma3": transformers.Gemma3ForCausalLM, "gpt2": transformers.GPT2LMHeadModel}
    model = (classes.get(family) or transformers.AutoModelForCausalLM.from_config)(config)
    return model.to(dtype).eval()  # no dropout (GPT-2's): the same batch gives the same loss


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "gemma2", "gemma3", "gpt_neox", "gpt2"]


def batch(device, B=2, S=9):
    ids = torch.randint(0, VOCAB, (B, S), device=device)
    labels = ids.clone()
    labels[0, :3] = -100  # padding
    return ids, labels


def record_launches(monkeypatch):
    """(op package, kernel name) of each pintail kernel launched from now on."""
    launched = []
    for module in ("norm.api", "rotary.api", "_loss.chunks", "_loss.checks", "cross_entropy.api", "gated.api"):
        api = importlib.import_module(f"pintail.{module}")
        real = api.launch

        def recording(kernel, grid, *args, real=real, op=module.split(".")[0], **kwargs):
            launched.append((op, kernel.__name__))
            real(kernel, grid, *args, **kwargs)
        monkeypatch.setattr(api, "launch", recording)
    return launched


def loss_and_grads(model, ids, labels, **kwargs):
    model.zero_grad()
    output = model(input_ids=ids, labels=labels, **kwargs)
    output.loss.backward()
    return output, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_unpatched(family, device, on_reference, monkeypatch):
    torch.manual_seed(0)
    model = tiny_model(family).to(device)
    patched = pintail.patch(copy.deepcopy(model))
    ids, labels = batch(device)
    expected, expected_grads = loss_and_grads(model, ids, labels)
    launched = record_launches(monkeypatch)
    got, grads = loss_and_grads(patched, ids, labels)
    assert got.logits is None and got.loss.dtype == torch.float32
    assert torch.allclose(got.loss, expected.loss, rtol=1e-5, atol=1e-6), (got.loss, expected.loss)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        scale = expected_grads[name].abs().max().item()
        assert torch.allclose(grad, expected_grads[name], rtol=1e-4, atol=1e-5 * scale), name
    if not on_reference:
        ops = {op for op, _ in launched}
        # _loss: linear_cross_entropy's chunk kernels and its target check
        expected_ops = {"norm", "_loss", "rotary", "gated"}
        expected_ops -= {"gpt2": {"rotary", "gated"}, "gpt_neox": {"gated"}}.get(family, set())
        assert ops == expected_ops, ops
        assert {"fold_kernel", "gradient_kernel", "target_check_kernel"} <= {kernel for _, kernel in launched}
    assert patched.state_dict().keys() == model.state_dict().keys()


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_training_curves_match(family, device):
    """Ten AdamW steps from the same weights give the same losses, patched or not."""
    torch.manual_seed(1)
    model = tiny_model(family).to(device)
    patched = pintail.patch(copy.deepcopy(model))
    ids, labels = batch(device)
    curves = []
    for m in (model, patched):
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        for _ in range(10):
            optimizer.zero_grad()
            loss = m(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        curves.append(losses)
    assert curves[0][-1] < curves[0][0]
    assert torch.allclose(torch.tensor(curves[1]), torch.tensor(curves[0]), rtol=1e-4), curves


def test_gradient_accumulation_and_packing(device):
    """num_items_in_batch: a sum divided by it, as transformers; packed sequences with
    position_ids restarting at each document."""
    torch.manual_seed(2)
    model = tiny_model("llama").to(device)
    patched = pintail.patch(copy.deepcopy(model))
    ids, labels = batch(device, B=1, S=12)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]], device=device)
    items = torch.tensor(17, device=device)
    for kwargs in (dict(num_items_in_batch=items), dict(position_ids=positions)):
        expected, expected_grads = loss_and_grads(model, ids, labels, **kwargs)
        got, grads = loss_and_grads(patched, ids, labels, **kwargs)
        assert torch.allclose(got.loss, expected.loss, rtol=1e-5), kwargs
        for name, grad in grads.items():
            assert torch.allclose(grad, expected_grads[name], rtol=1e-4, atol=1e-6), (name, kwargs)


def test_logits_without_labels_or_gradients(device):
    """generate() and evaluation get the logits as before; with labels and no gradients the
    loss comes with them."""
    torch.manual_seed(3)
    model = tiny_model("qwen3").to(device)
    patched = pintail.patch(copy.deepcopy(model))
    ids, labels = batch(device)
    with torch.no_grad():
        expected = model(input_ids=ids, labels=labels)
        got = patched(input_ids=ids, labels=labels)
        assert torch.allclose(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
        assert torch.allclose(got.loss, expected.loss, rtol=1e-5)
        generated = patched.generate(ids[:1, :4], max_new_tokens=5, do_sample=False)
        assert torch.equal(generated, model.generate(ids[:1, :4], max_new_tokens=5, do_sample=False))


@pytest.mark.kernels_only
def test_unpatched_model_of_the_same_family_keeps_torch(device, monkeypatch):
    """Patching one model leaves another of its family on torch's rotary."""
    model = tiny_model("llama").to(device)
    pintail.patch(tiny_model("llama").to(device))
    launched = record_launches(monkeypatch)
    ids, labels = batch(device)
    model(input_ids=ids, labels=labels).loss.backward()
    assert launched == []


def test_bfloat16_within_bf16_tolerance(device):
    torch.manual_seed(4)
    model = tiny_model("llama", torch.bfloat16).to(device)
    patched = pintail.patch(copy.deepcopy(model))
    ids, labels = batch(device)
    expected, _ = loss_and_grads(model, ids, labels)
    got, _ = loss_and_grads(patched, ids, labels)
    assert got.loss.dtype == expected.loss.dtype == torch.float32
    assert abs(got.loss.item() - expected.loss.item()) < 2e-2 * expected.loss.item()


def test_unknown_activation_stays_on_torch(device):
    """A gated MLP whose activation pintail has no kernel for (found by running it, whatever
    the config says) is left alone, with a warning."""
    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.mlp.act_fn = transformers.activations.ACT2FN["relu2"]
    mlp_forward = model.model.layers[0].mlp.forward
    with pytest.warns(UserWarning, match="mlp: expected {'LlamaMLP': 'silu separate'}, found {}"):
        pintail.patch(model)
    assert model.pintail_summary["torch"]["mlp LlamaMLP"] == "its activation has no pintail kernel"
    assert model.model.layers[0].mlp.forward == mlp_forward


def test_loud_failures_and_repeat(device, monkeypatch):
    with pytest.raises(TypeError, match="expected a Hugging Face transformers model, got Linear"):
        pintail.patch(torch.nn.Linear(2, 2))
    model = tiny_model("llama")
    forward = model.forward
    monkeypatch.setitem(pintail.transformers.FAMILIES, "llama",
                        {**pintail.transformers.FAMILIES["llama"], "norms": {"NoSuchNorm": "cast_then_weight"}})
    with pytest.raises(RuntimeError, match=r"LlamaForCausalLM: differs from pintail's entry for llama: .*NoSuchNorm"):
        pintail.patch(model, strict=True)
    assert model.forward == forward and not hasattr(model, "_pintail_patched")  # nothing changed
    monkeypatch.undo()
    pintail.patch(model)
    once = model.forward
    pintail.patch(model)
    assert model.forward is once


@pytest.mark.parametrize("mode", ["checkpointing", "reentrant checkpointing", "compile"])
def test_checkpointing_and_compile(mode, device, on_reference, monkeypatch):
    """Gradient checkpointing (non-reentrant and reentrant: the fused residual and norm
    layers recomputed) and torch.compile(model) (aot_eager: the traced graphs) keep the
    patched model's loss and gradients."""
    torch.manual_seed(5)
    model = tiny_model("llama").to(device)
    patched = pintail.patch(copy.deepcopy(model))
    ids, labels = batch(device)
    expected, expected_grads = loss_and_grads(model, ids, labels)
    if mode.endswith("checkpointing"):
        patched.train()
        reentrant = mode.startswith("reentrant")
        patched.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        run = patched
    else:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        run = torch.compile(patched, backend="aot_eager")
    patched.zero_grad()
    launched = record_launches(monkeypatch)
    got = run(input_ids=ids, labels=labels)
    got.loss.backward()
    if mode.endswith("checkpointing") and not on_reference:  # each layer's fused norms ran again in the backward
        forwards = [name for op, name in launched if op == "norm" and "forward" in name]
        assert len(forwards) == 2 * 2 * 2 + 1, forwards  # 2 layers x 2 norms, twice; the final norm once
    if mode == "compile":  # pintail's ops trace: no graph break (transformers' own code makes none here)
        assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert torch.allclose(got.loss, expected.loss, rtol=1e-5)
    for name, p in patched.named_parameters():
        assert torch.allclose(p.grad, expected_grads[name], rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_autocast(family, device):
    """Under autocast (float32 weights, bf16 compute) the patched model's loss is the
    unpatched one's within bf16 rounding, and every parameter gets a float32 gradient."""
    torch.manual_seed(6)
    model = tiny_model(family).to(device)
    patched = pintail.patch(copy.deepcopy(model))
    ids, labels = batch(device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        expected = model(input_ids=ids, labels=labels).loss
        got = patched(input_ids=ids, labels=labels).loss
    assert abs(got.item() - expected.item()) < 1e-2 * expected.item()
    got.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in patched.parameters())


def test_cuda_graph_training_step(device):
    """A patched Llama's forward and backward captured in a CUDA graph (no host
    synchronisation anywhere in pintail's path) replay to the eager step's loss and
    gradients, on a new batch copied into the captured one."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    torch.manual_seed(5)
    model = pintail.patch(tiny_model("llama").to(device))
    ids, labels = batch(device)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)

    def step():
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile the kernels and warm the allocator outside the capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    for p in model.parameters():
        p.grad = None
    with torch.cuda.graph(graph):
        captured_loss = step()
    new_ids, new_labels = batch(device)
    ids.copy_(new_ids)
    labels.copy_(new_labels)
    for p in model.parameters():
        p.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    replayed = {name: p.grad.clone() for name, p in model.named_parameters()}
    expected, expected_grads = loss_and_grads(model, new_ids, new_labels)
    assert torch.allclose(captured_loss, expected.loss, rtol=1e-5, atol=1e-6)
    for name, grad in expected_grads.items():
        assert torch.allclose(replayed[name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item()), name


class _CountAdds(torch.utils._python_dispatch.TorchDispatchMode):
    """How many elementwise additions of two tensors of the hidden states' shape run."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ("add", "add_") and all(
                isinstance(a, torch.Tensor) and tuple(a.shape) == self.shape for a in args[:2]):
            self.count += 1
        return out


@pytest.mark.parametrize("family", ["llama", "phi3", "gemma2"])
def test_residual_adds_run_in_the_norms(family, device):
    """With residual=True each decoder layer's add before a norm runs in the norm's kernel:
    forward and backward of a patched model run at least two fewer additions of
    hidden-state-sized tensors a layer (the add, and autograd's sum of the residual stream's
    gradients) than with residual=False, with the same loss and gradients."""
    torch.manual_seed(6)
    model = tiny_model(family).to(device)
    ids, labels = batch(device)
    counts, results = [], []
    for residual in (False, True):
        patched = pintail.patch(copy.deepcopy(model), residual=residual)
        with _CountAdds((*ids.shape, HIDDEN)) as adds:
            results.append(loss_and_grads(patched, ids, labels))
        counts.append(adds.count)
    layers = model.config.num_hidden_layers
    assert counts[1] <= counts[0] - 2 * layers, counts
    (plain, plain_grads), (fused, fused_grads) = results
    assert torch.allclose(fused.loss, plain.loss, rtol=1e-5, atol=1e-6)
    for name, grad in plain_grads.items():
        assert torch.allclose(fused_grads[name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item()), name


def test_layer_of_another_form_stays_with_a_warning(device, monkeypatch):
    """A decoder layer whose forward is not the form pintail fuses keeps its own forward (a
    warning names it); the rest of the patch applies."""
    layers = importlib.import_module("pintail.transformers.layers")
    monkeypatch.setitem(layers.LAYER_FORMS, "pre", ["return hidden_states"])
    model = tiny_model("llama").to(device)
    with pytest.warns(UserWarning, match="residual: expected {'LlamaDecoderLayer': 'pre'}, found {}"):
        pintail.patch(model)
    assert "residual LlamaDecoderLayer" in model.pintail_summary["torch"]
    layer = model.model.layers[0]
    assert "forward" not in vars(layer) and "forward" in vars(layer.post_attention_layernorm)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_llama_norm_rule_with_a_wider_weight(weight_dtype, device):
    """bf16 activations beside a float32 weight (autocast over float32 weights): Llama's rule
    rounds the normalised row to bf16 before the weight multiplies it, and so does the patched
    norm; the output float32, as Llama's. With a bf16 weight, within one bf16 step."""
    model = pintail.patch(tiny_model("llama").to(device))
    norm = model.model.norm.to(weight_dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 7, HIDDEN, device=device, dtype=torch.bfloat16)
    got = norm(x)
    expected = type(norm).forward(norm, x)  # the class's own forward: torch's
    assert got.dtype == expected.dtype == torch.promote_types(weight_dtype, torch.bfloat16)
    torch.testing.assert_close(got, expected, rtol=1.6e-2, atol=1e-5)
    if weight_dtype == torch.float32:  # a sum in another order may move a boundary entry one step
        apart = (got - expected).abs() > 1e-6 * expected.abs()
        assert apart.float().mean() <= 0.01, apart.sum()
