#!/usr/bin/env bash
# ferryd publishing to remote generators, on the bundled demo (fixtures/demo) shortened:
#   1. A `ferry sync receive` started BEFORE ferryd holds the base; ferryd started with
#      `ferry daemon start --publish ipc://...`; a second receiver is frozen (SIGSTOP) after its
#      first version and the step loop keeps going; paused, the first receiver activates the
#      paused step's version (its proven digest equals the run's generator_version) and
#      `ferry daemon status --json` shows its ack in remote_generators (lag 0); the store
#      records the acknowledgements (kAcknowledged events, `ferry sync status`).
#   2. Config errors named: [publish] mode "full" (publish.mode), tcp:// without keys
#      (publish.endpoint), --publish tcp:// without keys (the endpoint); none leaves a run
#      directory behind.
#   3. [control] endpoint tcp:// with CURVE: a client with an allowed key is served, a stranger
#      is not (ferryd logs its key as refused), and `ferry daemon status --dir` still finds the ipc socket.
#   4. [publish] mode "merged" and "delta": a `ferry sync receive` (no --base) following ferryd
#      activates the base first (sequence 1: published once), then the paused step's merged
#      version, whose id is the run's generator_version (served from the trainer's in-memory
#      snapshot: the store records it by digests only); status shows the ack (lag 0).
# Usage: ferryd_publish_test.sh FERRY FERRYD FIXTURES_DIR
set -euo pipefail
FERRY=$1
FERRYD=$2
FIXTURES=$3
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ferry_ferryd_publish_XXXXXX")
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -CONT "$p" 2>/dev/null || true; kill -9 "$p" 2>/dev/null || true; done
  if [ -n "${RUN:-}" ] && [ -f "$RUN/ferryd.lock" ]; then
    P=$(tr -dc 0-9 <"$RUN/ferryd.lock" || true)
    [ -n "$P" ] && kill -9 "$P" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

fail() { echo "FAIL: $*" >&2; exit 1; }
json_field() { sed -n "s/.*\"$2\":\s*\"\?\([^\",}]*\)\"\?.*/\1/p" <<<"$1" | head -1; }
# Polls `ferry daemon status --json` of $RUN (up to 10 s) until it matches the regex $1; leaves
# the last reply in STATUS.
wait_for_status() {
  for _ in $(seq 100); do
    STATUS=$("$FERRY" daemon status --dir "$RUN" --json)
    grep -q "$1" <<<"$STATUS" && return
    sleep 0.1
  done
}

cp -r "$FIXTURES/demo/model" "$WORK/model"
cp "$FIXTURES/demo/train.jsonl" "$WORK/train.jsonl"
sed -e 's/^max_steps = .*/max_steps = 1000/' -e 's/^save_steps = .*/save_steps = 1000/' \
    -e 's/^logging_steps = .*/logging_steps = 1/' -e 's/^per_device_train_batch_size = .*/per_device_train_batch_size = 32/' \
    "$FIXTURES/demo/grpo.toml" > "$WORK/grpo.toml"
grep -q '^max_steps = 1000$' "$WORK/grpo.toml" || fail "could not shorten the demo config"

step_of() { json_field "$("$FERRY" daemon status --dir "$RUN" --json)" step; }

echo "== 1. publish to remote receivers"
RUN="$WORK/run"
PUB="ipc://$WORK/pub"
"$FERRY" sync receive --connect "$PUB" --out "$WORK/recv1" --id remote-1 --json >"$WORK/recv1.jsonl" 2>"$WORK/recv1.err" &
PIDS+=($!)
disown
"$FERRY" sync receive --connect "$PUB" --out "$WORK/recv2" --id frozen-2 --json >"$WORK/recv2.jsonl" 2>"$WORK/recv2.err" &
FROZEN=$!
PIDS+=($FROZEN)
disown
"$FERRY" daemon start --config "$WORK/grpo.toml" --dir "$RUN" --publish "$PUB" --detach >/dev/null \
  || fail "daemon start --detach --publish: $(tail -5 "$RUN/ferryd.log" 2>/dev/null)"
