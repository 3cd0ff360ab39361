"""pintail.patch on a tiny random model of every family in pintail.transformers.FAMILIES
(tests/family_models.py builds them): patched against unpatched in float32 on one batch with
ignored labels (the loss and every parameter's gradient), pintail's kernels launched, the
state dict and generate() unchanged, the summary the family's entry; vision-language models
also with images. A family not in the registry is patched by structure, with its summary."""

import copy
import importlib
import re
import warnings

import pytest
import torch

import pintail

pytest.importorskip("transformers")
from family_models import FAMILY_TYPES, is_vision_language, tiny_inputs, tiny_model  # noqa: E402

from pintail.transformers import FAMILIES  # noqa: E402

OPS = {"norms": "norm", "rotary": "rotary", "mlp": "gated", "residual": "norm"}


def record_launches(monkeypatch):
    """The op packages whose kernels launch from now on."""
    launched = set()
    for module in ("norm.api", "rotary.api", "_loss.chunks", "cross_entropy.api", "gated.api"):
        api = importlib.import_module(f"pintail.{module}")
        real = api.launch

        def recording(kernel, grid, *args, real=real, op=module.split(".")[0], **kwargs):
            launched.add(op)
            real(kernel, grid, *args, **kwargs)
        monkeypatch.setattr(api, "launch", recording)
    return launched


def loss_and_grads(model, inputs):
    torch.manual_seed(0)  # the same dropout masks in both models (GPT-2 trains with dropout)
    model.zero_grad()
    output = model(**inputs)
    output.loss.backward()
    return output.loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_step(model, patched, inputs):
    want, want_grads = loss_and_grads(model, inputs)
    got, grads = loss_and_grads(patched, inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        scale = want_grads[name].abs().max().item()
        # summed in another order: float32 rounding of terms up to the largest entry's size
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-4 * scale + 1e-9, msg=name)


def assert_summary(summary, entry):
    assert {part: value for part, value in summary.items() if part not in ("torch", "loss", "joined")} == \
        {part: value for part, value in entry.items() if part not in ("torch", "loss")}
    assert (summary["loss"] or "").split(",")[0] == (entry["loss"] or "")
    assert set(summary["torch"]) == set(entry["torch"])


def test_registry_covers_every_built_family():
    assert set(FAMILY_TYPES) <= set(FAMILIES), sorted(set(FAMILY_TYPES) - set(FAMILIES))


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_family_matches_unpatched(model_type, on_reference, monkeypatch):
    model = tiny_model(model_type)
    patched = copy.deepcopy(model)
    state = {name: t.clone() for name, t in patched.state_dict().items()}
    if FAMILIES[model_type]["torch"]:  # what stays torch's is named
        with pytest.warns(UserWarning, match="left to torch: " + re.escape(FAMILIES[model_type]["torch"][0])):
            pintail.patch(patched)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            pintail.patch(patched)
    assert_summary(patched.pintail_summary, FAMILIES[model_type])
    after = patched.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[name], t) for name, t in state.items())
    launched = record_launches(monkeypatch)
    assert_same_step(model, patched, tiny_inputs(model_type, model))
    if not on_reference:
        summary = FAMILIES[model_type]
        wanted = {OPS[part] for part in OPS if summary[part]} | ({"_loss"} if summary["loss"] else set())
        assert wanted <= launched, (wanted, launched)
    if is_vision_language(model_type):
        assert_same_step(model, patched, tiny_inputs(model_type, model, images=True))
    ids = tiny_inputs(model_type, model)["input_ids"][:, :4]
    model.eval(), patched.eval()
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=3, do_sample=False)
        got = patched.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, want)


def test_unknown_family_patched_by_structure(monkeypatch):
    """A model_type pintail has no entry for: its parts are found by structure, verified, and
    named in a warning and the summary; strict=True raises where a part stays torch's."""
    monkeypatch.delitem(FAMILIES, "llama4")
    model = tiny_model("llama4")
    with pytest.warns(UserWarning, match="not in pintail's families.*left to torch.*Llama4TextExperts"):
        pintail.patch(copy.deepcopy(model))
    with pytest.raises(RuntimeError, match="left to torch"):
        pintail.patch(copy.deepcopy(model), strict=True)
    monkeypatch.delitem(FAMILIES, "llama")
    llama = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # every part found: nothing to warn about
        patched = pintail.patch(copy.deepcopy(llama), strict=True)
    assert patched.pintail_summary["rotary"] == {"apply_rotary_pos_emb": "half"}
    assert_same_step(llama, patched, tiny_inputs("llama", llama))


def test_registered_family_that_changed(monkeypatch):
    """A family whose code no longer has what its entry says (a transformers release that
    changed it): a warning names the difference; strict=True raises before anything changes."""
    monkeypatch.setitem(FAMILIES, "llama", {**FAMILIES["llama"], "norms": {"LlamaRMSNorm": "one_plus_weight"}})
    model = tiny_model("llama")
    with pytest.raises(RuntimeError, match="differs from pintail's entry.*LlamaRMSNorm"):
        pintail.patch(model, strict=True)
    assert "forward" not in model.model.norm.__dict__ and not hasattr(model, "pintail_summary")
    with pytest.warns(UserWarning, match="differs from pintail's entry.*LlamaRMSNorm"):
        pintail.patch(model)
    assert model.pintail_summary["norms"] == {"LlamaRMSNorm": "cast_then_weight"}  # what it is, verified


def test_rotary_attribute_keeps_its_kind():
    """The patch leaves the family's rotary attribute of the kind transformers made it (a
    function, or with the `kernels` package a module its hub decorators check), so a model of
    the family built later still loads."""
    modeling = importlib.import_module("transformers.models.gpt_oss.modeling_gpt_oss")
    kind = type(modeling.apply_rotary_pos_emb)
    pintail.patch(tiny_model("gpt_oss"))
    assert type(modeling.apply_rotary_pos_emb) is kind
    tiny_model("gpt_oss")
