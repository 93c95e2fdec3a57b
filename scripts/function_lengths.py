#!/usr/bin/env python3
"""Report C++ functions longer than N lines.

    scripts/function_lengths.py [--min N] [--summary] PATH...

PATH is a file or a directory (searched for .cc .cpp .h .hpp .inc). A
function's length runs from the first line of its signature to its closing
brace, both included. Lambdas and local classes inside a function count as
part of that function; a lambda bound at namespace or class scope
(`const auto f = [](...) {`) counts as a function of its own. Namespace,
`extern "C"` and class bodies are looked through, so member functions
defined in a class body are found. Comments, string and character literals
and preprocessor lines are ignored. The parser is a brace matcher with a few
rules, not a C++ front end: code whose braces only balance per `#if` branch
can mislead it.

Prints `path:line: length name` for each function at or over the threshold,
longest first, then a count; exits 0.
"""

import argparse
import os
import re
import sys

EXTENSIONS = (".cc", ".cpp", ".cxx", ".h", ".hpp", ".inc")
CONTROL = {"if", "for", "while", "switch", "catch", "do", "else", "try"}


def strip(text):
    """Blank out comments, literals and preprocessor lines, keeping newlines
    so line numbers survive."""
    out = []
    i, n = 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if line_start and c == "#":
            # A preprocessor directive, with its backslash continuations.
            while i < n and text[i] != "\n":
                if text[i] == "\\" and i + 1 < n and text[i + 1] == "\n":
                    out.append("\n")
                    i += 2
                    continue
                i += 1
            continue
        if c == "\n":
            out.append(c)
            line_start = True
            i += 1
            continue
        if c in " \t\r\f\v":
            out.append(c)
            i += 1
            continue
        line_start = False
        if text.startswith("//", i):
            while i < n and text[i] != "\n":
                i += 1
            continue
        if text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:end]))
            i = end
            continue
        raw = re.match(r'(?:u8|u|U|L)?R"([^()\\ ]{0,16})\(', text[i:i + 24])
        if raw and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            close = ")" + raw.group(1) + '"'
            end = text.find(close, i + raw.end())
            end = n if end < 0 else end + len(close)
            out.append('""' + "".join("\n" for ch in text[i:end] if ch == "\n"))
            i = end
            continue
        if c == '"' or (c == "'" and not digit_separator(text, i)):
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(c + c)
            i = j + 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


def digit_separator(text, i):
    """Whether the quote at i separates digits (1'000'000)."""
    j = i
    while j > 0 and (text[j - 1].isalnum() or text[j - 1] in "_'."):
        j -= 1
    return j < i and text[j].isdigit()


def top_level(header):
    """The header with everything inside (), [] and <> removed."""
    depth = 0
    out = []
    for ch in header:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def classify(header):
    """What a `{` opens, from the text since the previous `;`, `{` or `}` at
    the same level: 'scope' (looked through), 'function', 'init' (a brace
    initializer in a constructor's member list: the header goes on) or
    'other' (an aggregate, enum or other block: skipped whole)."""
    h = " ".join(header.split())
    if not h:
        return "other"
    flat = top_level(h)
    words = re.findall(r"[A-Za-z_]\w*", flat)
    if re.match(r"^(inline\s+)?namespace\b", h) or re.match(r"^extern\s*(\"\")?$", h):
        return "scope"
    body = re.sub(r"^template\s*<.*?>\s*", "", h)
    if re.match(r"^(typedef\s+)?(class|struct|union)\b", body) and "(" not in flat.split(":")[0]:
        return "scope"
    if re.match(r"^(typedef\s+)?enum\b", body):
        return "other"
    if "[" in h and re.search(r"\]\s*(\([^)]*\))?[^=;]*$", h) and "=" in flat:
        return "function"  # a lambda bound at namespace or class scope
    if "(" not in h:
        return "other"
    if words and words[0] in CONTROL:
        return "other"
    # A member initializer list: `Foo(...) : a_(x), b_{` ends in a name.
    if re.search(r"\)\s*(const\s*)?(noexcept\s*)?:", h) and re.search(r"(\w|>)\s*$", h):
        if not re.search(r"\b(const|noexcept|override|final|mutable)\s*$", h):
            return "init"
    if "=" in flat and not re.search(r"operator\s*\S*=", flat):
        return "other"  # `T x = f(...) {`-like aggregates
    return "function"


def function_name(header):
    h = " ".join(header.split())
    lam = re.search(r"([A-Za-z_]\w*)\s*=\s*\[", h)
    if lam:
        return "lambda " + lam.group(1)
    op = re.search(r"((?:[A-Za-z_]\w*::)*operator\s*(?:\(\)|[^\s(]+))\s*\(", h)
    if op:
        return op.group(1)
    m = re.search(r"((?:~?[A-Za-z_]\w*(?:<[^()]*>)?::)*~?[A-Za-z_]\w*)\s*\(", h)
    return m.group(1) if m else h[:60]


def functions(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        code = strip(f.read())
    results = []
    line = 1
    header_start = None  # offset of the current header's first non-blank char
    header_line = 1
    i, n = 0, len(code)

    def skip_block(j):
        """From just after a `{`, the offset after its matching `}` and the
        line there."""
        nonlocal line
        depth = 1
        while j < n and depth:
            ch = code[j]
            if ch == "\n":
                line += 1
            elif ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            j += 1
        return j

    while i < n:
        ch = code[i]
        if ch == "\n":
            line += 1
            i += 1
            continue
        if ch in " \t\r\f\v":
            i += 1
            continue
        if ch in ";}":
            header_start = None
            i += 1
            continue
        if header_start is None:
            header_start = i
            header_line = line
        if ch == "{":
            header = code[header_start:i]
            kind = classify(header)
            if kind == "scope":
                header_start = None
                i += 1
            elif kind == "init":
                i = skip_block(i + 1)  # the header continues after `b_{...}`
            elif kind == "function":
                i = skip_block(i + 1)
                results.append((line - header_line + 1, header_line, function_name(header)))
                header_start = None
            else:
                i = skip_block(i + 1)
                header_start = None
            continue
        i += 1
    return results


def sources(paths):
    for p in paths:
        if os.path.isdir(p):
            for root, dirs, files in os.walk(p):
                dirs.sort()
                for name in sorted(files):
                    if name.endswith(EXTENSIONS):
                        yield os.path.join(root, name)
        else:
            yield p


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min", type=int, default=120, help="report functions of at least this many lines")
    parser.add_argument("--summary", action="store_true", help="print only the count")
    parser.add_argument("paths", nargs="+")
    args = parser.parse_args()
    found = []
    for path in sources(args.paths):
        for length, line, name in functions(path):
            if length >= args.min:
                found.append((length, path, line, name))
    found.sort(key=lambda r: (-r[0], r[1], r[2]))
    if not args.summary:
        for length, path, line, name in found:
            print(f"{path}:{line}: {length} {name}")
    print(f"{len(found)} functions of {args.min} lines or more")
    return 0


if __name__ == "__main__":
    sys.exit(main())
