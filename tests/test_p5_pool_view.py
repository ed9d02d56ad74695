"""Phase 5.4's windows on the pool: KV events in vLLM's format and the /pool page (vLLM's metric names:
tests/test_p5_3_metrics.py).

- a ZMQ subscriber decodes the events and rebuilds the prefix cache's set of blocks, which must equal the
  engine's, through evictions and a reset;
- with the view and the events off, the engine runs phase 4.3's allocator and no step observer; a page
  that stops reading never holds the engine up;
- headless Chromium (Debian's `chromium`, driven by Playwright) loads /pool while requests run: a paused
  step draws the allocator's state, the page updates when requests finish, and logs no console error.
  `make test` installs chromium where it is missing; without it this test fails rather than skips.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from phases.p4_3_prefix_caching.prefix_cache import PrefixCachingAllocator
from phases.p5_4_pool_view.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from measure.background_server import BackgroundServer
from phases.p5_6_http_server.server import create_app
from tests.test_p5_3_metrics import assert_vllms_names_equal_ours, samples_of

TIMEOUT_S = 30
SYSTEM = "You are a careful assistant. Answer in one short sentence, and never make anything up. " * 3


def complete(srv, prompt: str, max_tokens: int, **extra) -> dict:
    r = httpx.post(srv.base_url + "/completions", timeout=TIMEOUT_S, trust_env=False,
                   json={"model": srv.served, "prompt": prompt, "max_tokens": max_tokens, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def serve(lm, **kw) -> BackgroundServer:
    srv = BackgroundServer(create_app(lm, **kw))
    srv.served = lm.name
    return srv


def on_engine(srv, fn):
    """`fn()` run on the engine thread between two steps; its result."""
    done = threading.Event()
    out = []
    srv.app.state.engine.call_on_engine(lambda: (out.append(fn()), done.set()))
    assert done.wait(TIMEOUT_S), "the engine thread did not run the call"
    return out[0]


def cached_hashes(allocator) -> set[int]:
    """The prefix cache's blocks, by hash, read from the allocator's public methods."""
    return {e.block_hash for b in range(allocator.n_blocks) if (e := allocator.cached_entry(b)) is not None}


# --- KV events --------------------------------------------------------------------------------
def test_a_zmq_subscriber_rebuilds_the_prefix_cache_from_the_events(tiny32):
    # 16 blocks of 16 tokens: the requests below fill more than that, so cached blocks are evicted too.
    srv = serve(tiny32, n_blocks=16, block_size=16, max_running=2, kv_events_endpoint="tcp://127.0.0.1:0",
                kv_events_topic="kv")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.connect(srv.app.state.server.kv_events.endpoint)
    # A PUB socket drops what no subscriber has asked for yet: wait for the connection's handshake (the
    # subscription goes out right after it), then a moment for the publisher to take it in.
    assert monitor.poll(TIMEOUT_S * 1000), "the subscriber never connected"
    recv_monitor_message(monitor)
    time.sleep(0.2)
    blocks: set[int] = set()
    seen = {BlockStored: 0, BlockRemoved: 0, AllBlocksCleared: 0}
    numbers = []

    def drain():
        while sub.poll(200):
            topic, number, payload = sub.recv_multipart()
            assert topic == b"kv"
            numbers.append(int.from_bytes(number, "big"))
            for event in msgspec.msgpack.decode(payload, type=KVEventBatch).events:
                seen[type(event)] += 1
                if isinstance(event, BlockStored):
                    assert event.block_size == 16 and len(event.token_ids) == 16 * len(event.block_hashes)
                    assert event.parent_block_hash is None or event.parent_block_hash in blocks
                    blocks.update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    assert set(event.block_hashes) <= blocks, "a block removed that was never stored"
                    blocks.difference_update(event.block_hashes)
                else:
                    blocks.clear()

    with srv:
        allocator = srv.app.state.engine.engine.allocator
        for i in range(8):
            complete(srv, SYSTEM + f"Question {i}: what is {i} + {i}?", 40, ignore_eos=True)
            drain()
            assert blocks == on_engine(srv, lambda: cached_hashes(allocator))
        assert seen[BlockStored] and seen[BlockRemoved], seen     # both kinds went by
        assert allocator.n_evictions > 0
        assert httpx.post(srv.url + "/reset_prefix_cache", timeout=TIMEOUT_S, trust_env=False).json() == {"reset": True}
        drain()
        assert seen[AllBlocksCleared] == 1 and blocks == set() == on_engine(srv, lambda: cached_hashes(allocator))
        complete(srv, SYSTEM + "Again?", 8)
        drain()
        assert blocks and blocks == on_engine(srv, lambda: cached_hashes(allocator))
    assert numbers == list(range(len(numbers))), "a batch was lost or sent out of order"
    sub.disable_monitor()
    monitor.close(linger=0)
    sub.close(linger=0)


def test_events_and_view_off_leave_the_engine_as_phase_4_3_built_it(tiny32):
    srv = serve(tiny32, n_blocks=32, block_size=16)
    with srv:
        aengine = srv.app.state.engine
        assert type(aengine.engine.allocator) is PrefixCachingAllocator
        assert aengine.step_observers == () and srv.app.state.server.kv_events is None
        # a page that opens the stream and never reads it: the engine serves on, and forgets the page
        with httpx.stream("GET", srv.url + "/pool/stream", timeout=TIMEOUT_S, trust_env=False) as stream:
            deadline = time.monotonic() + TIMEOUT_S
            while len(aengine.step_observers) != 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            for i in range(3):
                complete(srv, SYSTEM + f"Question {i}?", 100, ignore_eos=True)   # far more frames than it queues
            assert stream.status_code == 200
        deadline = time.monotonic() + TIMEOUT_S
        while aengine.step_observers:
            assert time.monotonic() < deadline, "the stream's observer stayed after the page left"
            complete(srv, "hi", 2)   # the server notices a gone client when it next writes to it
            time.sleep(0.05)


# --- vLLM's metric names, over HTTP ----------------------------------------------------------
def scrape(srv) -> dict[str, float]:
    """Every sample of /metrics, parsed by prometheus-client (tests/test_p5_3_metrics.py)."""
    return samples_of(httpx.get(srv.url + "/metrics", timeout=TIMEOUT_S, trust_env=False).text, srv.served)


def test_metrics_parse_and_vllms_names_hold_our_values(tiny32):
    # 20 blocks for 3 requests of 2 samples, each request up to 13 blocks: the pool runs dry, so preemptions count
    srv = serve(tiny32, n_blocks=20, block_size=16, max_running=4)
    with srv:
        answers = []
        threads = [threading.Thread(target=lambda i=i: answers.append(
            complete(srv, SYSTEM + f"Q{i}?", 60, ignore_eos=True, n=2))) for i in range(3)]
        for t in threads:
            t.start()
        mid = scrape(srv)            # while they run
        for t in threads:
            t.join(TIMEOUT_S)
        assert len(answers) == 3
        end = scrape(srv)
    for m in (mid, end):
        assert_vllms_names_equal_ours(m)
    assert end["vllm:generation_tokens_total"] == 3 * 2 * 60
    assert end["vllm:num_preemptions_total"] > 0
    assert end["vllm:prefix_cache_hits_total"] > 0
    assert end["vllm:time_to_first_token_seconds_count"] == 3
    assert end["vllm:inter_token_latency_seconds_count"] == 3 * 2 * 59
    assert end["vllm:num_requests_running"] == 0 and end["vllm:kv_cache_usage_perc"] == 0


# --- the page, in a real browser ---------------------------------------------------------------
def chromium_path() -> str:
    path = os.environ.get("CHROMIUM") or shutil.which("chromium")
    if path is None:
        pytest.fail("the /pool browser test needs Debian's chromium: `make test` installs it "
                    "(apt-get install chromium), or set CHROMIUM to a Chromium binary")
    return path


def truth_recorder(truth: dict):
    """A step observer that records the allocator's state after each step, read straight from the engine."""
    def record(engine, outputs):
        a = engine.allocator
        owners = {b: [] for b in range(a.n_blocks)}
        for seq in engine.running:
            for b in seq.kv.block_ids:
                owners[b].append(seq.seq_id)
        truth[engine.n_steps] = [
            {"ref": a.refcount(b), "cached": a.cached_entry(b) is not None, "evictable": b in a.evictor,
             "owners": sorted(owners[b])} for b in range(a.n_blocks)]
    return record


