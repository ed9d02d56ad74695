// The pool page: draws one frame of the engine's pool (pool_stream.py) at a time.
//
// Frames come from the server (`/pool/stream`, server-sent events, one per engine step) or, in a replay
// file, from `window.POOL_FRAMES`. Every frame is kept (up to MAX_FRAMES), so Pause freezes the view on one
// step while the engine runs on, and the step buttons walk the kept frames. Live, only the newest frame is
// drawn, at most once per animation frame: a page that draws slower than the engine steps skips frames
// instead of falling behind.
"use strict";

const MAX_FRAMES = 5000;       // frames kept for stepping back (older ones are dropped)
const MAX_FINISHED = 30;       // finished requests listed

const frames = [];
let cursor = -1;               // index in `frames` of the frame shown
let live = true;               // follow the newest frame
let drawPending = false;
const $ = (id) => document.getElementById(id);

function colour(req, sample = 0) {
  // golden-angle hues: neighbouring request ids get far-apart colours; a request's samples, lighter shades
  return `hsl(${(req * 137.508) % 360} 62% ${Math.min(80, 40 + 12 * sample)}%)`;
}

function addFrame(frame) {
  frames.push(frame);
  if (frames.length > MAX_FRAMES) {
    frames.shift();
    if (!live) cursor = Math.max(0, cursor - 1);
  }
  if (live) {
    cursor = frames.length - 1;
    if (!drawPending) {
      drawPending = true;
      requestAnimationFrame(() => { drawPending = false; draw(); });
    }
  } else {
    showWhere();
  }
}

let drawnKeys = [];             // per cell, what it shows now: only cells whose key changes are touched

function ensureGrid(n) {
  const grid = $("grid");
  if (grid.children.length === n) return grid;
  grid.textContent = "";
  drawnKeys = new Array(n).fill("");
  for (let b = 0; b < n; b++) {
    const cell = document.createElement("i");
    cell.className = "cell free";
    cell.dataset.block = b;
    grid.appendChild(cell);
  }
  return grid;
}

function drawBlocks(f) {
  const grid = ensureGrid(f.n_blocks);
  const owners = Array.from({ length: f.n_blocks }, () => []);
  for (const s of f.seqs) for (const b of s.blocks) owners[b].push(s);
  const cached = new Set(f.cached);
  const evictable = new Set(f.evictable);
  for (let b = 0; b < f.n_blocks; b++) {
    const ref = f.refs[b];
    const own = owners[b];
    if (own.length !== ref) {
      console.error(`step ${f.step}: block ${b} has ref count ${ref} but ${own.length} block tables list it`);
    }
    const state = ref > 0 ? "owned" : evictable.has(b) ? "cached-free" : "free";
    const isCached = cached.has(b);
    const ids = own.map((s) => s.id).sort((a, c) => a - c).join(",");
    const key = `${state}|${ref}|${isCached}|${ids}|${own.length ? own[0].req + "." + own[0].sample : ""}`;
    if (drawnKeys[b] === key) continue;   // a large pool changes in a few cells per step: touch only those
    drawnKeys[b] = key;
    const cell = grid.children[b];
    let cls = "cell " + state;
    if (ref > 1) cls += " shared";
    if (isCached && ref > 0) cls += " cached";
    cell.className = cls;
    cell.dataset.state = state;
    cell.dataset.ref = ref;
    cell.dataset.cached = isCached ? "1" : "0";
    cell.dataset.owners = ids;
    cell.style.setProperty("--c", own.length ? colour(own[0].req, own[0].sample) : "");
    cell.textContent = ref > 1 ? ref : "";
    cell.title = `block ${b}: ` + (ref > 0 ? `ref ${ref}, ${own.map((s) => s.label).join(", ")}` : state) +
                 (isCached ? " (cached)" : "");
  }
  const used = f.refs.filter((r) => r > 0).length;
  $("summary").textContent = `${f.n_blocks} blocks of ${f.block_size} tokens: ${used} in use, ` +
    `${evictable.size} cached-free, ${f.n_blocks - used - evictable.size} free; ${cached.size} cached`;
  const swapped = f.seqs.filter((s) => s.queue === "swapped");
  $("swap").textContent = f.cpu_blocks ? `CPU swap pool: ${f.cpu_blocks} blocks, ` +
    `${new Set(swapped.flatMap((s) => s.cpu_blocks)).size} holding swapped sequences` : "";
}

