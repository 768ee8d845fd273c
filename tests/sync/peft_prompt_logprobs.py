"""Prompt log-probabilities of token ids under a model, by the real transformers (and PEFT).

The independent reference of the engine tests (tests/sync/engine_vllm_test.cpp):
    python peft_prompt_logprobs.py MODEL_DIR [--adapter ADAPTER_DIR] --ids 1,2,3,...
prints a JSON list: log p(ids[t] | ids[<t]) for t = 1..n-1, in F32, as vLLM's prompt_logprobs.
"""
import argparse
import json

import torch
from transformers import AutoModelForCausalLM


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--adapter")
    p.add_argument("--ids", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    if a.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, a.adapter)
    model.eval()
    ids = torch.tensor([[int(x) for x in a.ids.split(",")]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    logp = torch.log_softmax(logits[0, :-1], dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    print(json.dumps([float(x) for x in logp]))


if __name__ == "__main__":
    main()