DRAWN_JS = """() => [...document.querySelectorAll('#grid .cell')].map(c => ({
    ref: +c.dataset.ref, state: c.dataset.state, cached: c.dataset.cached === '1',
    owners: c.dataset.owners ? c.dataset.owners.split(',').map(Number) : []}))"""


def as_drawn(state: list[dict]) -> list[dict]:
    return [{"ref": s["ref"], "cached": s["cached"], "owners": s["owners"],
             "state": "owned" if s["ref"] else "cached-free" if s["evictable"] else "free"} for s in state]


def test_the_pool_page_in_chromium(tiny32, tmp_path):
    from playwright.sync_api import sync_playwright

    executable = chromium_path()
    shot = Path(os.environ.get("POOL_SCREENSHOT") or tmp_path / "pool.png")
    srv = serve(tiny32, n_blocks=48, block_size=16, max_running=4)
    truth: dict[int, list] = {}
    errors: list[str] = []
    with srv, sync_playwright() as p:
        srv.app.state.engine.add_step_observer(truth_recorder(truth))
        browser = p.chromium.launch(executable_path=executable, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 520})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(srv.url + "/pool")
        page.wait_for_function("document.body.dataset.step !== undefined", timeout=TIMEOUT_S * 1000)

        answers = []
        threads = [threading.Thread(target=lambda i=i: answers.append(
            complete(srv, SYSTEM + f"Question {i}?", 150, ignore_eos=True, n=1 + i % 2))) for i in range(4)]
        for t in threads:
            t.start()
        # Pause once the samples share blocks: the requests run for 150 tokens, so the sharing lasts, but how soon
        # it starts depends on the machine (a pause at the first two running sequences could come before it).
        page.wait_for_function("document.querySelectorAll('#running li').length >= 2 && "
                               "[...document.querySelectorAll('#grid .cell')].some(c => +c.dataset.ref > 1)",
                               timeout=TIMEOUT_S * 1000)
        page.click("#pause")
        step = int(page.evaluate("document.body.dataset.step"))
        assert page.evaluate(DRAWN_JS) == as_drawn(truth[step])
        page.screenshot(path=str(shot))
        time.sleep(0.3)                                     # the engine runs on; the paused page does not move
        assert int(page.evaluate("document.body.dataset.step")) == step
        page.click("#prev")
        before = int(page.evaluate("document.body.dataset.step"))
        assert before < step and page.evaluate(DRAWN_JS) == as_drawn(truth[before])
        assert any(s["ref"] > 1 for s in truth[step]), "the paused step shows shared blocks (n=2 samples)"

        page.click("#pause")                                # live again
        for t in threads:
            t.join(TIMEOUT_S)
        labels = sorted(a["id"] for a in answers)
        assert len(labels) == 4
        page.wait_for_function(
            "labels => labels.every(l => document.querySelector(`#finished li[data-label='${l}']`)) && "
            "document.querySelectorAll('#running li').length === 0", arg=labels, timeout=TIMEOUT_S * 1000)
        drawn = page.evaluate(DRAWN_JS)
        assert all(c["ref"] == 0 and c["state"] != "owned" for c in drawn)
        assert any(c["state"] == "cached-free" for c in drawn), "finished prompts stay cached-free"
        browser.close()
    assert shot.stat().st_size > 0
    assert not errors, errors