# Both receivers activate a first version (the base, published before step 1).
for _ in $(seq 300); do [ -s "$WORK/recv1.jsonl" ] && [ -s "$WORK/recv2.jsonl" ] && break; sleep 0.1; done
[ -s "$WORK/recv2.jsonl" ] || fail "receiver frozen-2 activated nothing: $(cat "$WORK/recv2.err")"
FIRST=$(head -1 "$WORK/recv1.jsonl")
# A frozen receiver does not stall training.
kill -STOP "$FROZEN"
S1=$(step_of)
for _ in $(seq 600); do [ "$(step_of)" -ge $((S1 + 3)) ] && break; sleep 0.2; done
S2=$(step_of)
[ "$S2" -ge $((S1 + 3)) ] || fail "with receiver frozen-2 stopped the step moved only from $S1 to $S2"
# Paused: receiver 1 catches up with the paused step's version.
"$FERRY" daemon pause --dir "$RUN" >/dev/null  # returns once no step runs
STATUS=$("$FERRY" daemon status --dir "$RUN" --json)
GV=$(json_field "$STATUS" generator_version)
STEP=$(json_field "$STATUS" step)
[ -n "$GV" ] || fail "no generator_version in $STATUS"
for _ in $(seq 300); do grep -q "\"proven\":\"$GV\"" "$WORK/recv1.jsonl" && break; sleep 0.1; done
grep -q "\"proven\":\"$GV\"" "$WORK/recv1.jsonl" \
  || fail "receiver 1 never activated step $STEP's version $GV: $(tail -2 "$WORK/recv1.jsonl") $(tail -3 "$WORK/recv1.err")"
ACTIVE=$(json_field "$(grep "\"proven\":\"$GV\"" "$WORK/recv1.jsonl" | tail -1)" active)
[ "$ACTIVE" = "$GV" ] || fail "receiver 1 activated $ACTIVE, not the generator's $GV"
# remote_generators objects, keys sorted: alive, id, lag, last_ack_at, last_seen_at, step, version.
ACK="\"id\":\"remote-1\",\"lag\":0,\"last_ack_at\":[0-9.e+]*,\"last_seen_at\":[0-9.e+]*,\"step\":$STEP,\"version\":\"$GV\""
wait_for_status "$ACK"
grep -q '"remote_generators":\[' <<<"$STATUS" || fail "no remote_generators in $STATUS"
grep -q "$ACK" <<<"$STATUS" || fail "status lacks remote-1's ack of step $STEP's $GV with lag 0: $STATUS"
grep -q '"id":"frozen-2"' <<<"$STATUS" || fail "the frozen receiver is missing from $STATUS"
"$FERRY" daemon stop --dir "$RUN" >/dev/null || fail "daemon stop"
# The first version receiver 1 activated is the run's base, served whole, published once
# (sequence 1). A receiver whose first HELLO comes after step 1's publication (a loaded
# machine) is served the latest adapter instead: it fetches the base that adapter applies to
# and merges onto it. Either way it holds the base.
BASE=$("$FERRY" versions list --db "$RUN/store" --kind base --json | grep -o '[0-9a-f]\{32\}' | head -1)
[ -n "$BASE" ] || fail "no base version in $RUN/store"
[ -d "$WORK/recv1/versions/$BASE" ] || fail "receiver 1 does not hold the base $BASE: $(ls "$WORK/recv1/versions")"
if [ "$(json_field "$FIRST" sequence)" = 1 ]; then
  [ "$(json_field "$FIRST" active)" = "$BASE" ] && [ "$(json_field "$FIRST" proven)" = null ] \
    || fail "receiver 1's first version (sequence 1) is not the base $BASE: $FIRST"
else
  [ -n "$(json_field "$FIRST" proven)" ] && [ "$(json_field "$FIRST" proven)" != null ] \
    || fail "receiver 1's first version is neither the base (sequence 1) nor a proven merge: $FIRST"
  echo "note: receiver 1 joined after step 1 (first sequence $(json_field "$FIRST" sequence)); it fetched the base"
fi
# The store records the acknowledgements (kAcknowledged events: what the audit reads).
SYNC=$("$FERRY" sync status --db "$RUN/store" --json | tr -d " \n")
grep -q "\"receiver\":\"remote-1\",\"version\":\"$GV\",\"verified\":true" <<<"$SYNC" \
  || fail "the store records no ack of $GV by remote-1: $SYNC"
unset RUN

