"""The corpus's documents, read from Debian packages any machine can install (the list is
`PACKAGES`). Each source yields `Document`s in a fixed order, so a build is repeatable."""

from __future__ import annotations

import gzip
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from . import clean

#: Debian packages the corpus is built from (`apt-get install` them first).
PACKAGES = [
    "python3.11-doc", "rust-doc", "git-doc", "sqlite3-doc", "manpages", "manpages-dev",
    "dict-gcide", "wordnet-base",
]
#: Packages whose man pages join the corpus (besides `manpages` and `manpages-dev`): the
#: everyday command-line tools, which every Debian machine has.
MAN_PACKAGES = [
    "manpages", "manpages-dev", "coreutils", "findutils", "grep", "sed", "tar", "gzip",
    "bash", "git-man", "diffutils", "util-linux", "procps", "less", "openssh-client", "curl",
    "make", "man-db", "sqlite3", "python3.11",
]


@dataclass(frozen=True)
class Document:
    """One page, man page or group of dictionary entries."""

    source: str
    name: str
    text: str


def _files(root: Path, pattern: str) -> list[Path]:
    return sorted(p for p in root.rglob(pattern) if p.is_file())


def python_docs(root: Path = Path("/usr/share/doc/python3.11/html/_sources")) -> Iterator[Document]:
    """Python's library reference, tutorial, HOWTOs and FAQ, from their reST sources."""
    skip = ("whatsnew/", "c-api/", "distutils/", "install/")
    for path in _files(root, "*.rst.txt"):
        rel = str(path.relative_to(root))
        if rel.startswith(skip) or rel in ("contents.rst.txt", "copyright.rst.txt", "license.rst.txt"):
            continue
        yield Document("python-doc", rel, clean.rst_to_text(path.read_text(errors="replace")))


def rust_docs(root: Path = Path("/usr/share/doc/rust-doc/html")) -> Iterator[Document]:
    """The Rust book, Rust by Example, the reference and the nomicon (prose and examples; the
    generated std API pages are left out)."""
    for book in ("book", "rust-by-example", "reference", "nomicon"):
        base = root / book
        for path in _files(base, "*.html"):
            rel = str(path.relative_to(root))
            if "/2018-edition/" in rel or "/first-edition/" in rel or "/second-edition/" in rel:
                continue
            if path.name in ("print.html", "404.html", "toc.html", "SUMMARY.html"):
                continue
            text = clean.html_to_text(path.read_text(errors="replace"))
            if len(text) > 200:
                yield Document("rust-doc", rel, text)


def git_docs(root: Path = Path("/usr/share/doc/git-doc")) -> Iterator[Document]:
    """Git's manual pages and guides, from their AsciiDoc sources."""
    for path in _files(root, "*.txt"):
        text = clean.asciidoc_to_text(path.read_text(errors="replace"))
        if len(text) > 200:
            yield Document("git-doc", path.name, text)


def sqlite_docs(root: Path = Path("/usr/share/doc/sqlite3")) -> Iterator[Document]:
    """SQLite's documentation pages."""
    for path in _files(root, "*.html"):
        text = clean.html_to_text(path.read_text(errors="replace"))
        if len(text) > 200:
            yield Document("sqlite-doc", str(path.relative_to(root)), text)


def _package_files(package: str) -> list[str]:
    try:
        out = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return []
    return out.stdout.splitlines()


def man_pages(packages: list[str] = MAN_PACKAGES, render: Callable[[str], str] | None = None) -> Iterator[Document]:
    """English man pages (sections 1, 5, 7 and 8, and 2 and 3 from manpages-dev) of
    `packages`, rendered by `man` at 80 columns."""
    render = render or _render_man
    seen = set()
    for package in packages:
        for path in sorted(_package_files(package)):
            parts = path.split("/")
            if len(parts) < 6 or parts[:4] != ["", "usr", "share", "man"] or not parts[4].startswith("man"):
                continue
            if not os.path.isfile(path) or os.path.islink(path) or path in seen:
                continue
            seen.add(path)
            text = clean.man_to_text(render(path))
            if len(text) > 200:
                yield Document("man", f"{package}:{parts[-1]}", text)


def _render_man(path: str) -> str:
    env = dict(os.environ, MANWIDTH="80", MAN_KEEP_FORMATTING="0", LC_ALL="C.UTF-8")
    man = subprocess.run(["man", "-l", "-E", "UTF-8", path], capture_output=True, env=env)
    col = subprocess.run(["col", "-bx"], input=man.stdout, capture_output=True)
    return col.stdout.decode("utf-8", errors="replace")


def gcide(path: Path = Path("/usr/share/dictd/gcide.dict.dz"),
          index: Path = Path("/usr/share/dictd/gcide.index"), per_doc: int = 40) -> Iterator[Document]:
    """GCIDE's entries (Webster's 1913 with later additions), `per_doc` headwords a document."""
    data = gzip.open(path).read()
    entries: list[str] = []
    seen: set[tuple[int, int]] = set()
    for line in index.read_text(errors="replace").splitlines():
        fields = line.split("\t")
        if len(fields) < 3 or fields[0].startswith("00-database"):
            continue
        span = (_b64(fields[1]), _b64(fields[2]))
        if span in seen:
            continue
        seen.add(span)
        text = clean.gcide_entry_to_text(data[span[0]:span[0] + span[1]].decode("utf-8", errors="replace"))
        if len(text) > 20:
            entries.append(text)
    for k in range(0, len(entries), per_doc):
        yield Document("gcide", f"gcide-{k // per_doc:05d}", "\n\n".join(entries[k:k + per_doc]) + "\n")


def _b64(s: str) -> int:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    value = 0
    for ch in s:
        value = value * 64 + alphabet.index(ch)
    return value


def wordnet(root: Path = Path("/usr/share/wordnet"), per_doc: int = 80) -> Iterator[Document]:
    """WordNet's synsets as `words: gloss` lines, `per_doc` lines a document."""
    for pos in ("noun", "verb", "adj", "adv"):
        lines = [t for l in (root / f"data.{pos}").read_text(errors="replace").splitlines()
                 if (t := clean.wordnet_line_to_text(l))]
        for k in range(0, len(lines), per_doc):
            yield Document("wordnet", f"{pos}-{k // per_doc:05d}", "\n".join(lines[k:k + per_doc]) + "\n")


def python_source(root: Path | None = None, max_bytes: int = 200_000) -> Iterator[Document]:
    """The Python standard library's own source (the running interpreter's, which the
    python3 package installs), tests, IDLE and 2to3 left out: code with its docstrings."""
    import sysconfig

    root = root or Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__",
            "turtledemo", "ensurepip", "pydoc_data"}
    for path in _files(root, "*.py"):
        rel = path.relative_to(root)
        if skip & set(rel.parts) or path.stat().st_size > max_bytes:
            continue
        text = path.read_text(errors="replace")
        if len(text) > 200:
            yield Document("python-source", str(rel), text)


#: Every source by name, in the order a build reads them.
SOURCES: dict[str, Callable[[], Iterator[Document]]] = {
    "python-doc": python_docs,
    "rust-doc": rust_docs,
    "git-doc": git_docs,
    "sqlite-doc": sqlite_docs,
    "man": man_pages,
    "gcide": gcide,
    "wordnet": wordnet,
    "python-source": python_source,
}
#: What build_corpus.py reads by default; `python-source` is read where training runs
#: (train.py --extra), which has its own interpreter's library and no travel limit on it.
DEFAULT_SOURCES = [name for name in SOURCES if name != "python-source"]
