#!/usr/bin/env bash
# ferryd data-parallel (c10d, Gloo) as people launch it, on the bundled demo (fixtures/demo):
#   ranks   1. the demo with 2 ranks (one thread each, `--nproc-per-node 2`, 64 completions per
#              rank) learns as one process with the same 128 completions per step does; the
#              store holds each step once; `ferry convert` of the last checkpoint is the version
#              the ranks acknowledged
#           2. `ferry daemon start --nproc-per-node 2 --detach`: status lists both ranks (host,
#              pid, step, the same generator version); nothing of the launcher or the ranks
#              listens beyond loopback (they meet through a rendezvous file in a private
#              directory, removed at the end); pause, a snapshot (its checkpoint merged is that
#              version), resume, stop
#           3. kill -9 of rank 1 (launched through torchrun's environment): rank 0 exits within
#              the [distributed] timeout naming rank 1; the same start command resumes both from
#              rank 0's newest checkpoint, and metrics.jsonl ends with every step once; a run
#              resumed under another world size (1 -> 2 -> 1 ranks) goes on from the checkpoint;
#              a terminal's Ctrl-C (a pty's interrupt character) stops the launcher and both ranks
#              with the final checkpoint and exit 0, and so does SIGTERM to rank 1 alone
#           4. a base corrupted on one rank's "host" (a flipped weight byte) is caught by the
#              acknowledged-id comparison, naming the rank and both ids; a dataset that differs
#              there is refused at the start, naming the file and both digests
#           5. the real torchrun (PyPI torch's, from the venv scripts/vllm.sh caches): `torchrun
#              --standalone --nproc-per-node 2 --no-python ferryd train` trains; torch >= 2's
#              torchrun hosts the store itself (TORCHELASTIC_USE_AGENT_STORE): a ferryd on a
#              LibTorch of the same major version joins it, one on Debian's 1.13 (whose client it
#              refuses) says what to set, and trains with it set
#   hosts   two "hosts": each rank in a network namespace of its own (a veth pair, addresses
#           10.231.0.1/2, its own host name) made by the test, launched through torchrun's
#           environment with MASTER_ADDR the first namespace's address. Exit 77 (skipped) when
#           namespaces cannot be made here.
# Usage: ferryd_dp_test.sh FERRY FERRYD FIXTURES_DIR ranks|hosts
set -euo pipefail
FERRY=$1
FERRYD=$2
FIXTURES=$3
MODE=${4:-ranks}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ferry_ferryd_dp_XXXXXX")
NS0=ferrydp0-$$
NS1=ferrydp1-$$
cleanup() {
  pkill -9 -f "$WORK" 2>/dev/null || true
  ip netns del "$NS0" 2>/dev/null || true
  ip netns del "$NS1" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

fail() { echo "FAIL: $*" >&2; exit 1; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null ||
  echo $((20000 + RANDOM % 20000)); }
# The mean of `field` over metrics.jsonl lines FIRST..LAST (1-based).
mean_of() { sed -n "$2,$3p" "$1" | grep -o "\"$4\":[-0-9.e]*" | cut -d: -f2 | awk '{s += $1; n++} END {printf "%.4f", s / n}'; }

# The demo on one thread per rank, a line every 10 steps, a checkpoint every 50.
cp -r "$FIXTURES/demo/model" "$WORK/model"
cp "$FIXTURES/demo/train.jsonl" "$WORK/train.jsonl"
demo_config() {  # demo_config OUT PER_RANK_BATCH STEPS [extra sed]
  sed -e "s/^max_steps = .*/max_steps = $3/" -e 's/^save_steps = .*/save_steps = 50/' -e 's/^threads = .*/threads = 1/' \
      -e "s/^per_device_train_batch_size = .*/per_device_train_batch_size = $2/" ${5:+-e "$5"} \
      "$FIXTURES/demo/grpo.toml" > "$1"
  printf '\n[distributed]\ntimeout = %s\n' "${4:-60}" >> "$1"
  grep -q "^per_device_train_batch_size = $2\$" "$1" || fail "could not edit the demo config"
}

# ranks_env RANK WORLD PORT: torchrun's environment for one rank on loopback.
ranks_env() { echo "RANK=$1 LOCAL_RANK=$1 WORLD_SIZE=$2 LOCAL_WORLD_SIZE=$2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$3"; }

if [ "$MODE" = hosts ]; then
  echo "== two hosts: a network namespace per rank"
  if ! ip netns add "$NS0" 2>/dev/null || ! ip netns add "$NS1" 2>/dev/null; then
    echo "SKIP: cannot create network namespaces here (needs root and iproute2)"
    exit 77
  fi
  ip link add "v0-$$" type veth peer name "v1-$$"
  ip link set "v0-$$" netns "$NS0"
  ip link set "v1-$$" netns "$NS1"
  ip -n "$NS0" addr add 10.231.0.1/24 dev "v0-$$"
  ip -n "$NS1" addr add 10.231.0.2/24 dev "v1-$$"
  for ns in "$NS0" "$NS1"; do ip -n "$ns" link set lo up; done
  ip -n "$NS0" link set "v0-$$" up
  ip -n "$NS1" link set "v1-$$" up
  demo_config "$WORK/hosts.toml" 64 20 60
  RUN="$WORK/hosts"
  for r in 0 1; do
    ns=$([ $r = 0 ] && echo "$NS0" || echo "$NS1")
    ip netns exec "$ns" unshare --uts sh -c "hostname host$r; exec env RANK=$r LOCAL_RANK=0 WORLD_SIZE=2 \
      LOCAL_WORLD_SIZE=1 MASTER_ADDR=10.231.0.1 MASTER_PORT=29517 '$FERRYD' train --config '$WORK/hosts.toml' \
      --dir '$RUN'" >"$WORK/host$r.log" 2>&1 &
    eval "PID$r=\$!"
  done
  wait "$PID0" || fail "rank 0 (host0) failed: $(tail -5 "$WORK/host0.log")"
  wait "$PID1" || fail "rank 1 (host1) failed: $(tail -5 "$WORK/host1.log")"
  grep -q "rank 1 of 2 (local rank 0), gloo, met at MASTER_ADDR:MASTER_PORT 10.231.0.1:29517" "$WORK/host1.log" || fail "rank 1: $(head -3 "$WORK/host1.log")"
  [ "$(wc -l < "$RUN/metrics.jsonl")" = 2 ] || fail "metrics.jsonl: $(wc -l < "$RUN/metrics.jsonl") lines, not 2"
  [ -d "$RUN/checkpoint-20" ] || fail "no checkpoint-20 from rank 0"
  echo "PASS (two namespaces, hosts host0 and host1)"
  exit 0
fi

echo "== 1. the demo: 2 ranks x 64 completions against 1 process x 128"
demo_config "$WORK/one.toml" 128 150
demo_config "$WORK/two.toml" 64 150
# No rendezvous directory can be made: an error naming where, before any rank starts.
set +e; TMPDIR="$WORK/none" "$FERRYD" train --config "$WORK/two.toml" --dir "$WORK/none-run" --nproc-per-node 2 \
  2>"$WORK/none.log"; RC=$?; set -e
[ $RC -ne 0 ] && [ ! -e "$WORK/none-run" ] || fail "an unusable TMPDIR: exit $RC"
grep -q "error: creating the ranks' rendezvous directory in $WORK/none (TMPDIR): No such file or directory" \
  "$WORK/none.log" || fail "an unusable TMPDIR: $(cat "$WORK/none.log")"
"$FERRYD" train --config "$WORK/one.toml" --dir "$WORK/one" 2>"$WORK/one.log" || fail "1 rank: $(tail -3 "$WORK/one.log")"
"$FERRYD" train --config "$WORK/two.toml" --dir "$WORK/two" --nproc-per-node 2 2>"$WORK/two.log" \
  || fail "2 ranks: $(tail -5 "$WORK/two.log")"
grep -q "rank 1 of 2" "$WORK/two.log" || fail "no rank 1 in the log"
ONE_START=$(mean_of "$WORK/one/metrics.jsonl" 1 2 reward)
ONE_END=$(mean_of "$WORK/one/metrics.jsonl" 13 15 reward)
TWO_START=$(mean_of "$WORK/two/metrics.jsonl" 1 2 reward)
TWO_END=$(mean_of "$WORK/two/metrics.jsonl" 13 15 reward)
echo "reward: 1 rank $ONE_START -> $ONE_END, 2 ranks $TWO_START -> $TWO_END"
awk -v s="$TWO_START" -v e="$TWO_END" 'BEGIN {exit !(e - s >= 0.03)}' || fail "2 ranks did not learn: $TWO_START -> $TWO_END"
awk -v s="$ONE_START" -v e="$ONE_END" 'BEGIN {exit !(e - s >= 0.03)}' || fail "1 rank did not learn: $ONE_START -> $ONE_END"
awk -v a="$ONE_END" -v b="$TWO_END" 'BEGIN {exit !(b >= a - 0.04)}' || fail "2 ranks end at $TWO_END, 1 rank at $ONE_END"
# 128 completions per step on both: the same token counts per step.
grep -q '"completions/mean_length"' "$WORK/two/metrics.jsonl" || fail "no completion metrics"
# The store holds each step once (one merged version per step, written by rank 0 alone).
MERGED_STEPS=$("$FERRY" versions list --db "$WORK/two/store" --json |
  awk '/"kind":/ {kind = $2} /"step":/ {step = $2} /^  }/ {if (kind ~ /merged/) print step + 0; kind = ""; step = ""}')
[ "$(sort -n <<<"$MERGED_STEPS" | tr '\n' ' ')" = "$(seq 1 150 | tr '\n' ' ')" ] \
  || fail "merged versions recorded for steps: $(sort -n <<<"$MERGED_STEPS" | uniq -c | awk '$1 != 1' | head -3)"
LAST=$(tail -1 "$WORK/two/metrics.jsonl" | grep -o '"generator_version":"[0-9a-f]*"' | cut -d'"' -f4)
"$FERRY" convert --base "$WORK/model" --adapter "$WORK/two/checkpoint-150" --out "$WORK/merged-150" >/dev/null
"$FERRY" verify "$WORK/merged-150" --db "$WORK/two/store" --version "$LAST" >/dev/null \
  || fail "checkpoint-150 merged by ferry convert is not $LAST, the version the ranks acknowledged"

echo "== 2. ferry daemon start --nproc-per-node 2: status lists every rank"
demo_config "$WORK/ops.toml" 64 100000
RUN="$WORK/ops"
"$FERRY" daemon start --config "$WORK/ops.toml" --dir "$RUN" --nproc-per-node 2 --detach >/dev/null \
  || fail "daemon start --nproc-per-node 2 --detach: $(tail -5 "$RUN/ferryd.log")"
[ "$("$FERRY" daemon pause --dir "$RUN")" = paused ] || fail "daemon pause did not end paused"
STATUS=$("$FERRY" daemon status --dir "$RUN" --json)
VERSION=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["generator_version"])' "$STATUS")
python3 - "$STATUS" <<'EOF' || fail "status: $STATUS"
import json, sys
j = json.loads(sys.argv[1])
ranks = j["ranks"]
assert [r["rank"] for r in ranks] == [0, 1], ranks
assert all(r["generator_version"] == j["generator_version"] for r in ranks), ranks
assert all(r["step"] == j["step"] for r in ranks), ranks
assert ranks[0]["pid"] == j["pid"] and ranks[1]["pid"] != j["pid"], ranks
EOF
"$FERRY" daemon status --dir "$RUN" | grep -q "^  rank 1  host .*generator_version $VERSION" \
  || fail "status text: $("$FERRY" daemon status --dir "$RUN")"
