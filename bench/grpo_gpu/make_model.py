#!/usr/bin/env python3
"""Writes the GRPO/generation benchmark's inputs: a Qwen2-0.5B-shaped model with random bf16 weights, a
real-vocabulary tokenizer, and a prompt file. Needs torch and safetensors (the device image has both).

    python3 bench/grpo_gpu/make_model.py --out /tmp/grpo_gpu [--device cuda|cpu] [--hidden 896 ...]

(bench/grpo_gpu/compare.py runs it; the shape flags make the small model of its CPU mode.)

OUT/model_trl/    config.json, generation_config.json, tokenizer.json, tokenizer_config.json, model.safetensors
                  (eos = pad = <|endoftext|>, as Qwen2 ships them; TRL needs an EOS id and suppresses it with
                  min_new_tokens, so every completion has max_completion_length tokens)
OUT/model_ferry/  the same weights (a hard link) and tokenizer with no EOS anywhere (no eos_token_id in
                  config.json, no eos_token in tokenizer_config.json): ferryd's rollout has no stop token, so
                  every completion has max_completion_length tokens too (ferryd has no min_new_tokens key)
OUT/prompts.jsonl {"prompt": ...} x --prompts, plain text, every prompt the same number of tokens (they differ
                  only in a 4-digit number, and Qwen2's pre-tokenizer splits digits one per token)

The shape is Qwen2.5-0.5B's: hidden 896, 24 layers, 14 heads / 2 KV heads (head_dim 64), intermediate 4864,
vocab 151936, q/k/v biases, tied embeddings, rope_theta 1e6. Weights ~ N(0, 0.02), biases 0, norms 1.
The tokenizer is fixtures/tokenizers/qwen2/tokenizer.json (the real Qwen2 vocabulary, 151,643 tokens + 3
specials) padded with special tokens <|extra_N|> up to the model's 151,936 ids: a random model samples ids
above the vocabulary, which ferry_text refuses to decode (and transformers would silently drop).
"""
import argparse
import json
import os
import time


def padded_tokenizer(path, vocab_size):
    with open(path, encoding="utf-8") as f:
        tok = json.load(f)
    base = len(tok["model"]["vocab"])
    added = tok.get("added_tokens") or []
    next_id = base + sum(1 for t in added if t["content"] not in tok["model"]["vocab"])
    if any(t["id"] >= next_id for t in added):
        raise SystemExit(f"{path}: unexpected added token ids")
    for i in range(next_id, vocab_size):
        added.append({"id": i, "content": f"<|extra_{i - next_id}|>", "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": True})
    tok["added_tokens"] = added
    return tok, next_id


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                                        "fixtures", "tokenizers", "qwen2", "tokenizer.json"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=4864)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    import torch
    from safetensors.torch import save_file

    t0 = time.time()
    trl_dir, ferry_dir = os.path.join(a.out, "model_trl"), os.path.join(a.out, "model_ferry")
    os.makedirs(trl_dir, exist_ok=True)
    os.makedirs(ferry_dir, exist_ok=True)

    tok, first_extra = padded_tokenizer(a.tokenizer, a.vocab)
    for d in (trl_dir, ferry_dir):
        with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(tok, f, ensure_ascii=False)
    endoftext = 151643
    tc = {"backend": "tokenizers", "tokenizer_class": "TokenizersBackend", "bos_token": None,
          "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "model_max_length": 32768,
          "clean_up_tokenization_spaces": False, "padding_side": "left"}
    with open(os.path.join(trl_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f, indent=2)
    tc_ferry = dict(tc)
    del tc_ferry["eos_token"]
    with open(os.path.join(ferry_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tc_ferry, f, indent=2)

    head_dim = a.hidden // a.heads
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
        "bos_token_id": endoftext, "eos_token_id": endoftext, "pad_token_id": endoftext, "hidden_act": "silu",
        "hidden_size": a.hidden, "initializer_range": 0.02, "intermediate_size": a.intermediate,
        "max_position_embeddings": 32768, "max_window_layers": a.layers, "num_attention_heads": a.heads,
        "num_hidden_layers": a.layers, "num_key_value_heads": a.kv_heads, "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "sliding_window": None,
        "tie_word_embeddings": True, "dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
        "vocab_size": a.vocab,
    }
    with open(os.path.join(trl_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(trl_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": endoftext, "eos_token_id": endoftext, "pad_token_id": endoftext}, f, indent=2)
    config_ferry = {k: v for k, v in config.items() if k != "eos_token_id"}
    with open(os.path.join(ferry_dir, "config.json"), "w") as f:
        json.dump(config_ferry, f, indent=2)

    dev = torch.device(a.device)
    g = torch.Generator(device=dev).manual_seed(a.seed)

    def normal(*shape):
        return (torch.randn(*shape, generator=g, device=dev, dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()

    kv = a.kv_heads * head_dim
    t = {"model.embed_tokens.weight": normal(a.vocab, a.hidden),
         "model.norm.weight": torch.ones(a.hidden, dtype=torch.bfloat16)}
    for i in range(a.layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = normal(a.hidden, a.hidden)
        t[p + "self_attn.q_proj.bias"] = torch.zeros(a.hidden, dtype=torch.bfloat16)
        t[p + "self_attn.k_proj.weight"] = normal(kv, a.hidden)
        t[p + "self_attn.k_proj.bias"] = torch.zeros(kv, dtype=torch.bfloat16)
        t[p + "self_attn.v_proj.weight"] = normal(kv, a.hidden)
        t[p + "self_attn.v_proj.bias"] = torch.zeros(kv, dtype=torch.bfloat16)
        t[p + "self_attn.o_proj.weight"] = normal(a.hidden, a.hidden)
        t[p + "mlp.gate_proj.weight"] = normal(a.intermediate, a.hidden)
        t[p + "mlp.up_proj.weight"] = normal(a.intermediate, a.hidden)
        t[p + "mlp.down_proj.weight"] = normal(a.hidden, a.intermediate)
        t[p + "input_layernorm.weight"] = torch.ones(a.hidden, dtype=torch.bfloat16)
        t[p + "post_attention_layernorm.weight"] = torch.ones(a.hidden, dtype=torch.bfloat16)
    weights = os.path.join(trl_dir, "model.safetensors")
    save_file(t, weights, metadata={"format": "pt"})
    linked = os.path.join(ferry_dir, "model.safetensors")
    if os.path.exists(linked):
        os.remove(linked)
    os.link(weights, linked)
    params = sum(x.numel() for x in t.values())

    story = ("The lighthouse keeper had not spoken to another person in three weeks when the supply boat finally "
             "appeared on the horizon, and by then he had begun to talk to the gulls, the lamp and the long grey "
             "waves that folded themselves against the rocks below his window every night.")
    with open(os.path.join(a.out, "prompts.jsonl"), "w", encoding="utf-8") as f:
        for i in range(a.prompts):
            prompt = (f"Archive entry {i:04d}. Continue the following passage in plain English for one more "
                      f"paragraph, keeping its tone and its characters.\n\n{story}")
            f.write(json.dumps({"prompt": prompt}) + "\n")
    print(json.dumps({"model_dir": trl_dir, "ferry_model_dir": ferry_dir, "parameters": params,
                      "weight_bytes": os.path.getsize(weights), "first_padding_id": first_extra,
                      "prompts": a.prompts, "seconds": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
