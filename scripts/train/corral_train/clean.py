"""Markup to plain text: reStructuredText (Python's docs), HTML (Rust's books), AsciiDoc
(Git's docs), rendered man pages and dictionary entries. Each cleaner keeps prose and code and
drops navigation, directives and markup, so the text reads as a person would read the page."""

from __future__ import annotations

import html
import re
from html.parser import HTMLParser

_ROLE = re.compile(r":[a-zA-Z:]+:`~?!?([^`<]*?)(?:\s*<[^>]*>)?`")
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]*>`__?")
_REF = re.compile(r"`([^`<]+)`_+")
_EMPH = re.compile(r"\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*")
_LITERAL = re.compile(r"``([^`]+)``")
_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+.:_])\1{2,}\s*$")
_FOOTREF = re.compile(r"\s*\[#[^\]]*\]_")
# Directives whose body is kept as prose (the label becomes a lead-in word).
_PROSE_DIRECTIVES = {
    "note": "Note:",
    "warning": "Warning:",
    "seealso": "See also:",
    "tip": "Tip:",
    "important": "Important:",
    "attention": "Attention:",
    "caution": "Caution:",
    "impl-detail": "CPython implementation detail:",
}
# Directives that describe an API object: the signature becomes a line of its own.
_OBJECT_DIRECTIVES = {
    "function", "method", "class", "exception", "attribute", "data", "decorator",
    "classmethod", "staticmethod", "module", "describe", "option", "envvar", "cmdoption",
    "opcode", "pdbcommand", "c:function", "c:macro", "c:type", "c:member", "c:var",
    "abstractmethod", "coroutinefunction", "coroutinemethod", "decoratormethod", "program",
}
_VERSION_DIRECTIVES = {
    "versionadded": "New in version",
    "versionchanged": "Changed in version",
    "deprecated": "Deprecated since version",
    "deprecated-removed": "Deprecated since version",
}


def rst_inline(text: str) -> str:
    """reST inline markup to text: roles, links, emphasis and literals keep their words."""
    text = _FOOTREF.sub("", text)
    text = _LINK.sub(r"\1", text)
    text = _REF.sub(r"\1", text)
    text = _ROLE.sub(r"\1", text)
    text = _LITERAL.sub(r"\1", text)
    text = _EMPH.sub(lambda m: m.group(1) or m.group(2), text)
    return text.replace("\\ ", "").replace("\\", "")


def rst_to_text(source: str) -> str:
    """A reST page (Sphinx) to text: directives become prose or signatures, option fields and
    comments go, literal blocks stay indented."""
    out: list[str] = []
    lines = source.splitlines()
    i = 0
    skip_indent: int | None = None
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if stripped and indent <= skip_indent:
                skip_indent = None
            else:
                i += 1
                continue
        if _UNDERLINE.match(stripped):
            i += 1
            continue
        directive = re.match(r"^(\s*)\.\.\s+([\w:-]+)::\s*(.*)$", line)
        if directive:
            name, arg = directive.group(2), directive.group(3).strip()
            if name in _PROSE_DIRECTIVES:
                out.append(" " * indent + _PROSE_DIRECTIVES[name] + (" " + rst_inline(arg) if arg else ""))
            elif name in _OBJECT_DIRECTIVES:
                if arg:
                    out.append(" " * indent + rst_inline(arg))
            elif name in _VERSION_DIRECTIVES:
                out.append(" " * indent + f"{_VERSION_DIRECTIVES[name]} {arg.split(',')[0].strip()}.")
            elif name in ("code-block", "sourcecode", "code", "doctest", "testcode", "productionlist"):
                out.append("")
            else:
                # index, toctree, image, tabularcolumns and the like: drop with their body.
                skip_indent = indent
            i += 1
            continue
        if re.match(r"^\s*\.\.(\s|$)", line):
            # A comment or target: drop it and its indented body.
            skip_indent = indent
            i += 1
            continue
        if re.match(r"^\s*:[\w -]+:(\s|$)", line) and not stripped.startswith(":mod:"):
            # A field (:synopsis:, :noindex:, ...) under a directive.
            i += 1
            continue
        text = rst_inline(line.rstrip())
        if text.endswith("::"):
            text = text[:-1] if not text.endswith(" ::") else text[:-3]
        out.append(text)
        i += 1
    return _squeeze(out)


