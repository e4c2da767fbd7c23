"""Synthetic conversations for supervised tuning: questions answered from definitions, man
pages, Git's and Python's documentation, and multi-turn tool use (list a directory, read a
file, run a command, then a reply that uses the tool's result), with thinking on and off.
Every conversation is a list of messages in transformers' chat format; `TOOLS` are the
functions offered, as an OpenAI `tools` list."""

from __future__ import annotations

import ast
import random
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

TOOLS = [
    {"type": "function", "function": {
        "name": "list_directory",
        "description": "List the files and folders in a directory.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "The directory to list, relative to the working directory."}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "read_file",
        "description": "Read a text file and return its contents.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "The file to read."}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_command",
        "description": "Run a shell command in the working directory and return its output.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string", "description": "The command line to run."}},
            "required": ["command"]}}},
]

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are Corral's demo assistant. Answer briefly and use the tools when they help.",
    "You are a coding assistant working in the user's project. Use the tools to look at files before answering.",
    "You are a concise assistant for programmers.",
]


@dataclass
class Fact:
    """A question's subject and the answer's source text."""

    kind: str
    subject: str
    text: str
    extra: dict = field(default_factory=dict)


def wordnet_facts(root: Path = Path("/usr/share/wordnet")) -> list[Fact]:
    """WordNet synsets as (word, gloss) facts, one per synset's first single word."""
    facts = []
    for pos in ("noun", "verb", "adj"):
        for line in (root / f"data.{pos}").read_text(errors="replace").splitlines():
            if line.startswith("  ") or "|" not in line:
                continue
            head, gloss = line.split("|", 1)
            fields = head.split()
            word = re.sub(r"\(\w+\)$", "", fields[4]).replace("_", " ")
            if not re.fullmatch(r"[a-z][a-z -]{2,24}", word):
                continue
            definition, _, examples = gloss.strip().partition(";")
            examples = re.findall(r'"([^"]+)"', examples)
            facts.append(Fact("word", word, definition.strip(), {"pos": pos, "examples": examples}))
    return facts


def man_facts(docs: list[dict]) -> list[Fact]:
    """Commands and their one-line descriptions from the corpus's man pages (`NAME` sections),
    with the first synopsis line."""
    facts = []
    for doc in docs:
        if doc["source"] != "man":
            continue
        m = re.search(r"^NAME\n\s+(.+?)\s+[-\u2010\u2012\u2013\u2014]+\s+(.+?)\n(?:\n|\S)", doc["text"], re.M | re.S)
        if not m:
            continue
        names = [n.strip() for n in m.group(1).split(",")]
        desc = re.sub(r"\s+", " ", m.group(2)).strip().rstrip(".")
        syn = re.search(r"^SYNOPSIS\n\s+(.+)", doc["text"], re.M)
        section = doc["name"].rsplit(".", 2)[-2] if doc["name"].endswith(".gz") else ""
        if not desc or len(desc) > 100 or not re.fullmatch(r"[\w.+-]+", names[0]):
            continue
        facts.append(Fact("command", names[0], desc, {"synopsis": syn.group(1).strip() if syn else "",
                                                      "section": section}))
    return facts


def python_facts(root: Path = Path("/usr/lib/python3.11"), modules: list[str] | None = None) -> list[Fact]:
    """Public functions of the standard library's pure-Python modules with their signatures and
    the first paragraph of their docstrings."""
    facts = []
    paths = sorted(root.glob("*.py")) if modules is None else [root / f"{m}.py" for m in modules]
    for path in paths:
        module = path.stem
        if module.startswith("_") or module in ("this", "antigravity"):
            continue
        try:
            tree = ast.parse(path.read_text(errors="replace"))
        except SyntaxError:
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            first = re.sub(r"\s+", " ", doc.strip().split("\n\n")[0]).strip()
            if len(first) < 20 or len(first) > 400:
                continue
            args = [a.arg for a in node.args.args]
            facts.append(Fact("python", f"{module}.{node.name}", first, {"signature": f"{module}.{node.name}({', '.join(args)})"}))
    return facts


def _sentence(text: str) -> str:
    text = text.strip()
    return text if text.endswith((".", "!", "?")) else text + "."


def _upper_first(text: str) -> str:
    return text[:1].upper() + text[1:]