# Local ranks open no socket beyond loopback (torch's TCPStore would listen on every interface):
# they meet through c10d's FileStore in a directory only this user can enter.
LAUNCHER=$(ps -o ppid= -p "$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["pid"])' "$STATUS")" | tr -d ' ')
RDZV=$(grep -o 'rendezvous file [^ )]*' "$RUN/ferryd.log" | head -1 | cut -d' ' -f3)
[ -n "$RDZV" ] && [ -f "$RDZV" ] || fail "no rendezvous file in the log: $(head -3 "$RUN/ferryd.log")"
[ "$(stat -c %a "$(dirname "$RDZV")")" = 700 ] || fail "the rendezvous directory's mode: $(stat -c %a "$(dirname "$RDZV")")"
# From /proc: the TCP sockets of the launcher and the ranks (each rank has some: its Gloo
# connections), none of them a listener beyond loopback.
RANK_PIDS=$(python3 -c 'import json,sys; print(" ".join(str(r["pid"]) for r in json.loads(sys.argv[1])["ranks"]))' "$STATUS")
python3 - "$LAUNCHER" $RANK_PIDS <<'EOF' || fail "a socket of the run listens beyond loopback (above)"
import os, sys
tcp = {}  # inode -> (state, local address in hex)
for name in ("tcp", "tcp6"):
    for line in open(f"/proc/net/{name}").readlines()[1:]:
        f = line.split()
        tcp[f[9]] = (f[3], f[1].split(":")[0])
loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
ok = True
for i, pid in enumerate(sys.argv[1:]):
    links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    mine = [tcp[l[8:-1]] for l in links if l.startswith("socket:[") and l[8:-1] in tcp]
    if i > 0 and not mine:
        print(f"rank pid {pid}: no TCP socket found (it has Gloo connections)")
        ok = False
    for state, addr in mine:
        if state == "0A" and addr not in loopback:
            print(f"pid {pid} listens on {addr}")
            ok = False
sys.exit(0 if ok else 1)
EOF
# A snapshot while paused: rank 0 writes the checkpoint; merged, it is the version every rank holds.
SNAP=$("$FERRY" daemon snapshot --dir "$RUN" --json) || fail "daemon snapshot: $SNAP"
CKPT=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["checkpoint"])' "$SNAP")
"$FERRY" convert --base "$WORK/model" --adapter "$RUN/$CKPT" --out "$WORK/snap-merged" >/dev/null
"$FERRY" verify "$WORK/snap-merged" --db "$RUN/store" --version "$VERSION" >/dev/null \
  || fail "the snapshot $CKPT, merged, is not $VERSION, the version both ranks acknowledged"
"$FERRY" daemon resume --dir "$RUN" >/dev/null
PIDS=$(python3 -c 'import json,sys; print(" ".join(str(r["pid"]) for r in json.loads(sys.argv[1])["ranks"]))' "$STATUS")
"$FERRY" daemon stop --dir "$RUN" >/dev/null || fail "daemon stop"
for _ in $(seq 100); do
  alive=0; for p in $PIDS; do kill -0 "$p" 2>/dev/null && alive=1; done
  [ $alive = 0 ] && break; sleep 0.1
