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
LATENCY_DEMO_MAX_TOKENS = 128          # CPU: long answers run to this cap in ~40 s per batch on 2 cores
# GPU: the blog's cap (its prose says 2048; its code listing shows 128). Its long answers stopped at
# EOS after 443-1,592 steps and short ones after 2-24, which is what makes continuous batching's
# 15-36x for short prompts show.
LATENCY_DEMO_MAX_TOKENS_GPU = 2048
# The decode steps each latency-demo prompt ran in the blog's table (Inference Engines 2/N,
# "Phase 2, Step 4", its `steps` column): how long the blog's model answered each one. Run with
# EOS ignored, these lengths replay the blog's workload on any model, random weights included.
LATENCY_DEMO_BLOG_STEPS = {
    "What is the capital of France?": 9,
    "Explain in detail how the attention mechanism works in a transformer.": 1269,
    "Is Python interpreted or compiled? Answer in one sentence.": 24,
    "Write a short story about a robot who learns to paint.": 443,
    "What is 2 + 2?": 23,
    "Describe the history of the Roman Empire in significant detail.": 1592,
    "Name one fruit.": 2,
    "What are the key differences between supervised and unsupervised learning?": 913,
}
# The blog's wall demo reserves this many slots per sequence (StaticCache's
# worst-case reservation, "MAX_SEQ_LENGTH_DOOMSDAY_PREPARATION").
STATIC_RESERVATION_TOKENS = 2048

# --- phase 3.2: the table demo --------------------------------------------------
TABLE_DEMO_PROMPT = "Explain how the attention mechanism works in a transformer model."

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# --- phase 4.3: one long shared system prompt (one-shot / few-shot), short inputs -----
# The vLLM paper's shared-prefix experiment (§6.4): a task description with one example
# (one-shot) or five (few-shot) in front of every request, then a different short input.
TRANSLATION_INSTRUCTION = (
    "You are a professional translator. Translate the English sentence the user sends into French. "
    "Keep the meaning, the tone and the punctuation of the original, and reply with the French "
    "sentence only, without notes or explanations.")
TRANSLATION_EXAMPLES = [  # (English, French): the shots of the shared prefix
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
TRANSLATION_SENTENCES = [  # the per-request inputs
    "Where is the nearest bakery?", "The cat is sleeping on the sofa.", "I would like a cup of tea, please.",
    "We are going to the beach tomorrow.", "This book is very interesting.", "My brother plays the guitar.",
    "The shop closes at seven o'clock.", "It is cold this morning.", "She lost her keys again.",
    "The garden is full of flowers.", "Can you help me carry this box?", "He runs in the park every day.",
    "The soup is too hot to eat.", "Our teacher speaks three languages.", "The bus is late today.",
    "I forgot my umbrella at home.", "They painted the kitchen yellow.", "The river flows to the sea.",
    "Please close the window.", "We watched a film last night.", "The baby is laughing.",
    "My phone battery is empty.", "The mountains are covered in snow.", "Dinner will be ready soon.",
]


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


def translation_system_prompt(n_shots: int) -> str:
    """The translation instruction, then `n_shots` worked examples: the prefix every request shares."""
    if not 0 <= n_shots <= len(TRANSLATION_EXAMPLES):
        raise ValueError(f"shots must be between 0 and {len(TRANSLATION_EXAMPLES)}, got {n_shots}")
    shots = "".join(f"\n\nEnglish: {en}\nFrench: {fr}" for en, fr in TRANSLATION_EXAMPLES[:n_shots])
    return TRANSLATION_INSTRUCTION + ("\n\nExamples:" + shots if shots else "")


def translation_input(i: int) -> str:
    """Request i's input: the sentences in turn, then pairs of them, so no two requests are equal."""
    n = len(TRANSLATION_SENTENCES)
    if i < n:
        return TRANSLATION_SENTENCES[i]
    return f"{TRANSLATION_SENTENCES[i % n]} {TRANSLATION_SENTENCES[(i // n + i) % n]}"


def shared_prefix_len(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with (a shared system prompt and the template around it)."""
    n = 0
    while all(len(p) > n for p in prompts) and len({p[n] for p in prompts}) == 1:
        n += 1
    return n


# --- phase 4.5: workloads that copy their context, and open chat ---------------------------------
SPEC_CODE = '''def total_price(items, tax):
    subtotal = 0
    for item in items:
        subtotal = subtotal + item["price"] * item["quantity"]
    total = subtotal + subtotal * tax
    return round(total, 2)'''
SPEC_TEXT = ("The Great Barrier Reef is the largest coral reef system in the world. It lies off the coast of "
             "Queensland, Australia, and stretches for over two thousand kilometres. The reef is home to thousands "
             "of species of fish, corals and molluscs. Rising sea temperatures cause coral bleaching, which has "
             "damaged large parts of the reef in recent years.")
# name -> prompts. The first three copy much of their context into the answer; chat copies little.
SPEC_WORKLOADS = {
    "code_edit": [
        f"Rename the variable `subtotal` to `net` in this Python function. Reply with the whole function.\n\n{SPEC_CODE}",
        f"Add a docstring to this Python function. Reply with the whole function.\n\n{SPEC_CODE}",
        f"Rename the function to `order_total` and keep everything else. Reply with the whole function.\n\n{SPEC_CODE}",
        f"Add type hints to this Python function. Reply with the whole function.\n\n{SPEC_CODE}",
    ],
    "quote_summary": [
        f"Summarize this text in two sentences, quoting it word for word where you can.\n\n{SPEC_TEXT}",
        f"Which sentence of this text talks about fish? Quote it exactly.\n\n{SPEC_TEXT}",
        f"Copy the first two sentences of this text.\n\n{SPEC_TEXT}",
        f"What causes coral bleaching, according to this text? Quote the text.\n\n{SPEC_TEXT}",
    ],
    "repeated": [
        "Write the days of the week as a list, each line in the form 'Day N: <name> is day N of the week.'",
        "Write a multiplication table for 7, from 7 x 1 to 7 x 10, one line each in the form '7 x N = M'.",
        "List the months of the year, each line in the form 'Month N: <name>'.",
        "Write a JSON list of five people, each with the keys \"name\", \"age\" and \"city\".",
    ],
    "chat": SHORT_PROMPTS[:2] + LONG_PROMPTS[:2],
}