class _HtmlText(HTMLParser):
    """Collects the text of an mdBook or rustdoc page's main content."""

    _SKIP = {"script", "style", "nav", "head", "button", "noscript", "svg", "template"}
    _BLOCK = {"p", "div", "section", "h1", "h2", "h3", "h4", "h5", "h6", "li", "tr", "br",
              "blockquote", "dt", "dd", "table", "ul", "ol", "pre", "hr", "details", "summary"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip = 0
        self.pre = 0
        self.in_main = 0
        self.saw_main = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in self._SKIP or "sidebar" in (attrs.get("class") or "") or attrs.get("id") in (
            "sidebar", "menu-bar", "searchbar-outer", "searchresults-outer"
        ):
            self.skip += 1
            return
        if tag == "main":
            self.in_main += 1
            self.saw_main = True
        if tag == "pre":
            self.pre += 1
            self.parts.append("\n\n")
        elif tag in self._BLOCK:
            self.parts.append("\n\n" if tag not in ("li", "br", "tr", "dt", "dd") else "\n")
            if tag == "li":
                self.parts.append("- ")

    def handle_endtag(self, tag):
        if tag in self._SKIP:
            self.skip = max(0, self.skip - 1)
            return
        if self.skip and tag in ("div", "ul", "section"):
            # Closing a skipped sidebar container; depth is approximate but pages nest shallowly.
            return
        if tag == "main":
            self.in_main = max(0, self.in_main - 1)
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
            self.parts.append("\n\n")
        elif tag in self._BLOCK:
            self.parts.append("\n")

    def handle_data(self, data):
        if self.skip:
            return
        if self.pre:
            self.parts.append(data)
        else:
            self.parts.append(re.sub(r"\s+", " ", data))


def html_to_text(source: str) -> str:
    """An HTML page to text: its `<main>` (without one, the body from its first `<h1>`),
    scripts, navigation and sidebars dropped, `<pre>` blocks kept line for line."""
    main = re.search(r"<main[^>]*>(.*)</main>", source, re.S)
    if main:
        source = main.group(1)
    elif (h1 := re.search(r"<h1[\s>]", source)) is not None:
        source = source[h1.start():]
    parser = _HtmlText()
    parser.feed(source)
    text = "".join(parser.parts)
    lines = [l.rstrip() for l in text.splitlines()]
    return _squeeze(lines)


_ASCIIDOC_LINK = re.compile(r"(?:linkgit|link|gitlink):([\w./-]+?)\[(\d*)\]")
_ASCIIDOC_QUOTE = re.compile(r"(?<![\w`])'([^'\n]+)'(?![\w])")


def asciidoc_to_text(source: str) -> str:
    """Git's AsciiDoc pages to text: link macros become names, attribute lines and block
    delimiters go, quoted commands lose their quotes."""
    out = []
    for line in source.splitlines():
        s = line.strip()
        if _UNDERLINE.match(s) or re.match(r"^(\[[\w ,=\"]*\]|:[\w-]+:.*|ifdef::.*|endif::.*|ifndef::.*|include::.*|//.*)$", s):
            continue
        if re.match(r"^(-{4,}|\.{4,}|\+|_{4,}|={4,}|\*{4,})$", s):
            continue
        line = re.sub(r"^=+\s+", "", line)
        line = _ASCIIDOC_LINK.sub(lambda m: m.group(1) + (f"({m.group(2)})" if m.group(2) else ""), line)
        line = _ASCIIDOC_QUOTE.sub(r"\1", line)
        line = line.replace("`", "")
        line = re.sub(r"::$", ":", line.rstrip())
        out.append(line)
    return _squeeze(out)


def man_to_text(rendered: str) -> str:
    """A man page rendered by `man` (overstrikes removed by `col -b`) to text: the running
    header and footer lines go, indentation is kept."""
    lines = rendered.splitlines()
    if lines and re.match(r"^\S+\(\w+\)\s.*\S+\(\w+\)$", lines[0].strip()):
        lines = lines[1:]
    if lines and re.search(r"\S+\(\w+\)$", lines[-1].strip()):
        lines = lines[:-1]
    return _squeeze([l.rstrip() for l in lines])


def gcide_entry_to_text(entry: str) -> str:
    """A GCIDE entry as the dict server stores it, its pronunciation markup and source tags
    dropped: `Apple \\Ap"ple\\, n. [OE. appel.]` becomes `Apple, n.`."""
    entry = re.sub(r"\\[^\\\n]*\\", "", entry)
    while (bare := re.sub(r"\[[^\[\]]*\]", "", entry)) != entry:  # innermost brackets first
        entry = bare
    entry = entry.replace("{", "").replace("}", "")
    entry = re.sub(r"\s*--\s*\w+(\s+\w+)?\.\s*$", "", entry, flags=re.M)
    lines = [re.sub(r"\s+", " ", l).strip() for l in entry.splitlines()]
    paragraphs, current = [], []
    for l in lines:
        if not l:
            if current:
                paragraphs.append(" ".join(current))
                current = []
        else:
            current.append(l)
    if current:
        paragraphs.append(" ".join(current))
    text = "\n\n".join(p.replace(" ,", ",") for p in paragraphs)
    return html.unescape(text).strip()


def wordnet_line_to_text(line: str) -> str | None:
    """A WordNet data line to `word, word: gloss`, or None for the license header."""
    if line.startswith("  ") or "|" not in line:
        return None
    head, gloss = line.split("|", 1)
    fields = head.split()
    try:
        count = int(fields[3], 16)
    except (IndexError, ValueError):
        return None
    words = [fields[4 + 2 * k].replace("_", " ") for k in range(count)]
    words = [re.sub(r"\(\w+\)$", "", w) for w in words]
    return f"{', '.join(words)}: {gloss.strip()}"


def _squeeze(lines: list[str]) -> str:
    """Lines to text with runs of blank lines made one and the ends trimmed."""
    out: list[str] = []
    blank = False
    for line in lines:
        if not line.strip():
            if out and not blank:
                out.append("")
            blank = True
        else:
            out.append(line)
            blank = False
    return "\n".join(out).strip() + "\n"
