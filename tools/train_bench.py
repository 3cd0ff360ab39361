"""Time a training step of real model configurations under each provider, one process each.

    python tools/train_bench.py                                   # the three models, every provider, a GPU
    python tools/train_bench.py --models llama-3.2-1b --providers pintail,liger --out benchmarks/train-h100.jsonl
    python tools/train_bench.py --width tiny --device cpu --providers eager,pintail --steps 3 --warmup 1

Every (model, provider) runs in a process of its own (no cache, allocator or patch carries
over) from the same seed: the same random weights and the same batches of token ids. Steps:
AdamW (fused on a GPU), bf16 weights (--dtype), `--warmup` steps then `--steps` timed ones;
tokens/s of the median timed step, the peak memory, and the loss after the last step (the
providers' losses agree to bf16 rounding when each is right). One JSON line per run is
printed and appended to --out: model, provider, tokens_per_s, peak_gib, gpu, loss. --profile
DIR writes each run's kernels (milliseconds and launches a step, by name) over 2 more steps.

Providers: eager; compile (torch.compile(model)); liger (Liger-Kernel's patches, where
installed); pintail (pintail.patch); pintail+compile; pintail+graphs (pintail.patch, the
forward, backward and optimizer step captured once in a CUDA graph and replayed).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODELS = {  # the configurations of ../shared/BENCHMARKS.md, random weights
    "llama-3.2-1b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                         tie_word_embeddings=True, rope_theta=500000.0)),
    "qwen3-1.7b": ("Qwen3Config", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                       head_dim=128, tie_word_embeddings=True, rope_theta=1000000.0)),
    "gemma-2-2b": ("Gemma2Config", dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                                        num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                                        head_dim=256, query_pre_attn_scalar=256, final_logit_softcapping=30.0,
                                        attn_logit_softcapping=50.0, sliding_window=4096)),
}
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
PROVIDERS = ("eager", "compile", "liger", "pintail", "pintail+compile", "pintail+graphs")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, of: " + ", ".join(MODELS))
    parser.add_argument("--providers", default=",".join(PROVIDERS), help="comma-separated, of: " + ", ".join(PROVIDERS))
    parser.add_argument("--width", default="full", choices=("full", "tiny"), help="tiny: 2 layers of 64, a check")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="", help="JSON lines file to append the rows to")
    parser.add_argument("--patch", default="", metavar="K=V,...",
                        help="keyword arguments for pintail.patch, e.g. join_projections=False")
    parser.add_argument("--profile", default="", help="folder: each run's kernels over 2 more steps, a table a run")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "PROVIDER"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build(model_name, args):
    import torch
    import transformers

    class_name, sizes = MODELS[model_name]
    config = getattr(transformers, class_name)(**(dict(sizes, **TINY) if args.width == "tiny" else sizes))
    torch.manual_seed(0)  # attention as transformers picks it (SDPA; eager for Gemma 2's softcapped scores)
    with torch.device(args.device):  # initialised where it runs: seconds, not a CPU minute for 1B parameters
        model = transformers.AutoModelForCausalLM.from_config(config)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    return model.to(dtype=dtype), config.vocab_size


def prepared(model, provider, patch_options=""):
    import torch

    if provider.startswith("pintail"):
        import pintail
        options = dict(item.split("=") for item in patch_options.split(",") if item)
        pintail.patch(model, **{key: value == "True" for key, value in options.items()})
    if provider == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        _apply_liger_kernel_to_instance(model=model)
    return torch.compile(model) if provider.endswith("compile") else model


def label(model_name, args):
    return model_name + ("-tiny" if args.width == "tiny" else "")


def run_one(model_name, provider, args):
    """One process's run: its JSON row."""
    import torch

    model, vocab = build(model_name, args)
    model = prepared(model, provider, args.patch)
    cuda = args.device == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda, capturable=provider == "pintail+graphs")
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (args.batch, args.seq), generator=generator).to(args.device)
               for _ in range(args.warmup + args.steps)]
    ids = batches[0].clone()

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=provider != "pintail+graphs")
        return loss

    replay = None
    if provider == "pintail+graphs":  # warm on a side stream, then capture one step
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for batch in batches[:args.warmup]:
                ids.copy_(batch)
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        replay = graph.replay
        batches = batches[args.warmup:]
    else:
        for batch in batches[:args.warmup]:
            ids.copy_(batch)
            step()
        batches = batches[args.warmup:]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for batch in batches:
        ids.copy_(batch)
        start = time.perf_counter()
        if replay is not None:
            replay()
            loss = captured
        else:
            loss = step()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    if args.profile and cuda:
        profile(run_again=replay or step, path=os.path.join(args.profile, f"{label(model_name, args)}-{provider}.txt"))
    return {"model": label(model_name, args), "provider": provider,
            "tokens_per_s": round(args.batch * args.seq / statistics.median(seconds)),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            "gpu": torch.cuda.get_device_name() if cuda else "cpu", "loss": round(loss.item(), 4)}


def profile(run_again, path, steps=2):
    """The kernels of `steps` more steps, by name: CUDA milliseconds a step and launches a step."""
    import torch
    from torch.profiler import ProfilerActivity

    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run_again()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in kernels) / 1000 / steps
    lines = [f"{total:.1f} ms of kernels a step, {sum(e.count for e in kernels) // steps} launches",
             "ms/step  launches/step  kernel"]
    lines += [f"{e.self_device_time_total / 1000 / steps:8.2f} {e.count // steps:8d}  {e.key[:150]}" for e in kernels]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as stream:
        stream.write("\n".join(lines) + "\n")


def main(argv=None):
    args = parse_args(argv)
    if args.one:
        print("ROW " + json.dumps(run_one(*args.one, args)), flush=True)
        return 0
    passed = list(argv if argv is not None else sys.argv[1:])
    status = 0
    for model_name in args.models.split(","):
        for provider in args.providers.split(","):
            if model_name not in MODELS or provider not in PROVIDERS:
                sys.exit(f"unknown model or provider: {model_name}, {provider}")
            done = subprocess.run([sys.executable, __file__, *passed, "--one", model_name, provider],
                                  capture_output=True, text=True, env=dict(os.environ))
            rows = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
            if done.returncode or not rows:
                status = 1
                tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
                print(json.dumps({"model": label(model_name, args), "provider": provider, "error": tail}), flush=True)
                continue
            print(rows[0], flush=True)
            if args.out:
                with open(args.out, "a") as stream:
                    stream.write(rows[0] + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
