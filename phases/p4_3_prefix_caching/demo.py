"""`prefix_demo`: many requests behind one long system prompt, with and without prefix caching.

The vLLM paper's shared-prefix experiment (§6.4): a task description with one
example (one-shot) or five (few-shot) is put in front of every request, then a
different short input. Here the task is English -> French translation, the
shared part is the system prompt of the chat template, and each request asks
for one sentence. For each prompt style the same requests run twice on the
same engine settings, on PrefixCachingEngine with the cache off (every prompt
prefilled in full, as phase 4.2's engine does) and on (a prompt's cached full
blocks are mapped in, only the rest is prefilled).

All requests arrive at t = 0 and at most `max_running` run at once, so the
first wave computes the system prompt (nothing is cached yet, and requests
admitted together cannot use each other's blocks); every later request finds
it cached. Outputs have a fixed length (EOS ignored) so both runs do the same
decode work and differ only in prefill.
"""

from __future__ import annotations

import torch

from common.bench import now, summarize
from common.demos import Option, RunConfig, demo
from common.report import Report
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE
from phases.p4_3_prefix_caching.engine import PrefixCachingEngine

INSTRUCTION = ("You are a professional translator. Translate the English sentence the user sends into French. "
               "Keep the meaning, the tone and the punctuation of the original, and reply with the French "
               "sentence only, without notes or explanations.")
EXAMPLES = [  # (English, French): the shots of the shared prefix
    ("The old lighthouse on the hill has guided fishing boats home through the fog for more than a century.",
     "Le vieux phare sur la colline guide les bateaux de pêche à travers le brouillard depuis plus d'un siècle."),
    ("When the train finally arrived, the passengers who had waited in the cold for an hour cheered loudly.",
     "Quand le train est enfin arrivé, les passagers qui avaient attendu une heure dans le froid ont applaudi."),
    ("My grandmother keeps her recipes in a small notebook whose pages are stained with butter and flour.",
     "Ma grand-mère garde ses recettes dans un petit carnet dont les pages sont tachées de beurre et de farine."),
    ("The museum will stay open late on Fridays so that people who work during the day can visit it.",
     "Le musée restera ouvert tard le vendredi pour que les personnes qui travaillent la journée puissent le visiter."),
    ("Although it rained all weekend, the children spent hours building a castle out of cardboard boxes.",
     "Bien qu'il ait plu tout le week-end, les enfants ont passé des heures à construire un château en carton."),
]
SENTENCES = [  # the per-request inputs
    "Where is the nearest bakery?", "The cat is sleeping on the sofa.", "I would like a cup of tea, please.",
    "We are going to the beach tomorrow.", "This book is very interesting.", "My brother plays the guitar.",
    "The shop closes at seven o'clock.", "It is cold this morning.", "She lost her keys again.",
    "The garden is full of flowers.", "Can you help me carry this box?", "He runs in the park every day.",
    "The soup is too hot to eat.", "Our teacher speaks three languages.", "The bus is late today.",
    "I forgot my umbrella at home.", "They painted the kitchen yellow.", "The river flows to the sea.",
    "Please close the window.", "We watched a film last night.", "The baby is laughing.",
    "My phone battery is empty.", "The mountains are covered in snow.", "Dinner will be ready soon.",
]
PLOT_DPI = 120
QUICK = dict(n_requests=4, max_new_tokens=3, max_running=2, shots=[1])


def system_prompt(n_shots: int) -> str:
    """The instruction, then `n_shots` worked examples: the prefix every request shares."""
    if not 0 <= n_shots <= len(EXAMPLES):
        raise ValueError(f"shots must be between 0 and {len(EXAMPLES)}, got {n_shots}")
    shots = "".join(f"\n\nEnglish: {en}\nFrench: {fr}" for en, fr in EXAMPLES[:n_shots])
    return INSTRUCTION + ("\n\nExamples:" + shots if shots else "")


