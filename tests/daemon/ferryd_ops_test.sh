#!/usr/bin/env bash
# ferryd operated as people run it, on the bundled demo (fixtures/demo) shortened:
#   1. `ferry daemon start --detach`, status --json, pause (the step count holds), resume,
#      snapshot (a checkpoint and the generator's version id), a second daemon on the same
#      directory refused naming the holder's pid, stop (final checkpoint, exit), status after.
#   2. SIGTERM stops with a checkpoint (exit 0).
#   3. Crash-resume: ferryd killed with SIGKILL at random moments (KILLS times); restarting the
#      same command each time finishes the run, whose metrics equal an uninterrupted run's
#      step for step, every checkpoint is whole, and the store records every step once.
# Usage: ferryd_ops_test.sh FERRY FERRYD FIXTURES_DIR [KILLS]
set -euo pipefail
FERRY=$1
FERRYD=$2
FIXTURES=$3
KILLS=${4:-20}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ferry_ferryd_ops_XXXXXX")
trap 'pkill -9 -f "$WORK" 2>/dev/null || true; rm -rf "$WORK"' EXIT

fail() { echo "FAIL: $*" >&2; exit 1; }
json_field() { sed -n "s/.*\"$2\":\s*\"\?\([^\",}]*\)\"\?.*/\1/p" <<<"$1" | head -1; }

# The demo, shortened: 24 steps, a checkpoint every 4, a line per step.
cp -r "$FIXTURES/demo/model" "$WORK/model"
cp "$FIXTURES/demo/train.jsonl" "$WORK/train.jsonl"
sed -e 's/^max_steps = .*/max_steps = 24/' -e 's/^save_steps = .*/save_steps = 4/' \
    -e 's/^logging_steps = .*/logging_steps = 1/' -e 's/^per_device_train_batch_size = .*/per_device_train_batch_size = 32/' \
    "$FIXTURES/demo/grpo.toml" > "$WORK/grpo.toml"
grep -q '^max_steps = 24$' "$WORK/grpo.toml" || fail "could not shorten the demo config"

echo "== 1. start --detach, status, pause, resume, snapshot, lock, stop"
RUN="$WORK/ops"
"$FERRY" daemon start --config "$WORK/grpo.toml" --dir "$RUN" --max-steps 100000 --detach >/dev/null \
  || fail "daemon start --detach"
STATUS=$("$FERRY" daemon status --dir "$RUN" --json)
[ "$(json_field "$STATUS" state)" = running ] || fail "state after start: $STATUS"
PID=$(json_field "$STATUS" pid)
[ -n "$PID" ] && kill -0 "$PID" || fail "no live pid in $STATUS"
# pause returns once the step in flight has finished: the step read right after is final.
[ "$("$FERRY" daemon pause --dir "$RUN")" = paused ] || fail "daemon pause did not end paused"
S1=$(json_field "$("$FERRY" daemon status --dir "$RUN" --json)" step)
sleep 2
S2=$(json_field "$("$FERRY" daemon status --dir "$RUN" --json)" step)
[ "$S1" = "$S2" ] || fail "paused, yet the step moved from $S1 to $S2"
[ "$(json_field "$("$FERRY" daemon status --dir "$RUN" --json)" state)" = paused ] || fail "state is not paused"
# A second ferryd on the same directory is refused, naming the holder.
if OUTPUT=$("$FERRYD" train --config "$WORK/grpo.toml" --dir "$RUN" 2>&1); then fail "a second ferryd started"; fi
grep -q "pid $PID" <<<"$OUTPUT" || fail "the refusal does not name pid $PID: $OUTPUT"
"$FERRY" daemon resume --dir "$RUN" >/dev/null
SNAP=$("$FERRY" daemon snapshot --dir "$RUN")
VERSION=$(grep -o '[0-9a-f]\{32\}' <<<"$SNAP" | head -1)
[ -n "$VERSION" ] || fail "snapshot printed no version id: $SNAP"
CKPT=$(ls -d "$RUN"/checkpoint-* | sort -t- -k2 -n | tail -1)
[ -f "$CKPT/adapter_model.safetensors" ] && [ -f "$CKPT/adapter_config.json" ] || fail "snapshot wrote no whole checkpoint"
"$FERRY" convert --base "$WORK/model" --adapter "$CKPT" --out "$WORK/snap-merged" >/dev/null
"$FERRY" verify "$WORK/snap-merged" --db "$RUN/store" --version "$VERSION" >/dev/null \
  || fail "the snapshot's checkpoint, merged, is not version $VERSION"
"$FERRY" daemon stop --dir "$RUN" >/dev/null || fail "daemon stop"
for _ in $(seq 50); do kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
kill -0 "$PID" 2>/dev/null && fail "ferryd $PID still runs 5 s after stop"
set +e; "$FERRY" daemon status --dir "$RUN" --json >/dev/null; RC=$?; set -e
[ "$RC" = 3 ] || fail "status after stop exits $RC, not 3"
LAST_LINE_STEP=$(tail -1 "$RUN/metrics.jsonl" | sed 's/.*"step":\([0-9]*\).*/\1/')
[ -d "$RUN/checkpoint-$LAST_LINE_STEP" ] || fail "stop left no checkpoint of step $LAST_LINE_STEP"

