#!/usr/bin/env bash
# Formats Ferry's C++ sources with clang-format and the repository's .clang-format.
#
# Usage: scripts/format.sh [--check] [FILE...]
#   (no flag)  rewrites every C++ file under kernels/ core/ convert/ store/ sync/ daemon/ cli/
#              tests/ bench/ fuzz/ in place (or only the FILEs given)
#   --check    changes nothing; names every file whose formatting differs and exits 1
#              (0 when all are clean)
# Environment: CLANG_FORMAT (default: clang-format-14, else clang-format), FERRY_JOBS (nproc).
# Exit status: 0 clean/formatted, 1 files differ (--check), 2 usage error or clang-format missing.
#
# The files are those git knows (tracked and untracked, not ignored) with a C++ extension; outside
# a git checkout, the same folders are searched. clang-format runs once per batch of files, the
# batches in parallel.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

check=0
files=()
for arg in "$@"; do
  case "$arg" in
    --check) check=1 ;;
    -h|--help) sed -n '2,14s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) echo "format.sh: unknown option $arg (usage: scripts/format.sh [--check] [FILE...])" >&2; exit 2 ;;
    *) files+=("$arg") ;;
  esac
done

tool="${CLANG_FORMAT:-}"
if [ -z "$tool" ]; then
  for t in clang-format-14 clang-format; do
    if command -v "$t" >/dev/null; then tool="$t"; break; fi
  done
fi
if [ -z "$tool" ] || ! command -v "$tool" >/dev/null; then
  echo "format.sh: clang-format not found (${tool:-tried clang-format-14, clang-format});" \
       "install Debian's clang-format (scripts/setup.sh does) or set CLANG_FORMAT" >&2
  exit 2
fi
version="$("$tool" --version)"
if ! [[ "$version" =~ version\ 14\. ]]; then
  echo "format.sh: warning: $tool is not clang-format 14 ($version); the checked-in format is" \
       "clang-format 14's and other versions may format some lines differently" >&2
fi

DIRS=(kernels core convert store sync daemon cli tests bench fuzz)
EXT_RE='\.(h|hh|hpp|c|cc|cpp|cxx|cu|cuh)$'
if [ ${#files[@]} -eq 0 ]; then
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    mapfile -t files < <(git ls-files --cached --others --exclude-standard -- "${DIRS[@]}" |
                         grep -E "$EXT_RE" | while read -r f; do [ -f "$f" ] && echo "$f"; done)
  else
    mapfile -t files < <(find "${DIRS[@]}" -type f 2>/dev/null | grep -E "$EXT_RE" | sort)
  fi
fi
for f in "${files[@]}"; do
  [ -f "$f" ] || { echo "format.sh: $f: no such file" >&2; exit 2; }
done
if [ ${#files[@]} -eq 0 ]; then
  echo "format.sh: no C++ files found" >&2
  exit 2
fi

jobs="${FERRY_JOBS:-$(nproc)}"
batch=$(( (${#files[@]} + jobs - 1) / jobs ))
[ "$batch" -gt 64 ] && batch=64

if [ "$check" -eq 0 ]; then
  printf '%s\0' "${files[@]}" | xargs -0 -n "$batch" -P "$jobs" "$tool" -i --style=file
  echo "format.sh: formatted ${#files[@]} files with $tool"
  exit 0
fi

# --dry-run reports each difference as "FILE:LINE:COL: error: code should be clang-formatted".
# Each batch writes its report to a file of its own (parallel writers to one pipe interleave).
scratch="$(mktemp -d "${TMPDIR:-/tmp}/ferry-format.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT
printf '%s\0' "${files[@]}" |
  xargs -0 -n "$batch" -P "$jobs" sh -c \
    'tool=$1 out=$2; shift 2; "$tool" --dry-run --Werror --ferror-limit=1 --style=file "$@" >"$(mktemp "$out/batch.XXXXXX")" 2>&1 || true' \
    sh "$tool" "$scratch"
mapfile -t differ < <(cat "$scratch"/batch.* |
                      sed -n 's/^\(.*\):[0-9]*:[0-9]*: error: code should be clang-formatted.*/\1/p' | sort -u)
if [ ${#differ[@]} -gt 0 ]; then
  printf 'format.sh: not formatted: %s\n' "${differ[@]}" >&2
  echo "format.sh: ${#differ[@]} of ${#files[@]} files differ from .clang-format; run scripts/format.sh" >&2
  exit 1
fi
# No difference reported, but clang-format may still have failed (a file it could not read or parse).
if [ -n "$(cat "$scratch"/batch.*)" ]; then
  cat "$scratch"/batch.* >&2
  echo "format.sh: $tool failed (output above)" >&2
  exit 1
fi
echo "format.sh: all ${#files[@]} files are formatted"
