#!/usr/bin/env python3
"""ferryd against TRL's GRPOTrainer on a GPU, side by side in one run (issue 34's first two rows).

    python3 bench/grpo_gpu/compare.py [--ferryd build/cli/ferryd] [--work /tmp/grpo_gpu] [--steps 12]
        [--warmup 3] [--reps 1]
    python3 bench/grpo_gpu/compare.py --device cpu     # the CPU mode: a small model, a check of the bench itself

The GPU mode is the measurement: a Qwen2-0.5B-shaped model with random bf16 weights and the real Qwen2 vocabulary
(make_model.py), LoRA r 16 / alpha 32 on every linear layer, 8 prompts x 8 completions x 128 tokens, beta 0.04,
bf16, as grpo.toml (ferryd) and trl_peer.py (TRL 1.16, transformers' generate, no vLLM) set them; every completion
is exactly 128 tokens on both sides (ferryd's model has no EOS; TRL's generate is given min_new_tokens). Each
repetition runs ferryd, then TRL, so both see the same device; per side, after --warmup steps:
- the median seconds per optimizer step (ferryd: its step_time metric, the step up to its generator's proof of
  the new weights; TRL: on_step_begin to on_step_end, after torch.cuda.synchronize());
- the peak GPU memory the process used: nvidia-smi's memory.used, sampled every 100 ms, less what was in use
  before it started (the driver's view: context and allocator cache included, the same for both sides).
Printed: both figures per side, the ratios (TRL / ferryd for the step: the target is ferryd <= 1.2 s and >= 7x
TRL; ferryd / TRL for memory: the target is <= 1), and a calibration before and after (a bf16 4096^3 matmul on the
device, TFLOP/s; an F32 512 x 1024 x 1024 one on the CPU, GFLOP/s): a busy device shows as a drop.

The CPU mode runs the same two sides with a 2-layer, hidden-64 model, 2 prompts x 8 completions x 16 tokens, F32,
for a few steps: it checks that both sides run and the bench reads them, and its ratios mean nothing.

Needs a python with torch, transformers, peft, safetensors, datasets and trl 1.16 (--python; on the lent GPU
machine, ../shared/gpu-kit/whl adds trl) and a built ferryd (on a GPU, built against that python's torch:
scripts/build-pytorch.sh). Prints one JSON object last.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

SMALL = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128}
CPU_LENGTH, CPU_BATCH = 16, 16


def calibration(python, device):
    """One matmul's rate on `device` with `python`'s torch: TFLOP/s (cuda, bf16 4096^3) or GFLOP/s (cpu, F32)."""
    code = r"""
import sys, time, torch
dev = sys.argv[1]
if dev == "cuda":
    n, dt, scale = 4096, torch.bfloat16, 1e12
    a = torch.randn(n, n, device=dev, dtype=dt); b = torch.randn(n, n, device=dev, dtype=dt)
    shape = (n, n, n)
else:
    dt, scale = torch.float32, 1e9
    a = torch.rand(512, 1024); b = torch.rand(1024, 1024)
    shape = (512, 1024, 1024)
runs = []
for _ in range(7):
    if dev == "cuda": torch.cuda.synchronize()
    t = time.perf_counter(); c = a @ b
    if dev == "cuda": torch.cuda.synchronize()
    runs.append(time.perf_counter() - t)
