#!/usr/bin/env bash
# Benchmarks `ferry convert` (speed and peak memory) against `cp -r` of the same base, on
# synthetic Llama-shaped BF16 models of two sizes, and optionally against PEFT.
#
#   1. time: like for like, `ferry convert --no-fsync` vs `cp -r BASE OUT` (target <= 1.5x)
#      and the default, fsynced `ferry convert` vs a durable copy (`cp -r` + `sync` of the
#      copied files). The fused and lora layouts are timed too.
#   2. peak RSS (/usr/bin/time -v "Maximum resident set size") of each ferry run vs the
#      target 3 x (largest single tensor bytes) + 256 MiB, for both sizes; one extra
#      sampled run splits the resident set into anonymous memory and mapped-file pages.
#   3. PEFT (bench/peft_compare.py), unless --no-peft or the Python venv is missing.
#
# All runs of one size are interleaved (cp, ferry hf, fused, lora; repeated) from a warm
# page cache (every input file is read once first); figures are medians.
#
# Usage: bench/convert_bench.sh [--build DIR] [--work DIR] [--repeats N]
#          [--small-layers N] [--large-layers N] [--python PY] [--peft-size small|large] [--no-peft]
# Models are generated under --work (default /tmp/ferry-convert-bench) by
# ferry_bench_make_model and kept for later runs.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
build="${here}/../build"
work="/tmp/ferry-convert-bench"
repeats=3
small_layers=3
large_layers=22
python="/tmp/fixvenv/bin/python"
peft_size="large"
run_peft=1
# TinyLlama-1.1B shapes; only the layer count differs between the two sizes, so the largest
# tensor (embed_tokens / lm_head, vocab x hidden) and hence the memory target are the same.
hidden=2048 intermediate=5632 vocab=32000 heads=32 kv_heads=4

die() { echo "convert_bench: $*" >&2; exit 1; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) build="$2"; shift 2 ;;
    --work) work="$2"; shift 2 ;;
    --repeats) repeats="$2"; shift 2 ;;
    --small-layers) small_layers="$2"; shift 2 ;;
    --large-layers) large_layers="$2"; shift 2 ;;
    --python) python="$2"; shift 2 ;;
    --peft-size) peft_size="$2"; shift 2 ;;
    --no-peft) run_peft=0; shift ;;
    -h|--help) sed -n '2,21p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

ferry="${build}/cli/ferry"
maker="${build}/bench/ferry_bench_make_model"
[[ -x "$ferry" ]] || die "${ferry}: not built (ninja -C ${build} ferry)"
[[ -x "$maker" ]] || die "${maker}: not built (ninja -C ${build} ferry_bench_make_model)"
[[ -x /usr/bin/time ]] || die "/usr/bin/time is missing (apt-get install time)"
[[ "$repeats" =~ ^[1-9][0-9]*$ ]] || die "--repeats must be a positive integer"
mkdir -p "$work"

# median of the arguments
median() { printf '%s\n' "$@" | sort -g | awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }
mib() { awk -v b="$1" 'BEGIN {printf "%.0f", b / 1048576}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {if (b > 0) printf "%.2f", a / b; else printf "-"}'; }
now() { date +%s.%N; }

# timed CMD...: runs CMD under /usr/bin/time; sets T (wall seconds), CPU (user + system
# seconds: steadier than wall time on a shared machine) and RSS (bytes).
timed() {
  local tf; tf="$(mktemp)"
  local t0; t0="$(now)"
  /usr/bin/time -v -o "$tf" "$@" >/dev/null
  local t1; t1="$(now)"
  T="$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.3f", b - a}')"
  RSS="$(awk -F': ' '/Maximum resident set size/ {print $2 * 1024}' "$tf")"
  CPU="$(awk -F': ' '/User time|System time/ {s += $2} END {printf "%.2f", s}' "$tf")"
  rm -f "$tf"
}

make_model() {  # make_model DIR LAYERS
  local dir="$1" layers="$2"
  local stamp="hidden=${hidden} intermediate=${intermediate} layers=${layers} vocab=${vocab} heads=${heads} kv=${kv_heads} r=16"
  if [[ -f "${dir}/stamp" && "$(cat "${dir}/stamp")" == "$stamp" ]]; then return; fi
  rm -rf "$dir"
  "$maker" --base "${dir}/base" --adapter "${dir}/adapter" --hidden "$hidden" --intermediate "$intermediate" \
    --layers "$layers" --vocab "$vocab" --heads "$heads" --kv-heads "$kv_heads" --rank 16 --alpha 32 >/dev/null
  echo "$stamp" > "${dir}/stamp"
}

