"""Tokens in, text out, one token at a time: incremental detokenization and stop strings.

A byte-level BPE token can be half of a UTF-8 character (`'日'` is three byte-tokens; the first two decode
to `'\ufffd'`), so decoding each token alone garbles text, and decoding the whole output at every step
costs O(n) per token. `IncrementalDetokenizer` decodes a small window (a few tokens already sent, for
context, and the ones not sent yet) twice, as vLLM does, and sends the difference. `TextStream` adds
`StopStrings`, for one sample: its deltas concatenate to exactly the text a non-streamed answer returns.
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"  # what a decoder makes of an unfinished UTF-8 character


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the context window (tokens already sent)
        self.read_offset = 0    # first token whose text has not been sent

    def _decode(self, ids: list[int]) -> str:
        # Ids past the tokenizer's vocabulary (random test models) have no text.
        vocab = len(self.tokenizer)
        return self.tokenizer.decode([i for i in ids if i < vocab], skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """Add one token; return the new text it completes ('' while a character is unfinished)."""
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """The sequence ended: send whatever is held back, unfinished characters included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read_offset == len(self.ids):
            return ""
        sent = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.ids[self.prefix_offset:])
        if not final and (len(window) <= len(sent) or window.endswith(REPLACEMENT_CHAR)):
            return ""  # nothing new yet, or the last character is still missing bytes
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return window[len(sent):]


class StopStrings:
    """Cuts the text just before a stop string (OpenAI's rule), holding back what might start one."""

    def __init__(self, stops: list[str] | None):
        self.stops = [s for s in (stops or []) if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1  # chars that may start a stop string
        self.text = ""        # everything decoded so far (cut at the stop string once one is found)
        self.n_sent = 0       # characters of `text` released to the caller
        self.stopped = False

    def push(self, new_text: str) -> str:
        """Add decoded text; return what may be released now (never part of a stop string)."""
        if self.stopped:
            return ""
        # A stop string may straddle the old text and the new: search from `hold` chars back.
        start = max(0, len(self.text) - self.hold)
        self.text += new_text
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
            return self._release(len(self.text))
        return self._release(len(self.text) - self.hold)

    def flush(self) -> str:
        """The sequence ended for another reason: release the held-back tail."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        upto = max(upto, self.n_sent)
        out, self.n_sent = self.text[self.n_sent:upto], upto
        return out


class TextStream:
    """One sampled sequence: token ids in, text deltas out, stop strings applied."""

    def __init__(self, tokenizer, stops: list[str] | None = None):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = StopStrings(stops)
        self.n_tokens = 0

    def push(self, token_id: int) -> str:
        self.n_tokens += 1
        return self.stop.push(self.detok.push(token_id))

    def finish(self) -> str:
        """The engine ended the sequence (EOS or length): everything still held back."""
        return self.stop.push(self.detok.flush()) + self.stop.flush()

    @property
    def stopped(self) -> bool:
        """A stop string appeared: the caller must end the sequence in the engine."""
        return self.stop.stopped

    @property
    def text(self) -> str:
        return self.stop.text
