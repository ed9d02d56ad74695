"""Phase 3.8 adds chunked prefill to phase 3.6's engine: ONE forward pass per step, decode tokens and prefill chunks together under a token budget, the chunks on phase 3.7's varlen prefill kernel.

- engine.py     `TokenBudget`, the prefill plan: a token budget per step (`max_num_batched_tokens`), decode
                tokens first, then prompts prefilled in chunks; `WholePromptBudget`, prompts never cut
                (chunking's baseline); `ChunkedPrefillEngine` and `WholePromptEngine` pick them
- runner.py     `MixedRunner(PagedRunner)`: the step's one mixed pass, or phase 3.6's decode pass when no
                chunk is due
- attention.py  `varlen_attention_forward` (transformers' AttentionInterface): a mixed row of decode tokens
                (phase 3.5's decode kernel) and prefill chunks (phase 3.7's varlen kernel), `MixedBatch`
And:
- demo.py       `prefill_bench`: one layer's attention (3.6's loop vs the varlen call vs no paging), the
                whole prefill pass per engine, streams' inter-token latency with and without chunking, and
                workload_bench's work through 3.6's engine and this one
- README.md     the idea, its files, how to run it; its tables: docs/measurements/p3_8_chunked_prefill.md
"""
