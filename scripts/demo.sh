#!/usr/bin/env bash
# Sets up Ferry and runs its main job on the bundled example (fixtures/demo): `ferryd train`,
# GRPO with a LoRA adapter on a tiny Llama that half-learned two-digit addition, with the
# co-located generator fed a verified snapshot after every step. The reward (the fraction of
# the answer's digits in place) rises visibly within a few minutes on 2 CPU cores. Then the
# weight path is audited: `ferry convert` of the last checkpoint onto the base is exactly the
# version the generator acknowledged after that step (`ferry verify` names it), the store
# rebuilds that version from base + adapter (`ferry versions materialize`), and `ferry audit
# --run` writes the run's report (the reward curve and the steps); the last line names the file.
#   FERRY_DEMO_OUT   where the run goes (default build/demo)
#   FERRY_DEMO_STEPS optimizer steps (default: the config's 800)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh ferry ferryd
FERRY=build/cli/ferry
FERRYD=build/cli/ferryd
DEMO=fixtures/demo
OUT=${FERRY_DEMO_OUT:-build/demo}
rm -rf "$OUT"
mkdir -p "$OUT"
STEPS=()
if [ -n "${FERRY_DEMO_STEPS:-}" ]; then STEPS=(--max-steps "$FERRY_DEMO_STEPS"); fi

echo "== ferryd train: GRPO on $DEMO (config: $DEMO/grpo.toml)"
"$FERRYD" train --config "$DEMO/grpo.toml" --dir "$OUT/run" "${STEPS[@]}"

echo
echo "== the reward, averaged over each 10 logged lines (100 steps) (it was about 0.63 before training)"
awk '{
  if (match($0, /"reward":[-0-9.eE+]+/)) { sum += substr($0, RSTART + 9, RLENGTH - 9); n++ }
  if (match($0, /"step":[0-9]+/)) step = substr($0, RSTART + 7, RLENGTH - 7)
  if (n == 10) { printf "up to step %4d: reward %.3f\n", step, sum / n; sum = 0; n = 0 }
} END { if (n > 0) printf "up to step %4d: reward %.3f\n", step, sum / n }' "$OUT/run/metrics.jsonl"

LAST=$(ls -d "$OUT"/run/checkpoint-* | sed 's/.*checkpoint-//' | sort -n | tail -1)
VERSION=$(grep "\"step\":$LAST," "$OUT/run/metrics.jsonl" | sed 's/.*"generator_version":"\([0-9a-f]*\)".*/\1/')
echo
echo "== step $LAST: the generator acknowledged version $VERSION"
echo "== ferry convert of checkpoint-$LAST onto the base, then ferry verify against the run's store"
"$FERRY" convert --base "$DEMO/model" --adapter "$OUT/run/checkpoint-$LAST" --out "$OUT/merged-$LAST"
"$FERRY" verify "$OUT/merged-$LAST" --db "$OUT/run/store" --version "$VERSION"
echo
echo "== the store rebuilds that version from base + adapter (it recorded only its digests)"
"$FERRY" versions materialize "$VERSION" --db "$OUT/run/store" --out "$OUT/materialized-$LAST"
# The run's name in the store ([store] run; the demo's config keeps the default).
RUN=$(tr -d '\n' < "$OUT/run/run_config.json" | sed -n 's/.*"store": *{[^}]*"run": *"\([^"]*\)".*/\1/p')
RUN=${RUN:-default}
echo
echo "== ferry audit --run $RUN: every step's adapter and merged version, which generator acknowledged it and"
echo "   when, the anomalies; the HTML report plots reward, KL, entropy, completion length, the sampling"
echo "   mismatch and the learning rate per step"
"$FERRY" audit --db "$OUT/run/store" --run "$RUN" --html "$OUT/audit.html" | sed -n '/^Generators/,$p'
echo
echo "== the run's report (reward curve, per-step table, anomalies): $OUT/audit.html"