done
[ $alive = 0 ] || fail "ranks $PIDS still run 10 s after stop"
for _ in $(seq 50); do [ -e "$(dirname "$RDZV")" ] || break; sleep 0.1; done
[ ! -e "$(dirname "$RDZV")" ] || fail "the rendezvous directory $(dirname "$RDZV") is left after stop"

echo "== 3. kill -9 of rank 1: rank 0 names it; the same command resumes both"
demo_config "$WORK/kill.toml" 64 60 10
sed -i 's/^save_steps = .*/save_steps = 10/; s/^logging_steps = .*/logging_steps = 1/' "$WORK/kill.toml"
RUN="$WORK/kill"
start_ranks() {  # start_ranks CONFIG1: both ranks through torchrun's environment
  PORT=$(free_port)
  env $(ranks_env 0 2 "$PORT") "$FERRYD" train --config "$WORK/kill.toml" --dir "$RUN" >"$WORK/rank0.log" 2>&1 &
  R0=$!
  env $(ranks_env 1 2 "$PORT") "$FERRYD" train --config "${1:-$WORK/kill.toml}" --dir "$RUN" >"$WORK/rank1.log" 2>&1 &
  R1=$!
}
start_ranks
for _ in $(seq 300); do [ -f "$RUN/metrics.jsonl" ] && [ "$(wc -l < "$RUN/metrics.jsonl")" -ge 25 ] && break; sleep 0.1; done
[ "$(wc -l < "$RUN/metrics.jsonl")" -ge 25 ] || fail "the run did not reach step 25: $(tail -3 "$WORK/rank0.log")"
kill -9 "$R1"
T0=$(date +%s)
set +e; wait "$R0"; RC=$?; set -e
T1=$(date +%s)
[ $RC -ne 0 ] || fail "rank 0 exited 0 after rank 1 was killed"
[ $((T1 - T0)) -le 15 ] || fail "rank 0 took $((T1 - T0)) s to notice (timeout 10 s)"
grep -q "error: .*rank 1 (host .*, pid $R1) stopped answering" "$WORK/rank0.log" \
  || fail "rank 0's error does not name rank 1 (pid $R1): $(tail -2 "$WORK/rank0.log")"
