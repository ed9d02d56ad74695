"""The prompt sets and constants every demo uses, and the chat-template scaffolding.

The sets and numbers follow the blog post this project reproduces (Inference
Engines 2/N), so a reader can put our tables next to the post's tables.

Instruct models only stop on their end-of-sequence token when the prompt looks
like the conversations they were trained on. `format_prompt` wraps a user
message in the model's chat template (system turn + user turn + the opening of
the assistant turn); the model then ends its answer with its EOS token
(`<|im_end|>` for SmolLM2 and Qwen), which is what lets short questions stop
after ~10 tokens instead of running to the cap.
"""

from __future__ import annotations

# --- phase 0/1: one prompt, growing number of new tokens -----------------------
DECODE_PROMPT = "The transformer architecture revolutionized NLP because"
DECODE_NEW_TOKENS_CPU = [16, 32, 64, 128]
DECODE_NEW_TOKENS_GPU = [32, 128, 512, 1024]  # the blog's Phase-1 table

# --- phase 2.1: batch-size sweep on one prompt --------------------------------
SWEEP_PROMPT = "The transformer architecture revolutionized NLP because"
SWEEP_NEW_TOKENS = 128
SWEEP_BATCH_SIZES = [1, 2, 4, 8, 16]

# --- phase 2.1: the waste demo ---------------------------------------------------
WASTE_DEMO_PROMPTS = [
    "What is the capital of France?",
    "Explain in detail how the attention mechanism works in a transformer.",
    "Is Python interpreted or compiled? Answer in one sentence.",
    "Write a short story about a robot who learns to paint.",
]
WASTE_DEMO_MAX_TOKENS = 200

# --- phase 2.3 and 3: short and long prompts, interleaved -----------------------
SHORT_PROMPTS = [
    "What is the capital of France?",
    "Is Python interpreted or compiled? Answer in one sentence.",
    "What is 2 + 2?",
    "Name one fruit.",
]
LONG_PROMPTS = [
    "Explain in detail how the attention mechanism works in a transformer.",
    "Write a short story about a robot who learns to paint.",
    "Describe the history of the Roman Empire in significant detail.",
    "What are the key differences between supervised and unsupervised learning?",
]
LATENCY_DEMO_MAX_RUNNING = 4
LATENCY_DEMO_MAX_TOKENS = 128
# The blog's wall demo reserves this many slots per sequence (StaticCache's
# worst-case reservation, "MAX_SEQ_LENGTH_DOOMSDAY_PREPARATION").
STATIC_RESERVATION_TOKENS = 2048

# --- phase 3.2: the table demo --------------------------------------------------
TABLE_DEMO_PROMPT = "Explain how the attention mechanism works in a transformer model."

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."


def interleaved_latency_prompts() -> list[str]:
    """Short and long prompts alternating: short, long, short, long, ...

    The order is the blog's latency-demo order, so every static batch of four
    mixes two quick answers with two long ones.
    """
    out: list[str] = []
    for short, long in zip(SHORT_PROMPTS, LONG_PROMPTS):
        out += [short, long]
    return out


def has_chat_template(tokenizer) -> bool:
    return getattr(tokenizer, "chat_template", None) is not None


def format_prompt(tokenizer, user_message: str, system: str | None = DEFAULT_SYSTEM_PROMPT) -> str:
    """Wrap one user message in the model's chat template, ready to generate.

    A tokenizer without a chat template (a base model's) gets plain text: the
    system text, a blank line, the user message. Such text has no special
    tokens yet; tokenize it with the tokenizer's own (`add_special_tokens=True`),
    as `LoadedModel.prompt_ids` does.
    """
    if not user_message:
        raise ValueError("empty prompt: give at least one character of text")
    if not has_chat_template(tokenizer):
        return f"{system}\n\n{user_message}" if system else user_message
    messages = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": user_message})
    # enable_thinking=False: Qwen3's template otherwise opens a <think> block and
    # the model reasons at length before answering; other templates ignore it.
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=False)
