"""Request bodies of the OpenAI-compatible endpoints, as pydantic models: unknown fields and
wrong types are refused (HTTP 400 naming the field), never ignored or coerced.

Served fields: model, prompt / messages, max_tokens (chat also max_completion_tokens),
temperature, top_p, presence_penalty, frequency_penalty, stop, seed, stream,
stream_options.include_usage, n (up to MAX_CHOICES), user, logprobs (completions: the number of
top alternatives; chat: a bool, with top_logprobs), and vLLM's extra sampling fields top_k,
min_p, repetition_penalty, stop_token_ids (runtime/sampling.py's semantics).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["CompletionRequest", "ChatCompletionRequest", "ChatMessage"]

MAX_CHOICES = 16       # n per request: each choice holds an engine slot and its cache blocks


class _Body(BaseModel):
    # strict: "5" is not an int and 1 is not a bool; extra: an unknown field is an error.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0)          # OpenAI's default; 0 = greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)            # choices (one engine request each; seed + index)
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # vLLM's extra sampling fields
    top_k: int = Field(0, ge=-1)                       # 0 or -1: every token
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    stop_token_ids: list[int] | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1)          # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=20)   # the sampled token's + this many alternatives

    def num_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)        # None: up to the end of the context
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
