#!/usr/bin/env python3
"""The peer of ferry_bench_generate: transformers' generate on the same model, prompts, threads.

Prints one JSON line with the same fields as ferry_bench_generate. Run by bench/generate_compare.sh
with the fixture venv's python (torch, transformers); never part of the build or the tests.

Prompts are random ids of the same shape (not the same ids: with EOS disabled the content does not
change the work), every row decodes exactly --new-tokens tokens, decoding is greedy.
"""
import argparse
import json
import os
import resource
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def rss_bytes():
    """VmRSS of this process in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    w = torch.ones(64, 64)
    float((w @ w).sum())  # start torch's CPU side (BLAS, thread pool) before the baseline, as ferry_bench_generate
    rss_before_load = rss_bytes()
    dtype = torch.float32 if a.dtype == "f32" else torch.bfloat16
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype)
    model.to(a.device)
    model.eval()
    load_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(a.seed)
    ids = torch.randint(0, model.config.vocab_size, (a.batch, a.prompt_len), generator=g).to(a.device)
    mask = torch.ones_like(ids)

    def wait():
        if a.device == "cuda":
            torch.cuda.synchronize()

    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        wait()
        prefill_s = time.perf_counter() - t0
        del out
        t0 = time.perf_counter()
        gen = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=a.new_tokens,
            min_new_tokens=a.new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        wait()
        generate_s = time.perf_counter() - t0
    generated = int(gen[:, a.prompt_len:].numel())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({
        "system": "transformers", "device": a.device, "batch": a.batch, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
        "threads": a.threads, "dtype": str(dtype).replace("torch.", ""), "load_s": load_s, "prefill_s": prefill_s,
        "prefill_tokens_per_s": a.batch * a.prompt_len / prefill_s, "generate_s": generate_s,
        "generated_tokens": generated, "generate_tokens_per_s": generated / generate_s,
        "peak_rss_bytes": peak, "rss_before_load_bytes": rss_before_load, "model_peak_bytes": peak - rss_before_load,
        "weight_bytes": model.get_memory_footprint(),
    }))


if __name__ == "__main__":
    main()
