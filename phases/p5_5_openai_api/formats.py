"""How each endpoint shapes the `ChoiceDelta`s of the async engine into answers and stream chunks."""

from __future__ import annotations

from phases.p5_5_openai_api import protocol as P


class CompletionFormat:
    """/v1/completions: choices carry `text`."""
    prefix = "cmpl"

    def __init__(self, model: str, rid: str, created: int):
        self.model, self.rid, self.created = model, rid, created

    def _chunk(self, choices, usage=None) -> P.CompletionResponse:
        return P.CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage)

    def opening(self, n: int) -> list:
        return []

    def chunk(self, d) -> P.CompletionResponse:
        return self._chunk([P.CompletionChoice(index=d.index, text=d.text, finish_reason=d.finish_reason)])

    def usage_chunk(self, usage: P.Usage):
        return self._chunk([], usage)

    def response(self, texts, reasons, usage) -> P.CompletionResponse:
        return self._chunk([P.CompletionChoice(index=i, text=t, finish_reason=r)
                            for i, (t, r) in enumerate(zip(texts, reasons))], usage)


class ChatFormat(CompletionFormat):
    """/v1/chat/completions: choices carry a `message`, chunks a `delta` (the first one names the role)."""
    prefix = "chatcmpl"

    def _chunk(self, choices, usage=None) -> P.ChatCompletionChunk:
        return P.ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage)

    def opening(self, n: int) -> list:
        return [self._chunk([P.ChatChunkChoice(index=i, delta=P.ChatDelta(role="assistant", content=""))])
                for i in range(n)]

    def chunk(self, d) -> P.ChatCompletionChunk:
        delta = P.ChatDelta(content=d.text) if d.text or d.finish_reason is None else P.ChatDelta()
        return self._chunk([P.ChatChunkChoice(index=d.index, delta=delta, finish_reason=d.finish_reason)])

    def response(self, texts, reasons, usage) -> P.ChatCompletionResponse:
        choices = [P.ChatChoice(index=i, message=P.AssistantMessage(content=t), finish_reason=r)
                   for i, (t, r) in enumerate(zip(texts, reasons))]
        return P.ChatCompletionResponse(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage)
