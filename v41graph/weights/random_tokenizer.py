"""`write_random_tokenizer`: a small real tokenizer for random checkpoints, so text prompts, chat
templates, streaming detokenization and the Engram token map run offline in tests.

A byte-level BPE (`tokenizers`' BpeTrainer) over a short built-in corpus, with DeepSeek's special
tokens first (id 0 BOS, 1 EOS, 2 pad: the config's engram_pad_token_id; then the chat roles), the
corpus's byte alphabet (printable ASCII, tab, newline and the UTF-8 bytes of a few non-ASCII
characters, so some tokens end inside a multi-byte character), merges up to the model's
vocabulary and, where the corpus cannot fill a large vocabulary, placeholder special tokens (as
DeepSeek's own tokenizer has). A byte outside that alphabet encodes as <｜unk｜>. Written as
tokenizer.json + tokenizer_config.json (chat template, BOS/EOS), the files
`transformers.AutoTokenizer` loads.
"""
from __future__ import annotations

import json
import string
from pathlib import Path

__all__ = ["write_random_tokenizer", "SPECIAL_TOKENS", "CHAT_TEMPLATE"]

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
USER, ASSISTANT, UNK = "<｜User｜>", "<｜Assistant｜>", "<｜unk｜>"
SPECIAL_TOKENS = (BOS, EOS, PAD, USER, ASSISTANT, UNK)

# DeepSeek's chat layout: BOS, system text, then <｜User｜>... <｜Assistant｜>...<｜end▁of▁sentence｜> turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}" + USER + "{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}" + ASSISTANT + "{{ m['content'] }}" + EOS +
    "{% else %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}")

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "In the beginning there was the word, and the word was with the model; and the model was tiny.",
    "Hello, how are you today? I am fine, thank you! What is the weather like in Paris and Berlin?",
    "Once upon a time, a small model learned to count: one, two, three, four, five, six, seven.",
    "def add(a, b):\n\treturn a + b  # 1 + 2 = 3, 10 * 20 = 200, x[0] == {'k': \"v\"}\n",
    " ".join(string.printable),                  # every printable ASCII character is in the alphabet
    "café naïve façade — “quoted” 😀 €5 über",   # 2-, 3- and 4-byte UTF-8 characters
)


def write_random_tokenizer(out, vocab_size: int, model_max_length: int | None = None) -> Path:
    """Write tokenizer.json and tokenizer_config.json of exactly `vocab_size` tokens to `out`.
    Deterministic for a given `tokenizers` version. Returns the tokenizer.json path."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  min_frequency=1, show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is too small for the random tokenizer's special "
                         f"tokens and byte alphabet ({tok.get_vocab_size()} tokens)")
    fill = vocab_size - tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(f"<｜place▁holder▁no▁{i}｜>", special=True, normalized=False)
                            for i in range(fill)])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                       special_tokens=[(BOS, 0)])
    path = out / "tokenizer.json"
    tok.save(str(path))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK,
        "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    if model_max_length is not None:
        config["model_max_length"] = int(model_max_length)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return path
