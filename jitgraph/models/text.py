"""Text for language-model training, model-agnostic: the corpus, the held-out byte split, a
byte-level vocabulary, and random contiguous token windows.

The split is perplexity's convention (jitgraph.models.perplexity.split_text): the file's bytes
are cut at byte int(0.9 * size); the first 90 % train, the last 10 % ("tail:0.1") are held out.
Each part is tokenized on its own, without BOS (the tokenizer's space prefix applies, as
llama.cpp's tokenizer does to any text). A training example is a window of ctx + 1 consecutive
tokens at a random start: tokens window[:-1], labels window[1:] (next-token prediction).
Training windows come from the first part only, validation windows from the held-out part only.

The corpus shipped with the package (jitgraph/models/data/tinyshakespeare_head.txt, see the
README there) is what `jitgraph train llama` uses without --text.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

__all__ = ["HELD_OUT", "shipped_corpus", "read_corpus", "split_bytes", "byte_vocab",
           "TokenSplit", "tokenize_split", "Windows", "WindowSampler", "fixed_starts",
           "StridedWindows", "llama_split"]

HELD_OUT = 0.1                        # the tail fraction of the bytes held out for validation
_SHIPPED = "tinyshakespeare_head.txt"


def shipped_corpus() -> str:
    """Path of the public-domain corpus shipped with the package (a slice of tiny
    shakespeare, 262,063 bytes)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", _SHIPPED)


def read_corpus(path=None) -> bytes:
    """The bytes of `path`, or of the shipped corpus when `path` is None."""
    with open(shipped_corpus() if path is None else os.fspath(path), "rb") as f:
        return f.read()


def split_bytes(data: bytes, held_out: float = HELD_OUT) -> tuple:
    """(head, tail): the bytes cut at int((1 - held_out) * size), as perplexity's "head:F" and
    "tail:F" splits (the same function cuts them)."""
    from .perplexity import split_text
    spec = f"{float(held_out)!r}"
    return (split_text(data, f"head:{spec}", errors=None),
            split_text(data, f"tail:{spec}", errors=None))