runs.sort()
print(2.0 * shape[0] * shape[1] * shape[2] / runs[3] / scale)
"""
    out = subprocess.run([python, "-c", code, device], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    return float(out.stdout.strip().splitlines()[-1])


class MemorySampler:
    """nvidia-smi memory.used (MiB) of GPU 0 every 100 ms while running; peak minus the level before start."""

    def __init__(self, enabled):
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.samples, self.stop, self.thread = [], threading.Event(), None

    def read(self):
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True)
        return float(out.stdout.strip().splitlines()[0]) if out.returncode == 0 and out.stdout.strip() else None

    def __enter__(self):
        if self.enabled:
            self.baseline = self.read()

            def loop():
                while not self.stop.is_set():
                    v = self.read()
                    if v is not None:
                        self.samples.append(v)
                    self.stop.wait(0.1)
            self.thread = threading.Thread(target=loop, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc):
        if self.thread:
            self.stop.set()
            self.thread.join()

    def peak_gib(self):
        if not self.samples or self.baseline is None:
            return None
        return (max(self.samples) - self.baseline) / 1024.0


def write_ferryd_config(work, device, steps):
    with open(os.path.join(HERE, "grpo.toml"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    cpu = device == "cpu"
    sets = {"max_steps": str(steps), "device": f'"{device}"', "output_dir": '"runs/ferryd"'}
    if cpu:
        sets.update({"bf16": "false", "max_completion_length": str(CPU_LENGTH),
                     "per_device_train_batch_size": str(CPU_BATCH), "generation_dtype": '"auto"'})
    out = []
    for line in lines:
        key = line.split("=", 1)[0].strip() if "=" in line and not line.lstrip().startswith("#") else None
        if key in sets:
            out.append(f"{key} = {sets.pop(key)}")
        else:
            out.append(line)
    if sets:
        raise SystemExit(f"grpo.toml lacks {sorted(sets)}")
    path = os.path.join(work, "run.toml")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")
    return path


def run_ferryd(ferryd, config, work, rep, warmup, device):
    run_dir = os.path.join(work, "runs", f"ferryd-{rep}")
    shutil.rmtree(run_dir, ignore_errors=True)
    log = os.path.join(work, f"ferryd-{rep}.log")
    with MemorySampler(device == "cuda") as mem, open(log, "w") as f:
        rc = subprocess.run([ferryd, "train", "--config", config, "--dir", run_dir], stdout=f, stderr=subprocess.STDOUT,
                            cwd=work).returncode
    if rc != 0:
        raise SystemExit(f"ferryd train failed (exit {rc}): see {log}")
    times = []
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            m = json.loads(line)
            if m.get("step", 0) > warmup and "step_time" in m:
                times.append(m["step_time"])
    if not times:
        raise SystemExit(f"no step_time after step {warmup} in {run_dir}/metrics.jsonl")
    return {"s_per_step_median": statistics.median(times), "timed_steps": len(times), "peak_gpu_gib": mem.peak_gib()}


def run_trl(python, work, rep, steps, warmup, device):
    log = os.path.join(work, f"trl-{rep}.log")
    cmd = [python, os.path.join(HERE, "trl_peer.py"), "--model", os.path.join(work, "model_trl"), "--dataset",
           os.path.join(work, "prompts.jsonl"), "--steps", str(steps), "--warmup-steps", str(warmup)]
    if device == "cpu":
        cmd += ["--cpu-smoke", "--max-completion-length", str(CPU_LENGTH), "--batch", str(CPU_BATCH)]
    with MemorySampler(device == "cuda") as mem, open(log, "w") as err:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    if out.returncode != 0 or not out.stdout.strip():
        raise SystemExit(f"trl_peer.py failed (exit {out.returncode}): see {log}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {"s_per_step_median": r["s_per_step_median"], "timed_steps": r["timed_steps"],
            "peak_gpu_gib": mem.peak_gib(), "completion_lengths_seen": r.get("completion_lengths_seen"),
            "versions": r.get("versions")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ferryd", default=os.path.join(ROOT, "build", "cli", "ferryd"))
    ap.add_argument("--python", default=sys.executable, help="python with torch, transformers, peft, trl")
    ap.add_argument("--work", default="/tmp/grpo_gpu")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: 12 cuda, 4 cpu)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed first steps (default: 3 cuda, 1 cpu)")
    ap.add_argument("--reps", type=int, default=1)
    a = ap.parse_args()
    steps = a.steps if a.steps is not None else (12 if a.device == "cuda" else 4)
    warmup = a.warmup if a.warmup is not None else (3 if a.device == "cuda" else 1)
    if not 0 <= warmup < steps - 1:
        ap.error("need 0 <= --warmup < --steps - 1")
    if not os.access(a.ferryd, os.X_OK):
        ap.error(f"--ferryd {a.ferryd}: not an executable")
    os.makedirs(a.work, exist_ok=True)

    made = os.path.join(a.work, f"made-{a.device}.json")
    if not os.path.exists(made):
        cmd = [a.python, os.path.join(HERE, "make_model.py"), "--out", a.work, "--device", a.device]
        if a.device == "cpu":
            for k, v in SMALL.items():
                cmd += ["--" + k.replace("_", "-"), str(v)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit("make_model.py failed:\n" + out.stderr[-3000:])
        with open(made, "w") as f:
            f.write(out.stdout.strip().splitlines()[-1])
    with open(made) as f:
        model = json.load(f)
    config = write_ferryd_config(a.work, a.device, steps)
    unit = "TFLOP/s (bf16 4096^3)" if a.device == "cuda" else "GFLOP/s (F32 512x1024x1024)"
    before = calibration(a.python, a.device)
    print(f"calibration before: {before} {unit}", flush=True)
    reps = []
    for rep in range(a.reps):
        f = run_ferryd(a.ferryd, config, a.work, rep, warmup, a.device)
        t = run_trl(a.python, a.work, rep, steps, warmup, a.device)
        reps.append({"ferryd": f, "trl": t})
        print(f"  rep {rep + 1}: ferryd {f['s_per_step_median']:.3f} s/step, TRL {t['s_per_step_median']:.3f} s/step"
              f"; peak GPU GiB ferryd {f['peak_gpu_gib']}, TRL {t['peak_gpu_gib']}", flush=True)
    after = calibration(a.python, a.device)
    print(f"calibration after: {after} {unit}")

    def med(side, key):
        vals = [r[side][key] for r in reps if r[side][key] is not None]
        return statistics.median(vals) if vals else None
    fs, ts = med("ferryd", "s_per_step_median"), med("trl", "s_per_step_median")
    fm, tm = med("ferryd", "peak_gpu_gib"), med("trl", "peak_gpu_gib")
    print(f"\n{'':28s}{'ferryd':>10s}{'TRL':>10s}")
    print(f"{'s per optimizer step':28s}{fs:10.3f}{ts:10.3f}")
    if fm is not None and tm is not None:
        print(f"{'peak GPU memory, GiB':28s}{fm:10.2f}{tm:10.2f}")
    print(f"step: TRL / ferryd {ts / fs:.2f}x" + (
        f" (targets: ferryd <= 1.2 s: {'met' if fs <= 1.2 else 'NOT MET'}; >= 7x TRL: "
        f"{'met' if ts / fs >= 7 else 'NOT MET'})" if a.device == "cuda" else " (CPU mode: a check, not a figure)"))
    if fm is not None and tm is not None:
        print(f"memory: ferryd / TRL {fm / tm:.2f} (target <= 1: {'met' if fm <= tm else 'NOT MET'})")
    print(json.dumps({"device": a.device, "model": model, "steps": steps, "warmup": warmup,
                      "calibration": {"before": before, "after": after, "unit": unit}, "reps": reps,
                      "ferryd_s_per_step": fs, "trl_s_per_step": ts, "ferryd_peak_gpu_gib": fm,
                      "trl_peak_gpu_gib": tm}))


if __name__ == "__main__":
    main()