start_ranks
wait "$R0" || fail "the resumed rank 0 failed: $(tail -3 "$WORK/rank0.log")"
wait "$R1" || fail "the resumed rank 1 failed: $(tail -3 "$WORK/rank1.log")"
grep -q "resumed from .*checkpoint-" "$WORK/rank0.log" || fail "rank 0 did not resume: $(head -5 "$WORK/rank0.log")"
STEPS=$(grep -o '"step":[0-9]*' "$RUN/metrics.jsonl" | cut -d: -f2 | tr '\n' ' ')
[ "$STEPS" = "$(seq 1 60 | tr '\n' ' ')" ] || fail "metrics.jsonl steps after the resume: $STEPS"

echo "== 3b. a run resumed under another world size: 1 rank to step 10, 2 ranks to 20, 1 rank to 30"
demo_config "$WORK/ws.toml" 64 30 10
RUN="$WORK/ws"
"$FERRYD" train --config "$WORK/ws.toml" --dir "$RUN" --max-steps 10 2>"$WORK/ws1.log" || fail "1 rank: $(tail -3 "$WORK/ws1.log")"
"$FERRYD" train --config "$WORK/ws.toml" --dir "$RUN" --max-steps 20 --nproc-per-node 2 2>"$WORK/ws2.log" \
  || fail "2 ranks: $(tail -3 "$WORK/ws2.log")"
grep -q "resumed from .*checkpoint-10" "$WORK/ws2.log" || fail "2 ranks did not resume from checkpoint-10: $(head -4 "$WORK/ws2.log")"
"$FERRYD" train --config "$WORK/ws.toml" --dir "$RUN" 2>"$WORK/ws3.log" || fail "1 rank again: $(tail -3 "$WORK/ws3.log")"
grep -q "resumed from .*checkpoint-20" "$WORK/ws3.log" || fail "1 rank did not resume from checkpoint-20: $(head -4 "$WORK/ws3.log")"
[ -d "$RUN/checkpoint-30" ] || fail "no checkpoint-30"
# metrics.jsonl holds steps 10, 20, 30 (a line every 10), each once; the token count goes on growing, by
# 64 completions a step on 1 rank and 128 on 2.
STEPS=$(grep -o '"step":[0-9]*' "$RUN/metrics.jsonl" | cut -d: -f2 | tr '\n' ' ')
[ "$STEPS" = "10 20 30 " ] || fail "metrics.jsonl steps: $STEPS"
python3 - "$RUN/metrics.jsonl" <<'PY' || fail "token counts across the world sizes: $(grep -o '"num_tokens":[0-9.]*' "$RUN/metrics.jsonl" | tr '\n' ' ')"
import json, sys
t = [json.loads(l)["num_tokens"] for l in open(sys.argv[1])]
d1, d2, d3 = t[0], t[1] - t[0], t[2] - t[1]
# about 10 steps x 64 (or 128) completions x (prompt ~7 + completion ~4 tokens)
assert 1.7 < d2 / d1 < 2.3 and 1.7 < d2 / d3 < 2.3, t
PY

echo "== 3c. stop signals: a terminal's Ctrl-C, and SIGTERM to rank 1 alone"
# Ctrl-C in a terminal goes to the whole foreground process group: the launcher and both ranks.
# Each rank stops at a step's end, rank 0 writes the final checkpoint, and everything exits 0
# (the launcher used to pass it on as well: a second SIGINT, which exits at once).
demo_config "$WORK/stop.toml" 64 100000 10
sed -i 's/^save_steps = .*/save_steps = 100000/; s/^logging_steps = .*/logging_steps = 1/' "$WORK/stop.toml"
RUN="$WORK/ctrlc"
python3 - "$FERRYD" "$WORK/stop.toml" "$RUN" "$WORK/ctrlc.log" <<'PY' || fail "Ctrl-C: $(tail -4 "$WORK/ctrlc.log")"
import os, pty, select, sys, time
ferryd, config, run, log = sys.argv[1:]
pid, fd = pty.fork()  # the child leads a session whose terminal is the pty, in its foreground group
if pid == 0:
    os.execv(ferryd, [ferryd, "train", "--config", config, "--dir", run, "--nproc-per-node", "2"])
