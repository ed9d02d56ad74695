"""Phase 5.2: incremental detokenization and stop strings, no server: streamed deltas concatenate to a full
decode (UTF-8 characters cut at every byte), a stop string is cut before and its prefix held back.

The async engine itself is driven through phase 5.6's server: tests/test_p5_serving.py.
"""

from __future__ import annotations

import random

from phases.p5_2_async_engine.detokenize import IncrementalDetokenizer, StopStrings, TextStream


def test_incremental_detokenizer_equals_full_decode(tiny32):
    tok = tiny32.tokenizer
    tricky = tok("Héllo 🤖 wörld — 日本語 naïve", add_special_tokens=False)["input_ids"] + [2, 1792]
    rng = random.Random(0)
    # random ids biased to single-byte tokens, so UTF-8 characters break at every possible place
    cases = [tricky] + [[rng.choice([rng.randrange(260), rng.randrange(len(tok))]) for _ in range(30)]
                        for _ in range(50)]
    for ids in cases:
        d = IncrementalDetokenizer(tok)
        deltas = [d.push(i) for i in ids] + [d.flush()]
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    d = IncrementalDetokenizer(tok)
    assert [d.push(i) for i in tok("日", add_special_tokens=False)["input_ids"]][-1] == "日"  # held back until whole


def test_stop_strings_cut_before_the_stop_and_hold_back_its_prefix():
    s = StopStrings(["STOP", "xy"])
    released = s.push("hello S") + s.push("TO")  # "STO" might still become "STOP": held back
    assert released == "hello " and not s.stopped
    assert s.push("P and more") == "" and s.stopped and s.text == "hello "
    s = StopStrings(["STOP"])
    assert s.push("ab") == "" and s.flush() == "ab"  # the sequence ended: the held-back tail goes out
    s = StopStrings(["b", "abc"])
    assert s.push("zzabc") == "zz" and s.text == "zz"  # the earliest stop wins ("abc" at 2, not "b" at 3)
    s = StopStrings(None)
    assert s.push("anything") == "anything"


def test_text_stream_streamed_equals_final_text(tiny32):
    ids = tiny32.tokenizer(" one two three four five", add_special_tokens=False)["input_ids"]
    ts = TextStream(tiny32.tokenizer, stops=["four"])
    out = ""
    for i in ids:
        out += ts.push(i)
        if ts.stopped:
            break
    out += ts.finish()
    assert ts.stopped and out == ts.text == " one two three "
