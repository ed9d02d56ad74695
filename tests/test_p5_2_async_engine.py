"""Phase 5.2 without a server: incremental detokenization and stop strings (streamed deltas concatenate to a
full decode, UTF-8 characters cut at every byte; a stop string is cut before and its prefix held back), and
the async engine on an event loop: a client's text equals the engine run alone, and a client that stops
reading aborts its request. (Over HTTP, many clients at once: tests/test_p5_serving.py.)
"""

from __future__ import annotations

import asyncio
import random

from common.sampling import GREEDY
from phases.p5_1_served_engine.engine import ServingEngine
from phases.p5_2_async_engine.async_engine import AsyncEngine
from phases.p5_2_async_engine.detokenize import IncrementalDetokenizer, StopStrings, TextStream

TIMEOUT_S = 60
LONG = 200            # tokens a sample would make if nobody aborted it


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


def test_the_async_engine_streams_each_client_its_text_and_a_client_that_leaves_is_aborted(tiny32):
    prompt, other = list(range(10, 21)), list(range(30, 45))
    alone = ServingEngine(tiny32, max_running=4, block_size=4, n_blocks=256)
    group = alone.add_group(prompt, 8, GREEDY, True, n=1)
    alone.run()
    expected = tiny32.tokenizer.decode(group.seqs[0].output_ids, skip_special_tokens=True)
    aengine = AsyncEngine(ServingEngine(tiny32, max_running=4, block_size=4, n_blocks=256))

    async def serve():
        aengine.start()
        try:
            a = await aengine.submit(prompt, max_tokens=8, ignore_eos=True)
            b = await aengine.submit(other, n=2, max_tokens=LONG, ignore_eos=True)
            leaving = aengine.tokens(b)
            first = [await leaving.__anext__() for _ in range(3)]
            await leaving.aclose()                   # the client went away: its `finally` posts the abort
            deltas = [d async for d in aengine.texts(a)]
            while aengine.engine.has_work:           # b ends now (aborted), or after LONG tokens (not aborted)
                await asyncio.sleep(0.01)
            reasons = [s.finish_reason for s in b.group.seqs]
            return first, deltas, reasons, [len(s.output_ids) for s in b.group.seqs]
        finally:
            await aengine.stop()

    first, deltas, reasons, lengths = asyncio.run(asyncio.wait_for(serve(), TIMEOUT_S))
    assert "".join(d.text for d in deltas) == expected and deltas[-1].finish_reason == "length"
    assert {ev.index for ev in first} <= {0, 1}
    assert reasons == ["abort", "abort"] and max(lengths) < LONG
    assert aengine.engine.allocator.n_free == aengine.engine.allocator.n_blocks and not aengine.engine.groups
