#!/usr/bin/env python3
"""TRL 1.16's GRPOTrainer on cuda:0 with the settings of bench/grpo_gpu/grpo.toml (ferryd's side): the GPU variant of
bench/trl_grpo_peer.py, following its fair-comparison protocol (same model, prompts, reward and settings;
transformers' generate, no vLLM; timings from TrainerCallback on_step_begin to on_step_end, warm-up steps
excluded; generated tokens counted from completion_ids).

    python3 bench/grpo_gpu/trl_peer.py --model /tmp/grpo_gpu/model_trl --dataset /tmp/grpo_gpu/prompts.jsonl \
        --steps 12 --warmup-steps 3      (bench/grpo_gpu/compare.py runs it)

Differences from trl_grpo_peer.py, each mirrored on ferryd's side in grpo.toml: cuda instead of use_cpu, bf16
(autocast; the base loaded in bf16), LoRA r 16 / alpha 32, 64 completions = 8 prompts x 8, 128 completion
tokens, beta 0.04 (TRL computes the reference log-probs with the adapter disabled), lr 1e-5, the regex reward
"qu" (search), and generation_kwargs min_new_tokens = max_completion_length: the model's EOS can then never be
sampled, so every completion is exactly 128 tokens, as on ferryd's side, whose model directory has no EOS id.
gradient_checkpointing is off on both sides.

Timing: on_step_end calls torch.cuda.synchronize() before reading the clock, so queued GPU work counts in the
step it belongs to (ferryd's step ends after its generator has verified the new weights, a host-side wait).
Peak GPU memory: torch.cuda.max_memory_allocated / max_memory_reserved of this process (the driver's view,
context included, is run.sh's nvidia-smi sampling). Prints one JSON line last on stdout.
"""
import argparse
import json
import os
import re
import resource
import shutil
import statistics
import sys
import tempfile
import time

PATTERN = re.compile("qu")  # ferryd: type "regex", pattern "qu", match "search" (a literal: RE2 == re)


def qu_reward(completions, **kwargs):
    return [1.0 if PATTERN.search(c) else 0.0 for c in completions]


def read_prompts(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append({"prompt": json.loads(line)["prompt"]})
    return rows


def make_dataset(datasets, rows):
    """datasets.Dataset.from_list without its content fingerprint: hashing the Arrow table with dill fails for
    some datasets/pyarrow pairs (seen here: datasets 5.2.0 + pyarrow 26.0.1, "Can't pickle <class
    'MonthDayNano'>"), and a fixed fingerprint changes nothing GRPOTrainer does (it never maps the dataset)."""
    import pyarrow as pa
    from datasets.table import InMemoryTable
    return datasets.Dataset(InMemoryTable(pa.Table.from_pylist(rows)), fingerprint="ferry-gpu-prompts")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--max-completion-length", type=int, default=128)
    ap.add_argument("--progress", help="append one JSON line per finished step here (kept if the run is cut short)")
    ap.add_argument("--batch", type=int, default=64, help="completions per step (8 prompts x 8)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="a local check of this script without a GPU: use_cpu, fp32 (not a measurement)")
    a = ap.parse_args()
    if a.warmup_steps < 0 or a.warmup_steps >= a.steps - 1:
        ap.error("need 0 <= warmup-steps < steps - 1")
    for k, v in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"),
                 ("TOKENIZERS_PARALLELISM", "false"), ("WANDB_DISABLED", "true")):
        os.environ[k] = v
    tmp = tempfile.mkdtemp(prefix="ferry-trl-gpu-")
    os.environ["HF_HOME"] = os.path.join(tmp, "hf_home")
    os.environ["HF_DATASETS_CACHE"] = os.path.join(tmp, "hf_datasets")
    real_stdout, sys.stdout = sys.stdout, sys.stderr  # library chatter to stderr; stdout: the JSON line
    try:
        result = run(a, tmp)
    finally:
        sys.stdout = real_stdout
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result), flush=True)


