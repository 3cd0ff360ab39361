"""Train a randomly initialised Hugging Face causal LM with and without pintail.patch.

The corpus is this repository's own text (its Python sources and Markdown), read as bytes:
no download, no tokenizer. Every run (--providers: torch, compile, pintail, pintail+compile,
liger) starts from the same weights and sees the same batches; each step prints its loss,
tokens per second and peak GPU memory, then a summary table (median step after --warmup
steps) and (with matplotlib) a plot of the loss curves.

    python examples/train_causal_lm.py --model llama --steps 20             # tiny, CPU or GPU
    python examples/train_causal_lm.py --trainer --accumulate 2 --checkpointing   # through transformers.Trainer
    TRITON_INTERPRET=1 python examples/train_causal_lm.py --steps 5         # kernels on a CPU
    python examples/train_causal_lm.py --model llama --width 1b --batch 8 --seq 2048 --dtype bf16 \
        --steps 25 --warmup 5 --providers torch,compile,pintail,pintail+compile,liger
"""

import argparse
import copy
import os
import pathlib
import time

import torch

import pintail

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "gemma2", "gemma3", "gpt_neox", "gpt2")


def config(family, width):
    """A transformers config: `tiny` (2 layers, hidden 64) or `1b` (Llama-3.2-1B's sizes)."""
    import transformers
    if width == "tiny":
        sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
    else:
        sizes = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8)
    head_dim = sizes["hidden_size"] // sizes["num_attention_heads"]
    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=sizes["vocab_size"], n_embd=sizes["hidden_size"],
                                       n_layer=sizes["num_hidden_layers"], n_head=sizes["num_attention_heads"],
                                       n_positions=4096, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if family == "gpt_neox":
        sizes.pop("num_key_value_heads")
        return transformers.GPTNeoXConfig(**sizes, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                    "partial_rotary_factor": 0.25})
    extra = {"gemma2": dict(head_dim=head_dim, final_logit_softcapping=30.0, query_pre_attn_scalar=head_dim),
             "gemma3": dict(head_dim=head_dim, final_logit_softcapping=30.0, query_pre_attn_scalar=head_dim),
             "qwen3": dict(head_dim=head_dim), "phi3": dict(pad_token_id=0)}.get(family, {})
    name = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
            "phi3": "Phi3Config", "olmo2": "Olmo2Config", "gemma2": "Gemma2Config",
            "gemma3": "Gemma3TextConfig"}[family]
    return getattr(transformers, name)(**sizes, **extra)


def model_for(family, width, dtype, device):
    import transformers
    cfg = config(family, width)
    if family == "gemma3":
        model = transformers.Gemma3ForCausalLM(cfg)
    else:
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model.to(device=device, dtype=dtype)


def corpus(device):
    """The repository's text as one long tensor of bytes."""
    files = sorted(ROOT.glob("pintail/**/*.py")) + sorted(ROOT.glob("*.md")) + sorted(ROOT.glob("docs/*.md"))
    data = b"\n".join(f.read_bytes() for f in files)
    return torch.tensor(list(data), dtype=torch.long, device=device)


def batches(text, batch, seq, steps, seed):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, text.numel() - seq - 1, (batch,), generator=generator)
        yield torch.stack([text[s:s + seq] for s in starts.tolist()])


def prepared(model, provider):
    """The model as `provider` runs it."""
    if provider in ("pintail", "pintail+compile"):
        pintail.patch(model)
    if provider == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        _apply_liger_kernel_to_instance(model=model)
    if provider.endswith("compile"):
        return torch.compile(model)
    return model


