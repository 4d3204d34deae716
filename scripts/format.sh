#!/usr/bin/env bash
# Formats every tracked C/C++ source and header in place with .clang-format (make format).
set -euo pipefail
cd "$(dirname "$0")/.."
clang_format=${CLANG_FORMAT:-clang-format}
if ! command -v "$clang_format" >/dev/null 2>&1; then
  echo "format: $clang_format not found; install it with: apt-get install clang-format (or make deps)" >&2
  exit 2
fi
git ls-files -z '*.cpp' '*.hpp' '*.h' '*.cc' | xargs -0 -r "$clang_format" --style=file -i
echo "format: formatted the tracked C/C++ files (git diff shows the changes)"