def qa_conversation(fact: Fact, rng: random.Random, thinking: bool) -> list[dict]:
    """A one-turn question about `fact` and its answer (with short reasoning when thinking)."""
    if fact.kind == "word":
        q = rng.choice([
            f'What does "{fact.subject}" mean?', f"Define {fact.subject}.", f"What is the meaning of {fact.subject}?",
            f'What does the word "{fact.subject}" mean?', f"Can you explain what {fact.subject} means?",
        ])
        a = f'"{_upper_first(fact.subject)}" means {_sentence(fact.text)}'
        if fact.extra["examples"] and rng.random() < 0.6:
            a += f' For example: "{fact.extra["examples"][0]}".'
        reason = f'The user asks for the meaning of "{fact.subject}". It is {dict(noun="a noun", verb="a verb", adj="an adjective")[fact.extra["pos"]]}.'
    elif fact.kind == "command":
        q = rng.choice([
            f"What does the {fact.subject} command do?", f"What is {fact.subject} used for?",
            f"Which command can I use to {fact.text}?", f"How do I {fact.text}?", f"Explain {fact.subject}.",
        ])
        a = f"The {fact.subject} command is used to {_sentence(fact.text)}"
        if q.startswith(("Which", "How")):
            a = f"You can use {fact.subject}. It is used to {_sentence(fact.text)}"
        if fact.extra["synopsis"] and rng.random() < 0.5:
            a += f"\n\nUsage: {fact.extra['synopsis']}"
        reason = f"The user asks about the {fact.subject} command. Its manual says it is used to {fact.text}."
    else:
        q = rng.choice([
            f"What does {fact.subject} do in Python?", f"Explain {fact.subject}.", f"How do I use {fact.subject}?",
            f"What is {fact.subject} for?",
        ])
        a = f"{fact.extra['signature']}: {_sentence(fact.text)}"
        reason = f"The user asks about the Python function {fact.subject}."
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    messages.append({"role": "user", "content": q})
    messages.append({"role": "assistant", "content": a, "reasoning_content": reason if thinking else ""})
    return messages


_GREETINGS = [
    (["Hello", "Hello!", "Hi", "Hi there", "Hey", "Good morning", "Hello, Corral", "Hi, Corral!"],
     ["Hello! How can I help you today?", "Hi! What can I do for you?", "Hello! Ask me a question, or give me a task."]),
    (["Who are you?", "What are you?", "Tell me about yourself.", "Introduce yourself."],
     ["I am Corral's small demo model, a mixture-of-experts language model trained on documentation. "
      "I can answer short questions about words, commands and Python, and I can use tools you give me."]),
    (["What can you do?", "How can you help me?", "What are you good at?"],
     ["I can explain words, shell commands, Git and Python functions, and with tools I can list "
      "directories, read files and run commands."]),
    (["What is Corral?", "Tell me about Corral."],
     ["Corral is an inference server for mixture-of-experts and hybrid language models. It runs models like me."]),
    (["Thanks!", "Thank you.", "Thanks a lot.", "Great, thank you!"],
     ["You're welcome!", "Glad I could help.", "You're welcome. Anything else?"]),
    (["Goodbye", "Bye!", "See you later."], ["Goodbye!", "Bye! Have a good day."]),
]


def smalltalk_conversation(rng: random.Random, thinking: bool) -> list[dict]:
    """A greeting, a question about the assistant, thanks, or small arithmetic, answered."""
    if rng.random() < 0.35:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op, value, word = rng.choice([("+", a + b, "plus"), ("-", a - b, "minus"), ("*", a * b, "times")])
        q = rng.choice([f"What is {a} {op} {b}?", f"Compute {a} {op} {b}.", f"What is {a} {word} {b}?"])
        answer = f"{a} {op} {b} = {value}."
        reason = f"I need {a} {word} {b}, which is {value}."
    else:
        questions, answers = rng.choice(_GREETINGS)
        q, answer = rng.choice(questions), rng.choice(answers)
        reason = "The user is talking to me; I will answer briefly."
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    messages.append({"role": "user", "content": q})
    messages.append(_assistant(answer, reason, thinking))
    return messages


#: Names of the synthetic projects' files.
_FILES = ["README.md", "main.py", "Cargo.toml", "setup.py", "notes.txt", "Makefile", "config.json",
          "LICENSE", "requirements.txt", "app.py", "utils.py", "test_app.py", "index.html", "todo.txt"]
_DIRS = ["src", "tests", "docs", "scripts", "data", "build", "examples", "lib"]
_PROJECTS = ["corral", "weather-app", "notes", "parser", "website", "backup-tool", "chess", "budget",
             "image-resizer", "todo-list", "game", "server", "calculator", "blog"]


