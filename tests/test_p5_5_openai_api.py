"""Phase 5.5: OpenAI's wire format, without a server: bodies are refused field by field with the field named,
unsupported fields are refused rather than ignored, defaults and vLLM's extensions read as documented, and
the two endpoints shape the same text deltas into their own answers and chunks. (Over HTTP, every body the
schema allows and forbids: tests/test_p5_fuzz.py.)
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from phases.p5_5_openai_api import protocol as P
from phases.p5_5_openai_api.formats import ChatFormat, CompletionFormat

MODEL = "tiny"


def refused_field(cls, **body) -> str:
    """The field pydantic names when it refuses `body`."""
    with pytest.raises(ValidationError) as e:
        cls(model=MODEL, **body)
    return ".".join(str(p) for p in e.value.errors()[0]["loc"])


@pytest.mark.parametrize("body, field", [
    (dict(temperature=2.5), "temperature"), (dict(temperature=math.nan), "temperature"), (dict(top_p=0), "top_p"),
    (dict(n=P.MAX_N + 1), "n"), (dict(n=True), "n"), (dict(top_k=-2), "top_k"), (dict(seed=2**63), "seed"),
    (dict(stop=["a"] * (P.MAX_STOP_STRINGS + 1)), "stop"), (dict(stop=[""]), "stop"),
    (dict(stop="x" * (P.MAX_STOP_CHARS + 1)), "stop"), (dict(logprobs=True), "logprobs"),
    (dict(presence_penalty=0.5), "presence_penalty"), (dict(echo=True), "echo"), (dict(suffix="x"), "suffix"),
    (dict(best_of=2), "best_of"), (dict(prompt=["a", "b"]), "prompt"), (dict(prompt=""), "prompt"),
])
def test_a_completion_body_is_refused_naming_its_field(body, field):
    assert refused_field(P.CompletionRequest, **{"prompt": "hi", **body}) == field


def test_chat_bodies_are_refused_naming_their_field():
    assert refused_field(P.ChatCompletionRequest, messages=[]) == "messages"
    assert refused_field(P.ChatCompletionRequest, messages=[{"role": "tool", "content": "x"}]).startswith("messages")
    assert refused_field(P.ChatCompletionRequest, messages=[{"role": "user", "content": "x"}],
                         tools=[{"type": "function"}]) == "tools"


def test_defaults_and_vllms_extensions():
    c = P.CompletionRequest(model=MODEL, prompt=["one prompt in a list"], user="ignored", frequency_penalty=0)
    assert c.prompt == "one prompt in a list" and c.max_tokens == P.DEFAULT_COMPLETION_MAX_TOKENS
    assert c.n_samples == 1 and c.stop is None and not c.include_usage
    assert P.CompletionRequest(model=MODEL, prompt="x", stop="END").stop == ["END"]   # one string: a list of one
    s = c.sampling_params()
    assert s.temperature == P.DEFAULT_TEMPERATURE and s.top_p == 1.0 and s.top_k == 0 and s.seed is None
    assert P.CompletionRequest(model=MODEL, prompt="x", top_k=-1).sampling_params().top_k == 0   # -1: no cut
    streamed = P.CompletionRequest(model=MODEL, prompt="x", stream=True, stream_options={"include_usage": True})
    assert streamed.include_usage
    chat = P.ChatCompletionRequest(model=MODEL, max_tokens=5, max_completion_tokens=7, messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}])
    assert chat.requested_max_tokens() == 7      # the newer name wins
    assert chat.template_messages() == [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Hi there"}]


def test_the_two_endpoints_shape_the_same_deltas():
    deltas = [SimpleNamespace(index=0, text="Par", finish_reason=None),
              SimpleNamespace(index=0, text="is", finish_reason="stop")]
    usage = P.Usage.of(5, 2)
    assert usage.total_tokens == 7
    completion = CompletionFormat(MODEL, "cmpl-1", 0)
    assert completion.opening(2) == []
    assert [completion.chunk(d).choices[0].text for d in deltas] == ["Par", "is"]
    answer = completion.response(["Paris"], ["stop"], usage)
    assert answer.object == "text_completion" and answer.choices[0].text == "Paris" and answer.usage == usage
    chat = ChatFormat(MODEL, "chatcmpl-1", 0)
    opening = chat.opening(2)
    assert [o.choices[0].delta.role for o in opening] == ["assistant", "assistant"]
    assert [o.choices[0].index for o in opening] == [0, 1]
    chunks = [chat.chunk(d) for d in deltas]
    assert [c.choices[0].delta.content for c in chunks] == ["Par", "is"] and chunks[-1].choices[0].finish_reason == "stop"
    assert chat.chunk(SimpleNamespace(index=0, text="", finish_reason="length")).choices[0].delta.content is None
    assert chat.usage_chunk(usage).choices == [] and chat.usage_chunk(usage).usage == usage
    reply = chat.response(["Paris"], ["stop"], usage)
    assert reply.object == "chat.completion" and reply.choices[0].message.content == "Paris"


def test_an_error_body_is_openais_shape():
    body = P.error_body("temperature: too hot", "invalid_request_error", "temperature")
    assert body == {"error": {"message": "temperature: too hot", "type": "invalid_request_error",
                              "param": "temperature", "code": None}}
