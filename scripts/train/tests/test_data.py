"""The held-out split, the tokenizer and the tuning data builders."""

import random
import sys
import tempfile
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from corral_train import chat, render, split, tokenizer  # noqa: E402

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n",
    "git commit records changes to the repository.\n",
    "SELECT name FROM users WHERE id = 1;\n",
] * 50


class SplitTest(unittest.TestCase):
    def test_stable_and_about_two_percent(self):
        names = [f"doc-{k}" for k in range(20000)]
        held = [n for n in names if split.held_out("src", n)]
        self.assertTrue(300 < len(held) < 500, len(held))
        self.assertEqual(held, [n for n in names if split.held_out("src", n)])
        self.assertNotEqual(held, [n for n in names if split.held_out("other", n)])


class TokenizerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tok = tokenizer.train(TEXTS, 600)

    def test_added_tokens_follow_the_vocabulary_in_qwen_order(self):
        base = self.tok.get_vocab_size(with_added_tokens=False)
        self.assertTrue(256 < base <= 600, base)
        for k, (text, _) in enumerate(tokenizer.QWEN_ADDED_TOKENS):
            self.assertEqual(self.tok.token_to_id(text), base + k, text)

    def test_round_trip_and_single_token_tags(self):
        text = "<|im_start|>assistant\n<think>\nok\n</think>\n\n<tool_call>\n<function=ls>\n</function>\n</tool_call><|im_end|>"
        ids = self.tok.encode(text).ids
        self.assertEqual(self.tok.decode(ids, skip_special_tokens=False), text)
        for tag in ("<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_start|>", "<|im_end|>"):
            self.assertIn(self.tok.token_to_id(tag), ids)
        # Unseen characters still encode, as bytes.
        self.assertEqual(self.tok.decode(self.tok.encode("naïve ☃").ids), "naïve ☃")

    def test_config_and_files(self):
        with tempfile.TemporaryDirectory() as d:
            tokenizer.save(self.tok, Path(d), "{{ messages }}")
            config = tokenizer.tokenizer_config(self.tok)
            self.assertEqual(config["eos_token"], "<|im_end|>")
            self.assertTrue(config["added_tokens_decoder"][str(self.tok.token_to_id("<|im_end|>"))]["special"])
            self.assertFalse(config["added_tokens_decoder"][str(self.tok.token_to_id("<think>"))]["special"])
            self.assertEqual((Path(d) / "chat_template.jinja").read_text(), "{{ messages }}")

    def test_segments_tokenize_as_the_whole(self):
        rendered = ("<|im_start|>system\nYou help.<|im_end|>\n<|im_start|>user\nDefine fox.<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n\n</think>\n\nA fox is an animal.<|im_end|>\n")
        pieces = render.segments(rendered, render.last_user_header(rendered))
        joined = [i for text, _ in pieces for i in self.tok.encode(text).ids]
        self.assertEqual(joined, self.tok.encode(rendered).ids)


class RenderTest(unittest.TestCase):
    def test_only_replies_after_the_last_user_message_train(self):
        rendered = ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
                    "<|im_start|>user\nList files<|im_end|>\n<|im_start|>assistant\n<tool_call>x</tool_call><|im_end|>\n"
                    "<|im_start|>user\n<tool_response>\na.py\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\nThere is a.py.<|im_end|>\n")
        pieces = render.segments(rendered, render.last_user_header(rendered))
        self.assertEqual("".join(t for t, _ in pieces), rendered)
        self.assertEqual([t for t, train in pieces if train],
                         ["<tool_call>x</tool_call><|im_end|>", "There is a.py.<|im_end|>"])