out, sent, deadline = b"", False, time.time() + 120
status = None
while time.time() < deadline:
    r, _, _ = select.select([fd], [], [], 0.1)
    if r:
        try:
            out += os.read(fd, 65536)
        except OSError:
            pass
    done, st = os.waitpid(pid, os.WNOHANG)
    if done:
        status = st
        break
    m = os.path.join(run, "metrics.jsonl")
    if not sent and os.path.exists(m) and sum(1 for _ in open(m)) >= 5:
        os.write(fd, b"\x03")  # the terminal's interrupt character: SIGINT to the foreground group
        sent = True
open(log, "wb").write(out)
if status is None:
    os.kill(pid, 9)
    sys.exit("still running 120 s after Ctrl-C" if sent else "never reached step 5")
code = os.waitstatus_to_exitcode(status)
if code != 0:
    sys.exit(f"exit code {code} after one Ctrl-C")
if b"second interrupt" in out:
    sys.exit("one Ctrl-C was taken for two")
PY
LAST=$(tail -1 "$RUN/metrics.jsonl" | sed 's/.*"step":\([0-9]*\).*/\1/')
[ -f "$RUN/checkpoint-$LAST/adapter_model.safetensors" ] || fail "Ctrl-C left no checkpoint of step $LAST: $(ls "$RUN")"
# SIGTERM to rank 1 alone (torchrun's agent on a host being preempted signals its own ranks):
# rank 0 hears of it at the step's end and every rank stops there, with the checkpoint.
cp "$WORK/kill.toml" "$WORK/kill.saved"
sed -i 's/^save_steps = .*/save_steps = 100000/; s/^max_steps = .*/max_steps = 100000/' "$WORK/kill.toml"
RUN="$WORK/term1"
start_ranks
for _ in $(seq 300); do [ -f "$RUN/metrics.jsonl" ] && [ "$(wc -l < "$RUN/metrics.jsonl")" -ge 5 ] && break; sleep 0.1; done
kill -TERM "$R1"
( sleep 60; kill -9 "$R0" "$R1" 2>/dev/null ) &
WATCHDOG=$!
set +e; wait "$R1"; RC1=$?; wait "$R0"; RC0=$?; set -e
kill "$WATCHDOG" 2>/dev/null || true
[ "$RC0" = 0 ] && [ "$RC1" = 0 ] || fail "SIGTERM to rank 1: exit codes $RC0, $RC1: $(tail -2 "$WORK/rank0.log") / $(tail -2 "$WORK/rank1.log")"
LAST=$(tail -1 "$RUN/metrics.jsonl" | sed 's/.*"step":\([0-9]*\).*/\1/')
grep -q "rank 1 (host .*, pid $R1) was asked to stop: every rank stops after step $LAST" "$WORK/rank0.log" \
  || fail "rank 0 does not say why it stopped: $(tail -3 "$WORK/rank0.log")"
[ -f "$RUN/checkpoint-$LAST/adapter_model.safetensors" ] || fail "SIGTERM to rank 1 left no checkpoint of step $LAST"
mv "$WORK/kill.saved" "$WORK/kill.toml"

echo "== 4. a base that differs on one rank's host is caught by the id comparison"
cp -r "$WORK/model" "$WORK/model-bad"
python3 - "$WORK/model-bad/model.safetensors" <<'EOF'
import struct, sys
p = sys.argv[1]
with open(p, "r+b") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    f.seek(8 + n + 1000)          # a byte of the first tensors' data, past the header
    b = f.read(1); f.seek(-1, 1); f.write(bytes([b[0] ^ 0x40]))
EOF
sed "s|^model_name_or_path = .*|model_name_or_path = \"$WORK/model-bad\"|" "$WORK/kill.toml" > "$WORK/bad.toml"
RUN="$WORK/bad"
start_ranks "$WORK/bad.toml"
set +e; wait "$R0"; RC0=$?; wait "$R1"; RC1=$?; set -e
[ $RC0 -ne 0 ] && [ $RC1 -ne 0 ] || fail "the ranks ran on different bases (exit codes $RC0, $RC1)"
grep -q "at the start: the generator of rank 1 (host .*) acknowledged [0-9a-f]\{32\} but that of rank 0 (host .*) acknowledged [0-9a-f]\{32\}" \
  "$WORK/rank0.log" || fail "rank 0's error: $(tail -2 "$WORK/rank0.log")"
