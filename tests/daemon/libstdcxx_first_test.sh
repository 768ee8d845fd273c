#!/usr/bin/env bash
# Programs that link LibTorch bind libstdc++'s symbols to the system libstdc++, never to LibTorch
# (cmake/ferry_torch.cmake: the PyPI LibTorch exports a static copy of part of libstdc++, and
# ferryd crashed in its std::filesystem::remove_all). For each EXE:
#   1. its DT_NEEDED names libstdc++.so.6 before every LibTorch library (libtorch*, libc10*),
#      and it names at least one of those;
#   2. the LibTorch libraries it loads all lie in one folder (no two LibTorch installations mixed)
#      and every library it needs is found;
#   3. with every symbol bound at load (the loader's trace mode, as `ldd -r`: main never runs), no
#      symbol that the loaded libstdc++.so.6 defines is bound to a LibTorch library, and every
#      std::filesystem symbol EXE itself uses is bound to libstdc++.so.6.
# Debian's LibTorch exports no libstdc++ symbols, so there 3 holds whatever the order and 1 is the
# check that keeps the link order; built against a PyPI torch (scripts/build-pytorch.sh), 3 fails
# without that order.
# Usage: libstdcxx_first_test.sh EXE...
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: libstdcxx_first_test.sh EXE..." >&2; exit 2; }

fail() { echo "FAIL: $*" >&2; exit 1; }
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ferry_libstdcxx_first_XXXXXX")
trap 'rm -rf "$WORK"' EXIT

for exe in "$@"; do
  name=$(basename "$exe")
  [ -x "$exe" ] || fail "$exe is not an executable file"

  # 1. The order of DT_NEEDED.
  mapfile -t needed < <(readelf -d "$exe" | sed -n 's/.*(NEEDED).*\[\(.*\)\]$/\1/p')
  stdcxx=-1
  torch=-1
  for i in "${!needed[@]}"; do
    case ${needed[$i]} in
      libstdc++.so.6) stdcxx=$i ;;
      libtorch* | libc10*) ((torch >= 0)) || torch=$i ;;
    esac
  done
  ((torch >= 0)) || fail "$name needs no LibTorch library (DT_NEEDED: ${needed[*]})"
  ((stdcxx >= 0)) || fail "$name does not name libstdc++.so.6 (DT_NEEDED: ${needed[*]})"
  ((stdcxx < torch)) || fail "$name names libstdc++.so.6 (entry $((stdcxx + 1))) after ${needed[$torch]}" \
    "(entry $((torch + 1))): LibTorch's copies of libstdc++ symbols would be bound first (DT_NEEDED: ${needed[*]})"

  # 2. What the loader finds: everything, one LibTorch, which libstdc++.
  loaded=$(LD_TRACE_LOADED_OBJECTS=1 "$exe")
  if grep -q "not found" <<<"$loaded"; then fail "$name: libraries not found:"$'\n'"$(grep "not found" <<<"$loaded")"; fi
  torch_dirs=$(awk '$1 ~ /^lib(torch|c10)/ && $2 == "=>" { sub(/\/[^\/]*$/, "", $3); print $3 }' <<<"$loaded" | sort -u)
  [ "$(wc -l <<<"$torch_dirs")" = 1 ] || fail "$name loads LibTorch libraries from more than one folder:"$'\n'"$torch_dirs"
  libstdcxx=$(awk '$1 == "libstdc++.so.6" && $2 == "=>" { print $3 }' <<<"$loaded")
  [ -f "$libstdcxx" ] || fail "$name: no libstdc++.so.6 in the loader's list:"$'\n'"$loaded"

  # 3. The bindings, every symbol bound now (LD_BIND_NOW) in trace mode with relocations (LD_WARN).
  # A binding line: "PID: binding file FROM [0] to TO [0]: normal symbol `SYM' [VERSION]".
  LD_TRACE_LOADED_OBJECTS=1 LD_WARN=yes LD_BIND_NOW=yes LD_DEBUG=bindings "$exe" >/dev/null 2>"$WORK/debug" ||
    fail "$name: the loader's trace mode failed:"$'\n'"$(grep -v binding "$WORK/debug" | tail -5)"
  sed -n "s/^ *[0-9]*:[[:space:]]*binding file \([^ ]*\) \[[0-9]*\] to \([^ ]*\) \[[0-9]*\]: normal symbol \`\([^']*\)'.*/\1 \2 \3/p" "$WORK/debug" >"$WORK/bindings"
  [ -s "$WORK/bindings" ] || fail "$name: the loader reported no bindings (LD_DEBUG=bindings)"
  nm -D --defined-only "$libstdcxx" | awk '{ sub(/@.*/, "", $3); print $3 }' >"$WORK/libstdcxx_defined"
  wrong=$(awk 'NR == FNR { defined[$1] = 1; next }
               { to = $2; sub(/.*\//, "", to) }
               to ~ /^lib(torch|c10)/ && ($3 in defined) { print $1 " -> " $2 ": " $3 }' \
    "$WORK/libstdcxx_defined" "$WORK/bindings")
  if [ -n "$wrong" ]; then
    fail "$name: $(wc -l <<<"$wrong") libstdc++ symbols bound to LibTorch, the first:"$'\n'"$(head -5 <<<"$wrong" | c++filt)"
  fi
  # EXE's own std::filesystem references: to libstdc++.so.6 (or EXE itself), and there are some.
  own_fs=$(awk -v exe="$exe" '$1 == exe && $3 ~ /St10filesystem/ { print $2 }' "$WORK/bindings" | sort | uniq -c)
  [ -n "$own_fs" ] || fail "$name binds no std::filesystem symbol of its own: nothing to check"
  if awk -v exe="$exe" '$2 != exe && $2 !~ /\/libstdc\+\+\.so\.6$/ { bad = 1 } END { exit !bad }' <<<"$own_fs"; then
    fail "$name binds its std::filesystem symbols to:"$'\n'"$own_fs"
  fi
  echo "$name: libstdc++.so.6 is DT_NEEDED entry $((stdcxx + 1)), ${needed[$torch]} entry $((torch + 1));" \
    "LibTorch from $torch_dirs; $(wc -l <"$WORK/bindings") bindings, none of a libstdc++ symbol to LibTorch;" \
    "its std::filesystem symbols bound as: $(awk '{ printf "%s%s to %s", (NR > 1 ? ", " : ""), $1, $2 }' <<<"$own_fs")"
done