def run(a, tmp):
    import torch
    import datasets
    import peft
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    cuda = not a.cpu_smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("trl_grpo_gpu: no CUDA device")

    def sync():
        if cuda:
            torch.cuda.synchronize()
    datasets.disable_caching()
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    t_load = time.perf_counter()
    train = make_dataset(datasets, read_prompts(a.dataset))
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16 if cuda else torch.float32)

    lora = peft.LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    C = a.max_completion_length
    args = trl.GRPOConfig(
        output_dir=os.path.join(tmp, "out"),
        use_vllm=False, bf16=cuda, fp16=False, gradient_checkpointing=False, use_cpu=not cuda,
        learning_rate=1e-5, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, optim="adamw_torch",
        per_device_train_batch_size=a.batch, num_generations=8, gradient_accumulation_steps=1,
        max_completion_length=C, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.04, epsilon=0.2, loss_type="dapo", scale_rewards="group", num_iterations=1,
        seed=a.seed, data_seed=a.seed, max_steps=a.steps, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
        log_completions=False, generation_kwargs={"min_new_tokens": C})

    counts = {"step": 0, "tokens": 0, "all_tokens": 0, "lengths": set()}

    def reward_fn(completions, completion_ids, **kwargs):
        n = sum(len(ids) for ids in completion_ids)
        counts["all_tokens"] += n
        counts["lengths"].update(len(ids) for ids in completion_ids)
        if counts["step"] > a.warmup_steps:
            counts["tokens"] += n
        return qu_reward(completions)
    reward_fn.__name__ = "qu"

    class Timer(TrainerCallback):
        def __init__(self):
            self.durations, self.begins, self.logs = [], {}, []
            self.t0 = None

        def on_step_begin(self, args, state, control, **kw):
            sync()
            counts["step"] = state.global_step + 1
            self.t0 = time.perf_counter()
            self.begins[state.global_step + 1] = self.t0

        def on_step_end(self, args, state, control, **kw):
            sync()
            d = time.perf_counter() - self.t0
            if state.global_step > a.warmup_steps:
                self.durations.append(d)
            self.logs.append({"step": state.global_step, "s": d})
            if a.progress:
                with open(a.progress, "a") as f:
                    f.write(json.dumps({"step": state.global_step, "s": d,
                                        "peak_gpu_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None})
                        + "\n")

        def on_log(self, args, state, control, logs=None, **kw):
            if logs:
                keep = {k: v for k, v in logs.items() if k in ("reward", "reward_std", "kl", "loss", "step_time",
                                                                "completions/mean_length", "frac_reward_zero_std")}
                if keep:
                    self.logs.append({"step": state.global_step, **keep})

    timer = Timer()
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[reward_fn], args=args, train_dataset=train,
                              processing_class=tokenizer, peft_config=lora, callbacks=[timer])
    load_s = time.perf_counter() - t_load
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    out = trainer.train()
    d = timer.durations
    total = sum(d)
    first, last = a.warmup_steps + 1, max(timer.begins)
    cycle = (timer.begins[last] - timer.begins[first]) / (last - first) if last > first else None
    return {
        "system": "trl",
        "steps": trainer.state.global_step, "timed_steps": len(d), "warmup_steps": a.warmup_steps,
        "s_per_step_median": statistics.median(d), "s_per_step_mean": total / len(d),
        "s_per_step_all": d, "s_per_step_cycle": cycle,
        "generated_tokens": counts["tokens"], "generated_tokens_per_s": counts["tokens"] / total,
        "completion_lengths_seen": sorted(counts["lengths"]),
        "peak_gpu_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "setup_s": load_s, "train_runtime_s": out.metrics.get("train_runtime"),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "log": timer.logs,
        "versions": {"torch": torch.__version__, "trl": trl.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__, "datasets": datasets.__version__, "python": sys.version.split()[0],
                     "gpu": torch.cuda.get_device_name(0) if cuda else "cpu (smoke test)"},
    }


if __name__ == "__main__":
    main()
