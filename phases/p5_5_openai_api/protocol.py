"""The OpenAI wire format: request bodies (validated) and response bodies, as pydantic models.

Only what this server implements is declared: a field it does not support is refused with a 400 when set,
never silently ignored. The bounds written here are the ones a client reads in the OpenAPI schema; the
engine checks the sampling values again itself, and the server turns its refusals into the same 400.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from common.sampling import SEED_MAX, SEED_MIN, SamplingParams

MAX_N = 16                          # samples per request
MAX_STOP_STRINGS = 4                # OpenAI's limit
MAX_STOP_CHARS = 256                # per stop string: the stream holds back len(longest) - 1 characters
NO_TOP_K = -1                       # vLLM's "no top-k cut" (0 means the same here)
MAX_TEMPERATURE = 2.0               # OpenAI's range is [0, 2]
DEFAULT_TEMPERATURE = 1.0           # OpenAI's default: sampling, not greedy
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# OpenAI's chat default is "until the context is full"; the engine refuses a request that could outgrow
# the whole pool, so that would refuse every chat request on a pool smaller than the context.
DEFAULT_CHAT_MAX_TOKENS = 256


class StreamOptions(BaseModel):
    include_usage: bool = False  # one last chunk with `usage` and no choices


class _Sampling(BaseModel):
    """Fields both endpoints share. None means "the default" (the openai client may send null)."""
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: StrictInt | None = Field(None, ge=NO_TOP_K)  # vLLM extension: -1 or 0 is no cut
    n: StrictInt | None = Field(None, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: StrictInt | None = Field(None, ge=SEED_MIN, le=SEED_MAX)  # sample i of n draws with seed + i
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False                   # vLLM extension: run to max_tokens
    logprobs: Any = None                               # not supported: must stay unset
    presence_penalty: float | None = None              # only 0 (no penalty) is supported
    frequency_penalty: float | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string may be {MAX_STOP_CHARS} characters at most")
        return stops

    @field_validator("logprobs", "presence_penalty", "frequency_penalty")
    @classmethod
    def _unsupported(cls, v, info):
        if v not in (None, False, 0):
            raise ValueError(f"{info.field_name} is not supported by this server")
        return v

    def sampling_params(self) -> SamplingParams:
        t = DEFAULT_TEMPERATURE if self.temperature is None else self.temperature
        return SamplingParams(temperature=t, top_k=max(self.top_k or 0, 0),
                              top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed)

    @property
    def n_samples(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    max_tokens: StrictInt | None = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=1)
    echo: bool | None = False
    suffix: str | None = None
    best_of: StrictInt | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        # One prompt per request keeps choices[i] == sample i; a list of one is accepted.
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError(f"give one prompt per request (a string), got a list of {len(v)}")
            v = v[0]
        if not v:
            raise ValueError("empty prompt: give at least one character of text")
        return v

    @field_validator("echo", "suffix")
    @classmethod
    def _unsupported_here(cls, v, info):
        if v:
            raise ValueError(f"{info.field_name} is not supported by this server")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v):
        if v not in (None, 1):
            raise ValueError("best_of > 1 is not supported by this server; use n")
        return v


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)  # the newer name of max_tokens
    tools: list[Any] | None = None                          # no tool calling

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v):
        if v:
            raise ValueError("tool calling is not supported by this server")
        return v

    def template_messages(self) -> list[dict[str, str]]:
        # "developer" is the newer name of "system"; chat templates know only "system".
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# --- responses ----------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, n_prompt: int, n_completion: int) -> "Usage":
        return cls(prompt_tokens=n_prompt, completion_tokens=n_completion, total_tokens=n_prompt + n_completion)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "inference-engine-phases"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
