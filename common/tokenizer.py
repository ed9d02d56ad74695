"""A tokenizer built in code, for random-weight models on a machine without the packaged model.

`tiny` and `dummy:<arch>` models have random weights, so the text they
produce is noise; they need a tokenizer only to turn prompts into ids and ids
back into (noise) text. They borrow the packaged SmolLM2 tokenizer when it is
installed. A bare GPU box or a fresh Modal image has only torch,
transformers and triton, so `byte_tokenizer()` builds one from nothing:

- one token per byte (a byte-level BPE with no merges): any text encodes,
  every id decodes, no vocabulary file is needed;
- the three ChatML special tokens at ids 0, 1, 2, where SmolLM2 has them, so
  the tiny model's config (bos 1, eos 2) means the same tokens under either
  tokenizer;
- a ChatML chat template (SmolLM2's and Qwen's format), so prompts keep the
  shape `common.prompts.format_prompt` gives them with a real model.

It is a real `transformers` fast tokenizer: engines, HF `generate` and the
server use it exactly as they use a downloaded one.
"""

from __future__ import annotations

END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END]   # ids 0, 1, 2, as in SmolLM2's vocabulary
BYTE_TOKENIZER_NAME = "built-in byte tokenizer"

# ChatML: each turn is <|im_start|>role\ncontent<|im_end|>\n; generation opens the assistant's turn.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_tokenizer():
    """A byte-level fast tokenizer with ChatML special tokens and chat template (259 ids).

    Built anew on each call (a few ms): callers may change a tokenizer's settings (padding side)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # ByteLevel maps each of the 256 byte values to a printable character; with no
    # merges, BPE leaves every byte its own token.
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for ch in byte_chars:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=IM_START, eos_token=IM_END,
                                        pad_token=END_OF_TEXT, chat_template=CHATML_TEMPLATE)
    tokenizer.name_or_path = BYTE_TOKENIZER_NAME
    return tokenizer
