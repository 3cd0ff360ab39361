"""A patched model under transformers.Trainer: gradient accumulation (the loss a sum over
the accumulated batch's tokens, num_items_in_batch), bf16 and gradient checkpointing; the
loss curve is the unpatched model's."""

import copy

import pytest
import torch

import pintail
from test_transformers import VOCAB, tiny_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer's own requirement


def losses(model, device, tmp_path, bf16, checkpointing):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (16, 12), generator=generator)
    rows = [{"input_ids": row, "labels": row.clone()} for row in ids]
    for row in rows[::3]:  # uneven token counts across the accumulated batches
        row["labels"][:4] = -100
    args = transformers.TrainingArguments(
        str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=device.type == "cpu", bf16=bf16,
        gradient_checkpointing=checkpointing, dataloader_num_workers=0, seed=0, data_seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("bf16, checkpointing", [(False, False), (True, True)], ids=["float32", "bf16+checkpointing"])
def test_trainer_loss_curve_matches_unpatched(bf16, checkpointing, device, tmp_path):
    torch.manual_seed(0)
    model = tiny_model("llama").train()
    expected = losses(copy.deepcopy(model), device, tmp_path, bf16, checkpointing)
    got = losses(pintail.patch(copy.deepcopy(model)), device, tmp_path, bf16, checkpointing)
    assert len(got) == len(expected) == 3
    assert torch.allclose(torch.tensor(got), torch.tensor(expected), rtol=1e-3 if bf16 else 1e-5), (got, expected)
