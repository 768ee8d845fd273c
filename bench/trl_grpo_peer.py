#!/usr/bin/env python3
"""The peer of ferryd's GRPO benchmark: TRL 1.16's GRPOTrainer on the same model, prompts, reward and settings.

Run with the fixture venv's python (torch on CPU, transformers, peft, trl); never part of the build or the tests:

    /tmp/fixvenv/bin/python bench/trl_grpo_peer.py --model fixtures/demo/model \
        --dataset fixtures/demo/train.jsonl --steps 100 --threads 2 --seed 42 --warmup-steps 5

Prints one JSON line (the driver reads the last line of stdout; TRL's and transformers' own chatter goes to
stderr). Steps 1..--warmup-steps are run but excluded from the timings and the token counts. With
--eval-dataset the held-out greedy accuracy is measured before and after training (untimed), which is how
fixtures/demo/make_demo.py --validate checks that the demo learns.

The settings are ferryd's run config for fixtures/demo/grpo.toml, following the protocol of the project's
reference notes on a fair comparison with TRL on CPU:
  - use_vllm False (generation is transformers' generate), bf16 False, gradient_checkpointing False, use_cpu True,
    torch.set_num_threads(--threads) (and OMP/MKL thread variables set before torch loads);
  - LoRA r 8, alpha 16, dropout 0 on q/k/v/o/gate/up/down_proj;
  - AdamW lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0, constant schedule, no warmup, max_grad_norm 1.0
    (TrainingArguments' default; ferryd's default is the same);
  - per_device_train_batch_size 128 completions = 16 prompts x num_generations 8, gradient accumulation 1,
    max_completion_length 4, temperature 1.0, top_p 1.0, top_k 0;
  - beta 0, epsilon 0.2, loss_type "dapo", scale_rewards "group", num_iterations 1, seed --seed;
  - one reward: digit_match on the dataset's "answer" field, left-aligned, default pattern (below).
Prompts are plain text: TRL tokenizes them with add_special_tokens=True, so the tokenizer's post-processor puts
<bos> in front, as in the SFT data.

Output fields: steps, timed_steps, warmup_steps, threads, seed, s_per_step_median, s_per_step_mean (wall time of each
timed optimizer step, from TrainerCallback.on_step_begin to on_step_end: generation, reward, loss, backward and the
optimizer step), steps_per_s (timed steps / their summed time), s_per_step_cycle (the timed steps' mean
start-to-next-start time: everything between steps included), generated_tokens (completion tokens of the timed
steps, EOS included, as TRL's completion mask counts them), generated_tokens_per_s, peak_rss_bytes (ru_maxrss),
reward_log ([step, reward] for each logged step: TRL's mean reward over the steps since the previous log),
trl_step_time_log ([step, step_time] for each logged step: TRL's own metric, the mean over the logged steps),
train_runtime_s, load_average (at the end), omp_wait_policy (the environment's; on a loaded machine, PASSIVE
keeps spinning OpenMP threads from slowing every step many times over), eval_before / eval_after (with
--eval-dataset: held-out greedy exact accuracy and digit reward, untimed), versions.

Nothing is written outside a temporary directory, which is deleted at exit.
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

# The reward, exactly as ferryd's built-in digit_match (daemon/run/rewards.h) with field "answer", the default
# pattern (config.h's kDefaultAnswerPattern: the last number) and align "left". RE2 and Python's re agree on this
# pattern (leftmost-first alternation, no lookaround); re.ASCII because RE2's \d is ASCII only.
DEFAULT_ANSWER_PATTERN = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?", re.ASCII)
_ASCII_SPACE = " \t\n\r\f\v"  # rewards.cpp's Trim


def digit_match(completion, reference, align="left"):
    """matches / max(len(a), len(r)) over code points of the trimmed last number a of `completion` and the
    trimmed `reference`, lined up from the left (or right); 0.0 when the completion has no number."""
    last = None
    for m in DEFAULT_ANSWER_PATTERN.finditer(completion):
        last = m.group(0)
    if last is None:
        return 0.0
    a, r = last.strip(_ASCII_SPACE), str(reference).strip(_ASCII_SPACE)
    longest = max(len(a), len(r))
    if longest == 0:
        return 1.0
    if align == "right":
        a, r = a[::-1], r[::-1]
    return sum(1 for x, y in zip(a, r) if x == y) / longest


def digit_match_reward(completions, answer, **kwargs):
    """TRL reward function: one float per completion (plain-text completions, the dataset column "answer")."""
    return [digit_match(c, r) for c, r in zip(completions, answer, strict=True)]


# Fixed completions against the values the documented definition gives, worked out by hand (r = "052": 3 digits).
SELF_TEST = [
    ("052", "052", 1.0),
    ("052", "052", 1.0),
    ("053", "052", 2 / 3),        # the last digit wrong
    ("152", "052", 2 / 3),        # the first digit wrong
    ("05", "052", 2 / 3),         # left-aligned: 0 and 5 in place
    ("52", "052", 0.0),           # left-aligned: 5 vs 0, 2 vs 5
    ("0521", "052", 3 / 4),       # no EOS within 4 tokens: 3 of max(4, 3)
    ("", "052", 0.0),             # no number
    ("+=", "052", 0.0),
    ("05+2", "052", 0.0),         # the last number is "2": 2 vs 0
    ("1+052", "052", 1.0),        # the last number
    ("999", "052", 0.0),
    ("  052 ", "052", 1.0),       # trimmed
    ("052", " 052\t", 1.0),
    ("12", "123", 2 / 3),         # the table in docs/daemon.md "## Rewards"
    ("1234", "123", 3 / 4),
    ("23", "123", 0.0),
    ("124", "123", 2 / 3),
    ("1,234", "1,234", 1.0),      # thousands commas are part of the number
    ("-12", "-12", 1.0),
    ("3.50", "3.5", 3 / 4),       # text, not value: "3.50" vs "3.5"
    ("x٣", "3", 0.0),             # Arabic-Indic digit: not \d in RE2
]
SELF_TEST_RIGHT = [("12", "123", 0.0), ("23", "123", 2 / 3), ("1234", "123", 0.0), ("05", "052", 0.0),
                   ("52", "052", 2 / 3)]


def self_test():
    for completion, ref, want in SELF_TEST:
        got = digit_match(completion, ref)
        if got != want:
            raise AssertionError(f"digit_match({completion!r}, {ref!r}) = {got}, expected {want}")
    for completion, ref, want in SELF_TEST_RIGHT:
        got = digit_match(completion, ref, align="right")
        if got != want:
            raise AssertionError(f"digit_match({completion!r}, {ref!r}, right) = {got}, expected {want}")
    got = digit_match_reward(["052", "05"], ["052", "052"])
    if got != [1.0, 2 / 3]:
        raise AssertionError(f"digit_match_reward = {got}")


def read_jsonl(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{n}: not JSON: {e}")
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or \
                    not isinstance(row.get("answer"), (str, int)):
                raise SystemExit(f"{path}:{n}: expected {{\"prompt\": string, \"answer\": string}}")
            rows.append({"prompt": row["prompt"], "answer": str(row["answer"])})
    if not rows:
        raise SystemExit(f"{path}: no examples")
    return rows


def greedy_accuracy(model, tokenizer, rows, max_new_tokens, batch=500):
    """Exact-answer accuracy of greedy decoding (the completion, special tokens skipped and trimmed, equals the
    answer), and the mean digit_match reward of the same completions."""
    import torch
    was_training = model.training
    model.eval()
    exact = reward = 0.0
    with torch.inference_mode():
        for i in range(0, len(rows), batch):
            chunk = rows[i:i + batch]
            enc = tokenizer([r["prompt"] for r in chunk], return_tensors="pt", padding=True, padding_side="left")
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            for t, r in zip(texts, chunk):
                exact += t.strip(_ASCII_SPACE) == r["answer"]
                reward += digit_match(t, r["answer"])
    if was_training:
        model.train()
    return {"greedy_exact": exact / len(rows), "greedy_digit_reward": reward / len(rows), "examples": len(rows)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face model directory (config, weights, tokenizer)")
    ap.add_argument("--dataset", required=True, help='JSONL of {"prompt": ..., "answer": ...}')
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps, warm-up included")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--warmup-steps", type=int, default=5, help="first steps excluded from the timings")
    ap.add_argument("--logging-steps", type=int, default=10)
    ap.add_argument("--eval-dataset", help="JSONL to measure greedy accuracy on before and after (untimed)")
    a = ap.parse_args()
    if a.steps < 1 or a.threads < 1 or a.warmup_steps < 0 or a.warmup_steps >= a.steps:
        ap.error("need steps >= 1, threads >= 1 and 0 <= warmup-steps < steps")

    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(a.threads)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["WANDB_DISABLED"] = "true"
    tmp = tempfile.mkdtemp(prefix="ferry-trl-grpo-peer-")
    os.environ["HF_HOME"] = os.path.join(tmp, "hf_home")          # the datasets cache lands here, not in ~
    os.environ["HF_DATASETS_CACHE"] = os.path.join(tmp, "hf_datasets")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton")
    try:
        result = run(a, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result), flush=True)


def run(a, tmp):
    # Everything TRL, transformers and datasets print goes to stderr; stdout carries only the JSON line.
    real_stdout = sys.stdout
    sys.stdout = sys.stderr
    try:
        return _run(a, tmp)
    finally:
        sys.stdout = real_stdout


def _run(a, tmp):
    self_test()
    import torch
    torch.set_num_threads(a.threads)
    import datasets
    import peft
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    datasets.disable_caching()
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()

    rows = read_jsonl(a.dataset)
    train = datasets.Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)

    eval_rows = read_jsonl(a.eval_dataset) if a.eval_dataset else None
    max_completion_length = 4
    eval_before = greedy_accuracy(model, tokenizer, eval_rows, max_completion_length) if eval_rows else None

    lora = peft.LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    args = trl.GRPOConfig(
        output_dir=os.path.join(tmp, "out"),
        use_vllm=False, bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True,
        learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, optim="adamw_torch",
        per_device_train_batch_size=128, num_generations=8, gradient_accumulation_steps=1,
        max_completion_length=max_completion_length, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group", num_iterations=1,
        seed=a.seed, data_seed=a.seed, max_steps=a.steps, logging_steps=a.logging_steps,
        save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
        log_completions=False)

    counts = {"step": 0, "tokens": 0}

    def reward_fn(completions, answer, completion_ids, **kwargs):
        if counts["step"] > a.warmup_steps:
            counts["tokens"] += sum(len(ids) for ids in completion_ids)
        return digit_match_reward(completions, answer)
    reward_fn.__name__ = "digit_match"

    class Timer(TrainerCallback):
        def __init__(self):
            self.durations, self.reward_log, self.step_time_log, self.t0 = [], [], [], None
            self.begins = {}  # step -> perf_counter() at its on_step_begin

        def on_step_begin(self, args, state, control, **kw):
            counts["step"] = state.global_step + 1
            self.t0 = time.perf_counter()
            self.begins[state.global_step + 1] = self.t0

        def on_step_end(self, args, state, control, **kw):
            if state.global_step > a.warmup_steps:
                self.durations.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.reward_log.append([state.global_step, logs["reward"]])
            if logs and "step_time" in logs:
                self.step_time_log.append([state.global_step, logs["step_time"]])

    timer = Timer()
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[reward_fn], args=args, train_dataset=train,
                              processing_class=tokenizer, peft_config=lora, callbacks=[timer])
    out = trainer.train()

    eval_after = greedy_accuracy(trainer.model, tokenizer, eval_rows, max_completion_length) if eval_rows else None
    d = timer.durations
    total = sum(d)
    # Whole cycles, step start to the next step's start (logging and callbacks between steps
    # included), over the timed steps but the last (whose successor never starts).
    first, last = a.warmup_steps + 1, max(timer.begins)
    cycle = (timer.begins[last] - timer.begins[first]) / (last - first) if last > first else None
    result = {
        "system": "trl",
        "steps": trainer.state.global_step,
        "timed_steps": len(d),
        "warmup_steps": a.warmup_steps,
        "threads": a.threads,
        "seed": a.seed,
        "s_per_step_median": statistics.median(d),
        "s_per_step_mean": total / len(d),
        "steps_per_s": len(d) / total,
        "s_per_step_cycle": cycle,
        "generated_tokens": counts["tokens"],
        "generated_tokens_per_s": counts["tokens"] / total,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "reward_log": timer.reward_log,
        "trl_step_time_log": timer.step_time_log,
        "train_runtime_s": out.metrics.get("train_runtime"),
        "load_average": list(os.getloadavg()),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "versions": {"torch": torch.__version__, "trl": trl.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__, "python": sys.version.split()[0]},
    }
    if eval_rows:
        result["eval_before"] = eval_before
        result["eval_after"] = eval_after
    return result


if __name__ == "__main__":
    main()