echo "== 2. config errors are named"
printf '\n[publish]\nmode = "full"\n' | cat "$WORK/grpo.toml" - > "$WORK/full.toml"
if OUT=$("$FERRYD" train --config "$WORK/full.toml" --dir "$WORK/bad1" 2>&1); then fail "mode full was accepted"; fi
grep -q "publish.mode" <<<"$OUT" || fail "the full-mode refusal does not name publish.mode: $OUT"
printf '\n[publish]\nendpoint = "tcp://127.0.0.1:5999"\n' | cat "$WORK/grpo.toml" - > "$WORK/tcp.toml"
if OUT=$("$FERRYD" train --config "$WORK/tcp.toml" --dir "$WORK/bad2" 2>&1); then fail "tcp:// without keys was accepted"; fi
grep -q "publish.endpoint" <<<"$OUT" || fail "the tcp refusal does not name publish.endpoint: $OUT"
if OUT=$("$FERRYD" train --config "$WORK/grpo.toml" --dir "$WORK/bad3" --publish tcp://127.0.0.1:5999 --max-steps 1 2>&1); then
  fail "--publish tcp:// without keys was accepted"
fi
grep -q "tcp://127.0.0.1:5999" <<<"$OUT" || fail "the --publish tcp refusal does not name the endpoint: $OUT"
for d in bad1 bad2 bad3; do
  [ ! -e "$WORK/$d" ] || fail "a refused start left $WORK/$d behind: $(ls -A "$WORK/$d")"
done

echo "== 3. control socket over tcp:// with CURVE"
"$FERRY" keys generate --out "$WORK/server" >/dev/null
"$FERRY" keys generate --out "$WORK/client" >/dev/null
"$FERRY" keys generate --out "$WORK/stranger" >/dev/null
cp "$WORK/client.pub" "$WORK/allowed.txt"
PORT=$((20000 + RANDOM % 20000))
printf '\n[control]\nendpoint = "tcp://127.0.0.1:%s"\nkey = "%s"\nallow = "%s"\n' "$PORT" "$WORK/server" "$WORK/allowed.txt" \
  | cat "$WORK/grpo.toml" - > "$WORK/control.toml"
RUN="$WORK/ctl"
"$FERRY" daemon start --config "$WORK/control.toml" --dir "$RUN" --detach >/dev/null \
  || fail "daemon start with [control]: $(tail -5 "$RUN/ferryd.log" 2>/dev/null)"
"$FERRY" daemon status --dir "$RUN" --json | grep -q '"state":"running"' || fail "--dir no longer finds the ipc socket"
OUT=$("$FERRY" daemon status --connect "tcp://127.0.0.1:$PORT" --key "$WORK/client" --server-key "$WORK/server.pub" --json) \
  || fail "the allowed client was not served"
grep -q '"state":"running"' <<<"$OUT" || fail "the allowed client got: $OUT"
if OUT=$("$FERRY" daemon status --connect "tcp://127.0.0.1:$PORT" --key "$WORK/stranger" --server-key "$WORK/server.pub" \
          --timeout-ms 1500 --json 2>&1); then
  fail "a client whose key is not allowed was served: $OUT"
fi
grep -q "no ferryd answered" <<<"$OUT" || fail "the stranger's error is not the unanswered request: $OUT"
# ferryd names the refused key in its log, once.
grep -q "refused a control client with CURVE public key .*: not in \[control\] allow" "$RUN/ferryd.log" \
  || fail "ferryd did not log the refused key: $(tail -5 "$RUN/ferryd.log")"
"$FERRY" daemon stop --dir "$RUN" >/dev/null || fail "daemon stop"
unset RUN

echo "== 4. merged and delta mode"
for MODE in merged delta; do
  RUN="$WORK/run-$MODE"
  PUB="ipc://$WORK/pub-$MODE"
  OUTF="$WORK/recv-$MODE.jsonl"
  printf '\n[publish]\nmode = "%s"\n' "$MODE" | cat "$WORK/grpo.toml" - > "$WORK/$MODE.toml"
  "$FERRY" sync receive --connect "$PUB" --out "$WORK/recv-$MODE" --id "gen-$MODE" --json >"$OUTF" 2>"$WORK/recv-$MODE.err" &
  PIDS+=($!)
  disown
  "$FERRY" daemon start --config "$WORK/$MODE.toml" --dir "$RUN" --publish "$PUB" --detach >/dev/null \
    || fail "$MODE: daemon start: $(tail -5 "$RUN/ferryd.log" 2>/dev/null)"
  grep -q "publishing (mode $MODE)" "$RUN/ferryd.log" || fail "$MODE: ferryd does not say it publishes in $MODE mode"
  for _ in $(seq 300); do [ -s "$OUTF" ] && break; sleep 0.1; done
  FIRST=$(head -1 "$OUTF")
  [ -n "$FIRST" ] || fail "$MODE: the receiver activated nothing: $(cat "$WORK/recv-$MODE.err")"
  # The base (sequence 1), unless the receiver's first HELLO came after step 1 (a loaded
  # machine): a receiver takes the latest version.
  [ "$(json_field "$FIRST" sequence)" = 1 ] \
    || echo "note: $MODE: the receiver joined after step 1 (first sequence $(json_field "$FIRST" sequence))"
  for _ in $(seq 600); do [ "$(step_of)" -ge 3 ] && break; sleep 0.2; done
  "$FERRY" daemon pause --dir "$RUN" >/dev/null
  STATUS=$("$FERRY" daemon status --dir "$RUN" --json)
  GV=$(json_field "$STATUS" generator_version)
  STEP=$(json_field "$STATUS" step)
  [ -n "$GV" ] && [ "$STEP" -ge 3 ] || fail "$MODE: no generator_version after step 3 in $STATUS"
  for _ in $(seq 300); do grep -q "\"active\":\"$GV\"" "$OUTF" && break; sleep 0.1; done
  LINE=$(grep "\"active\":\"$GV\"" "$OUTF" | tail -1)
  [ -n "$LINE" ] || fail "$MODE: the receiver never activated step $STEP's version $GV: $(tail -2 "$OUTF") $(tail -3 "$WORK/recv-$MODE.err")"
  [ "$(json_field "$LINE" version)" = "$GV" ] && [ "$(json_field "$LINE" proven)" = null ] \
    || fail "$MODE: the receiver was not served $GV itself: $LINE"
  if [ "$MODE" = delta ]; then
    [ "$(json_field "$LINE" bytes_reused)" -gt 0 ] || fail "delta: nothing reused from the active version: $LINE"
  fi
  ACK="\"id\":\"gen-$MODE\",\"lag\":0,\"last_ack_at\":[0-9.e+]*,\"last_seen_at\":[0-9.e+]*,\"step\":$STEP,\"version\":\"$GV\""
  wait_for_status "$ACK"
  grep -q "$ACK" <<<"$STATUS" || fail "$MODE: status lacks gen-$MODE's ack of step $STEP's $GV with lag 0: $STATUS"
  "$FERRY" daemon stop --dir "$RUN" >/dev/null || fail "$MODE: daemon stop"
  # The version served is the step's merged version, recorded by its digests only.
  "$FERRY" versions show "$GV" --db "$RUN/store" --json | tr -d " \n" | grep -q '"derived":true' \
    || fail "$MODE: $GV is not the derived merged version in the store"
  if [ "$MODE" = merged ]; then
    # A resumed run publishes the version it resumed from first (sequence 1), never the base:
    # a generator must not run the base while the run is past it.
    LAST=$(json_field "$(tail -1 "$RUN/metrics.jsonl")" generator_version)
    BASE_M=$("$FERRY" versions list --db "$RUN/store" --kind base --json | grep -o '[0-9a-f]\{32\}' | head -1)
    "$FERRY" daemon start --config "$WORK/$MODE.toml" --dir "$RUN" --publish "$PUB" --detach >/dev/null \
      || fail "$MODE: resumed daemon start: $(tail -5 "$RUN/ferryd.log")"
    R=$("$FERRY" sync receive --once --connect "$PUB" --out "$WORK/recv-resumed" --id resumed --json) \
      || fail "$MODE: a receiver of the resumed run got nothing"
    [ "$(json_field "$R" version)" != "$BASE_M" ] || fail "$MODE: the resumed run served the base: $R"
    if [ "$(json_field "$R" sequence)" = 1 ]; then
      [ "$(json_field "$R" version)" = "$LAST" ] || fail "$MODE: sequence 1 of the resumed run is not $LAST: $R"
    fi
    "$FERRY" daemon stop --dir "$RUN" >/dev/null || fail "$MODE: resumed daemon stop"
  fi
  unset RUN
done
echo "PASS"