# sampled_rss BASE ADAPTER OUT: one ferry hf run with /proc/PID/status and /proc/PID/smaps
# sampled every 0.05 s. Sets ANON_MAX (heap), FILE_MAX (all mapped-file pages), BASE_MAX and
# ADAPTER_MAX (resident pages of the base's and the adapter's mapped files), in bytes, and
# BASE_AT / ADAPTER_AT (when in the run, as a fraction, each peaked). Sampling can miss
# short peaks: /usr/bin/time's figure is the authoritative maximum.
sampled_rss() {
  local base_abs adapter_abs
  base_abs="$(realpath "$1")" adapter_abs="$(realpath "$2")"
  "$ferry" convert --base "$1" --adapter "$2" --out "$3" >/dev/null &
  local pid=$! n=0 anon=0 file=0 bmax=0 amax=0 bat=0 aat=0 a f b d
  while [[ -r /proc/$pid/status ]]; do
    read -r a f < <(awk '/^RssAnon/ {a=$2} /^RssFile/ {f=$2} END {print a+0, f+0}' "/proc/$pid/status" 2>/dev/null || echo "0 0")
    read -r b d < <(awk -v B="$base_abs/" -v A="$adapter_abs/" '
        /^[0-9a-f]+-[0-9a-f]+ / {cur = (index($6, B) == 1) ? "b" : (index($6, A) == 1) ? "a" : ""}
        /^Rss:/ {if (cur == "b") b += $2; else if (cur == "a") a += $2}
        END {print b+0, a+0}' "/proc/$pid/smaps" 2>/dev/null || echo "0 0")
    (( a > anon )) && anon=$a
    (( f > file )) && file=$f
    (( b > bmax )) && { bmax=$b; bat=$n; }
    (( d > amax )) && { amax=$d; aat=$n; }
    n=$((n + 1))
    sleep 0.05
  done
  wait "$pid"
  ANON_MAX=$((anon * 1024)) FILE_MAX=$((file * 1024)) BASE_MAX=$((bmax * 1024)) ADAPTER_MAX=$((amax * 1024))
  BASE_AT="$(awk -v a="$bat" -v n="$n" 'BEGIN {printf "%.0f%%", n ? 100 * a / n : 0}')"
  ADAPTER_AT="$(awk -v a="$aat" -v n="$n" 'BEGIN {printf "%.0f%%", n ? 100 * a / n : 0}')"
}

largest=$(( (vocab * hidden > intermediate * hidden ? vocab * hidden : intermediate * hidden) * 2 ))
target_rss=$(( 3 * largest + 256 * 1048576 ))

echo "ferry convert benchmark: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GB", $2/1e6}' /proc/meminfo) RAM, ${repeats} interleaved repeats, warm page cache"
echo "binary: ${ferry}; load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
declare -A summary
for size in small large; do
  layers=$small_layers; [[ $size == large ]] && layers=$large_layers
  dir="${work}/${size}"
  make_model "$dir" "$layers"
  base="${dir}/base" adapter="${dir}/adapter"
  cat "$base"/* "$adapter"/* >/dev/null   # warm the page cache
  bytes=$(du -sb "$base" | cut -f1)
  echo
  echo "== ${size}: ${layers} layers, hidden ${hidden}, intermediate ${intermediate}, vocab ${vocab}, base $(mib "$bytes") MiB BF16, r=16 on all 7 projections"
  declare -a t_cp=() t_cps=() t_hf=() t_hfn=() t_fused=() t_lora=() r_hf=() r_hfn=() r_fused=() r_lora=()
  declare -a c_cp=() c_cps=() c_hf=() c_hfn=() c_fused=() c_lora=()
  for ((i = 0; i < repeats; ++i)); do
    out="${dir}/out"
    rm -rf "$out"; timed cp -r "$base" "$out"; t_cp+=("$T"); c_cp+=("$CPU")
    rm -rf "$out"; timed bash -c 'cp -r "$1" "$2" && sync "$2"/*' _ "$base" "$out"; t_cps+=("$T"); c_cps+=("$CPU")
    rm -rf "$out"; timed "$ferry" convert --base "$base" --adapter "$adapter" --out "$out"; t_hf+=("$T"); r_hf+=("$RSS"); c_hf+=("$CPU")
    rm -rf "$out"; timed "$ferry" convert --base "$base" --adapter "$adapter" --out "$out" --no-fsync; t_hfn+=("$T"); r_hfn+=("$RSS"); c_hfn+=("$CPU")
    rm -rf "$out"; timed "$ferry" convert --base "$base" --adapter "$adapter" --out "$out" --layout fused; t_fused+=("$T"); r_fused+=("$RSS"); c_fused+=("$CPU")
    rm -rf "$out"; timed "$ferry" convert --base "$base" --adapter "$adapter" --out "$out" --layout lora; t_lora+=("$T"); r_lora+=("$RSS"); c_lora+=("$CPU")
    rm -rf "$out"
    echo "  run $((i + 1)) (wall s): cp ${t_cp[-1]}, cp+sync ${t_cps[-1]}, hf ${t_hf[-1]} ($(mib "${r_hf[-1]}") MiB), hf --no-fsync ${t_hfn[-1]}, fused ${t_fused[-1]} ($(mib "${r_fused[-1]}") MiB), lora ${t_lora[-1]} ($(mib "${r_lora[-1]}") MiB); load $(cut -d' ' -f1 /proc/loadavg)"
  done
  sampled_rss "$base" "$adapter" "${dir}/out"; rm -rf "${dir}/out"
  cp_m=$(median "${t_cp[@]}") cps_m=$(median "${t_cps[@]}")
  hf_m=$(median "${t_hf[@]}") hfn_m=$(median "${t_hfn[@]}") fused_m=$(median "${t_fused[@]}") lora_m=$(median "${t_lora[@]}")
  ccp=$(median "${c_cp[@]}") ccps=$(median "${c_cps[@]}")
  chf=$(median "${c_hf[@]}") chfn=$(median "${c_hfn[@]}") cfused=$(median "${c_fused[@]}") clora=$(median "${c_lora[@]}")
  rhf=$(median "${r_hf[@]}") rfused=$(median "${r_fused[@]}") rlora=$(median "${r_lora[@]}")
  # Like for like: cp -r fsyncs nothing, so the target compares it with `--no-fsync`; the
  # default (fsynced) conversion is compared with the durable copy (cp -r + sync).
  time_ratio=$(ratio "$hfn_m" "$cp_m")
  durable_ratio=$(ratio "$hf_m" "$cps_m")
  time_ok=$(awk -v r="$time_ratio" 'BEGIN {print (r <= 1.5) ? "PASS" : "FAIL"}')
  rss_ok=$(awk -v a="$rhf" -v b="$target_rss" 'BEGIN {print (a <= b) ? "PASS" : "FAIL"}')
  row() { printf '  %-30s %8s %8s %8s %8s %9s\n' "$@"; }
  echo
  row "median of ${repeats}" "wall s" "x cp -r" "cpu s" "x cp -r" "peak RSS"
  row "cp -r base" "$cp_m" "1.00" "$ccp" "1.00" "-"
  row "cp -r + sync (durable copy)" "$cps_m" "$(ratio "$cps_m" "$cp_m")" "$ccps" "$(ratio "$ccps" "$ccp")" "-"
  row "ferry convert --layout hf" "$hf_m" "$(ratio "$hf_m" "$cp_m")" "$chf" "$(ratio "$chf" "$ccp")" "$(mib "$rhf") MiB"
  row "ferry convert hf --no-fsync" "$hfn_m" "$time_ratio" "$chfn" "$(ratio "$chfn" "$ccp")" "-"
  row "ferry convert --layout fused" "$fused_m" "$(ratio "$fused_m" "$cp_m")" "$cfused" "$(ratio "$cfused" "$ccp")" "$(mib "$rfused") MiB"
  row "ferry convert --layout lora" "$lora_m" "$(ratio "$lora_m" "$cp_m")" "$clora" "$(ratio "$clora" "$ccp")" "$(mib "$rlora") MiB"
  echo "  time (hf --no-fsync vs cp -r, wall): ${time_ratio}x vs target <= 1.5x: ${time_ok}; fsynced hf vs cp -r + sync: ${durable_ratio}x"
  echo "  peak RSS (hf) $(mib "$rhf") MiB vs target 3 x $(mib "$largest") MiB (largest tensor) + 256 MiB = $(mib "$target_rss") MiB: ${rss_ok}"
  echo "  sampled hf run (0.05 s): max RssAnon $(mib "$ANON_MAX") MiB (heap), max RssFile $(mib "$FILE_MAX") MiB (mapped files):"
  echo "    base files resident max $(mib "$BASE_MAX") MiB (at ${BASE_AT} of the run), adapter file resident max $(mib "$ADAPTER_MAX") MiB of $(mib "$(du -sb "$adapter" | cut -f1)") MiB (at ${ADAPTER_AT})"
  summary[$size]="$(mib "$bytes") MiB base: hf --no-fsync ${hfn_m} s = ${time_ratio}x cp -r (${time_ok}), fsynced hf ${durable_ratio}x cp -r + sync, peak RSS $(mib "$rhf") MiB / target $(mib "$target_rss") MiB (${rss_ok})"
done

echo
echo "== summary (load average now: $(cut -d' ' -f1-3 /proc/loadavg))"
for size in small large; do echo "  ${size}: ${summary[$size]}"; done

if [[ $run_peft == 1 ]]; then
  if [[ -x "$python" ]]; then
    echo
    echo "== PEFT comparison (${peft_size} model)"
    "$python" "${here}/peft_compare.py" --ferry "$ferry" --base "${work}/${peft_size}/base" \
      --adapter "${work}/${peft_size}/adapter" --work "${work}/peft" --repeats "$repeats" || echo "peft_compare.py: outputs disagree or it failed"
    rm -rf "${work}/peft"
  else
    echo "PEFT comparison skipped: ${python} missing (python3 -m venv /tmp/fixvenv && /tmp/fixvenv/bin/pip install -r fixtures/requirements.txt)"
  fi
fi