function queueItem(s) {
  const li = document.createElement("li");
  li.dataset.seq = s.id;
  li.dataset.label = s.label;
  li.style.setProperty("--c", colour(s.req, s.sample));
  const name = (s.sample ? `#${s.sample} ` : "") + s.label;   // the sample first: a long label is cut at its end
  const pct = s.max ? Math.min(100, (100 * s.out) / s.max) : 0;
  li.innerHTML = `<span class="swatch"></span><span class="name"></span>` +
                 `<span class="bar"><span style="width:${pct}%"></span></span><span class="num"></span>`;
  li.querySelector(".name").textContent = name;
  li.querySelector(".num").textContent = `${s.out}/${s.max} · ${s.blocks.length || s.cpu_blocks.length} blk`;
  li.title = `${s.label}, sample ${s.sample}: ${s.status}, prompt ${s.prompt} tokens, ${s.out} of ${s.max} made`;
  return li;
}

function drawQueues(f) {
  const byId = new Map(f.seqs.map((s) => [s.id, s]));
  for (const q of ["running", "waiting", "swapped"]) {
    const ul = $(q);
    ul.textContent = "";
    for (const id of f.queues[q]) ul.appendChild(queueItem(byId.get(id)));
    $("n-" + q).textContent = `(${f.queues[q].length})`;
  }
  const did = $("did");
  did.textContent = "";
  const names = { preemptions: "preemptions", cow_copies: "copy-on-write copies", prefix_hit_blocks: "prefix-hit blocks" };
  for (const k of Object.keys(names)) {
    const li = document.createElement("li");
    li.textContent = `${names[k]}: ${f.did[k]} (total ${f.totals[k]})`;
    if (f.did[k]) li.className = "hot";
    did.appendChild(li);
  }
  const li = document.createElement("li");
  li.textContent = `finished: ${f.finished.length}`;
  did.appendChild(li);
  const fin = $("finished");
  fin.textContent = "";
  let shown = 0;
  for (let i = cursor; i >= 0 && shown < MAX_FINISHED; i--) {
    for (const s of frames[i].finished) {
      if (shown >= MAX_FINISHED) break;
      const item = document.createElement("li");
      item.dataset.label = s.label;
      item.dataset.seq = s.id;
      item.textContent = `${s.label}: ${s.out} tokens (${s.reason}), step ${frames[i].step}`;
      fin.appendChild(item);
      shown++;
    }
  }
}

function showWhere() {
  const f = frames[cursor];
  if (!f) return;
  document.body.dataset.step = f.step;
  document.body.dataset.live = live ? "1" : "0";
  $("where").textContent = `step ${f.step}` + (live ? " (live)" : ` (paused: frame ${cursor + 1} of ${frames.length})`);
  $("prev").disabled = live || cursor <= 0;
  $("next").disabled = live || cursor >= frames.length - 1;
  $("pause").textContent = live ? "Pause" : "Live";
}

function draw() {
  const f = frames[cursor];
  if (!f) return;
  drawBlocks(f);
  drawQueues(f);
  showWhere();
}

$("pause").addEventListener("click", () => {
  live = !live;
  if (live) cursor = frames.length - 1;
  draw();
});
$("prev").addEventListener("click", () => { if (cursor > 0) { cursor--; draw(); } });
$("next").addEventListener("click", () => { if (cursor < frames.length - 1) { cursor++; draw(); } });
document.addEventListener("keydown", (e) => {
  if (e.key === " ") { e.preventDefault(); $("pause").click(); }
  else if (e.key === "ArrowLeft") $("prev").click();
  else if (e.key === "ArrowRight") $("next").click();
});

if (window.POOL_FRAMES) {            // a replay file: every frame is here already; start at the first
  $("source").textContent = window.POOL_TITLE || "replay";
  for (const f of window.POOL_FRAMES) frames.push(f);
  live = false;
  cursor = 0;
  draw();
} else {
  $("source").textContent = "live";
  const stream = new EventSource("/pool/stream");
  stream.onmessage = (e) => addFrame(JSON.parse(e.data));
  stream.onerror = () => { $("where").textContent = "reconnecting to the engine…"; };
}
