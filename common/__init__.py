"""The ground floor every phase stands on: what an engine imports, and nothing else.

- model.py      `load_model(name) -> LoadedModel`: the packaged SmolLM2, HF ids, dummy weights, the tiny test model
- tokenizer.py  a tokenizer built in code, for random-weight models
- prompts.py    the prompt sets and the chat-template scaffolding
- sampling.py   greedy, temperature, top-k, top-p from logits; `SamplingParams`
- clock.py      `now()`, a synchronised wall clock, and `SeqTiming`, one request's timestamps
- __main__.py   `python -m common <demo>`, handed to the measurement package's runner (measure/cli.py)

Nothing here imports a phase or the measurement package (measure/), which
sits above every phase: the tests check both.
"""