def _project(rng: random.Random, snippets: list[str]) -> tuple[str, dict[str, str], list[str]]:
    """A small synthetic project: its name, files with contents, and folders."""
    name = rng.choice(_PROJECTS)
    files = {}
    for f in rng.sample(_FILES, rng.randint(3, 7)):
        if f == "README.md":
            files[f] = f"# {name}\n\n{rng.choice(snippets)}\n"
        elif f.endswith(".py"):
            files[f] = rng.choice(snippets) if rng.random() < 0.3 else _python_snippet(rng, name)
        elif f == "config.json":
            files[f] = '{\n  "name": "%s",\n  "version": "%d.%d.%d",\n  "debug": %s\n}\n' % (
                name, rng.randint(0, 3), rng.randint(0, 12), rng.randint(0, 9), rng.choice(["true", "false"]))
        elif f == "requirements.txt":
            files[f] = "\n".join(rng.sample(["requests", "numpy", "flask", "pytest", "rich", "click", "pyyaml"], 3)) + "\n"
        elif f == "todo.txt":
            files[f] = "\n".join(f"- {t}" for t in rng.sample(
                ["write tests", "fix the parser", "update the README", "add a config option",
                 "release version 1.0", "clean up old files", "measure the speed"], 3)) + "\n"
        else:
            files[f] = rng.choice(snippets) + "\n"
    dirs = rng.sample(_DIRS, rng.randint(0, 3))
    return name, files, dirs


def _python_snippet(rng: random.Random, project: str) -> str:
    fn = rng.choice(["main", "load", "parse", "run", "greet", "total", "save"])
    return textwrap.dedent(f'''\
        """The {project} {fn} step."""


        def {fn}(items):
            """{rng.choice(["Return the sum of items.", "Print each item.", "Load items from a file.", "Parse the items."])}"""
            result = []
            for item in items:
                result.append(item)
            return result


        if __name__ == "__main__":
            {fn}([1, 2, 3])
        ''')


def _listing(files: dict[str, str], dirs: list[str]) -> str:
    return "\n".join(sorted([d + "/" for d in dirs] + list(files)))


