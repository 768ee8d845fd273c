#!/usr/bin/env python3
"""A 0.5B-shaped NF4 model (double quantisation) as transformers + bitsandbytes serialise it, for the
4-bit generation-memory bench (bench/README.md, "nf4_memory.py").

The shape is Qwen2.5-0.5B's (Qwen2: hidden 896, 24 layers, intermediate 4864, 14 heads / 2 KV heads, vocab
151936, q/k/v biases, tied embeddings); the weights are transformers' random init (seeded). The model is cast
to --dtype, written to a temporary directory, loaded back by transformers with a BitsAndBytesConfig (NF4,
double quantisation, compute dtype = --dtype, quant storage uint8) on the CPU and saved to OUT before any
forward, as fixtures/runtime/generate.py makes its small NF4 fixtures. The linear layers of the decoder are
4-bit; the embedding (tied with lm_head), norms and biases stay in --dtype.

Usage: make_nf4_model.py OUT [--dtype f32|bf16] [--seed 1]
Needs torch, transformers and bitsandbytes (the fixture venv). The model is about 0.75 GB (f32) or 0.47 GB
(bf16): write it under /tmp, never into the repository.
"""
import argparse
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--dtype", default="f32", choices=sorted(DTYPES))
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if os.path.exists(a.out):
        sys.exit(f"make_nf4_model: {a.out} exists")
    dtype = DTYPES[a.dtype]
    cfg = Qwen2Config(hidden_size=896, num_hidden_layers=24, intermediate_size=4864, num_attention_heads=14,
                      num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
                      max_position_embeddings=32768, rope_theta=1000000.0, bos_token_id=151643,
                      eos_token_id=151643)
    torch.manual_seed(a.seed)
    model = Qwen2ForCausalLM(cfg).eval()
    parent = os.path.dirname(os.path.abspath(a.out))
    with tempfile.TemporaryDirectory(dir=parent, prefix=".make_nf4_model_") as td:
        model.to(dtype).save_pretrained(td)
        del model
        bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                 bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=torch.uint8)
        q = AutoModelForCausalLM.from_pretrained(td, dtype=dtype, device_map="cpu", quantization_config=bnb)
        tmp_out = a.out + ".partial"
        q.save_pretrained(tmp_out)  # before any forward: nothing repacked
        os.rename(tmp_out, a.out)
    print(a.out)


if __name__ == "__main__":
    main()