def sentence(i: int) -> str:
    """Request i's input: the sentences in turn, then pairs of them, so no two requests are equal."""
    n = len(SENTENCES)
    if i < n:
        return SENTENCES[i]
    return f"{SENTENCES[i % n]} {SENTENCES[(i // n + i) % n]}"


def request_ids(lm, n_shots: int, n_requests: int) -> list[list[int]]:
    system = system_prompt(n_shots)
    return [lm.prompt_ids(sentence(i), system=system) for i in range(n_requests)]


def shared_prefix_len(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with (the system prompt and the template around it)."""
    n = 0
    while all(len(p) > n for p in prompts) and len({p[n] for p in prompts}) == 1:
        n += 1
    return n


def _run(engine, prompts: list[list[int]], max_new_tokens: int, progress, label: str) -> dict:
    task = progress.add_task(label, total=len(prompts))
    t0 = now(engine.lm.device)
    seqs = [engine.add(p, max_new_tokens, ignore_eos=True, arrival=t0) for p in prompts]
    engine.run(progress=lambda done, _added: progress.update(task, completed=done))
    wall = now(engine.lm.device) - t0
    progress.remove_task(task)
    metrics = summarize([s.timing for s in seqs], wall)
    stats = engine.cache_stats if engine.prefix_caching else None
    prompt_tokens = sum(len(p) for p in prompts)
    skipped = stats.tokens_skipped if stats else 0
    return dict(outputs=[s.output_ids for s in seqs], wall_s=wall, mean_ttft_ms=metrics.mean_ttft_ms,
                total_tok_s=metrics.total_tok_s, prompt_tokens=prompt_tokens, prefill_tokens=prompt_tokens - skipped,
                tokens_skipped=skipped, hit_rate=stats.hit_rate if stats else float("nan"),
                blocks_hit=stats.blocks_hit if stats else 0, blocks_queried=stats.blocks_queried if stats else 0,
                evictions=engine.allocator.n_evictions if stats else 0)


def plot_prefix(report: Report, png_path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report.data["runs"]
    shots = sorted({r["shots"] for r in runs})
    labels = [f"{s}-shot" for s in shots]
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    panels = [("prefill tokens computed", "prefill_tokens"), ("mean TTFT (ms)", "mean_ttft_ms"),
              ("total throughput (tok/s)", "total_tok_s")]
    width = 0.38
    for ax, (title, key) in zip(axes, panels):
        for j, caching in enumerate((False, True)):
            ys = [next(r[key] for r in runs if r["shots"] == s and r["caching"] == caching) for s in shots]
            ax.bar([i + j * width for i in range(len(shots))], ys, width,
                   label="prefix cache on" if caching else "prefix cache off")
        ax.set_xticks([i + width / 2 for i in range(len(shots))])
        ax.set_xticklabels(labels)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend()
    m = report.meta
    fig.suptitle(f"prefix caching on a shared system prompt ({m.get('model')}, {m.get('device_name')})")
    fig.tight_layout()
    fig.savefig(png_path, dpi=PLOT_DPI)
    plt.close(fig)


@demo("prefix_demo", phase="p4_3",
      help="shared system prompt (one-shot / few-shot): hit rate, prefill skipped, TTFT, tok/s with vs without prefix caching",
      options=[
          Option("shots", int, cpu=[1, 5], gpu=[1, 5], many=True,
                 help="worked examples in the shared system prompt (1: one-shot, 5: few-shot)"),
          Option("n_requests", int, cpu=16, gpu=256, help="requests per run, all arriving at t = 0"),
          Option("max_new_tokens", int, cpu=16, gpu=64, help="tokens generated per request (EOS ignored)"),
          Option("max_running", int, cpu=4, gpu=64, help="sequences running at once"),
          Option("block_size", int, cpu=DEFAULT_BLOCK_SIZE, help="tokens per KV block"),
          Option("n_blocks", int, cpu=1024, gpu=0, help="KV pool blocks (0: size the pool from free memory)"),
      ], plot=plot_prefix)
def prefix_demo(cfg: RunConfig) -> Report:
    from rich.progress import Progress

    lm = cfg.load()
    report = cfg.new_report("prefix_demo")
    opts = dict(n_requests=cfg.n_requests, max_new_tokens=cfg.max_new_tokens, max_running=cfg.max_running,
                shots=cfg.shots)
    if cfg.quick:
        opts.update(QUICK)
    if opts["n_requests"] < 1 or opts["max_new_tokens"] < 1:
        raise ValueError("n_requests and max_new_tokens must be >= 1")
    engine_kwargs = dict(max_running=opts["max_running"], block_size=cfg.block_size, n_blocks=cfg.n_blocks or None)

    workload = report.table("Shared-prefix workload (English -> French translation)",
                            ["shots", "requests", "shared prefix (tok)", "full blocks", "mean prompt (tok)",
                             "new tok each"])
    runs = report.table("With and without prefix caching (same engine settings, same requests)",
                        ["shots", "prefix cache", "hit rate", "blocks hit/looked up", "prefilled tok",
                         "skipped tok", "mean TTFT (ms)", "total tok/s", "wall (s)"])
    gains = report.table("Speedup from prefix caching", ["shots", "TTFT speedup", "throughput speedup",
                                                         "outputs identical"])
    report.data.update(block_size=cfg.block_size, runs=[])
    with Progress(transient=True) as progress:
        # Warm-up on a throwaway engine: the first forward passes pay one-off costs.
        warm = PrefixCachingEngine(lm, prefix_caching=False, **engine_kwargs)
        _run(warm, request_ids(lm, 0, 2), 2, progress, "warm-up")
        del warm
        for shots in opts["shots"]:
            prompts = request_ids(lm, shots, opts["n_requests"])
            shared = shared_prefix_len(prompts)
            workload.add_row(shots, len(prompts), shared, shared // cfg.block_size,
                             round(sum(map(len, prompts)) / len(prompts), 1), opts["max_new_tokens"])
            result = {}
            for name in ("off", "on"):
                engine = PrefixCachingEngine(lm, prefix_caching=name == "on", **engine_kwargs)
                r = _run(engine, prompts, opts["max_new_tokens"], progress, f"{shots}-shot, prefix cache {name}")
                result[name] = r
                runs.add_row(shots, name, "-" if name == "off" else f"{r['hit_rate']:.0%}",
                             "-" if name == "off" else f"{r['blocks_hit']}/{r['blocks_queried']}",
                             r["prefill_tokens"], r["tokens_skipped"], r["mean_ttft_ms"], r["total_tok_s"],
                             r["wall_s"])
                report.data["runs"].append(dict({k: v for k, v in r.items() if k != "outputs"},
                                                shots=shots, caching=name == "on"))
            off, on = result["off"], result["on"]
            same = sum(a == b for a, b in zip(off["outputs"], on["outputs"]))
            gains.add_row(shots, f"{off['mean_ttft_ms'] / on['mean_ttft_ms']:.2f}x",
                          f"{on['total_tok_s'] / off['total_tok_s']:.2f}x", f"{same}/{len(prompts)}")
    runs.notes += [
        f"CPU threads: {torch.get_num_threads()}" if not cfg.on_gpu else f"GPU: {report.meta.get('device_name')}",
        f"all requests arrive at t = 0; {opts['max_running']} run at once; block size {cfg.block_size}; "
        f"TTFT includes the time a request waits in the queue",
        "hit rate = prompt blocks found in the cache / full prompt blocks looked up ((len - 1) // block_size "
        "per request: the last prompt token is always computed)",
        "the first wave of requests is admitted together, before anything is cached: those all miss",
    ]
    gains.notes.append("outputs identical: greedy tokens equal with and without the cache (in bf16 a reused "
                       "prefix can round differently from a recomputed one; in fp32 the tests require equality)")
    return report
