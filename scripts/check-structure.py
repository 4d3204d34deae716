#!/usr/bin/env python3
"""Checks the limits docs/DESIGN.md sets on the library's code (run by `make test`):

- no file in src/ over 450 lines;
- no function in src/ over 80 lines (from its signature's first line to its closing brace; data
  tables and class bodies aside);
- one call of oneDNN's sgemm in the library and the example Transformer: src/gemm.cpp's.

The function scan is textual: the code is formatted by .clang-format, so a definition at namespace
scope starts at column 0 and its closing brace is a `}` at column 0. Exits 1 listing what is over.
"""
import pathlib
import re
import subprocess
import sys

MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80
ROOT = pathlib.Path(__file__).resolve().parent.parent

NOT_A_FUNCTION = re.compile(r"^(template\s*<.*>\s*)?(namespace|struct|class|enum|union)\b|=\s*\{?$|^extern\b")


def tracked(*patterns):
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / line for line in out.stdout.split()]


def long_functions(path):
    """(first line, length) of each namespace-scope definition over the limit."""
    lines = path.read_text().splitlines()
    found, start = [], None
    for n, line in enumerate(lines):
        if start is None and line.endswith("{") and not line.startswith((" ", "}", "#", "//")):
            signature = n  # the definition starts here, or at the nearest column-0 line above
            while signature > 0 and lines[signature].startswith(" "):
                signature -= 1
            if not NOT_A_FUNCTION.search(lines[signature]) and not NOT_A_FUNCTION.search(line):
                start = signature
        elif start is None and line.endswith("{") and line.startswith(" ") and n > 0:
            signature = n  # a signature wrapped onto indented lines ends with the brace
            while signature > 0 and lines[signature].startswith(" "):
                signature -= 1
            head = lines[signature]
            if head and not head.startswith(("}", "#", "//")) and "(" in head and not NOT_A_FUNCTION.search(head) \
                    and not head.rstrip().endswith((";", "{")):
                start = signature
        elif start is not None and line.startswith("}"):
            if n - start + 1 > MAX_FUNCTION_LINES:
                found.append((start + 1, n - start + 1))
            start = None
    return found


def main():
    problems = []
    for path in tracked("src/*"):
        count = len(path.read_text().splitlines())
        if count > MAX_FILE_LINES:
            problems.append(f"{path.relative_to(ROOT)}: {count} lines (limit {MAX_FILE_LINES}): split it by concern")
    for path in tracked("src/*.cpp", "src/*.hpp", "src/*.h"):
        for first, length in long_functions(path):
            problems.append(f"{path.relative_to(ROOT)}:{first}: a function of {length} lines "
                            f"(limit {MAX_FUNCTION_LINES}): split it into named steps")
    calls = [f"{p.relative_to(ROOT)}:{n + 1}" for p in tracked("src/*", "examples/*")
             if p.suffix in (".cpp", ".hpp", ".h")
             for n, line in enumerate(p.read_text().splitlines()) if "dnnl_sgemm(" in line]
    if len(calls) != 1 or not calls[0].startswith("src/gemm.cpp:"):
        problems.append("dnnl_sgemm must be called from src/gemm.cpp only (the one GEMM entry); found: " +
                        ", ".join(calls))
    for p in problems:
        print("check-structure: " + p)
    print(f"check-structure: {'FAILED' if problems else 'ok'} (files <= {MAX_FILE_LINES} lines, "
          f"functions <= {MAX_FUNCTION_LINES} lines, one sgemm call)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