def byte_vocab():
    """A byte-level llama (SPM) vocabulary that llama.cpp loads and whose tokens round-trip
    through llama.cpp's own tokenizer: <unk> <s> </s>, the 256 byte tokens <0x00>..<0xFF>,
    "\u2581" (SentencePiece's space) and the 94 printable ASCII characters other than space as
    one-character tokens (354 tokens). No two tokens concatenate into a token, so the SPM
    algorithm merges nothing: every byte of a text is one token (a space is "\u2581", a printable
    ASCII byte its character, any other byte its <0xXX> byte-fallback token), plus the leading
    "\u2581" that llama.cpp's space prefix adds."""
    from .tokenizer import BYTE, CONTROL, NORMAL, SPACE, UNKNOWN, Tokenizer
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [SPACE] + \
        [chr(c) for c in range(0x21, 0x7F)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * 95
    return Tokenizer(tokens, [0.0] * len(tokens), types, bos_id=1, eos_id=2, unk_id=0)


@dataclass
class TokenSplit:
    """The token streams of the two parts of a text (int32), and the byte where it was cut."""
    train: np.ndarray
    val: np.ndarray
    cut: int
    size: int                          # bytes of the whole text


def tokenize_split(data: bytes, tokenizer, held_out: float = HELD_OUT) -> TokenSplit:
    """Cut `data` (bytes) with split_bytes and tokenize each part without BOS."""
    head, tail = split_bytes(bytes(data), held_out)

    def ids(part):
        return np.asarray(tokenizer.encode(part, bos=False) if part else [], np.int32)

    return TokenSplit(ids(head), ids(tail), len(head), len(data))


class Windows:
    """Windows of `length` consecutive tokens of a token stream: window i starts at token i,
    for i in [0, n_starts)."""

    def __init__(self, tokens, length: int, what: str = "text"):
        self.tokens = np.ascontiguousarray(tokens, np.int32)
        self.length = int(length)
        if self.length < 2:
            raise ValueError(f"windows: length {length} must be >= 2 (tokens and their next "
                             f"tokens)")
        if len(self.tokens) < self.length:
            raise ValueError(f"the {what} has {len(self.tokens)} tokens, fewer than one window of "
                             f"{self.length} (ctx {self.length - 1} + 1)")
        self.n_starts = len(self.tokens) - self.length + 1
        self._offsets = np.arange(self.length)

    def starts(self, rng, n: int) -> np.ndarray:
        """`n` random window starts drawn from `rng` (uniform over every start)."""
        return rng.integers(0, self.n_starts, size=int(n))

    def batch(self, starts) -> tuple:
        """(tokens, labels) int32 [len(starts), length - 1]: each window but its last token, and
        each window shifted by one."""
        w = self.tokens[np.asarray(starts)[:, None] + self._offsets]
        return np.ascontiguousarray(w[:, :-1]), np.ascontiguousarray(w[:, 1:])


class WindowSampler:
    """Random batches of training windows from one numpy PCG64 stream; `state` (JSON-able) is
    what a checkpoint saves to continue the same sequence of batches."""

    def __init__(self, windows: Windows, batch: int, seed: int = 0):
        self.windows, self.batch_size = windows, int(batch)
        self.rng = np.random.default_rng([int(seed), 0])

    def next_starts(self) -> np.ndarray:
        return self.windows.starts(self.rng, self.batch_size)

    def next(self) -> tuple:
        return self.windows.batch(self.next_starts())

    @property
    def state(self) -> dict:
        return self.rng.bit_generator.state

    @state.setter
    def state(self, value: dict) -> None:
        self.rng.bit_generator.state = value


def fixed_starts(windows: Windows, batch: int, n_batches: int, seed: int = 0) -> np.ndarray:
    """[n_batches, batch] window starts chosen once from `seed` (a stream of its own, not the
    training sampler's): the same validation windows at every evaluation of a run."""
    rng = np.random.default_rng([int(seed), 1])
    return windows.starts(rng, int(n_batches) * int(batch)).reshape(int(n_batches), int(batch))


class _Rows:
    """Row view of a StridedWindows data set: `rows[idx]` -> int32 [len(idx), ctx], the windows
    `idx` shifted by `shift` tokens (0: the inputs, 1: the labels), gathered on demand."""

    def __init__(self, windows, shift):
        self.w, self.shift = windows, shift

    def __getitem__(self, idx):
        starts = self.w.starts[np.asarray(idx)]
        return np.ascontiguousarray(self.w.tokens[starts[:, None] + self.shift + self.w.offsets])

    def __len__(self):
        return len(self.w)


class StridedWindows:
    """llama.cpp's training data set (common_opt_dataset_init): window i holds the tokens
    [i*stride, i*stride + ctx) and its labels the next ones, [i*stride + 1, i*stride + ctx + 1),
    for i < (n_tokens - ctx - 1) // stride; the stride is ctx / 2 by default (llama-finetune's).
    `x` and `y` index like arrays (jitgraph.training.fit's data set), gathered on demand."""

    def __init__(self, tokens, ctx: int, stride: int | None = None, what: str = "text"):
        self.tokens = np.ascontiguousarray(tokens, np.int32)
        self.ctx = int(ctx)
        self.stride = int(stride) if stride is not None else max(1, self.ctx // 2)
        if self.ctx < 1 or self.stride < 1:
            raise ValueError(f"windows: ctx {ctx} and stride {stride} must be >= 1")
        n = (len(self.tokens) - self.ctx - 1) // self.stride
        if n < 1:
            raise ValueError(f"the {what} has {len(self.tokens)} tokens: no window of ctx "
                             f"{self.ctx} at stride {self.stride} (llama.cpp's count "
                             f"(tokens - ctx - 1) // stride needs >= {self.ctx + 1 + self.stride} "
                             f"tokens); use a smaller --ctx or a longer text")
        self.starts = np.arange(n, dtype=np.int64) * self.stride
        self.offsets = np.arange(self.ctx)
        self.x, self.y = _Rows(self, 0), _Rows(self, 1)

    def __len__(self):
        return len(self.starts)


def llama_split(n: int, val_split: float) -> int:
    """Windows that train of `n` (llama-finetune's idata_split = ndata * (1.0f - val_split), in
    float32 as it computes it): the first ones train, the last fraction validates."""
    return int(np.float32(n) * (np.float32(1.0) - np.float32(val_split)))
