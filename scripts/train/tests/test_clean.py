"""The markup cleaners keep prose and code and drop markup."""

import sys
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from corral_train import clean  # noqa: E402


class RstTest(unittest.TestCase):
    def test_directives_roles_and_literal_blocks(self):
        source = """:mod:`json` --- JSON encoder
============================

.. module:: json
   :synopsis: Encode and decode.

.. index:: single: JSON

The :func:`dumps` function uses ``sort_keys`` and `Sphinx`_ and `the spec <https://json.org>`_.

.. function:: dumps(obj, *, indent=None)

   Serialize *obj* to a **string**.

   .. versionadded:: 3.4

   .. note::
      Keys are strings.

Example::

    >>> json.dumps([1, 2])
    '[1, 2]'
"""
        text = clean.rst_to_text(source)
        self.assertIn("json --- JSON encoder", text)
        self.assertNotIn("=====", text)
        self.assertNotIn("synopsis", text)
        self.assertNotIn("single: JSON", text)
        self.assertIn("The dumps function uses sort_keys and Sphinx and the spec.", text)
        self.assertIn("dumps(obj, *, indent=None)", text)
        self.assertIn("Serialize obj to a string.", text)
        self.assertIn("New in version 3.4.", text)
        self.assertIn("Note:", text)
        self.assertIn("Keys are strings.", text)
        self.assertIn("Example:\n", text)
        self.assertIn("    >>> json.dumps([1, 2])", text)


class HtmlTest(unittest.TestCase):
    def test_main_content_without_navigation(self):
        page = """<html><head><title>T</title><script>var x = 1;</script></head><body>
<nav>Home | Next</nav><div class="sidebar">Chapters</div>
<main><h1>Ownership</h1><p>Each value has an <em>owner</em>.</p>
<pre><code>fn main() {
    let s = String::new();
}</code></pre><ul><li>one</li><li>two</li></ul></main></body></html>"""
        text = clean.html_to_text(page)
        self.assertTrue(text.startswith("Ownership\n"))
        self.assertIn("Each value has an owner.", text)
        self.assertIn("fn main() {\n    let s = String::new();\n}", text)
        self.assertIn("- one", text)
        for gone in ("var x", "Home | Next", "Chapters"):
            self.assertNotIn(gone, text)

    def test_page_without_main_starts_at_its_heading(self):
        page = "<div>Small. Fast.</div><h1>About SQLite</h1><p>SQLite is a library.</p>"
        self.assertEqual(clean.html_to_text(page), "About SQLite\n\nSQLite is a library.\n")


class OtherFormatsTest(unittest.TestCase):
    def test_asciidoc_links_quotes_and_delimiters(self):
        source = "git-add(1)\n==========\n\n== NAME\n[verse]\n'git add' [<pathspec>...]\n--------\nSee linkgit:git-commit[1] and `git status`.\n--dry-run::\n\tDo nothing.\n"
        text = clean.asciidoc_to_text(source)
        self.assertIn("NAME", text)
        self.assertNotIn("==", text)
        self.assertIn("git add [<pathspec>...]", text)
        self.assertIn("See git-commit(1) and git status.", text)
        self.assertIn("--dry-run:", text)
        self.assertNotIn("[verse]", text)

    def test_man_page_header_and_footer(self):
        rendered = "LS(1)                 User Commands                 LS(1)\n\nNAME\n       ls - list\n\nGNU coreutils 9.1          2022          LS(1)\n"
        self.assertEqual(clean.man_to_text(rendered), "NAME\n       ls - list\n")

    def test_gcide_entry(self):
        entry = 'Apple \\Ap"ple\\, n. [OE. appel, AS. [ae]ppel.]\n   1. The fleshy fruit of a tree.\n      [1913 Webster]\n\n   2. {Apple of the eye}, the pupil.\n'
        text = clean.gcide_entry_to_text(entry)
        self.assertEqual(text, "Apple, n. 1. The fleshy fruit of a tree.\n\n2. Apple of the eye, the pupil.")

    def test_wordnet_line(self):
        line = '02084071 05 n 02 dog 0 domestic_dog 0 003 @ 02083346 n 0000 | a member of the genus Canis; "the dog barked"'
        self.assertEqual(clean.wordnet_line_to_text(line), 'dog, domestic dog: a member of the genus Canis; "the dog barked"')
        self.assertIsNone(clean.wordnet_line_to_text("  1 This software and database is being provided"))


if __name__ == "__main__":
    unittest.main()
