"""vLLM's CPU build, driven over stdin/stdout: run by the Python of its own venv (`make peer-vllm`).

It imports nothing of this repo (its venv has vLLM's pins, not ours). One JSON
object per line each way:

    argv[1]          {"model": folder, "dtype": "bfloat16", "max_num_seqs": n}
    out              {"ready": true, "vllm": version, "load_s": s}      once LLM(...) is built
    in               {"requests": [{"prompt_token_ids", "max_tokens", "ignore_eos", "temperature", ...}]}
    out              {"wall_s": s, "tokens": n, "outputs": [[ids], ...]}
    in               {"stop": true}

vLLM spawns processes of its own, so everything runs under `__main__`.
"""

import json
import sys
import time


def main() -> int:
    settings = json.loads(sys.argv[1])
    start = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=settings["model"], dtype=settings["dtype"], max_num_seqs=settings["max_num_seqs"], seed=0,
              max_model_len=settings.get("max_model_len", 2048))
    reply({"ready": True, "vllm": vllm.__version__, "load_s": time.perf_counter() - start})
    for line in sys.stdin:
        ask = json.loads(line)
        if ask.get("stop"):
            break
        prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in ask["requests"]]
        params = [SamplingParams(max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"],
                                 temperature=r["temperature"], top_p=r.get("top_p", 1.0), top_k=r.get("top_k", 0),
                                 seed=r.get("seed")) for r in ask["requests"]]
        begin = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - begin
        ids = [list(o.outputs[0].token_ids) for o in outs]
        reply({"wall_s": wall, "tokens": sum(map(len, ids)), "outputs": ids})
    return 0


def reply(obj: dict) -> None:
    # vLLM logs to stdout too: a marker keeps our lines apart from its own.
    sys.stdout.write("@@peer " + json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