# --- a replay: one HTML file, offline ----------------------------------------------------------
def drawn_from(frame: dict) -> list[dict]:
    """What the page must draw for a frame of pool_replay's report."""
    owners = {b: [] for b in range(frame["n_blocks"])}
    for s in frame["seqs"]:
        for b in s["blocks"]:
            owners[b].append(s["id"])
    evictable, cached = set(frame["evictable"]), set(frame["cached"])
    return [{"ref": r, "cached": b in cached, "owners": sorted(owners[b]),
             "state": "owned" if r else "cached-free" if b in evictable else "free"}
            for b, r in enumerate(frame["refs"])]


@pytest.mark.parametrize("scene, extra", [("tput", []), ("cow_demo", []), ("share_demo", []), ("prefix_demo", []),
                                          ("preempt_demo", []),
                                          ("preempt_demo", ["--preemption-mode", "swap"])])
def test_pool_replay_writes_one_file_that_draws_every_step_offline(scene, extra, tmp_path):
    import json

    from playwright.sync_api import sync_playwright

    from measure.cli import main

    assert main(["pool_replay", scene, *extra, "--model", "tiny", "--dtype", "fp32", "--quick",
                 "--results-dir", str(tmp_path)]) == 0
    html = tmp_path / f"pool-replay-{scene.replace('_', '-')}_cpu_tiny.html"
    frames = json.loads(html.with_suffix(".json").read_text())["data"]["frames"]
    assert len(frames) > 2 and frames[-1]["queues"]["running"] == []
    if scene in ("cow_demo", "share_demo"):
        assert frames[-1]["totals"]["cow_copies"] > 0
        assert any(r > 1 for f in frames for r in f["refs"])   # blocks shared by samples, or by beams
    elif scene == "prefix_demo":
        assert frames[-1]["totals"]["prefix_hit_blocks"] > 0
    elif scene == "preempt_demo":
        assert frames[-1]["totals"]["preemptions"] > 0
        swapped = [s for f in frames for s in f["seqs"] if s["queue"] == "swapped"]
        assert bool(swapped) == bool(extra)                  # swapped sequences: their blocks in the CPU pool only
        assert all(s["cpu_blocks"] and not s["blocks"] for s in swapped)
    errors, fetched = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), headless=True, args=["--no-sandbox"])
        page = browser.new_page()
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: fetched.append(r.url) if not r.url.startswith(("file:", "data:")) else None)
        page.goto(html.as_uri())
        for i in (0, 1, 2):
            assert int(page.evaluate("document.body.dataset.step")) == frames[i]["step"]
            assert page.evaluate(DRAWN_JS) == drawn_from(frames[i])
            page.click("#next")
        page.click("#pause")                                   # "Live": the last frame
        assert int(page.evaluate("document.body.dataset.step")) == frames[-1]["step"]
        assert page.evaluate(DRAWN_JS) == drawn_from(frames[-1])
        browser.close()
    assert not errors and not fetched, (errors, fetched)
