"""pintail.patch with PEFT's LoRA adapters, patched before or after get_peft_model: adapters
on attention, on the MLP and on the output head (the fused loss takes the adapted head
exactly), and the head in modules_to_save; the loss and every trained parameter's gradient
are the unpatched adapted model's, the logits never made."""

import copy

import pytest
import torch

import pintail
from test_transformers import batch, loss_and_grads, tiny_model

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ADAPTED = [(["q_proj", "v_proj"], None), (["gate_proj", "up_proj", "down_proj"], None), (["lm_head"], None),
           (["q_proj", "lm_head"], None), (["q_proj"], ["lm_head"])]


def adapted(model, targets, modules_to_save):
    torch.manual_seed(1)  # B initialised at random too, so that the adapters change the loss
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, modules_to_save=modules_to_save,
                             init_lora_weights=False)
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("order", ["patch first", "patch after"])
@pytest.mark.parametrize("targets, modules_to_save", ADAPTED, ids=lambda v: "+".join(v) if v else "none")
def test_lora_matches_unpatched(targets, modules_to_save, order, device):
    torch.manual_seed(0)
    model = tiny_model("llama").to(device)
    ids, labels = batch(device)
    expected, expected_grads = loss_and_grads(adapted(copy.deepcopy(model), targets, modules_to_save), ids, labels)
    if order == "patch first":
        patched = adapted(pintail.patch(copy.deepcopy(model)), targets, modules_to_save)
    else:
        patched = pintail.patch(adapted(copy.deepcopy(model), targets, modules_to_save))
    got, grads = loss_and_grads(patched, ids, labels)
    assert got.logits is None  # the fused loss ran
    assert torch.allclose(got.loss, expected.loss, rtol=1e-5)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad, expected_grads[name], rtol=1e-4, atol=1e-6), name
    with torch.no_grad():  # evaluation: logits through the adapters, as unpatched
        logits = patched(input_ids=ids).logits
        assert logits.shape[-1] == model.config.vocab_size
