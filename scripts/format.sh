#!/usr/bin/env bash
# .clang-format on every tracked C/C++ source and header.
#   scripts/format.sh           formats them in place (make format)
#   scripts/format.sh --check   lists the files that differ and exits 1 if any do (make format-check)
# Exits 2 when clang-format is missing or fails.
set -euo pipefail
cd "$(dirname "$0")/.."

clang_format=${CLANG_FORMAT:-clang-format}
if ! command -v "$clang_format" >/dev/null 2>&1; then
  echo "format: $clang_format not found; install it with: apt-get install clang-format (or make deps)" >&2
  exit 2
fi
files() { git ls-files -z '*.cpp' '*.hpp' '*.h' '*.cc'; }

if [ "${1:-}" != "--check" ]; then
  files | xargs -0 -r "$clang_format" --style=file -i
  echo "format: formatted the tracked C/C++ files (git diff shows the changes)"
  exit 0
fi

status=0
out=$(files | xargs -0 -r "$clang_format" --style=file --dry-run --Werror 2>&1) || status=$?
[ "$status" -eq 0 ] && { echo "format-check: all files formatted"; exit 0; }

# Each difference is reported as "FILE:LINE:COL: error: code should be clang-formatted [...]".
bad=$(sed -n 's/^\(.*\):[0-9]*:[0-9]*: error: code should be clang-formatted.*/\1/p' <<<"$out" | sort -u)
if [ -z "$bad" ]; then  # clang-format itself failed (a missing file, a bad .clang-format)
  awk '!seen[$0]++' <<<"$out" | head -n 20 >&2
  exit 2
fi
sed 's/^/  /' <<<"$bad"
echo "format-check: $(wc -l <<<"$bad") files differ from .clang-format (clang-format" \
  "$("$clang_format" --version | sed 's/.*version //')). Run: make format" >&2
exit 1
