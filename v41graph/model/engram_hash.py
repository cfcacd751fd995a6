"""Engram n-gram hashing for DeepSeek-V4.1-Flash (MODEL.md section 7).

Everything here depends only on token ids and the config, never on activations,
which is why the hash (and the table gather it feeds) can be hoisted to the
start of a step.  The pieces:

* host side, once per model build:
    - ``engram_primes``      one prime modulus per (layer, n-gram order, head)
    - ``engram_offsets``     where each head's slice starts in the layer table
    - ``engram_table_rows``  rows of a layer's table (= engram_num_embeddings)
    - ``engram_multipliers`` odd int64 multipliers per layer, from numpy's RNG
    - ``build_compressed_token_map``  tokenizer id -> compressed (normalised) id; the
      normalisation is `tokenizers`' own normalizers in the reference's order
      (``engram_normalizer``); what the library has no step for is written here: the key rule
      (U+FFFD texts keep their raw token string, an empty result keeps the original text) and
      the first-appearance numbering
* device side, every step (plain torch int64 ops, static shapes):
    - ``engram_prefill_history`` / ``engram_roll_history``  the previous N-1
      compressed ids of each token, padded at the sequence start
    - ``engram_hash_ids``    table row ids [..., n_layers, (N-1)*heads]; defined in
      custom_ops/reference.py (the engram_hash op's reference), re-exported here

All conventions below were checked bit-for-bit against the golden vectors in
shared/golden/golden_v41_tiny (see tests/test_engram_hash.py).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import numpy as np
import torch

from v41graph.custom_ops.reference import engram_hash_ids  # the hash itself (the op's reference)

__all__ = [
    "is_prime",
    "engram_primes",
    "engram_offsets",
    "engram_table_rows",
    "engram_multipliers",
    "engram_hash_params",
    "engram_normalizer",
    "normalize_token_text",
    "tokenizer_token_texts",
    "build_compressed_token_map",
    "engram_prefill_history",
    "engram_roll_history",
    "engram_hash_ids",
]


# --------------------------------------------------------------------------
# Primes
# --------------------------------------------------------------------------

# With these 12 bases Miller-Rabin is exact for every n < 3.3e24 (far beyond
# any table size), so no probabilistic caveat and no sympy dependency.
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Deterministic primality test (exact for n < 3.3e24)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    # n - 1 = d * 2^s with d odd
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x == 1 or x == n - 1:
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(
    vocab_size_start: int, layer_ids: Sequence[int], max_ngram: int, n_heads: int
) -> list[list[list[int]]]:
    """Prime moduli, indexed [engram layer][order n-2][head].

    The reference's "search start" is ``vocab_size_start - 1`` and it returns
    the first prime STRICTLY above the start, i.e. the search effectively
    begins at ``vocab_size_start`` itself (37 -> 37 in the tiny golden).  Each
    order restarts the search from that same point, but a single "seen" set
    shared by all layers and orders forbids reuse, so in practice the result is
    just the consecutive primes >= vocab_size_start handed out in
    (layer, order, head) order.  We keep the literal restart-and-skip
    procedure anyway so that it stays right should the per-order start ever
    differ.
    """
    seen: set[int] = set()
    out: list[list[list[int]]] = []
    for _layer in layer_ids:
        per_order: list[list[int]] = []
        for _n in range(2, max_ngram + 1):
            start = vocab_size_start - 1
            heads: list[int] = []
            for _h in range(n_heads):
                cand = start + 1
                while cand in seen or not is_prime(cand):
                    cand += 1
                seen.add(cand)
                heads.append(cand)
                start = cand
            per_order.append(heads)
        out.append(per_order)
    return out


def _flatten(primes_of_layer) -> list[int]:
    # Accept [order][head] nested lists (what engram_primes gives per layer)
    # or an already-flat list.
    flat: list[int] = []
    for item in primes_of_layer:
        if isinstance(item, (list, tuple)):
            flat.extend(int(p) for p in item)
        else:
            flat.append(int(item))
    return flat


def engram_offsets(primes_of_layer) -> list[int]:
    """Exclusive cumsum of the layer's primes, flattened order-major (n=2 heads
    first): head j of the flattened list owns rows [off[j], off[j] + p[j])."""
    offsets, acc = [], 0
    for p in _flatten(primes_of_layer):
        offsets.append(acc)
        acc += p
    return offsets


def engram_table_rows(primes_of_layer) -> int:
    """Number of rows in the layer's table (= config engram_num_embeddings[l])."""
    return sum(_flatten(primes_of_layer))


# --------------------------------------------------------------------------
# Multipliers
# --------------------------------------------------------------------------

_LAYER_SEED_PRIME = 10007