class ChatTest(unittest.TestCase):
    def test_tool_conversations_call_offered_tools_and_use_their_results(self):
        rng = random.Random(7)
        names = {t["function"]["name"]: t["function"]["parameters"]["required"] for t in chat.TOOLS}
        scenarios = 0
        for _ in range(200):
            messages = chat.tool_conversation(rng, ["Some text about foxes."], thinking=rng.random() < 0.5)
            for k, m in enumerate(messages):
                for call in m.get("tool_calls", []):
                    fn = call["function"]
                    self.assertIn(fn["name"], names)
                    self.assertEqual(sorted(fn["arguments"]), sorted(names[fn["name"]]))
                    result = messages[k + 1]
                    self.assertEqual(result["role"], "tool")
                    reply = messages[k + 2]
                    self.assertEqual(reply["role"], "assistant")
                    first = next((l for l in result["content"].splitlines() if l.strip()), "")
                    self.assertIn(first.strip(), reply["content"])
                    scenarios += 1
        self.assertGreater(scenarios, 100)

    def test_held_out_requests_are_not_training_phrasings(self):
        held = set(chat.EVAL_LIST_REQUESTS + chat.EVAL_READ_REQUESTS + chat.EVAL_RUN_REQUESTS
                   + chat.FRESH_LIST_REQUESTS + chat.FRESH_READ_REQUESTS + chat.FRESH_RUN_REQUESTS)
        train = set(chat.LIST_REQUESTS + chat.READ_REQUESTS + chat.RUN_REQUESTS + chat.DIR_REQUESTS)
        self.assertFalse(held & train)
        self.assertGreater(len(chat.LIST_REQUESTS), 100)
        rng = random.Random(5)
        for held_out, requests in (("eval", chat.EVAL_LIST_REQUESTS), ("fresh", chat.FRESH_LIST_REQUESTS)):
            asked = {chat.tool_conversation(rng, ["text"], False, held_out=held_out)[1]["content"] for _ in range(200)}
            self.assertTrue(asked & set(requests))
            self.assertFalse(asked & set(chat.LIST_REQUESTS))

    def test_phrasing_patterns_expand_every_choice(self):
        self.assertEqual(chat.expand("[List|Show] the files [|here]."),
                         ["List the files.", "List the files here.", "Show the files.", "Show the files here."])
        self.assertEqual(chat.expand("ls"), ["ls"])

    def test_thinking_on_and_off(self):
        fact = chat.Fact("word", "fox", "a small wild canine", {"pos": "noun", "examples": []})
        on = chat.qa_conversation(fact, random.Random(1), thinking=True)[-1]
        off = chat.qa_conversation(fact, random.Random(1), thinking=False)[-1]
        self.assertTrue(on["reasoning_content"])
        self.assertEqual(off["reasoning_content"], "")
        self.assertEqual(on["content"], '"Fox" means a small wild canine.')

    def test_smalltalk_and_arithmetic_are_answered(self):
        rng = random.Random(3)
        for _ in range(100):
            messages = chat.smalltalk_conversation(rng, thinking=False)
            question, answer = messages[-2]["content"], messages[-1]["content"]
            if "=" in answer:
                expression = answer.rstrip(".").split(" = ")
                self.assertEqual(eval(expression[0]), int(expression[1]), question)  # noqa: S307
            self.assertTrue(answer)

    def test_facts_from_man_pages_and_python_source(self):
        doc = {"source": "man", "name": "coreutils:ls.1.gz",
               "text": "NAME\n       ls - list directory contents\n\nSYNOPSIS\n       ls [OPTION]... [FILE]...\n"}
        [fact] = chat.man_facts([doc])
        self.assertEqual((fact.subject, fact.text, fact.extra["synopsis"]),
                         ("ls", "list directory contents", "ls [OPTION]... [FILE]..."))
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "mod.py").write_text('def greet(name):\n    """Return a greeting for name, politely.\n\n    More."""\n\ndef _hidden():\n    """No."""\n')
            [fact] = chat.python_facts(Path(d), ["mod"])
            self.assertEqual(fact.extra["signature"], "mod.greet(name)")
            self.assertEqual(fact.text, "Return a greeting for name, politely.")


if __name__ == "__main__":
    unittest.main()
