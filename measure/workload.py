"""Request traces for the benchmarks: fixed prompt lists, length distributions, Poisson arrivals, bursts.

A trace is a list of `Request`s. Everything is drawn from a seeded generator,
so two engines measured on "the same workload" really get the same requests.
The vLLM-style traces (`equal_work`, `mixed_work`) use random token ids as
prompts and fixed per-request output lengths with EOS ignored: every engine
then does exactly the same number of forward-pass tokens; `nano_vllm_work` is
nano-vllm's bench.py in that form (the work small engines publish tok/s on).

Step-timed traces (`TracedRequest`: phase 4.4's preemption and stress demos)
arrive at an engine *step*, not a second, so a trace means the same thing on a
fast GPU and a slow CPU, and two runs of it are comparable; each request is
plain (greedy), n seeded samples, or a beam search of width n (which needs
phase 4.2's engine; phase 4.4's demos send plain requests and samples only):
- `burst`: n greedy requests that all arrive at once, lengths drawn uniformly;
- `stress_trace`: bursts every few steps, a seeded mix of the three kinds.
measure/harness.py's `drive(engine, trace)` feeds one to an engine.

`rate_trace` is the vLLM paper's serving workload (§6.1): prompt and output
lengths drawn like ShareGPT's or Alpaca's (the paper's means, scaled), arriving
as a Poisson process in seconds; measure/harness.py's `drive_timed` feeds it
to an engine on the wall clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from common.sampling import GREEDY, SamplingParams

DEFAULT_SEED = 0
# Token ids below this are special tokens in SmolLM2's vocabulary (and in
# most BPE vocabularies): random prompts draw above it.
FIRST_ORDINARY_TOKEN_ID = 100

EQUAL_WORK_N = 64
EQUAL_WORK_PROMPT_LEN = (16, 128)
EQUAL_WORK_OUTPUT_LEN = 64
MIXED_WORK_OUTPUT_LEN = (16, 256)
# nano-vllm's bench.py, the workload the small engines publish throughput on: 256 sequences, prompt and output
# lengths each uniform in [100, 1024], EOS ignored (its prompts are random ids below 10,000, sampled at
# temperature 0.6; these are greedy, which runs the same forward passes).
NANO_VLLM_N = 256
NANO_VLLM_LENGTHS = (100, 1024)
TRACE_SAMPLE_TEMPERATURE = 0.8  # a step-timed trace's sampled requests


@dataclass
class Request:
    prompt: str | None = None            # text (goes through the chat template), or
    prompt_ids: list[int] | None = None  # token ids used as they are
    max_new_tokens: int = 64
    arrival_s: float = 0.0               # offset from the start of the run
    ignore_eos: bool = False
    sampling: SamplingParams = GREEDY
    n: int = 1                            # parallel samples (phase 4)
    meta: dict = field(default_factory=dict)

    def ids(self, lm) -> list[int]:
        return list(self.prompt_ids) if self.prompt_ids is not None else lm.prompt_ids(self.prompt)


def from_prompts(prompts: list[str], max_new_tokens: int, ignore_eos: bool = False) -> list[Request]:
    """The fixed prompt lists of the blog's demos, all arriving at t = 0."""
    return [Request(prompt=p, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos) for p in prompts]


