#!/usr/bin/env python3
"""ferry_bench_generate against transformers' generate, side by side in one run.

Runs the two alternately (ferry, transformers, ferry, ...) on the same model, shapes, threads, dtype and
device, for each batch size, and prints per batch the median prefill and decode throughput of each and
their ratios (ferry / transformers; above 1 means Ferry is faster), plus peak RSS. With no --model it
first writes a synthetic 0.5B-shaped Llama (hidden 896, 24 layers, 14/2 heads, intermediate 4864, vocab
151936) with ferry_bench_make_model into a temporary directory, removed at the end.

Usage: bench/generate_compare.py [--build build] [--python PY] [--model DIR] [--device cpu|cuda]
         [--dtype f32|bf16] [--threads 2] [--batches 1,16] [--prompt-len 128] [--new-tokens 128]
         [--repeats 3] [--json]
The peer needs a python with torch and transformers (--python; default: this interpreter).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile


def run_json(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit(f"generate_compare: {' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        sys.exit(f"generate_compare: no JSON line from {' '.join(cmd)}")
    return json.loads(lines[-1])


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(here, "..", "build"))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--model")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    a = ap.parse_args()
    bench = os.path.join(a.build, "bench", "ferry_bench_generate")
    maker = os.path.join(a.build, "bench", "ferry_bench_make_model")
    for exe in ([bench] if a.model else [bench, maker]):
        if not os.access(exe, os.X_OK):
            sys.exit(f"generate_compare: {exe} not found (bash scripts/build.sh ferry_bench_generate ferry_bench_make_model)")
    tmp = None
    model = a.model
    try:
        if not model:
            tmp = tempfile.mkdtemp(prefix="ferry_generate_compare_")
            model = os.path.join(tmp, "model")
            print("writing a 0.5B-shaped model ...", file=sys.stderr)
            subprocess.run([maker, "--base", model, "--adapter", os.path.join(tmp, "adapter"), "--hidden", "896",
                            "--intermediate", "4864", "--layers", "24", "--vocab", "151936", "--heads", "14",
                            "--kv-heads", "2"], check=True, stdout=subprocess.DEVNULL)
        common = ["--model", model, "--device", a.device, "--dtype", a.dtype, "--threads", str(a.threads),
                  "--prompt-len", str(a.prompt_len), "--new-tokens", str(a.new_tokens)]
        peer = [a.python, os.path.join(here, "hf_generate_peer.py")]
        results = []
        for batch in [int(b) for b in a.batches.split(",")]:
            runs = {"ferry": [], "transformers": []}
            for r in range(a.repeats):
                print(f"batch {batch}: run {r + 1}/{a.repeats}", file=sys.stderr)
                runs["ferry"].append(run_json([bench] + common + ["--batch", str(batch)]))
                runs["transformers"].append(run_json(peer + common + ["--batch", str(batch)]))
            row = {"batch": batch}
            for side, rs in runs.items():
                row[side] = {k: statistics.median(x[k] for x in rs)
                             for k in ("prefill_tokens_per_s", "generate_tokens_per_s", "peak_rss_bytes",
                                       "model_peak_bytes")}
            row["prefill_ratio"] = row["ferry"]["prefill_tokens_per_s"] / row["transformers"]["prefill_tokens_per_s"]
            row["decode_ratio"] = row["ferry"]["generate_tokens_per_s"] / row["transformers"]["generate_tokens_per_s"]
            row["rss_ratio"] = row["ferry"]["peak_rss_bytes"] / row["transformers"]["peak_rss_bytes"]
            row["weight_bytes"] = runs["ferry"][0]["weight_bytes"]
            row["kv_cache_bytes"] = runs["ferry"][0]["kv_cache_bytes"]
            floor = row["weight_bytes"] + row["kv_cache_bytes"]
            row["ferry"]["memory_ratio"] = row["ferry"]["model_peak_bytes"] / floor
            row["transformers"]["memory_ratio"] = row["transformers"]["model_peak_bytes"] / floor
            results.append(row)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    out = {"device": a.device, "dtype": a.dtype, "threads": a.threads, "prompt_len": a.prompt_len,
           "new_tokens": a.new_tokens, "repeats": a.repeats, "results": results}
    if a.json:
        print(json.dumps(out))
        return
    print(f"{a.device} {a.dtype}, {a.threads} threads, {a.prompt_len} prompt + {a.new_tokens} new tokens, "
          f"median of {a.repeats} alternating runs (ratio = ferry / transformers)")
    print(f"{'batch':>5} {'prefill tok/s ferry':>20} {'hf':>9} {'ratio':>6} {'decode tok/s ferry':>19} {'hf':>9} "
          f"{'ratio':>6} {'peak RSS ratio':>15}")
    for r in results:
        f, h = r["ferry"], r["transformers"]
        print(f"{r['batch']:>5} {f['prefill_tokens_per_s']:>20.1f} {h['prefill_tokens_per_s']:>9.1f} "
              f"{r['prefill_ratio']:>6.2f} {f['generate_tokens_per_s']:>19.1f} {h['generate_tokens_per_s']:>9.1f} "
              f"{r['decode_ratio']:>6.2f} {r['rss_ratio']:>15.2f}")
    print("memory: model_peak = peak RSS (VmHWM) - RSS before the model load; floor = ferry's weight_bytes (4-bit "
          "counted packed) + kv_cache_bytes")
    for r in results:
        f, h = r["ferry"], r["transformers"]
        print(f"{r['batch']:>5} floor {(r['weight_bytes'] + r['kv_cache_bytes']) / 1e6:.1f} MB (weights "
              f"{r['weight_bytes'] / 1e6:.1f} + KV {r['kv_cache_bytes'] / 1e6:.1f}); model_peak ferry "
              f"{f['model_peak_bytes'] / 1e6:.1f} MB = {f['memory_ratio']:.3f}x, transformers "
              f"{h['model_peak_bytes'] / 1e6:.1f} MB = {h['memory_ratio']:.3f}x")


if __name__ == "__main__":
    main()
