"""Tuning rows: packing, and tool conversations behind a long system prompt."""

import random
import sys
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from corral_train import rows  # noqa: E402

IM_END, EOS, NEWLINE, PAD = 90, 91, 92, 93


def conversation(n: int, tools: bool, start: int) -> rows.Conversation:
    """A system message of 3 tokens ended by IM_END, then n tokens the assistant says."""
    ids = [start, start + 1, start + 2, IM_END] + [start + 10 + k for k in range(n)]
    return ids, [0, 0, 0, 0] + [1] * n, tools


class PackTest(unittest.TestCase):
    def test_whole_conversations_padded_and_cut(self):
        convs = [conversation(2, False, 0), conversation(3, True, 20), conversation(20, False, 40)]
        packed, masks = rows.pack(convs, PAD, 16)
        self.assertEqual([len(r) for r in packed], [16, 16])
        self.assertEqual(packed[0][:13], convs[0][0] + convs[1][0])
        self.assertEqual(packed[0][13:], [PAD] * 3)
        self.assertEqual(masks[0], convs[0][1] + convs[1][1] + [0] * 3)
        self.assertEqual(packed[1], convs[2][0][:16], "a conversation longer than a row is cut")
        self.assertEqual(masks[1], convs[2][1][:16])


class LongRowsTest(unittest.TestCase):
    def test_tool_conversations_behind_a_long_system_prompt(self):
        convs = [conversation(5, True, 0), conversation(5, False, 20), conversation(60, True, 40)]
        stream = [EOS if k % 10 == 0 else 100 + k for k in range(300)]  # documents' ends in every slice
        long, masks = rows.long_tool_rows(convs, stream, 8, 40, random.Random(3), im_end=IM_END, eos=EOS,
                                          newline=NEWLINE)
        self.assertEqual(len(long), 8)
        ids, m, _ = convs[0]  # the only tool conversation shorter than a row
        for row, mask in zip(long, masks):
            self.assertEqual(len(row), 40)
            self.assertEqual(row[:3], ids[:3], "the system message's start")
            self.assertEqual(row[-len(ids) + 3:], ids[3:], "its end, and what follows it, unchanged")
            inserted = row[3:40 - len(ids) + 3]
            self.assertNotIn(EOS, inserted)
            self.assertIn(NEWLINE, inserted, "a document's end reads as a line break")
            self.assertTrue(all(100 <= t < 400 or t == NEWLINE for t in inserted))
            self.assertEqual(mask, m[:3] + [0] * len(inserted) + m[3:], "the inserted text is not trained")
        self.assertEqual(long, rows.long_tool_rows(convs, stream, 8, 40, random.Random(3), im_end=IM_END, eos=EOS,
                                                   newline=NEWLINE)[0], "drawn by the seed")
        self.assertEqual(rows.long_tool_rows(convs[1:2], stream, 4, 40, random.Random(3), im_end=IM_END, eos=EOS,
                                             newline=NEWLINE), ([], []), "no tool conversation, no row")


if __name__ == "__main__":
    unittest.main()