def uniform_lengths(n: int, lo: int, hi: int, seed: int = DEFAULT_SEED) -> list[int]:
    """n integers drawn uniformly from [lo, hi]."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def random_token_ids(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    """n random ordinary token ids (no special token) drawn from `rng`."""
    return [int(t) for t in rng.integers(FIRST_ORDINARY_TOKEN_ID, vocab_size, size=n)]


def random_prompt_ids(lengths: list[int], vocab_size: int, seed: int = DEFAULT_SEED) -> list[list[int]]:
    """One random-token prompt per length (ordinary tokens only)."""
    rng = np.random.default_rng(seed + 1)
    return [random_token_ids(rng, n, vocab_size) for n in lengths]


def poisson_arrivals(n: int, rate_per_s: float, seed: int = DEFAULT_SEED) -> list[float]:
    """Arrival offsets (s) of a Poisson process: exponential gaps with mean 1/rate."""
    if rate_per_s <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate_per_s}")
    rng = np.random.default_rng(seed + 2)
    return [float(t) for t in np.cumsum(rng.exponential(1.0 / rate_per_s, size=n))]


def equal_work(vocab_size: int, n: int = EQUAL_WORK_N, prompt_len: tuple[int, int] = EQUAL_WORK_PROMPT_LEN,
               output_len: int = EQUAL_WORK_OUTPUT_LEN, seed: int = DEFAULT_SEED) -> list[Request]:
    """n requests, prompts of uniform random length, the same output length each, EOS ignored."""
    ids = random_prompt_ids(uniform_lengths(n, *prompt_len, seed=seed), vocab_size, seed)
    return [Request(prompt_ids=p, max_new_tokens=output_len, ignore_eos=True) for p in ids]


def mixed_work(vocab_size: int, n: int = EQUAL_WORK_N, prompt_len: tuple[int, int] = EQUAL_WORK_PROMPT_LEN,
               output_len: tuple[int, int] = MIXED_WORK_OUTPUT_LEN, seed: int = DEFAULT_SEED) -> list[Request]:
    """The same prompts as `equal_work`, output lengths spread uniformly over `output_len`, EOS ignored."""
    ids = random_prompt_ids(uniform_lengths(n, *prompt_len, seed=seed), vocab_size, seed)
    outs = uniform_lengths(n, *output_len, seed=seed + 3)
    return [Request(prompt_ids=p, max_new_tokens=o, ignore_eos=True) for p, o in zip(ids, outs)]


def nano_vllm_work(vocab_size: int, n: int = NANO_VLLM_N, input_len: tuple[int, int] = NANO_VLLM_LENGTHS,
                   output_len: tuple[int, int] = NANO_VLLM_LENGTHS, seed: int = DEFAULT_SEED) -> list[Request]:
    """nano-vllm's bench.py workload: n random-token prompts and output lengths, each uniform in its range,
    EOS ignored. Our seeded draw, not its own: the same shape of work, not the same token ids."""
    return mixed_work(vocab_size, n, input_len, output_len, seed)


def total_output_tokens(requests: list[Request]) -> int:
    return sum(r.max_new_tokens * r.n for r in requests)


# --- step-timed traces --------------------------------------------------------------------------
@dataclass
class TracedRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    arrival_step: int = 0
    kind: str = "plain"        # "plain" (greedy), "samples" (n seeded samples), "beam" (beam search, width n)
    n: int = 1
    seed: int | None = None    # samples: the request's seed (sample i draws with seed + i)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=TRACE_SAMPLE_TEMPERATURE, seed=self.seed) if self.kind == "samples" \
            else GREEDY


def _uniform(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    """One integer drawn uniformly from [lo, hi]."""
    return int(rng.integers(bounds[0], bounds[1] + 1))


def burst(vocab_size: int, n: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
          seed: int = DEFAULT_SEED) -> list[TracedRequest]:
    """n greedy requests arriving together at step 0; lengths uniform in the given [lo, hi] ranges."""
    rng = np.random.default_rng(seed)
    return [TracedRequest(random_token_ids(rng, _uniform(rng, prompt_len), vocab_size), _uniform(rng, output_len))
            for _ in range(n)]


def stress_trace(vocab_size: int, n_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                 burst_size: tuple[int, int], burst_gap: tuple[int, int], p_samples: float, p_beam: float,
                 max_n: int, seed: int = DEFAULT_SEED) -> list[TracedRequest]:
    """Bursts of requests (sizes, and gaps in steps, drawn uniformly); each is plain, n samples or a beam search
    (probabilities p_samples, p_beam; n uniform in [2, max_n])."""
    rng = np.random.default_rng(seed)
    trace, step = [], 0
    while len(trace) < n_requests:
        for _ in range(min(_uniform(rng, burst_size), n_requests - len(trace))):
            kind = rng.choice(["samples", "beam", "plain"], p=[p_samples, p_beam, 1 - p_samples - p_beam])
            trace.append(TracedRequest(
                random_token_ids(rng, _uniform(rng, prompt_len), vocab_size), _uniform(rng, output_len),
                arrival_step=step, kind=str(kind), n=1 if kind == "plain" else _uniform(rng, (2, max_n)),
                seed=len(trace)))
        step += _uniform(rng, burst_gap)
    return trace


def demand_tokens(trace: list[TracedRequest]) -> int:
    """KV tokens the trace would hold if every request ran to max_new_tokens at once, nothing shared."""
    return sum(r.n * (len(r.prompt_ids) + r.max_new_tokens) for r in trace)


# --- the vLLM paper's workloads (§6.1): lengths like ShareGPT's or Alpaca's, Poisson arrivals ----------------
# Mean (prompt, output) tokens of the two datasets the paper synthesizes its requests from, as printed in its
# Fig. 11; the text gives their ratios (ShareGPT's prompts 8.4x longer than Alpaca's, outputs 5.8x).
DATASET_MEANS = {"sharegpt": (161.31, 337.99), "alpaca": (19.31, 58.45)}
# The paper publishes histograms, not a spread: ours is a lognormal of this sigma (a long right tail, median
# about 0.6x the mean), scaled to the dataset's means.
LENGTH_SIGMA = 1.0
PAPER_CONTEXT_LIMIT = 2048   # OPT's maximum sequence length: what the paper's Orca (Max) reserves


def dataset_lengths(dataset: str, n: int, scale: float, context_limit: int,
                    seed: int = DEFAULT_SEED) -> list[tuple[int, int]]:
    """n (prompt, output) token counts drawn like `dataset`'s, its means times `scale`; each at least 1, and
    prompt + output within `context_limit` (the tail is cut there, as the paper's traces are)."""
    if dataset not in DATASET_MEANS:
        raise ValueError(f"unknown dataset {dataset!r}: choose one of {sorted(DATASET_MEANS)}")
    rng = np.random.default_rng(seed + 4)
    out = []
    for mean in DATASET_MEANS[dataset]:
        mu = np.log(mean * scale) - LENGTH_SIGMA ** 2 / 2     # a lognormal's mean is exp(mu + sigma^2 / 2)
        out.append(np.maximum(1, np.rint(rng.lognormal(mu, LENGTH_SIGMA, size=n))).astype(int))
    prompts = np.minimum(out[0], context_limit - 1)
    return [(int(p), int(min(o, context_limit - p))) for p, o in zip(prompts, out[1])]


def rate_trace(vocab_size: int, n: int, rate_per_s: float, dataset: str, scale: float, context_limit: int,
               seed: int = DEFAULT_SEED) -> list[Request]:
    """n random-token requests with `dataset_lengths` and Poisson arrivals at `rate_per_s`, EOS ignored, so
    each generates exactly its drawn output length. The same seed gives the same lengths at every rate."""
    lengths = dataset_lengths(dataset, n, scale, context_limit, seed)
    prompts = random_prompt_ids([p for p, _ in lengths], vocab_size, seed)
    arrivals = poisson_arrivals(n, rate_per_s, seed)
    return [Request(prompt_ids=ids, max_new_tokens=o, arrival_s=t, ignore_eos=True)
            for ids, (_, o), t in zip(prompts, lengths, arrivals)]
