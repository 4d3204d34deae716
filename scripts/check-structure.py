#!/usr/bin/env python3
"""Checks the limits docs/DESIGN.md sets on the library's code (run by `make test`):

- no file in src/ over 450 lines;
- no function in src/ over 80 lines (from its signature's first line to its closing brace; data
  tables and class bodies aside);
- one call of oneDNN's sgemm in the library and the example Transformer: src/gemm.cpp's.

The function scan is textual: with comments and string literals blanked out, every `{` is matched to
its `}`, and a brace opens a function body when what precedes it is a parameter list `(...)` (after
qualifiers such as const, noexcept, override or a trailing return type) that follows no control keyword,
or a lambda's capture list. So functions at namespace scope, member functions defined in a class body,
operator() bodies and lambdas are all measured, from the first line of their declaration (after the
template header) to their closing brace; a lambda's lines count in its enclosing function too. Exits 1
listing what is over.
"""
import pathlib
import re
import subprocess
import sys

MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80
ROOT = pathlib.Path(__file__).resolve().parent.parent

CONTROL = re.compile(r"(?<![\w:])(if|for|while|switch|catch|sizeof|alignof|decltype|requires)$")


def tracked(*patterns):
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / line for line in out.stdout.split()]


def blank_comments_and_strings(text):
    """text with comments, string and character literals replaced by spaces (newlines kept), so that
    braces and parentheses inside them do not count."""
    literal = re.compile(r'//[^\n]*|/\*.*?\*/|R"([^(]*)\(.*?\)\1"|"(\\.|[^"\\\n])*"|(?<![\w\d])\'(\\.|[^\'\\\n])+\'', re.S)
    return literal.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), text)


def strip_qualifiers(head):
    """head without what may stand between a parameter list and the body: const, noexcept (with its
    condition), override, final, mutable, HWY_ATTR, a trailing return type."""
    while True:
        head = head.rstrip()
        trailing = re.search(r"->[\w:<>,\s*&]*$", head)
        word = re.search(r"\b(const|noexcept|override|final|mutable|HWY_ATTR)$", head)
        if trailing:
            head = head[:trailing.start()]
        elif word:
            head = head[:word.start()]
        elif head.endswith(")") and re.search(r"\bnoexcept$", head[:matching_paren(head)].rstrip()):
            head = head[:matching_paren(head)].rstrip()[:-len("noexcept")]
        else:
            return head


def matching_paren(head):
    """The index of the `(` that the `)` ending head closes (-1 if none)."""
    depth, k = 0, len(head) - 1
    while k >= 0:
        depth += {")": 1, "(": -1}.get(head[k], 0)
        if depth == 0:
            return k
        k -= 1
    return -1


def opens_function_body(before):
    """Whether a `{` preceded by the text `before` opens a function (or lambda) body."""
    head = strip_qualifiers(before)
    if head.endswith("]"):
        return True  # a lambda without parameters: [&] { ... }
    if not head.endswith(")"):
        return False  # a class, namespace, initializer, or a block after else, do, try
    name = head[:matching_paren(head)].rstrip()
    return bool(name) and not CONTROL.search(name) and not name.endswith(("=", ",", "(", "return", "&&", "||"))


def declaration_start(text, brace):
    """Where the declaration whose body opens at `brace` begins: after the previous `;`, `{`, `}` or access
    specifier, and after a template header."""
    k = brace
    depth = 0
    while k > 0:
        k -= 1
        c = text[k]
        if c in ")]" or (c == ">" and text[k - 1] != "-"):
            depth += 1
        elif c in "([<":
            depth -= 1
        elif depth <= 0 and (c in ";{}" or (c == ":" and re.search(r"\b(public|private|protected)\s*$", text[:k]))):
            break
    start = k + 1 if k > 0 else 0
    while start < brace and text[start].isspace():
        start += 1
    template = re.match(r"template\s*<", text[start:])
    if template:  # skip the template header: the first `>` that closes it
        depth, j = 0, start + template.end() - 1
        while j < brace:
            depth += {"<": 1, ">": -1}.get(text[j], 0)
            j += 1
            if depth == 0:
                break
        start = j
        while start < brace and text[start].isspace():
            start += 1
    return start


def long_functions(path):
    """(first line, length) of each function body over the limit: functions, member functions, operator()
    bodies and lambdas alike."""
    text = blank_comments_and_strings(path.read_text())
    found, opened = [], []
    for match in re.finditer(r"[{}]", text):
        if match.group() == "{":
            opened.append((match.start(), opens_function_body(text[max(0, match.start() - 2000):match.start()])))
            continue
        if not opened:
            continue  # an unbalanced brace (a macro's): nothing to measure
        brace, is_function = opened.pop()
        if is_function:
            first = text.count("\n", 0, declaration_start(text, brace)) + 1
            length = text.count("\n", 0, match.start()) + 1 - first + 1
            if length > MAX_FUNCTION_LINES:
                found.append((first, length))
    return sorted(found)


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