def train_with_trainer(model, text, args, label):
    """The same steps through transformers.Trainer (needs accelerate): its AdamW, its loss
    logging, --accumulate micro-batches a step, --bf16-mixed and --checkpointing as its flags."""
    import transformers

    class StepClock(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            if text.is_cuda:
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            if text.is_cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - self.start)

    seconds = []
    steps = args.steps * args.accumulate
    rows = [{"input_ids": ids, "labels": ids} for batch in batches(text.cpu(), args.batch, args.seq, steps, args.seed)
            for ids in batch]
    options = transformers.TrainingArguments(
        f"bench-out/trainer-{label}", per_device_train_batch_size=args.batch, max_steps=args.steps,
        gradient_accumulation_steps=args.accumulate, learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=not text.is_cuda,
        bf16=args.bf16_mixed, gradient_checkpointing=args.checkpointing, dataloader_num_workers=0, seed=args.seed)
    trainer = transformers.Trainer(model=model, args=options, train_dataset=rows, callbacks=[StepClock()])
    if text.is_cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    for step, (value, step_seconds) in enumerate(zip(losses, seconds)):
        rate = args.batch * args.accumulate * args.seq / step_seconds
        print(f"{label:>15} step {step:3d}: loss {value:.4f}, {rate:,.0f} tokens/s (Trainer)", flush=True)
    return losses, seconds, torch.cuda.max_memory_allocated() / 2**30 if text.is_cuda else None


def train(model, text, args, label):
    if args.trainer:
        return train_with_trainer(model, text, args, label)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    cuda = text.is_cuda
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses, seconds = [], []
    for step, ids in enumerate(batches(text, args.batch, args.seq, args.steps, args.seed)):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()  # waits for the step
        seconds.append(time.perf_counter() - start)
        rate = ids.numel() / seconds[-1]
        losses.append(value)
        peak = f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if cuda else "-"
        print(f"{label:>15} step {step:3d}: loss {value:.4f}, {rate:,.0f} tokens/s, peak {peak}", flush=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return losses, seconds, peak


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama", choices=FAMILIES)
    p.add_argument("--width", default="tiny", choices=("tiny", "1b"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median step time")
    p.add_argument("--providers", default="torch,pintail",
                   help="comma-separated: torch, compile, pintail, pintail+compile, liger (default %(default)s)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--trainer", action="store_true", help="train through transformers.Trainer (needs accelerate)")
    p.add_argument("--accumulate", type=int, default=1, help="--trainer: micro-batches of gradient accumulation a step")
    p.add_argument("--bf16-mixed", action="store_true", help="--trainer: its bf16 flag (autocast over float32 weights)")
    p.add_argument("--checkpointing", action="store_true", help="--trainer: gradient checkpointing")
    p.add_argument("--plot", default="bench-out/train_causal_lm.png",
                   help="loss curves (needs matplotlib; default under bench-out/, which git ignores)")
    args = p.parse_args(argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    text = corpus(args.device)
    torch.manual_seed(args.seed)
    model = model_for(args.model, args.width, dtype, args.device)
    runs = {}
    for provider in args.providers.split(","):
        runs[provider] = train(prepared(copy.deepcopy(model), provider), text, args, provider)  # same start
        if args.device == "cuda":
            torch.cuda.empty_cache()
    warm = slice(min(args.warmup, args.steps - 1), None)  # steps after compilation and warm-up
    tokens = args.batch * args.seq * (args.accumulate if args.trainer else 1)
    print(f"\n{args.model} ({args.width}, {args.dtype}), {args.batch} x {args.seq} tokens, {args.steps} steps, "
          f"{args.device}{', ' + torch.cuda.get_device_name() if args.device == 'cuda' else ''}\n")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        print("pintail's kernels ran in the Triton interpreter (TRITON_INTERPRET=1): its tokens/s time the\n"
              "interpreter, a check of the kernels, not their speed (on a GPU they run compiled).\n")
    print(f"| run | first loss | last loss | tokens/s (median step after {warm.start}) | vs {next(iter(runs))} | "
          f"peak memory |\n|---|---|---|---|---|---|")
    base = None
    for label, (losses, seconds, peak) in runs.items():
        tail = sorted(seconds[warm])
        rate = tokens / tail[len(tail) // 2]
        base = base or rate
        print(f"| {label} | {losses[0]:.4f} | {losses[-1]:.4f} | {rate:,.0f} | {rate / base:.2f}x | "
              f"{f'{peak:.2f} GiB' if peak is not None else '-'} |")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    for label, (losses, _, _) in runs.items():
        plt.plot(losses, label=label)
    plt.xlabel("step")
    plt.ylabel("loss")
    plt.title(f"{args.model} ({args.width})")
    plt.legend()
    os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
    plt.savefig(args.plot, dpi=100)
    print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