def engram_multipliers(layer_id: int, compressed_vocab_size: int, max_ngram: int) -> list[int]:
    """Odd multipliers m_k, k = 0..max_ngram-1, for one Engram layer.

    The bound keeps id * m inside int64 (ids < compressed_vocab_size and
    m <= int64max // compressed_vocab_size), so the products never wrap.
    Exact draw (one vectorised call, reproduces io.safetensors bit for bit):
    ``default_rng(10007 * layer_id).integers(0, half, size=(max_ngram,), dtype=np.int64)``
    then ``2 * r + 1``.  The reference adds a base seed of 0.
    """
    int64_max = np.iinfo(np.int64).max
    half = max(1, (int64_max // int(compressed_vocab_size)) // 2)
    rng = np.random.default_rng(_LAYER_SEED_PRIME * int(layer_id))
    r = rng.integers(low=0, high=half, size=(max_ngram,), dtype=np.int64)
    return [int(v) for v in (r * 2 + 1)]


def engram_hash_params(
    layer_ids: Sequence[int],
    max_ngram: int,
    n_heads: int,
    vocab_size_start: int,
    compressed_vocab_size: int,
) -> dict[str, torch.Tensor]:
    """All host-side constants as int64 tensors, shaped like io.safetensors:
    multipliers [L, N], primes [L, N-1, H], offsets [L, (N-1)*H],
    table_rows [L]."""
    primes = engram_primes(vocab_size_start, layer_ids, max_ngram, n_heads)
    return {
        "multipliers": torch.tensor(
            [engram_multipliers(l, compressed_vocab_size, max_ngram) for l in layer_ids],
            dtype=torch.int64,
        ),
        "primes": torch.tensor(primes, dtype=torch.int64),
        "offsets": torch.tensor([engram_offsets(p) for p in primes], dtype=torch.int64),
        "table_rows": torch.tensor([engram_table_rows(p) for p in primes], dtype=torch.int64),
    }


# --------------------------------------------------------------------------
# Compressed token map
# --------------------------------------------------------------------------

_SENTINEL = "\ue000"          # private-use char the reference uses to protect a lone " " from Strip
_REPLACEMENT_CHAR = "\ufffd"


@functools.cache
def engram_normalizer():
    """The reference's normalizer chain, built from `tokenizers`' own normalizers as the
    reference builds it: NFKC -> NFD -> StripAccents -> Lowercase -> collapse [ \\t\\r\\n]+ to
    " " -> a string that is exactly " " becomes the sentinel -> Strip -> sentinel back to " ".
    (The library itself, not a re-implementation: its Unicode tables, e.g. which characters are
    marks, are not Python's unicodedata ones, and the reference's map follows the library.)"""
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_SENTINEL, " "),
    ])


def normalize_token_text(text: str) -> str:
    """One token text through the reference chain (`engram_normalizer`). Net effect: a
    whitespace-only token like "  " or "\\n" normalises to " " (not to ""), " the" -> "the"."""
    return engram_normalizer().normalize_str(text)


def tokenizer_token_texts(tokenizer, vocab_size: int) -> tuple[list[str], list[str]]:
    """(texts, raw) of token ids 0..vocab_size-1 from a `tokenizers.Tokenizer`, as the reference
    reads its tokenizer: texts[i] = decode([i]) with special tokens kept, raw[i] the vocabulary
    string. Ids past the tokenizer's vocabulary (a model vocabulary padded beyond it) get ""."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = [tokenizer.decode([i], skip_special_tokens=False) if i < size else "" for i in range(vocab_size)]
    raw = [(tokenizer.id_to_token(i) or "") if i < size else "" for i in range(vocab_size)]
    return texts, raw


def build_compressed_token_map(
    texts: Sequence[str], raw_tokens: Optional[Sequence[str]] = None
) -> tuple[torch.Tensor, int]:
    """Map tokenizer id -> compressed id; returns (map LongTensor[V], size).

    texts[i] is the decoded text of token i (skip_special_tokens=False);
    raw_tokens[i] its raw vocabulary string.  Key per token:
      * decoded text contains U+FFFD (a partial UTF-8 byte token): the raw
        token string, so distinct byte tokens stay distinct;
      * otherwise the normalised text, or the original text if normalising
        leaves nothing (e.g. a lone combining mark).
    Equal keys share an id; ids are assigned in first-appearance order over
    token ids 0..V-1.  The pad's compressed id is simply map[pad_id].
    """
    key_to_id: dict[str, int] = {}
    ids: list[int] = []
    for i, text in enumerate(texts):
        if _REPLACEMENT_CHAR in text:
            if raw_tokens is None:
                raise ValueError(
                    f"token {i} decodes to U+FFFD; its raw token string is needed (raw_tokens)"
                )
            key = raw_tokens[i]
        else:
            key = normalize_token_text(text) or text
        ids.append(key_to_id.setdefault(key, len(key_to_id)))
    return torch.tensor(ids, dtype=torch.int64), len(key_to_id)


# --------------------------------------------------------------------------
# Device-side hash
# --------------------------------------------------------------------------
# History convention: history[..., j] is the compressed id of the token j+1
# positions back (j = 0: the previous token), with the pad's compressed id
# where that position is before the sequence start.  One row per token, so a
# flat decode batch of tokens from different sequences is just
# compressed_ids [num_tokens] + history [num_tokens, N-1].


def engram_prefill_history(
    compressed_ids: torch.Tensor, pad_compressed_id: int, max_ngram: int
) -> torch.Tensor:
    """History [..., T, N-1] for sequences [..., T] that start at position 0."""
    t = compressed_ids.shape[-1]
    lead = compressed_ids.shape[:-1]
    pad = compressed_ids.new_full((*lead, max_ngram - 1), int(pad_compressed_id))
    padded = torch.cat([pad, compressed_ids], dim=-1)  # [..., N-1+T]
    # back k (k = 1..N-1) of token t sits at padded index (N-1) + t - k.
    cols = [padded[..., max_ngram - 1 - k : max_ngram - 1 - k + t] for k in range(1, max_ngram)]
    return torch.stack(cols, dim=-1)


def engram_roll_history(
    history: torch.Tensor, compressed_ids: torch.Tensor
) -> torch.Tensor:
    """History of the NEXT token, given this token's id and history:
    shift by one and put the current token in slot 0."""
    return torch.cat([compressed_ids.unsqueeze(-1), history[..., :-1]], dim=-1)
