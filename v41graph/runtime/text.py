"""Text in, text out: the checkpoint's tokenizer, chat prompts, streaming detokenization and stop
strings, in one place (the Engine and the HTTP server both use it).

    tok = Tokenizer.from_pretrained(checkpoint_dir)      # transformers' AutoTokenizer over the folder
    ids = tok.encode("Hello")                            # the tokenizer's own special tokens (BOS) added
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])   # + the generation prompt
    out = tok.text_stream(stop=["\\n\\n"])               # one per request
    for t in new_ids: stopped = out.push(t)              # out.text grows; True once a stop string appears
    out.finish()                                         # flush what was held back

Detokenization is `tokenizers`' own `DecodeStream` (a window of the last tokens is decoded and
only text that no later token can change is released; a token that ends inside a multi-byte
character releases nothing until the character is complete). What the library lacks, and is
written here: the flush at the end (DecodeStream never releases an incomplete trailing character,
a full decode shows it as U+FFFD) and stop strings, matched on the released text with the part
that could still become a stop string held back, so the text never shows any of a stop string
and is cut exactly before its first occurrence (vLLM's and OpenAI's rule).

Decoding uses the tokenizer without `clean_up_tokenization_spaces`: that clean-up rewrites text
around punctuation after the fact, so a streamed text could not stay a prefix of the final one.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["Tokenizer", "TextStream", "TokenizerError", "has_tokenizer", "is_chat", "TOKENIZER_FILES"]

# The files that make a checkpoint folder a tokenizer folder (AutoTokenizer needs the first).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class TokenizerError(ValueError):
    """A prompt the tokenizer cannot take (bad chat messages, a template that fails)."""


def has_tokenizer(path) -> bool:
    return path is not None and (Path(path) / TOKENIZER_FILES[0]).is_file()


def is_chat(prompt) -> bool:
    """Whether a prompt is a list of chat messages (dicts) rather than token ids or a string."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], Mapping)


class Tokenizer:
    """The checkpoint's tokenizer: transformers' AutoTokenizer (a `tokenizers` fast tokenizer and
    the chat template of tokenizer_config.json), with the few calls the runtime needs."""

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        self.backend = hf_tokenizer.backend_tokenizer      # the `tokenizers.Tokenizer`
        self.eos_token_id = hf_tokenizer.eos_token_id
        self.bos_token_id = hf_tokenizer.bos_token_id

    @classmethod
    def from_pretrained(cls, path) -> "Tokenizer":
        path = Path(path)
        if not has_tokenizer(path):
            raise FileNotFoundError(f"{path}: no {TOKENIZER_FILES[0]} (a checkpoint folder with the "
                                    f"tokenizer files {', '.join(TOKENIZER_FILES)} is needed)")
        from transformers import AutoTokenizer, PretrainedConfig

        # config=: the folder's config.json is the model's (no transformers model_type), so
        # AutoTokenizer must not read it; tokenizer_config.json names the tokenizer class.
        return cls(AutoTokenizer.from_pretrained(str(path), config=PretrainedConfig()))

    def __len__(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        """Token ids of a plain-text prompt, with the tokenizer's special tokens (e.g. BOS)."""
        if not isinstance(text, str):
            raise TokenizerError(f"a text prompt must be a str, got {type(text).__name__}")
        return list(self.hf(text, add_special_tokens=True)["input_ids"])

    def apply_chat_template(self, messages: Sequence[Mapping]) -> list[int]:
        """Token ids of a chat (messages {"role": str, "content": str}) through the checkpoint's
        chat template, ending with the generation prompt (the assistant's turn)."""
        check_messages(messages)
        if self.hf.chat_template is None:
            raise TokenizerError("this tokenizer has no chat template (tokenizer_config.json "
                                 "'chat_template'); send a plain prompt instead")
        try:
            ids = self.hf.apply_chat_template([dict(m) for m in messages], tokenize=True,
                                              add_generation_prompt=True, return_dict=False)
        except Exception as e:   # noqa: BLE001  (jinja's TemplateError and whatever the template raises)
            raise TokenizerError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
        return [int(t) for t in ids]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def text_stream(self, stop: Sequence[str] = (), skip_special_tokens: bool = True) -> "TextStream":
        return TextStream(self, stop, skip_special_tokens)


def check_messages(messages) -> None:
    """Chat messages as the template needs them, or a TokenizerError naming the bad one."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TokenizerError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TokenizerError(f"messages[{i}] must be a dict with 'role' and 'content', got "
                                 f"{type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise TokenizerError(f"messages[{i}].{key} must be a string, got {m.get(key)!r}")


class TextStream:
    """One request's output text, grown token by token: `text` is what may be shown now (never
    part of a stop string), `stop_reason` the stop string that ended it, if one did."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._decoder = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        self._decoded = 0          # characters of the decoded text already passed to the matcher
        self._held = ""            # decoded text that could still be the start of a stop string
        self.text = ""
        self.stop_reason: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def push(self, token_id: int) -> bool:
        """Add one generated token. Returns True when a stop string has appeared (the text is
        then cut before it and further tokens are ignored)."""
        if self.stopped:
            return True
        self._ids.append(int(token_id))
        piece = self._decoder.step(self._tokenizer.backend, int(token_id))
        if piece:
            self._decoded += len(piece)
            self._release(piece)
        return self.stopped

    def finish(self) -> str:
        """The request is over: release what was held back, including an incomplete trailing
        character (as U+FFFD, like a full decode). Returns the final text."""
        if self.stopped:
            return self.text
        full = self._tokenizer.decode(self._ids, self._skip)
        # DecodeStream's released text is a prefix of the full decode; the rest was pending.
        self._release(full[self._decoded:])
        self._decoded = len(full)
        if not self.stopped:
            self.text += self._held
            self._held = ""
        return self.text

    def _release(self, piece: str) -> None:
        buf = self._held + piece
        if not self._stop:
            self.text += buf
            self._held = ""
            return
        hits = [(i, s) for s in self._stop if (i := buf.find(s)) >= 0]
        if hits:
            i, s = min(hits)
            self.text += buf[:i]
            self._held, self.stop_reason = "", s
            return
        # Hold the longest tail of buf that is the start of some stop string (it may complete).
        keep = max((k for s in self._stop for k in range(min(len(s) - 1, len(buf)), 0, -1)
                    if s.startswith(buf[len(buf) - k:])), default=0)
        self.text += buf[:len(buf) - keep]
        self._held = buf[len(buf) - keep:]