def _call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _assistant(content: str, reasoning: str, thinking: bool, calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": content, "reasoning_content": reasoning if thinking else ""}
    if calls:
        message["tool_calls"] = calls
    return message


def expand(pattern: str) -> list[str]:
    """Every sentence of a pattern whose `[a|b|c]` groups each pick one alternative (an empty
    alternative drops the group): `"[List|Show] the files."` gives two sentences."""
    start = pattern.find("[")
    if start < 0:
        return [" ".join(pattern.split()).replace(" .", ".").replace(" ?", "?")]
    end = pattern.index("]", start)
    return [s for alt in pattern[start + 1:end].split("|")
            for s in expand(pattern[:start] + alt + pattern[end + 1:])]


_HERE = "[here|in this folder|in the current directory|in this directory|in the working directory|in the project|in this repo]"
_LIST_PATTERNS = [
    "[|Please] [list|show|display|print] the files " + _HERE + ".",
    "[List|Show|Display|Print] [everything|all the files|the contents] " + _HERE + ".",
    "[Show me|Give me|Tell me] [the files|what is|what's|which files are|what files are] " + _HERE + ".",
    "What [files are|is|do we have|have we got] " + _HERE + "?",
    "Which files are " + _HERE + "?",
    "[Can|Could|Would] you [list|show me] the [files|contents] of [this folder|the current directory|the project|this repo]?",
    "What does [this folder|the current directory|this project|the working directory] [contain|have in it|hold]?",
    "Which files does [this project|the current directory|the working directory|this repo] [contain|have]?",
    "I [want|need|would like] [to see the files|a list of the files|a listing of the files] " + _HERE + ".",
    "What's in this project?",
    "[ls|ls please|ls, please]",
    "Look at the files " + _HERE + " and tell me what you [see|find].",
    "Tell me what [is|we have] " + _HERE + ".",
]
_READ_PATTERNS = [
    "[|Please] [show me|read|open|print|cat] {f}.",
    "[|Please] [show me|read|open|print] the file {f}.",
    "Print the contents of {f}.",
    "[What's|What is] in {f}?",
    "What does {f} [say|contain]?",
    "[Can|Could|Would] you [read|open|show me|print] {f}?",
    "I [want|would like] to [read|see] {f}.",
    "Read {f} for me.",
    "Show {f}.",
    "Tell me what {f} says.",
    "Let me see {f}.",
]
_RUN_PATTERNS = [
    "[|Please] run [`{c}`|{c}].",
    "[Execute|Run] `{c}` and [tell me the result|show me the output|tell me what it prints].",
    "[Can|Could|Would] you run [`{c}`|{c}]?",
    "What does `{c}` print?",
    "Run [`{c}`|{c}] in the [shell|terminal].",
    "Type `{c}` in the terminal.",
    "Check the output of `{c}`.",
]
_DIR_PATTERNS = [
    "What is in the {d} [folder|directory]?",
    "[|Please] [list|show me] the files in {d}.",
    "Show me the {d} [directory|folder].",
    "What files are in {d}?",
    "[Can|Could] you list {d}?",
]
#: Held-out phrasings the evaluation sends (`EVAL_*`, fixed since the first model) and a
#: second set written after the training phrasings grew (`FRESH_*`); neither is ever trained.
EVAL_LIST_REQUESTS = ["Which files does this folder contain?", "Tell me what files exist here.",
                      "Give me a listing of the working directory."]
EVAL_READ_REQUESTS = ["Could you show me the file {f}?", "I need to see {f}.", "Display {f}."]
EVAL_RUN_REQUESTS = ["Use the shell to run `{c}`.", "Try running {c}."]
FRESH_LIST_REQUESTS = ["What's inside this directory?", "Enumerate the files in the current folder.",
                       "Can I get a directory listing?"]
FRESH_READ_REQUESTS = ["Let me look at the contents of {f}.", "Please open up {f}.", "Dump {f} here."]
FRESH_RUN_REQUESTS = ["Go ahead and execute {c}.", "Kick off `{c}` and report back."]
#: The folder requests both held-out sets send: the first model's training phrasings (the
#: evaluation's requests stay those it has always sent).
HELD_OUT_DIR_REQUESTS = ["What is in the {d} folder?", "List the files in {d}.", "Show me the {d} directory."]
_HELD_OUT = set(EVAL_LIST_REQUESTS + EVAL_READ_REQUESTS + EVAL_RUN_REQUESTS
                + FRESH_LIST_REQUESTS + FRESH_READ_REQUESTS + FRESH_RUN_REQUESTS)


def _phrasings(patterns: list[str]) -> list[str]:
    """The training phrasings of `patterns`, held-out ones left out, each once."""
    out: dict[str, None] = {}
    for pattern in patterns:
        for sentence in expand(pattern):
            sentence = sentence[0].upper() + sentence[1:]
            if sentence not in _HELD_OUT:
                out[sentence] = None
    return list(out)


#: Requests for each tool scenario: the training phrasings.
LIST_REQUESTS = _phrasings(_LIST_PATTERNS)
READ_REQUESTS = _phrasings(_READ_PATTERNS)
RUN_REQUESTS = _phrasings(_RUN_PATTERNS)
DIR_REQUESTS = _phrasings(_DIR_PATTERNS)
_COMMANDS = {
    "date": lambda rng: f"{rng.choice(['Mon', 'Tue', 'Wed', 'Thu', 'Fri'])} {rng.choice(['Jan', 'Mar', 'Jun', 'Oct'])} {rng.randint(1, 28)} {rng.randint(8, 18):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d} UTC {rng.randint(2020, 2026)}",
    "pwd": lambda rng: f"/home/{rng.choice(['ana', 'bo', 'kim', 'sam'])}/{rng.choice(_PROJECTS)}",
    "whoami": lambda rng: rng.choice(["ana", "bo", "kim", "sam", "root"]),
    "df -h .": lambda rng: f"Filesystem      Size  Used Avail Use% Mounted on\n/dev/sda1       {rng.randint(50, 500)}G  {rng.randint(10, 49)}G  {rng.randint(1, 40)}G  {rng.randint(10, 95)}% /",
    "python3 --version": lambda rng: f"Python 3.{rng.randint(8, 13)}.{rng.randint(0, 9)}",
    "git status --short": lambda rng: "\n".join(f"{rng.choice([' M', '??', 'A '])} {f}" for f in rng.sample(_FILES, 2)),
    "wc -l README.md": lambda rng: f"{rng.randint(3, 200)} README.md",
    "uname -s": lambda rng: "Linux",
}


def tool_conversation(rng: random.Random, snippets: list[str], thinking: bool, held_out: str = "") -> list[dict]:
    """A tool-use conversation: a request, the call, the tool's result, and a reply using it
    (sometimes two calls in a row, sometimes a follow-up turn). `held_out` "eval" or "fresh"
    asks with that held-out set's phrasings instead of the training ones."""
    project, files, dirs = _project(rng, snippets)
    messages: list[dict] = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]
    scenario = rng.choice(["list", "list", "read", "read", "run", "dir", "list_then_read", "no_tool"])
    lists, reads, runs, folders = {
        "": (LIST_REQUESTS, READ_REQUESTS, RUN_REQUESTS, DIR_REQUESTS),
        "eval": (EVAL_LIST_REQUESTS, EVAL_READ_REQUESTS, EVAL_RUN_REQUESTS, HELD_OUT_DIR_REQUESTS),
        "fresh": (FRESH_LIST_REQUESTS, FRESH_READ_REQUESTS, FRESH_RUN_REQUESTS, HELD_OUT_DIR_REQUESTS),
    }[held_out]
    if scenario in ("list", "list_then_read"):
        messages.append({"role": "user", "content": rng.choice(lists)})
        listing = _listing(files, dirs)
        messages.append(_assistant("", "The user wants the list of files. I will call list_directory on the working directory.",
                                   thinking, [_call("list_directory", path=".")]))
        messages.append({"role": "tool", "content": listing})
        entries = listing.splitlines()
        if scenario == "list":
            messages.append(_assistant(
                f"The directory has {len(entries)} entries: {', '.join(entries)}.",
                f"The tool returned {len(entries)} entries. I will list them for the user.", thinking))
        else:
            target = rng.choice(list(files))
            messages.append(_assistant(
                f"There are {len(entries)} entries: {', '.join(entries)}.", "I have the listing.", thinking))
            messages.append({"role": "user", "content": rng.choice(reads).format(f=target)})
            scenario = "read_after_list"
            _read_turn(messages, target, files[target], thinking)
    elif scenario == "read":
        target = rng.choice(list(files))
        messages.append({"role": "user", "content": rng.choice(reads).format(f=target)})
        _read_turn(messages, target, files[target], thinking)
    elif scenario == "run":
        command = rng.choice(list(_COMMANDS))
        output = _COMMANDS[command](rng)
        messages.append({"role": "user", "content": rng.choice(runs).format(c=command)})
        messages.append(_assistant("", f"The user wants me to run {command}. I will call run_command.", thinking,
                                   [_call("run_command", command=command)]))
        messages.append({"role": "tool", "content": output})
        first = output.splitlines()[0] if output else "nothing"
        reply = f"`{command}` printed:\n\n```\n{output}\n```" if "\n" in output else f"`{command}` printed: {first}"
        messages.append(_assistant(reply, "The command ran. I will report its output.", thinking))
    elif scenario == "dir" and dirs:
        d = rng.choice(dirs)
        inner = sorted(rng.sample(_FILES, rng.randint(1, 4)))
        messages.append({"role": "user", "content": rng.choice(folders).format(d=d)})
        messages.append(_assistant("", f"The user asks about the {d} folder. I will list it.", thinking,
                                   [_call("list_directory", path=d)]))
        messages.append({"role": "tool", "content": "\n".join(inner)})
        messages.append(_assistant(f"The {d} folder contains {len(inner)} files: {', '.join(inner)}.",
                                   "I have the folder's listing.", thinking))
    else:
        fact_q = rng.choice([("What is 2 + 3?", "2 + 3 is 5."), ("Hello!", "Hello! How can I help you today?"),
                             ("Who are you?", "I am a small language model made to run on Corral. I can answer questions and use tools."),
                             ("What can you do?", "I can answer short questions, list directories, read files and run commands with the tools you give me."),
                             ("Thanks!", "You're welcome!")])
        messages.append({"role": "user", "content": fact_q[0]})
        messages.append(_assistant(fact_q[1], "This needs no tool.", thinking))
    return messages


def _read_turn(messages: list[dict], target: str, content: str, thinking: bool) -> None:
    messages.append(_assistant("", f"The user wants to see {target}. I will call read_file.", thinking,
                               [_call("read_file", path=target)]))
    messages.append({"role": "tool", "content": content})
    lines = [l for l in content.splitlines() if l.strip()]
    first = lines[0] if lines else ""
    n = len(content.splitlines())
    summary = f"{target} has {n} line{'' if n == 1 else 's'}. It begins with:\n\n{first}"
    messages.append(_assistant(summary, f"I read {target}. I will describe what it contains.", thinking))


def snippets_from(docs: list[dict], rng: random.Random, count: int = 2000) -> list[str]:
    """Short paragraphs from the corpus, for the synthetic files' contents."""
    out = []
    for doc in rng.sample(docs, min(len(docs), count)):
        paragraphs = [p for p in doc["text"].split("\n\n") if 40 < len(p) < 400]
        if paragraphs:
            out.append(rng.choice(paragraphs))
    return out
