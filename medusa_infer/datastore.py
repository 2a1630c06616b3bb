"""A datastore of the model's own answers, searched like prompt lookup (retrieval drafts, as in REST).

Prompt lookup copies continuations from the text at hand; a datastore copies them from text the
model wrote before. Self-distillation already produces that text: the model's answers to the
training prompts. A small model answers in recurring phrases ("Here are some", "I'm sorry, but",
list and code scaffolding), so on Spec-Bench questions its own earlier answers predict what it
writes next where the prompt does not.

The store is a token array of sequences separated by ``SEPARATOR``. For each n-gram length
``min_ngram..max_ngram`` it keeps every position's n-gram hash, sorted (built on the first lookup),
so a lookup is a binary search; hash collisions are removed by comparing the tokens. A match
proposes the continuation shared by most of the n-gram's (latest ``max_occurrences``) occurrences,
token by token (REST's trie walk, done lazily): the first token is the most frequent next token;
each later one is the most frequent among the occurrences that agreed with the draft so far, and
the draft stops when its share of them falls below ``min_share``.

Drafts are deterministic, so they are verified like any candidate: greedy stays exact and
lossless sampling stays lossless. The store lives with the heads as ``datastore.safetensors``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

DATASTORE_NAME = "datastore.safetensors"
SEPARATOR = -1
_MODULUS = 2_147_483_647  # a prime: (h * _BASE + token) stays inside int64
MAX_NGRAM = 64  # an index is built per n-gram length on first use, 16 bytes per stored token each
_SAVED_SETTINGS = ("min_ngram", "max_ngram", "max_occurrences", "min_share")  # what save writes, load reads
_BASE = 1_000_003
#: what a stale store's refusal at load advises (``Datastore.check_tokenizer``, ``check_vocabulary``)
STALE_STORE_FIX = ("; rebuild it with `python -m medusa_train.datastore` or delete it (--no-datastore, or "
                   "from_pretrained's datastore=False, leaves it unread)")


def tokenizer_digest(tokenizer: Any, below: int | None = None) -> str:
    """A fingerprint of a tokenizer's vocabulary (every token and its id; ``below``: those of the ids below it),
    which a datastore records. Tokens held as bytes (tiktoken-based tokenizers: Qwen v1's, HunYuan's) enter as
    their hex."""
    vocab = sorted(((token.hex() if isinstance(token, (bytes, bytearray)) else token, index)
                    for token, index in tokenizer.get_vocab().items() if below is None or index < below),
                   key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:32]


def tokenizer_ids(tokenizer: Any) -> int:
    """One more than a tokenizer's highest id: what a datastore records beside ``tokenizer_digest``, so that a
    tokenizer that only adds tokens (a pad token for batches) still takes the store."""
    return max(tokenizer.get_vocab().values(), default=-1) + 1


class DatastoreMatch(NamedTuple):
    """A store's draft for one history.

    Attributes:
        n: length of the matched suffix (0: no match).
        draft: the proposed continuation.
        occurrences: how many occurrences of the suffix voted on the draft's first token.
        share: the share of them whose next token is the draft's first.
    """

    n: int
    draft: list[int]
    occurrences: int = 0
    share: float = 0.0

    def confidence(self) -> str:
        """The draft's confidence class, by how its first token was voted for: ``"single"`` (one
        occurrence), ``"low"`` (share < 0.5), ``"mid"`` (< 0.8) or ``"high"``. Acceptance differs
        several-fold between these classes at the same ``n`` (on SmolLM2's greedy answers to 40
        Spec-Bench questions, the first token was right 13-20% of the time for "low" drafts and
        45-85% for "high" ones; ``scripts/datastore_confidence.py``), so the lookup gate measures
        each class separately. Shares of few occurrences are coarse: two that agree are "high",
        two that differ "mid"."""
        if self.occurrences <= 1:
            return "single"
        return "low" if self.share < 0.5 else "mid" if self.share < 0.8 else "high"


def ngram_hash(tokens: Sequence[int], modulus: int = _MODULUS) -> int:
    """The hash the index sorts by, of one n-gram (Python side, for queries)."""
    h = 0
    for token in tokens:
        h = (h * _BASE + token + 1) % modulus
    return h


class Datastore:
    """Token sequences indexed by their n-grams.

    Args:
        tokens: ``[N]`` token ids, sequences separated by ``SEPARATOR`` (use ``from_sequences``).
        min_ngram, max_ngram: the n-gram lengths searched, longest first.
        max_occurrences: occurrences of an n-gram that vote on its continuation (the latest).
        min_share: a draft continues while its next token is that of at least this share of the
            occurrences still agreeing with it.
        modulus: the hash modulus (tests use a tiny one to force collisions).
        tokenizer: ``tokenizer_digest`` of the tokenizer the tokens come from (saved with them;
            ``from_pretrained`` refuses the store on a model of another tokenizer), or None.
        tokenizer_size: that tokenizer's ``tokenizer_ids`` (saved with them; the digest is compared over
            the ids below it, so that tokens added since pass), or None: not recorded (all ids compared).
        origin: where the text comes from, in words (saved with it; the model card says it: the
            folder's readers can decode the text), or None: not recorded.
    """

    def __init__(self, tokens: torch.Tensor, min_ngram: int = 2, max_ngram: int = 6,
                 max_occurrences: int = 256, min_share: float = 0.3, modulus: int = _MODULUS,
                 tokenizer: str | None = None, origin: str | None = None, tokenizer_size: int | None = None
                 ) -> None:
        if not 1 <= min_ngram <= max_ngram <= MAX_NGRAM:
            raise ValueError(f"a datastore needs 1 <= min_ngram <= max_ngram <= {MAX_NGRAM}, got {min_ngram} and "
                             f"{max_ngram}")
        if not 0.0 < min_share <= 1.0:
            raise ValueError(f"min_share must lie in (0, 1], got {min_share}")
        if max_occurrences < 1:
            raise ValueError(f"max_occurrences must be >= 1, got {max_occurrences}")
        if not 2 <= modulus <= _MODULUS:  # larger moduli would overflow the int64 hashes
            raise ValueError(f"modulus must lie in [2, {_MODULUS}], got {modulus}")
        tokens = torch.as_tensor(tokens, dtype=torch.long).flatten()
        if len(tokens) and int(tokens.min()) < SEPARATOR:
            raise ValueError(f"datastore tokens must be ids >= 0 or the separator {SEPARATOR}")
        if not len(tokens) or int(tokens[-1]) != SEPARATOR:  # every draft then stops inside the array
            tokens = torch.cat([tokens, torch.tensor([SEPARATOR])])
        self.tokens = tokens
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.max_occurrences, self.min_share, self.modulus = max_occurrences, min_share, modulus
        self.tokenizer = tokenizer  # tokenizer_digest of the tokenizer the tokens come from, when known
        self.tokenizer_size = tokenizer_size  # its tokenizer_ids, when known
        self.origin = origin
        self._list = tokens.tolist()  # drafts read single tokens: list indexing beats tensor indexing
        self._largest = int(tokens.max())  # the highest id (the separator where none), checked per proposer
        self._index: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # built on first use

    @classmethod
    def from_sequences(cls, sequences: Iterable[Sequence[int]], **kwargs) -> "Datastore":
        """A store of ``sequences`` (token id lists), each followed by a separator."""
        flat: list[int] = []
        for sequence in sequences:
            flat.extend(int(t) for t in sequence)
            flat.append(SEPARATOR)
        return cls(torch.tensor(flat, dtype=torch.long), **kwargs)

    def _build(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Per n-gram length of ``min_ngram..max_ngram``, ``(sorted hashes, ends)``: for every n-gram followed
        by a token of its sequence, its hash (``ngram_hash``) and the position after it. Each length's
        hashes roll from the shorter one's (one multiply-add per position: hashing every window afresh cost
        O(n) per position, 23 s for the first lookup of a 357k-token store at max_ngram 64)."""
        tokens, empty = self.tokens, torch.empty(0, dtype=torch.long)
        index = {}
        # for n-grams ending before position e = n..len: their hash, and whether they hold no separator
        h, whole = tokens + 1, tokens != SEPARATOR
        for n in range(1, self.max_ngram + 1):
            if n > 1:
                h = (h[:-1] * _BASE + tokens[n - 1 :] + 1) % self.modulus
                whole = whole[:-1] & (tokens[n - 1 :] != SEPARATOR)
            if n < self.min_ngram:
                continue
            if len(tokens) <= n:
                index[n] = (empty, empty)
                continue
            ends = torch.arange(n, len(tokens))
            clean = whole[:-1] & (tokens[n:] != SEPARATOR)  # a continuation exists
            keys, ends = h[:-1][clean], ends[clean]
            order = torch.sort(keys, stable=True).indices  # stable: equal hashes stay in text order
            index[n] = (keys[order], ends[order])
        return index

    def __len__(self) -> int:
        """Tokens stored (separators excluded)."""
        return int((self.tokens != SEPARATOR).sum())

    def occurrences(self, ngram: Sequence[int], last: int | None = None) -> list[int]:
        """Positions right after each occurrence of ``ngram`` (with a continuation), in text order;
        with ``last``, only the last ``last`` of them."""
        n = len(ngram)
        if not self.min_ngram <= n <= self.max_ngram:
            raise ValueError(f"this datastore indexes n-grams of {self.min_ngram}..{self.max_ngram} tokens, not {n}")
        if self._index is None:
            self._index = self._build()
        keys, ends = self._index[n]
        key = ngram_hash(ngram, self.modulus)
        lo = int(torch.searchsorted(keys, key, side="left"))
        hi = int(torch.searchsorted(keys, key, side="right"))
        wanted, found = list(ngram), []
        for end in reversed(ends[lo:hi].tolist()):  # latest first; colliding hashes are skipped
            if self._list[end - n : end] == wanted:
                found.append(end)
                if last is not None and len(found) == last:
                    break
        return found[::-1]

    def match(self, history: Sequence[int], limit: int) -> DatastoreMatch:
        """Up to ``limit`` tokens continuing the longest suffix of ``history`` (``max_ngram`` down
        to ``min_ngram`` tokens) found in the store, with the vote behind the first token;
        ``DatastoreMatch(0, [])`` if none."""
        if limit <= 0:
            return DatastoreMatch(0, [])
        for n in range(min(self.max_ngram, len(history)), self.min_ngram - 1, -1):
            found = self.occurrences(history[len(history) - n :], last=self.max_occurrences)
            if found:
                return self._continue(n, found, limit)
        return DatastoreMatch(0, [])

    def _continue(self, n: int, live: list[int], limit: int) -> DatastoreMatch:
        tokens, draft = self._list, []
        occurrences, share = len(live), 0.0
        for step in range(limit):
            counts: dict[int, int] = {}
            for end in reversed(live):  # latest first: a tie goes to the latest occurrence's token
                token = tokens[end + step]
                if token != SEPARATOR:
                    counts[token] = counts.get(token, 0) + 1
            if not counts:
                break
            best = max(counts, key=counts.__getitem__)  # the first of the most frequent
            if step and counts[best] < self.min_share * len(live):
                break
            if not step:
                share = counts[best] / len(live)
            draft.append(best)
            live = [end for end in live if tokens[end + step] == best]
        return DatastoreMatch(n, draft, occurrences, share)  # indexed n-grams all have a next token

    # ------------------------------------------------------------------ files

    def check_tokenizer(self, tokenizer: Any, where: str | Path, fix: str = STALE_STORE_FIX) -> None:
        """``ValueError`` when the store records a tokenizer (``tokenizer_digest``) other than ``tokenizer``:
        its ids would stand for other text, and its drafts would never be accepted (``fix``: what to do, the
        message's end)."""
        if self.tokenizer is not None and tokenizer is not None and tokenizer_digest(
                tokenizer, self.tokenizer_size) != self.tokenizer:
            raise ValueError(f"{where} was built with another tokenizer than this model's: its token ids stand for "
                             "other text (or, for a store that records no tokenizer size, tokens were added since)"
                             f"{fix}")

    def check_vocabulary(self, vocab_size: int, where: str | Path, fix: str = STALE_STORE_FIX) -> None:
        """``ValueError`` when the store holds a token id outside a vocabulary of ``vocab_size``: it was built
        with another tokenizer (and its drafts would fail in the model's embedding)."""
        largest = self._largest
        if largest >= vocab_size:
            raise ValueError(f"{where} holds token id {largest}, outside this model's vocabulary of {vocab_size}: "
                             f"it was built with another tokenizer{fix}")

    def save(self, path: str | Path) -> Path:
        """Write the tokens and settings to ``path`` (safetensors)."""
        path = Path(path)
        settings = {name: getattr(self, name) for name in _SAVED_SETTINGS}
        # one metadata key: safetensors writes the map in random order, and the same store must give the
        # same bytes (a Hub upload of unchanged heads sent it again); the tokenizer digest is a tensor of
        # its own (its bytes), which earlier releases leave unread
        tensors = {"tokens": self.tokens.to(torch.int32).contiguous()}
        for name, text in (("tokenizer", self.tokenizer), ("origin", self.origin)):
            if text is not None:  # tensors of their own (their bytes), as the tokenizer digest
                tensors[name] = torch.tensor(list(text.encode()), dtype=torch.uint8)
        if self.tokenizer_size is not None:
            tensors["tokenizer_size"] = torch.tensor([self.tokenizer_size], dtype=torch.int64)
        partial = path.with_name(path.name + ".partial")  # then moved into place: a write cut short (a killed
        # build) had left a store that stopped the whole heads folder from loading
        save_file(tensors, str(partial), metadata={"settings": json.dumps(settings, sort_keys=True)})
        os.replace(partial, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Datastore":
        """Read a store written by ``save`` (the index is rebuilt: a second or so per million tokens)."""
        from safetensors import safe_open

        path = Path(path)
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
            settings = json.loads(metadata.get("settings", "{}"))
            tensors = load_file(str(path))
            digest = tensors.get("tokenizer")  # a metadata key of its own before, and for a while one of settings'
            legacy = settings.pop("tokenizer", None) if isinstance(settings, dict) else None
            tokenizer = bytes(digest.tolist()).decode() if digest is not None else (
                metadata.get("tokenizer") or (legacy if isinstance(legacy, str) else None))
            size = tensors.get("tokenizer_size")
            size = int(size.reshape(-1)[0]) if size is not None and size.numel() == 1 else None
            origin = bytes(tensors["origin"].tolist()).decode() if "origin" in tensors else None
            tokens = tensors["tokens"]
            if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
                raise TypeError(f"its tokens are a {tokens.dim()}-d {tokens.dtype} tensor, not 1-d integer ids")
            if not isinstance(settings, dict) or any(isinstance(v, bool) or not isinstance(v, int)
                                                     for k, v in settings.items() if k != "min_share"):
                raise TypeError(f"its settings {settings} are not whole numbers")
            unknown = sorted(set(settings) - set(_SAVED_SETTINGS))
            if unknown:  # (the hash modulus among them: a store's hashes are rebuilt with the default one)
                raise KeyError(f"settings {unknown}, which no save writes")
            return cls(tokens.long(), **settings, tokenizer=tokenizer, origin=origin, tokenizer_size=size)
        except (SafetensorError, OSError, KeyError, TypeError, ValueError, UnicodeDecodeError) as err:
            raise ValueError(f"{path} is not a readable datastore ({err}); rebuild it with "
                             "`python -m medusa_train.datastore`, or delete it (--no-datastore, or from_pretrained's "
                             "datastore=False, leaves it unread)"
                             ) from err
