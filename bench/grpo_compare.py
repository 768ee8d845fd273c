#!/usr/bin/env python3
"""ferryd against TRL's GRPOTrainer on the same model, prompts, reward and settings, side by side in one run.

    /tmp/fixvenv/bin/python bench/grpo_compare.py [--ferryd build/cli/ferryd] [--demo fixtures/demo]
        [--steps 60] [--warmup-steps 5] [--reps 2] [--threads 2] [--omp-wait-policy default|PASSIVE|ACTIVE]

Each repetition runs ferryd (`ferryd train` on the demo's grpo.toml with max_steps --steps and a metrics line per
step) and then bench/trl_grpo_peer.py (TRL 1.16, the same settings: see its docstring for the fair-comparison
protocol), alternately, so both see the same machine. Both get the same thread count and the same OpenMP wait
policy: by default none is set (libgomp's default: a waiting thread spins briefly, then sleeps), as a user runs them;
--omp-wait-policy PASSIVE (threads sleep at once) is for a machine other jobs load, where spinning threads slow
either side many times over, but on an idle machine it costs ferryd, whose small operations each wake a thread, a
factor of 2-4. Per side: the median wall time of
an optimizer step after the warm-up steps (ferryd: its step_time metric, from the start of the step to the
generator's acknowledgement of the new weights; the step's store record follows it and is not included (it records
the step's metrics: docs/daemon.md "Speed"); TRL: TrainerCallback on_step_begin to on_step_end), the generated
tokens per second, the peak RSS, and the reward over the last logged steps. Also each side's whole cycle: the mean
time from one timed step to the next with everything between steps included (ferryd: the commit times of the steps'
adapter versions in its store, so its store record counts; TRL: on_step_begin to the next on_step_begin, so its
logging counts). Prints one JSON object and two ratio lines: `ferryd/TRL step time` and the whole-cycle ratio
(lower is better for ferryd).
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def child_peak_rss(cmd, env):
    """Runs cmd in a fresh Python child that reports its own child's peak RSS (bytes)."""
    probe = ("import resource, subprocess, sys, json\n"
             "rc = subprocess.call(sys.argv[1:])\n"
             "print(json.dumps({'rc': rc, 'rss': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))\n")
    out = subprocess.run([sys.executable, "-c", probe] + cmd, env=env, stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_ferryd(args, env, work, rep):
    cfg = open(os.path.join(args.demo, "grpo.toml")).read()
    lines = []
    batch = 128
    for line in cfg.splitlines():
        key = line.split("=")[0].strip()
        if key == "max_steps":
            line = "max_steps = %d" % args.steps
        elif key == "logging_steps":
            line = "logging_steps = 1"
        elif key == "save_steps":
            line = "save_steps = %d" % (args.steps * 10)
        elif key == "per_device_train_batch_size":
            batch = int(line.split("=")[1].split("#")[0])
        elif key == "threads":
            line = "threads = %d" % args.threads
        elif key == "model_name_or_path":
            line = 'model_name_or_path = "%s"' % os.path.abspath(os.path.join(args.demo, "model"))
        elif key == "dataset":
            line = 'dataset = "%s"' % os.path.abspath(os.path.join(args.demo, "train.jsonl"))
        lines.append(line)
    config = os.path.join(work, "grpo-%d.toml" % rep)
    with open(config, "w") as f:
        f.write("\n".join(lines) + "\n")
    run_dir = os.path.join(work, "ferryd-%d" % rep)
    res = child_peak_rss([args.ferryd, "train", "--config", config, "--dir", run_dir], env)
    if res["rc"] != 0:
        sys.exit("grpo_compare: ferryd exited %d" % res["rc"])
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    timed = [r for r in rows if r["step"] > args.warmup_steps]
    times = [r["step_time"] for r in timed]
    tokens = sum(r["completions/mean_length"] * batch for r in timed)
    # Whole cycles: the commit times of the steps' adapter versions in the run's store (each step's
    # store record, checkpointing and logging included), from the last warm-up step's to the last's.
    out = subprocess.run([args.ferry, "versions", "list", "--db", os.path.join(run_dir, "store"), "--kind",
                          "adapter", "--json"], stdout=subprocess.PIPE, text=True, check=True)
    commit = {v["step"]: v["time_ns"] * 1e-9 for v in json.loads(out.stdout)}
    last = max(commit)
    cycle = (commit[last] - commit[args.warmup_steps]) / (last - args.warmup_steps)
    return {"s_per_step_median": statistics.median(times), "s_per_step_mean": statistics.mean(times),
            "s_per_step_cycle": cycle,
            "generated_tokens_per_s": tokens / sum(times), "peak_rss_bytes": res["rss"],
            "reward_last_10": statistics.mean(r["reward"] for r in rows[-10:])}


def run_trl(args, env):
    cmd = [sys.executable, os.path.join(HERE, "trl_grpo_peer.py"), "--model", os.path.join(args.demo, "model"),
           "--dataset", os.path.join(args.demo, "train.jsonl"), "--steps", str(args.steps), "--threads",
           str(args.threads), "--warmup-steps", str(args.warmup_steps), "--logging-steps", "1"]
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if out.returncode != 0:
        sys.exit("grpo_compare: trl_grpo_peer.py exited %d" % out.returncode)
    j = json.loads(out.stdout.strip().splitlines()[-1])
    rewards = [r for _, r in j["reward_log"]][-10:]
    return {"s_per_step_median": j["s_per_step_median"], "s_per_step_mean": j["s_per_step_mean"],
            "s_per_step_cycle": j["s_per_step_cycle"], "generated_tokens_per_s": j["generated_tokens_per_s"], "peak_rss_bytes": j["peak_rss_bytes"],
            "reward_last_10": statistics.mean(rewards) if rewards else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ferryd", default="build/cli/ferryd")
    ap.add_argument("--ferry", default=None, help="the ferry command (default: beside --ferryd)")
    ap.add_argument("--demo", default="fixtures/demo")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--omp-wait-policy", choices=["default", "PASSIVE", "ACTIVE"], default="default")
    args = ap.parse_args()
    if args.ferry is None:
        args.ferry = os.path.join(os.path.dirname(args.ferryd), "ferry")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    env.pop("OMP_WAIT_POLICY", None)
    if args.omp_wait_policy != "default":
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy
    result = {"steps": args.steps, "warmup_steps": args.warmup_steps, "threads": args.threads,
              "omp_wait_policy": args.omp_wait_policy, "ferryd": [], "trl": []}
    with tempfile.TemporaryDirectory(prefix="ferry_grpo_compare_") as work:
        for rep in range(args.reps):
            result["ferryd"].append(run_ferryd(args, env, work, rep))
            result["trl"].append(run_trl(args, env))
    f = statistics.median(r["s_per_step_median"] for r in result["ferryd"])
    t = statistics.median(r["s_per_step_median"] for r in result["trl"])
    result["ratio_step_time_ferryd_over_trl"] = f / t
    fc = statistics.median(r["s_per_step_cycle"] for r in result["ferryd"])
    tc = statistics.median(r["s_per_step_cycle"] for r in result["trl"])
    result["ratio_cycle_ferryd_over_trl"] = fc / tc
    result["ratio_peak_rss_ferryd_over_trl"] = (statistics.median(r["peak_rss_bytes"] for r in result["ferryd"]) /
                                                 statistics.median(r["peak_rss_bytes"] for r in result["trl"]))
    result["load_average"] = os.getloadavg()
    print(json.dumps(result))
    print("ferryd %.4f s/step, TRL %.4f s/step: ferryd/TRL step time %.3f (ferryd %.1fx faster); peak RSS ratio %.2f"
          % (f, t, f / t, t / f, result["ratio_peak_rss_ferryd_over_trl"]), file=sys.stderr)
    print("whole cycles (everything between steps included): ferryd %.4f s/step, TRL %.4f s/step: ratio %.3f "
          "(ferryd %.1fx faster)" % (fc, tc, fc / tc, tc / fc), file=sys.stderr)


if __name__ == "__main__":
    main()
