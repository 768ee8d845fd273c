#!/usr/bin/env python3
"""Encode throughput of ferry_text against the `tokenizers` package, measured side by side.

    /tmp/fixvenv/bin/python bench/tokenizer_bench.py [--tokenizer DIR_OR_FILE] [--corpus FILE]
        [--reps N] [--seconds S] [--bin build/bench/ferry_bench_tokenizer]

Defaults: the Qwen2 vocabulary of fixtures/tokenizers/qwen2/, the corpus
fixtures/tokenizers/corpus.jsonl, 3 interleaved repetitions of 3 s each. Both sides run on
one thread: the package with RAYON_NUM_THREADS=1 and TOKENIZERS_PARALLELISM=false, timed
two ways (a Python loop of Tokenizer.encode, and encode_batch on the whole corpus, which
leaves out most of the per-call Python overhead), each after one untimed warm-up pass, as
ferry_bench_tokenizer does. Prints the medians in MB/s (corpus bytes, UTF-8) and the ratios
ferry / package.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def package_runs(tokenizer_path, corpus, seconds):
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer
    path = tokenizer_path if os.path.isfile(tokenizer_path) else os.path.join(tokenizer_path, "tokenizer.json")
    start = time.perf_counter()
    tok = Tokenizer.from_file(path)
    load = time.perf_counter() - start
    nbytes = sum(len(t.encode("utf-8")) for t in corpus)

    def loop():
        for t in corpus:
            tok.encode(t, add_special_tokens=False)

    def batch():
        tok.encode_batch(corpus, add_special_tokens=False)

    out = {"load": load}
    for name, fn in (("encode", loop), ("encode_batch", batch)):
        fn()
        passes, start = 0, time.perf_counter()
        while True:
            fn()
            passes += 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
        out[name] = nbytes * passes / elapsed / 1e6
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=os.path.join(REPO, "fixtures", "tokenizers", "qwen2"))
    ap.add_argument("--corpus", default=os.path.join(REPO, "fixtures", "tokenizers", "corpus.jsonl"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--bin", default=os.path.join(REPO, "build", "bench", "ferry_bench_tokenizer"))
    args = ap.parse_args()
    with open(args.corpus, encoding="utf-8") as f:
        corpus = [json.loads(line) for line in f]
    ferry, enc, batch, ferry_load, pkg_load = [], [], [], [], []
    for _ in range(args.reps):
        p = subprocess.run([args.bin, args.tokenizer, args.corpus, "--seconds", str(args.seconds)],
                           capture_output=True, text=True, check=True)
        out = json.loads(p.stdout)
        ferry.append(out["mb_per_s"])
        ferry_load.append(out["load_seconds"])
        pkg = package_runs(args.tokenizer, corpus, args.seconds)
        enc.append(pkg["encode"])
        batch.append(pkg["encode_batch"])
        pkg_load.append(pkg["load"])
    f, e, b = statistics.median(ferry), statistics.median(enc), statistics.median(batch)
    nbytes = sum(len(t.encode("utf-8")) for t in corpus)
    print("corpus: %d strings, %d bytes; tokenizer: %s; %d reps x %.1f s, medians" %
          (len(corpus), nbytes, args.tokenizer, args.reps, args.seconds))
    print("%-42s %8.2f MB/s   runs %s" % ("ferry_text Encode (1 thread)", f, ["%.2f" % x for x in ferry]))
    print("%-42s %8.2f MB/s   runs %s" % ("tokenizers encode loop (1 thread)", e, ["%.2f" % x for x in enc]))
    print("%-42s %8.2f MB/s   runs %s" % ("tokenizers encode_batch (1 thread)", b, ["%.2f" % x for x in batch]))
    print("%-42s %8.2f s      (package: %.2f s)" % ("load (median)", statistics.median(ferry_load),
                                                       statistics.median(pkg_load)))
    print("ratio ferry / encode loop:  %.2f" % (f / e))
    print("ratio ferry / encode_batch: %.2f" % (f / b))
    return 0


if __name__ == "__main__":
    sys.exit(main())
