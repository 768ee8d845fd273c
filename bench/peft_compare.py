#!/usr/bin/env python3
"""Ferry vs PEFT on the same merge: wall time, peak RSS, and whether the outputs agree.

For each repeat, interleaved, in separate child processes (so each peak RSS is its own):
  ferry  `ferry convert --base B --adapter A --out W/ferry_out` (layout hf, default threads)
  peft   AutoModelForCausalLM.from_pretrained(B, dtype=bfloat16) -> PeftModel.from_pretrained(A)
         -> merge_and_unload() -> save_pretrained(W/peft_out, safe_serialization=True)
Peak RSS is the child's ru_maxrss (os.wait4). PEFT's time is given two ways: the whole child
process (Python + torch + transformers imports included) and load-to-saved only (imports
excluded, the figure most favourable to PEFT); the ratio uses the latter.

Then the last outputs are compared: with `ferry diff PEFT_OUT FERRY_OUT --max-ulp 1 --json`
when that command works, and always independently here, tensor by tensor in torch (same key
set, dtypes, shapes; largest BF16 ULP distance).

Setup (CPU-only torch is enough):
  python3 -m venv /tmp/fixvenv && /tmp/fixvenv/bin/pip install -r fixtures/requirements.txt
Usage:
  /tmp/fixvenv/bin/python bench/peft_compare.py --ferry build/cli/ferry \\
      --base /tmp/cbench/large/base --adapter /tmp/cbench/large/adapter --work /tmp/cbench/peft [--repeats 3]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time


def peft_worker(base, adapter, out):
    """Runs in a child process: the PEFT merge, timed; prints one JSON line."""
    t_start = time.perf_counter()
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    t_imported = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    except TypeError:  # transformers < 4.56 names it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.bfloat16)
    t_loaded = time.perf_counter()
    model = PeftModel.from_pretrained(model, adapter)
    t_adapter = time.perf_counter()
    merged = model.merge_and_unload()
    t_merged = time.perf_counter()
    merged.save_pretrained(out, safe_serialization=True)
    t_saved = time.perf_counter()
    print(json.dumps({
        "import_s": t_imported - t_start,
        "load_base_s": t_loaded - t_imported,
        "load_adapter_s": t_adapter - t_loaded,
        "merge_s": t_merged - t_adapter,
        "save_s": t_saved - t_merged,
        "work_s": t_saved - t_imported,
        "torch_threads": torch.get_num_threads(),
    }))


def run_measured(argv):
    """Runs argv and reaps it with wait4: (wall seconds, CPU seconds (user + system), peak RSS
    bytes, stdout text)."""
    r, w = os.pipe()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os.dup2(w, 1)
        os.close(r)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        try:
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {code}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, b"".join(chunks).decode()


def rm(path):
    if os.path.lexists(path):
        shutil.rmtree(path)


def warm(directory):
    """Reads every file of a directory once, so both tools start from a warm page cache."""
    for name in sorted(os.listdir(directory)):
        p = os.path.join(directory, name)
        if os.path.isfile(p):
            with open(p, "rb") as f:
                while f.read(1 << 24):
                    pass


def bf16_ulp_vector(a, b):
    """Element-wise ULP distance between two BF16 tensors (ordered-integer mapping of the bits)."""
    import torch

    def ordered(t):
        i = t.contiguous().view(torch.int16).to(torch.int32)
        # Sign-magnitude to two's-complement order: negative values count down from 0.
        return torch.where(i < 0, -(i & 0x7FFF), i)

    return (ordered(a) - ordered(b)).abs()


def bf16_ulp_distance(a, b):
    """Largest ULP distance between two BF16 tensors."""
    return int(bf16_ulp_vector(a, b).max().item()) if a.numel() else 0


def lora_reference(base_tensors, adapter_tensors, adapter_config, key, index):
    """(exact fp64 merged values, |W| + scaling * sum_k |B_ik A_kj|) of base tensor `key` at flat
    positions `index`, or None when `key` has no lora_A/lora_B pair (or the config uses
    per-module patterns, DoRA or fan_in_fan_out)."""
    import torch

    cfg = adapter_config
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern") or cfg.get("use_dora") or cfg.get("fan_in_fan_out"):
        return None
    module = "base_model.model." + key[: -len(".weight")]
    a_key, b_key = module + ".lora_A.weight", module + ".lora_B.weight"
    if a_key not in adapter_tensors or b_key not in adapter_tensors or key not in base_tensors:
        return None
    r = cfg["r"]
    scaling = cfg["lora_alpha"] / (r ** 0.5 if cfg.get("use_rslora") else r)
    w = base_tensors[key].get_tensor(key)
    a = adapter_tensors[a_key].get_tensor(a_key).double()  # [r, in]
    b = adapter_tensors[b_key].get_tensor(b_key).double()  # [out, r]
    rows, cols = index // w.shape[1], index % w.shape[1]
    products = b[rows] * a[:, cols].T  # [n, r]
    w = w.reshape(-1)[index].double()
    return w + scaling * products.sum(dim=1), w.abs() + scaling * products.abs().sum(dim=1)


def open_all(d):
    """{tensor name: safe_open handle} over every .safetensors file of directory d."""
    from safetensors import safe_open

    where = {}
    for f in sorted(f for f in os.listdir(d) if f.endswith(".safetensors")):
        h = safe_open(os.path.join(d, f), framework="pt")
        for k in h.keys():
            where[k] = h
    return where


def compare_in_python(peft_out, ferry_out, base, adapter):
    """Independent check: key sets, dtypes, shapes, the largest ULP / abs difference, and at
    every element where the two differ, which one is closer to the exact fp64 merge."""
    import torch

    pa, fa = open_all(peft_out), open_all(ferry_out)
    base_tensors, adapter_tensors = open_all(base), open_all(adapter)
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        adapter_config = json.load(f)
    result = {"keys_only_in_peft": sorted(set(pa) - set(fa)), "keys_only_in_ferry": sorted(set(fa) - set(pa)),
              "dtype_or_shape_mismatch": [], "tensors": 0, "identical": 0, "max_ulp": 0, "max_abs": 0.0,
              "elements_differing": 0, "elements": 0, "worst_tensor": None, "elements_over_1ulp": 0,
              "differing_checked_vs_fp64": 0, "ferry_closer": 0, "peft_closer": 0, "equally_close": 0,
              "max_diff_over_bound": 0.0, "max_over_1ulp_diff_over_fp32_bound": 0.0, "max_ferry_err_abs": 0.0, "max_peft_err_abs": 0.0}
    rank = adapter_config.get("r", 8)
    for k in sorted(set(pa) & set(fa)):
        a, b = pa[k].get_tensor(k), fa[k].get_tensor(k)
        result["tensors"] += 1
        if a.dtype != b.dtype or a.shape != b.shape:
            result["dtype_or_shape_mismatch"].append(f"{k}: peft {a.dtype} {tuple(a.shape)} ferry {b.dtype} {tuple(b.shape)}")
            continue
        result["elements"] += a.numel()
        if torch.equal(a, b):
            result["identical"] += 1
            continue
        result["elements_differing"] += int((a != b).sum().item())
        ulp = bf16_ulp_distance(a, b) if a.dtype == torch.bfloat16 else -1
        if a.dtype == torch.bfloat16:
            result["elements_over_1ulp"] += int((bf16_ulp_vector(a, b) > 1).sum().item())
        index = (a != b).reshape(-1).nonzero().squeeze(1)
        ref = lora_reference(base_tensors, adapter_tensors, adapter_config, k, index) if a.dim() == 2 else None
        if ref is not None:
            ref, magnitude = ref
            av, bv = a.reshape(-1)[index].double(), b.reshape(-1)[index].double()
            err_peft, err_ferry = (av - ref).abs(), (bv - ref).abs()
            # Two correct implementations differ by at most one BF16 rounding each plus the fp32
            # accumulation error of each: 2 * (r + 1) * 2^-24 * (|W| + s * sum |B A|).
            _, exponent = torch.frexp(torch.maximum(av.abs(), bv.abs()))
            bound = torch.ldexp(torch.ones_like(av), exponent - 8) + 2 * (rank + 1) * 2.0**-24 * magnitude
            result["max_diff_over_bound"] = max(result["max_diff_over_bound"], float(((av - bv).abs() / bound).max()))
            over = bf16_ulp_vector(a.reshape(-1)[index], b.reshape(-1)[index]) > 1
            if bool(over.any()):
                fp32_bound = 2 * (rank + 1) * 2.0**-24 * magnitude[over]
                result["max_over_1ulp_diff_over_fp32_bound"] = max(
                    result["max_over_1ulp_diff_over_fp32_bound"], float(((av - bv).abs()[over] / fp32_bound).max()))
            result["max_ferry_err_abs"] = max(result["max_ferry_err_abs"], float(err_ferry.max()))
            result["max_peft_err_abs"] = max(result["max_peft_err_abs"], float(err_peft.max()))
            result["differing_checked_vs_fp64"] += index.numel()
            result["ferry_closer"] += int((err_ferry < err_peft).sum().item())
            result["peft_closer"] += int((err_peft < err_ferry).sum().item())
            result["equally_close"] += int((err_peft == err_ferry).sum().item())
        diff = float((a.float() - b.float()).abs().max().item())
        if ulp > result["max_ulp"]:
            result["max_ulp"], result["worst_tensor"] = ulp, k
        result["max_abs"] = max(result["max_abs"], diff)
    return result


def ferry_diff(ferry, peft_out, ferry_out, extra=()):
    """`ferry diff PEFT_OUT FERRY_OUT --max-ulp 1 [extra] --json`: (exit code, parsed JSON or None, note)."""
    probe = subprocess.run([ferry, "diff", "--help"], capture_output=True, text=True)
    if probe.returncode != 0:
        return None, None, "ferry diff is not available in this build"
    p = subprocess.run([ferry, "diff", peft_out, ferry_out, "--max-ulp", "1", *extra, "--json"], capture_output=True,
                       text=True)
    try:
        return p.returncode, json.loads(p.stdout), ""
    except json.JSONDecodeError:
        return p.returncode, None, (p.stdout + p.stderr)[-2000:]


def fmt_mib(b):
    return f"{b / 2**20:8.0f} MiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ferry", help="path to the ferry binary")
    ap.add_argument("--base", required=True)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--work", help="scratch directory for the outputs (under /tmp)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-out", help="also write the figures as JSON here")
    ap.add_argument("--peft-worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.peft_worker_out:
        peft_worker(args.base, args.adapter, args.peft_worker_out)
        return 0
    if not args.ferry or not args.work:
        ap.error("--ferry and --work are required")

    os.makedirs(args.work, exist_ok=True)
    ferry_out = os.path.join(args.work, "ferry_out")
    peft_out = os.path.join(args.work, "peft_out")
    warm(args.base)
    warm(args.adapter)

    rows = []
    for i in range(args.repeats):
        rm(ferry_out)
        f_wall, f_cpu, f_rss, _ = run_measured([args.ferry, "convert", "--base", args.base, "--adapter", args.adapter,
                                         "--out", ferry_out, "--json"])
        rm(peft_out)
        p_wall, p_cpu, p_rss, p_stdout = run_measured([sys.executable, os.path.abspath(__file__), "--base", args.base,
                                                "--adapter", args.adapter, "--peft-worker-out", peft_out])
        phases = json.loads(p_stdout.strip().splitlines()[-1])
        rows.append({"ferry_s": f_wall, "ferry_cpu_s": f_cpu, "ferry_rss": f_rss, "peft_process_s": p_wall,
                     "peft_work_s": phases["work_s"], "peft_cpu_s": p_cpu, "peft_rss": p_rss, "peft_phases": phases})
        print(f"  run {i + 1}: ferry {f_wall:6.2f} s ({f_cpu:.1f} s cpu) {fmt_mib(f_rss)} | peft {phases['work_s']:6.2f} s "
              f"work ({p_wall:6.2f} s process, {p_cpu:.1f} s cpu) {fmt_mib(p_rss)}  [peft load {phases['load_base_s']:.1f} adapter "
              f"{phases['load_adapter_s']:.1f} merge {phases['merge_s']:.1f} save {phases['save_s']:.1f} s, "
              f"{phases['torch_threads']} torch threads]", flush=True)

    med = {k: statistics.median(r[k] for r in rows)
           for k in ("ferry_s", "ferry_cpu_s", "ferry_rss", "peft_process_s", "peft_work_s", "peft_cpu_s", "peft_rss")}
    print(f"\nFerry vs PEFT, median of {args.repeats} (interleaved, warm page cache)")
    print(f"  {'':22}{'ferry':>14}{'peft':>14}{'peft/ferry':>12}")
    print(f"  {'time (PEFT w/o imports)':22}{med['ferry_s']:12.2f} s{med['peft_work_s']:12.2f} s"
          f"{med['peft_work_s'] / med['ferry_s']:11.1f}x")
    print(f"  {'time (PEFT process)':22}{med['ferry_s']:12.2f} s{med['peft_process_s']:12.2f} s"
          f"{med['peft_process_s'] / med['ferry_s']:11.1f}x")
    print(f"  {'cpu (PEFT process)':22}{med['ferry_cpu_s']:12.2f} s{med['peft_cpu_s']:12.2f} s"
          f"{med['peft_cpu_s'] / med['ferry_cpu_s']:11.1f}x")
    print(f"  {'peak RSS':22}{fmt_mib(med['ferry_rss']):>14}{fmt_mib(med['peft_rss']):>14}"
          f"{med['peft_rss'] / med['ferry_rss']:11.1f}x")

    diff_summary = None
    code = None
    # --max-ulp 1 alone, then with an absolute tolerance for near-zero merged values (see below).
    for extra in ((), ("--atol", "1e-9")):
        c, diff_json, note = ferry_diff(args.ferry, peft_out, ferry_out, extra)
        if diff_json is None:
            print(f"\nferry diff: {note}")
            break
        counts = diff_json.get("counts", {k: v for k, v in diff_json.items() if k != "tensors"})
        print(f"\nferry diff PEFT_OUT FERRY_OUT --max-ulp 1 {' '.join(extra)} --json: exit {c}")
        print("  " + json.dumps(counts))
        if not extra:
            code, diff_summary = c, counts
    py = compare_in_python(peft_out, ferry_out, args.base, args.adapter)
    same_keys = not py["keys_only_in_peft"] and not py["keys_only_in_ferry"] and not py["dtype_or_shape_mismatch"]
    within_1ulp = same_keys and py["max_ulp"] <= 1
    # Both round fp32 W + delta to BF16 once, but sum the r products of delta in different
    # orders: where W + delta nearly cancels, that fp32 difference is several BF16 ulps of the tiny
    # result. So agreement is: every differing element within the bound of compare_in_python.
    agree = (same_keys and py["differing_checked_vs_fp64"] == py["elements_differing"]
             and py["max_diff_over_bound"] <= 1.0)
    print(f"python check: {py['tensors']} common tensors, {py['identical']} bit-identical, "
          f"{py['elements_differing']} of {py['elements']} elements differ, {py['elements_over_1ulp']} by more "
          f"than 1 ulp, max {py['max_ulp']} BF16 ulp (max abs {py['max_abs']:.3g}, worst {py['worst_tensor']}); "
          f"keys only in peft {py['keys_only_in_peft']}, only in ferry {py['keys_only_in_ferry']}, "
          f"dtype/shape mismatches {py['dtype_or_shape_mismatch']}")
    print(f"  at the {py['differing_checked_vs_fp64']} differing elements vs the exact fp64 merge: ferry closer "
          f"{py['ferry_closer']}, peft closer {py['peft_closer']}, equally close {py['equally_close']}; max abs error "
          f"ferry {py['max_ferry_err_abs']:.3g}, peft {py['max_peft_err_abs']:.3g}")
    print(f"  largest |peft - ferry| / (1 BF16 ulp + 2 (r+1) 2^-24 (|W| + s sum|BA|)) = {py['max_diff_over_bound']:.3f}; "
          f"over the elements more than 1 ulp apart, largest |peft - ferry| / (2 (r+1) 2^-24 (|W| + s sum|BA|)) = "
          f"{py['max_over_1ulp_diff_over_fp32_bound']:.3f}")
    print(f"outputs within 1 ulp everywhere: {'PASS' if within_1ulp else 'FAIL'}; same keys/dtypes/shapes and every "
          f"difference within one BF16 rounding + fp32 accumulation error: {'PASS' if agree else 'FAIL'}")

    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"runs": rows, "median": med, "ferry_diff_exit": code, "ferry_diff": diff_summary,
                       "python_check": py, "within_1ulp": within_1ulp, "agree": agree}, f, indent=2)
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
