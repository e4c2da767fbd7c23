#!/usr/bin/env python3
"""Checks docs/performance.md against the raw files it cites, so that it cannot drift.

Each `##` section names its raw files (`bench/results/NAME`, `{a,b}` alternatives allowed).
Every decimal number the section states outside its code blocks (2.989, 1.00e-02, 32,154.5)
must be one of the numbers in those files at the precision printed; every cited file must
exist; and every file in bench/results/ must be cited by some doc (by path, or by name or
pattern in backticks), itself or a companion of the same stem. A number found anywhere in a
section's files passes, so a figure copied wrong can pass where its files hold many numbers;
a figure with no file behind it, or a file gone, cannot. Prints what fails and exits 1;
exits 0 when all holds.
"""

import fnmatch
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "performance.md"
RESULTS = ROOT / "bench" / "results"
NUMBER = re.compile(r"(?<![\w.\-/])(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+(?:e[-+]?\d+)?|\d+e[-+]?\d+)(?![\w/])")
CITED = re.compile(r"bench/results/([\w.\-{},*]+)")
RAW_NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
TICKED = re.compile(r"`([\w.\-{},*]+\.(?:txt|json|md|log|csv|\{[\w,]+\}|\*))`")


def expand(name):
    """`a.{md,json}` -> [a.md, a.json]."""
    m = re.search(r"\{([^}]*)\}", name)
    if not m:
        return [name.rstrip(".,")]
    out = []
    for alt in m.group(1).split(","):
        out += expand(name[: m.start()] + alt + name[m.end() :])
    return out


def parse(text):
    return float(text.replace(",", ""))


def decimals(text):
    """The step of the last digit printed: 2.989 -> 0.001, 1.00e-02 -> 1e-4, 32,154 -> 1."""
    t = text.replace(",", "")
    mant, _, exp = t.partition("e")
    step = 10.0 ** -(len(mant.split(".")[1]) if "." in mant else 0)
    return step * (10.0 ** int(exp) if exp else 1.0)


def matches(value, step, candidates):
    return any(abs(c - value) <= step / 2 * (1 + 1e-9) for c in candidates)


def sections(text):
    parts = re.split(r"(?m)^## ", text)
    return [("(preamble)" if i == 0 else p.splitlines()[0], p) for i, p in enumerate(parts)]


def main():
    failures = []
    text = DOC.read_text()
    names = sorted(p.name for p in RESULTS.iterdir())
    cited_anywhere = set()
    for doc in [*(ROOT / "docs").glob("*.md"), ROOT / "README.md"]:
        doc_text = doc.read_text()
        for m in [*CITED.finditer(doc_text), *TICKED.finditer(doc_text)]:
            for pattern in expand(m.group(1)):
                cited_anywhere.update(fnmatch.filter(names, pattern))
    for title, body in sections(text):
        files = []
        for m in CITED.finditer(body):
            for name in expand(m.group(1)):
                path = RESULTS / name
                if not path.is_file():
                    failures.append(f"{title}: cites bench/results/{name}, which is not there")
                else:
                    files.append(path)
        prose = re.sub(r"```.*?```", "", body, flags=re.S)
        prose = re.sub(r"`[^`]*`", "", prose)
        stated = [m.group(1) for m in NUMBER.finditer(prose)]
        if not stated:
            continue
        if not files:
            failures.append(f"{title}: states {len(stated)} numbers and cites no raw file")
            continue
        raw = []
        for path in files:
            raw_text = path.read_text(errors="replace")
            raw += [parse(m) for m in RAW_NUMBER.findall(raw_text)]
        raw = sorted(set(raw))
        for number in stated:
            if not matches(parse(number), decimals(number), raw):
                failures.append(f"{title}: {number} is in none of its raw files")
    stems = {n.rsplit(".", 1)[0] for n in cited_anywhere}
    for name in names:
        # A cited file's companions (its .json beside the .txt) go with it.
        if name not in cited_anywhere and name.rsplit(".", 1)[0] not in stems:
            failures.append(f"bench/results/{name} is cited by no doc")
    for f in failures:
        print(f)
    print(f"{len(failures)} problems" if failures else "docs/performance.md agrees with its raw files")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