# A dataset that differs on rank 1's host (one answer changed: a stale copy) is refused at the
# start, naming the file and both digests; rank 0 names rank 1's failure.
sed '1s/"answer": "000"/"answer": "001"/' "$WORK/train.jsonl" > "$WORK/train-bad.jsonl"
cmp -s "$WORK/train.jsonl" "$WORK/train-bad.jsonl" && fail "could not edit the dataset"
sed "s|^dataset = .*|dataset = \"$WORK/train-bad.jsonl\"|" "$WORK/kill.toml" > "$WORK/bad-data.toml"
RUN="$WORK/bad-data"
start_ranks "$WORK/bad-data.toml"
set +e; wait "$R0"; RC0=$?; wait "$R1"; RC1=$?; set -e
[ $RC0 -ne 0 ] && [ $RC1 -ne 0 ] || fail "the ranks ran on different datasets (exit codes $RC0, $RC1)"
grep -q "the dataset $WORK/train-bad.jsonl of rank 1 (host .*) has digest [0-9a-f]*, that of rank 0 (host .*) [0-9a-f]*; every rank needs the same dataset" \
  "$WORK/rank1.log" || fail "rank 1's error: $(tail -2 "$WORK/rank1.log")"
grep -q "rank 1 (host .*) failed: starting: .*every rank needs the same dataset" "$WORK/rank0.log" \
  || fail "rank 0's error: $(tail -2 "$WORK/rank0.log")"

echo "== 5. the real torchrun"
PY=$(bash "$FIXTURES/../scripts/vllm.sh" python) || fail "no torchrun: bash scripts/vllm.sh setup creates the venv that has it"
TORCHRUN=$(dirname "$PY")/torchrun
[ -x "$TORCHRUN" ] || fail "no $TORCHRUN"
TORCH_MAJOR=$("$PY" -c 'import torch; print(torch.__version__.split(".")[0])')
LIBTORCH_MAJOR=$("$FERRYD" --version | sed -n 's/.*(LibTorch \([0-9]*\)\..*/\1/p')
[ -n "$LIBTORCH_MAJOR" ] || fail "ferryd --version names no LibTorch: $("$FERRYD" --version)"
demo_config "$WORK/tr.toml" 64 20 30
torchrun_ferryd() {  # torchrun_ferryd RUN_DIR [env...]: 2 local ranks on this host
  env "${@:2}" "$TORCHRUN" --standalone --nproc-per-node 2 --no-python "$FERRYD" train --config "$WORK/tr.toml" \
    --dir "$1" >"$1.log" 2>&1
}
if [ "$TORCH_MAJOR" -ge 2 ] && [ "$LIBTORCH_MAJOR" -lt 2 ]; then
  set +e; torchrun_ferryd "$WORK/tr-agent"; RC=$?; set -e
  [ $RC -ne 0 ] || fail "LibTorch $LIBTORCH_MAJOR joined torch $TORCH_MAJOR's store"
  grep -q "error: .*rank [01] of 2: the rendezvous at MASTER_ADDR:MASTER_PORT .* (torchrun's store) did not complete .*run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" \
    "$WORK/tr-agent.log" || fail "torchrun's store refused, but not said so: $(grep error: "$WORK/tr-agent.log" | head -2)"
  torchrun_ferryd "$WORK/tr" TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 || fail "torchrun, rank 0's store: $(grep error: "$WORK/tr.log" | head -3)"
else
  torchrun_ferryd "$WORK/tr" || fail "torchrun, its agent's store: $(grep error: "$WORK/tr.log" | head -3)"
  grep -q "failed to bind" "$WORK/tr.log" && fail "a rank tried to host torchrun's store: $(grep -m1 'failed to bind' "$WORK/tr.log")"
fi
grep -q "rank 1 of 2 (local rank 1), gloo, met at MASTER_ADDR:MASTER_PORT " "$WORK/tr.log" || fail "torchrun: no rank 1: $(head -5 "$WORK/tr.log")"
[ "$(grep -c '"step"' "$WORK/tr/metrics.jsonl")" = 2 ] && [ -d "$WORK/tr/checkpoint-20" ] \
  || fail "torchrun: metrics.jsonl has $(grep -c '"step"' "$WORK/tr/metrics.jsonl") lines, checkpoints: $(ls "$WORK/tr")"
echo PASS