echo "== 2. SIGTERM stops with a checkpoint"
RUN="$WORK/term"
"$FERRYD" train --config "$WORK/grpo.toml" --dir "$RUN" --max-steps 100000 2>"$WORK/term.log" &
PID=$!
for _ in $(seq 100); do [ -s "$RUN/metrics.jsonl" ] && break; sleep 0.2; done
kill -TERM "$PID"
set +e; wait "$PID"; RC=$?; set -e
[ "$RC" = 0 ] || fail "ferryd exited $RC after SIGTERM: $(tail -3 "$WORK/term.log")"
LAST_LINE_STEP=$(tail -1 "$RUN/metrics.jsonl" | sed 's/.*"step":\([0-9]*\).*/\1/')
[ -f "$RUN/checkpoint-$LAST_LINE_STEP/adapter_model.safetensors" ] || fail "SIGTERM left no checkpoint of step $LAST_LINE_STEP"

echo "== 3. crash-resume under SIGKILL ($KILLS kills)"
# CRASH_STEPS steps, each life killed at a random time until KILLS kills. The lives are scaled to
# this machine's speed (fixed 0.3-1.2 s lives let the run finish first on faster machines: 40, 100
# and then 250 steps each fell short once steps got faster): each lasts 0.1-1.0 x the uninterrupted
# run's wall time / KILLS, start-up included, so KILLS lives cover about half of that run.
CRASH_STEPS=250
sed -e "s/^max_steps = .*/max_steps = $CRASH_STEPS/" "$WORK/grpo.toml" > "$WORK/crash.toml"
T0=$(date +%s.%N)
"$FERRYD" train --config "$WORK/crash.toml" --dir "$WORK/clean" 2>/dev/null || fail "the uninterrupted run"
LIFE=$(awk -v a="$T0" -v b="$(date +%s.%N)" -v k="$KILLS" 'BEGIN { print (b - a) / k }')
echo "   lives of up to ${LIFE}s"
RUN="$WORK/killed"
kills=0
attempts=0
while :; do
  attempts=$((attempts + 1))
  [ "$attempts" -le $((KILLS * 4)) ] || fail "the killed run did not finish after $attempts starts"
  "$FERRYD" train --config "$WORK/crash.toml" --dir "$RUN" 2>>"$WORK/killed.log" &
  PID=$!
  if [ "$kills" -lt "$KILLS" ]; then
    sleep "$(awk -v r=$RANDOM -v l="$LIFE" 'BEGIN { printf "%.3f", l * (0.1 + 0.9 * r / 32767) }')"
    if kill -9 "$PID" 2>/dev/null; then
      wait "$PID" 2>/dev/null || true
      kills=$((kills + 1))
      # No checkpoint is ever half-written: every checkpoint-N is whole.
      for c in "$RUN"/checkpoint-*; do
        [ -e "$c" ] || continue
        [ -f "$c/adapter_model.safetensors" ] && [ -f "$c/adapter_config.json" ] && [ -f "$c/trainer_state.json" ] \
          || fail "after kill $kills: $c is not whole"
      done
      continue
    fi
  fi
  wait "$PID" || fail "a restarted ferryd failed: $(tail -3 "$WORK/killed.log")"
  if [ "$kills" -lt "$KILLS" ]; then
    # The run finished before every kill landed (the clean run, timed on a busier machine, set
    # the lives too long): run it again from the start with shorter lives.
    LIFE=$(awk -v l="$LIFE" 'BEGIN { print l / 2 }')
    echo "   the run finished after $kills kills: again from the start, lives of up to ${LIFE}s"
    rm -rf "$RUN"
    continue
  fi
  break
done
echo "   $kills kills, $attempts starts"
# Seconds differ from run to run: step_time and each phase's timing/*.
strip() { sed -e 's/"step_time":[^,}]*,\?//' -e 's/"timing\/[a-z_]*":[^,}]*,\?//g' "$1"; }
diff <(strip "$WORK/clean/metrics.jsonl") <(strip "$RUN/metrics.jsonl") >/dev/null \
  || fail "the resumed run's metrics differ from the uninterrupted run's: $(diff <(strip "$WORK/clean/metrics.jsonl") <(strip "$RUN/metrics.jsonl") | head -4)"
[ "$(wc -l < "$RUN/metrics.jsonl")" = "$CRASH_STEPS" ] \
  || fail "metrics.jsonl has $(wc -l < "$RUN/metrics.jsonl") lines, not $CRASH_STEPS"
[ "$kills" -ge "$KILLS" ] || fail "only $kills kills landed (the run finished first)"
# The store records every step once (one merged version per step).
MERGED_STEPS=$("$FERRY" versions list --db "$RUN/store" --json |
  awk '/"kind":/ {kind = $2} /"step":/ {step = $2} /^  }/ {if (kind ~ /merged/) print step + 0; kind = ""; step = ""}')
DUPS=$(sort -n <<<"$MERGED_STEPS" | uniq -c | awk '$1 != 1 {print "step " $2 " recorded " $1 " times"}')
[ -z "$DUPS" ] || fail "$DUPS"
[ "$(sort -n <<<"$MERGED_STEPS" | tr '\n' ' ')" = "$(seq 1 "$CRASH_STEPS" | tr '\n' ' ')" ] \
  || fail "merged versions recorded for steps: $(tr '\n' ' ' <<<"$MERGED_STEPS"), not 1..$CRASH_STEPS"
echo "PASS"
