"""llama.cpp's SentencePiece-style ("SPM", GGUF `tokenizer.ggml.model = "llama"`) tokenizer, token
for token, and a small vocabulary builder for models trained from scratch in the same format.

Encoding follows llama.cpp (src/llama-vocab.cpp: llama_vocab::impl::tokenize, llm_tokenizer_spm):
  - user-defined tokens (token type 4) are split out of the text first, longest first; control and
    unknown tokens only when `special=True` (llama.cpp's parse_special);
  - each remaining text fragment that follows the start or a special token gets a leading space
    (add_space_prefix, on by default for SPM), then every " " becomes "\u2581" (U+2581);
  - the fragment is split into UTF-8 characters and adjacent symbols are merged, best-scored pair
    first (ties: leftmost), as long as the concatenation is a token of the vocabulary;
  - a final symbol that is not a token is emitted as its bytes' <0xXX> tokens (byte fallback);
  - BOS in front (encode(bos=True)); empty text gives just [BOS].
Decoding follows llama_token_to_piece: normal tokens with "\u2581" -> " ", byte tokens as their
byte, control and unknown tokens as nothing (their text with special=True); the leading space that
encoding added is removed again, so decode(encode(text)) == text whenever every character of
`text` is covered by the vocabulary or by byte tokens.

Token attributes (which tokens are special, phi-3's space stripping) are set as llama.cpp's loader
sets them (jitgraph.models.bpe.token_attrs). load_tokenizer / Tokenizer.from_metadata give this
class for "llama" vocabularies and jitgraph.models.bpe.BpeTokenizer for "gpt2" ones.
"""
from __future__ import annotations

import heapq
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from .merging import merge_adjacent
from .special_tokens import (A_BYTE, A_CONTROL, A_NORMAL, A_UNKNOWN, A_USER, SpecialTokens,
                             check_metadata, fim_given, token_attrs)

SPACE = "\u2581"          # SentencePiece's visible space, "▁"
SPACE_BYTES = SPACE.encode("utf-8")

# llama.cpp's llama_token_type (the values of tokenizer.ggml.token_type)
UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(7)
_BYTE_TOKEN = re.compile(rb"<0x([0-9A-Fa-f]{2})>")

# GGUF metadata keys
TOKENIZERS = ("llama", "gpt2")   # the tokenizer.ggml.model values jitgraph reads: SPM, BPE
K_MODEL, K_TOKENS, K_SCORES, K_TYPES = ("tokenizer.ggml.model", "tokenizer.ggml.tokens",
                                        "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
K_BOS, K_EOS, K_UNK, K_PAD = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                              "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id")
K_ADD_BOS, K_ADD_EOS, K_ADD_SPACE = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
                                     "tokenizer.ggml.add_space_prefix")


def _utf8_len(lead: int) -> int:
    """llama.cpp's unicode_len_utf8: the length a lead byte announces (1 for continuation bytes)."""
    return (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)[lead >> 4]


def _f32(x) -> float:
    return float(np.float32(x))


_NO_MERGE = float("inf")        # the priority of a pair that is no token


@dataclass
class Tokenizer:
    """A llama (SPM) vocabulary: token texts (str), scores and llama token types, one per id."""
    tokens: list
    scores: list
    types: list
    bos_id: int | None = 1
    eos_id: int | None = 2
    unk_id: int | None = 0
    pad_id: int | None = None
    add_bos: bool = True
    add_eos: bool = False
    add_space_prefix: bool = True
    name: str | None = None                  # general.name (phi-3's special tokens strip spaces)
    fim_ids: frozenset = frozenset()         # fill-in-the-middle kinds the metadata gives ids of
    _ids: dict = field(init=False, repr=False)

    def __post_init__(self):
        n = len(self.tokens)
        if not (len(self.scores) == len(self.types) == n) or n == 0:
            raise ValueError(f"tokenizer: {n} tokens, {len(self.scores)} scores and "
                             f"{len(self.types)} token types; need one of each per token")
        self.tokens = [str(t) for t in self.tokens]
        self.scores = [_f32(s) for s in self.scores]
        self.types = [int(t) for t in self.types]
        for name in ("bos_id", "eos_id", "unk_id", "pad_id"):  # llama.cpp: out of range = none
            v = getattr(self, name)
            if v is not None and not 0 <= int(v) < n:
                v = None
            setattr(self, name, None if v is None else int(v))
        # the byte strings llama.cpp matches on; an empty token reads as "[EMPTY_<id>]"; with
        # duplicate texts the last id wins (token_to_id[word] = i)
        self._text = [(t or f"[EMPTY_{i}]").encode("utf-8", "surrogatepass")
                      for i, t in enumerate(self.tokens)]
        self._ids = {t: i for i, t in enumerate(self._text)}
        self.attrs = token_attrs({t: i for i, t in enumerate(self.tokens)}, self.types,
                                 self.fim_ids, None, self.name)
        self._special = SpecialTokens(self.tokens, self.attrs)
        self._pieces = [self._piece(i) for i in range(n)]
        # the characters some token holds right before a "\u2581": text may be cut in front of
        # any other "\u2581", since no merge can then join across the cut (see _spm_words)
        before = set()
        for t in self._text:
            k = t.find(SPACE_BYTES, 1)
            while k > 0:
                c = t[:k].decode("utf-8", "replace")[-1:]
                before.add(c)
                k = t.find(SPACE_BYTES, k + 1)
        self._before_space = before
        self._cache = {}
        self._ids_str = {t.decode("utf-8", "surrogatepass"): i for t, i in self._ids.items()}
        self._byte_ids = [None] * 256                # byte -> its fallback token (lazily)

    # ---- GGUF metadata ---------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path_or_reader):
        """From a GGUF file (a path or a gguf.GGUFReader): this SPM class for
        tokenizer.ggml.model = "llama", jitgraph.models.bpe.BpeTokenizer for "gpt2"."""
        import gguf
        r = path_or_reader
        if isinstance(r, gguf.GGUFReader):
            return cls.from_metadata({k: f.contents() for k, f in r.fields.items()})
        return load_tokenizer(r)

    @classmethod
    def from_metadata(cls, md: dict, source: str = ""):
        """From a {key: value} dict of GGUF metadata (as gguf's ReaderField.contents() gives):
        this SPM class for tokenizer.ggml.model = "llama", a jitgraph.models.bpe.BpeTokenizer
        for "gpt2". `source` (a file name) prefixes the errors."""
        where = f"{source}: " if source else ""
        check_metadata(md, where)
        model = md.get(K_MODEL)
        if model == "gpt2":
            from .bpe import BpeTokenizer
            return BpeTokenizer.from_metadata(md, source)
        if model != "llama":
            raise ValueError(f"{where}tokenizer model {model!r} ({K_MODEL}) is not supported: "
                             f"jitgraph reads \"llama\" (SPM) and \"gpt2\" (BPE)")
        tokens = md.get(K_TOKENS)
        if not tokens:
            raise ValueError(f"{where}tokenizer: no {K_TOKENS} in the metadata")
        n = len(tokens)
        scores = md.get(K_SCORES)
        types = md.get(K_TYPES)

        def tid(key, default):
            v = md.get(key, default)
            return None if v is None or not 0 <= int(v) < n else int(v)

        return cls(list(tokens), [0.0] * n if scores is None else list(scores),
                   [NORMAL] * n if types is None else list(types),
                   bos_id=tid(K_BOS, 1), eos_id=tid(K_EOS, 2), unk_id=tid(K_UNK, 0),
                   pad_id=tid(K_PAD, None), add_bos=bool(md.get(K_ADD_BOS, True)),
                   add_eos=bool(md.get(K_ADD_EOS, False)),
                   add_space_prefix=bool(md.get(K_ADD_SPACE, True)),
                   name=md.get("general.name"), fim_ids=fim_given(md))

    def write_gguf(self, writer) -> None:
        """Add this vocabulary's metadata to a gguf.GGUFWriter (before its header is written)."""
        writer.add_tokenizer_model("llama")
        writer.add_token_list(self.tokens)
        writer.add_token_scores([float(s) for s in self.scores])
        writer.add_token_types([int(t) for t in self.types])
        for key, v in ((K_BOS, self.bos_id), (K_EOS, self.eos_id), (K_UNK, self.unk_id),
                       (K_PAD, self.pad_id)):
            if v is not None:
                writer.add_uint32(key, int(v))
        writer.add_bool(K_ADD_BOS, bool(self.add_bos))
        writer.add_bool(K_ADD_EOS, bool(self.add_eos))
        writer.add_bool(K_ADD_SPACE, bool(self.add_space_prefix))

    # ---- basics ----------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def __len__(self):
        return len(self.tokens)

    def token_to_id(self, text: str) -> int | None:
        return self._ids.get(text.encode("utf-8", "surrogatepass"))

    def byte_to_token(self, b: int) -> int:
        """llama_vocab::byte_to_token: <0xXX>, else the one-byte token; else (where llama.cpp
        throws) the unknown token."""
        i = self._ids.get(b"<0x%02X>" % b)
        if i is None:
            i = self._ids.get(bytes([b]))
        if i is None:
            if self.unk_id is None:
                raise KeyError(f"tokenizer: byte 0x{b:02X} has no token and there is no <unk>")
            i = self.unk_id
        return i

    # ---- encoding --------------------------------------------------------------------------
    def encode(self, text, bos: bool = True, eos: bool = False, special: bool = False) -> list:
        """Token ids of `text` (str, or UTF-8 bytes), as llama.cpp's llama_tokenize(text,
        add_special, parse_special=special) with add_special = bos (then EOS too if the
        vocabulary's add_eos). `eos=True` appends EOS regardless."""
        raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
        out = []
        if bos:
            if self.bos_id is None:
                raise ValueError("tokenizer: BOS requested but the vocabulary has no BOS token")
            out.append(self.bos_id)
        prev_special = True                          # a space prefix for the first fragment
        for frag in self._partition(raw, special):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                frag = b" " + frag
            self._spm_words(frag.replace(b" ", SPACE_BYTES), out)
            prev_special = False
        if (eos or (bos and self.add_eos)) and self.eos_id is not None:
            out.append(self.eos_id)
        return out

    def _partition(self, raw: bytes, special: bool):
        """llama.cpp's tokenizer_st_partition: split out special tokens (str fragments stay
        bytes, special tokens become ints)."""
        return self._special.split(raw, special)

    def _spm_words(self, text: bytes, out: list) -> None:
        """_spm on the pieces of `text` cut in front of each "\u2581" that no token holds after
        the character before it (merges never cross such a cut, and each piece's merges come
        in the same order alone), each piece's ids cached."""
        try:
            s = text.decode("utf-8")
        except UnicodeDecodeError:              # a broken character could span a cut
            self._spm(text, out)
            return
        parts = s.split(SPACE)
        before, cache = self._before_space, self._cache
        if len(cache) > 1 << 20:
            cache.clear()
        pieces, cur = [], parts[0]
        for p in parts[1:]:
            if cur and cur[-1] in before:
                cur += SPACE + p
            else:
                pieces.append(cur)
                cur = SPACE + p
        pieces.append(cur)
        for piece in pieces:
            ids = cache.get(piece)
            if ids is None:
                ids = []
                if len(piece) <= 512:
                    self._spm_short(list(piece), self._ids_str, ids)
                else:
                    self._spm(piece.encode("utf-8"), ids)
                if len(piece) <= 256:            # long pieces seldom repeat: not kept
                    cache[piece] = ids
            out.extend(ids)

    def _spm_short(self, syms: list, ids: dict, out: list) -> None:
        """_spm on a fragment's characters (str, or bytes with `ids` keyed by bytes): pairs
        merged by priority, minus the merged token's score (no token: inf), ties leftmost."""
        scores = self.scores

        def pri(a, b):
            t = ids.get(a + b)
            return _NO_MERGE if t is None else -scores[t]

        for sym in merge_adjacent(syms, pri, _NO_MERGE):                             # resegment: tokens, else byte fallback
            tok = ids.get(sym)
            if tok is not None:
                out.append(tok)
            else:
                raw = sym.encode("utf-8", "surrogatepass") if isinstance(sym, str) else sym
                out.extend(self._byte_token(b) for b in raw)

    def _byte_token(self, b: int) -> int:
        t = self._byte_ids[b]
        if t is None:
            t = self._byte_ids[b] = self.byte_to_token(b)
        return t

    def _spm(self, text: bytes, out: list) -> None:
        """llm_tokenizer_spm_session::tokenize on an escaped fragment."""
        starts, pos = [], 0
        while pos < len(text):                       # UTF-8 characters (by their lead bytes)
            starts.append(pos)
            pos += min(_utf8_len(text[pos]), len(text) - pos)
        n = len(starts)
        if n == 0:
            return
        if n <= 512:
            syms = [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]
            self._spm_short(syms, self._ids, out)
            return
        sym_start = starts
        sym_len = [(starts[i + 1] if i + 1 < n else len(text)) - starts[i] for i in range(n)]
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n)) + [-1]
        ids, scores = self._ids, self.scores
        heap = []

        def add(left, right):
            if left == -1 or right == -1:
                return
            s = sym_start[left]
            size = sym_len[left] + sym_len[right]
            tok = ids.get(text[s:s + size])
            if tok is not None:                      # best score first, then the leftmost
                heapq.heappush(heap, (-scores[tok], left, right, size))

        for i in range(1, n):
            add(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if sym_len[left] == 0 or sym_len[right] == 0 or sym_len[left] + sym_len[right] != size:
                continue                             # stale: one side was merged already
            sym_len[left] += sym_len[right]
            sym_len[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            add(prev[left], left)
            add(left, nxt[left])
        i = 0
        while i != -1:                               # resegment: tokens, else byte fallback
            s, ln = sym_start[i], sym_len[i]
            tok = ids.get(text[s:s + ln])
            if tok is not None:
                out.append(tok)
            else:
                out.extend(self.byte_to_token(b) for b in text[s:s + ln])
            i = nxt[i]

    # ---- decoding --------------------------------------------------------------------------
    def _piece(self, i: int) -> bytes:
        a = self.attrs[i]
        if a & (A_CONTROL | A_UNKNOWN | A_USER):
            return self._text[i]
        if a & A_NORMAL:
            return self._text[i].replace(SPACE_BYTES, b" ")
        if a & A_BYTE:
            m = _BYTE_TOKEN.fullmatch(self._text[i])
            return bytes([int(m.group(1), 16)]) if m else b""
        return b""                                   # unused / undefined: nothing (as llama.cpp)

    def token_to_piece(self, i: int, special: bool = False) -> bytes:
        """llama_token_to_piece: the bytes token `i` stands for (control and unknown tokens: b""
        unless special)."""
        if not 0 <= int(i) < len(self.tokens):
            raise IndexError(f"tokenizer: token id {i} out of range [0, {len(self.tokens)})")
        if not special and self.attrs[i] & (A_CONTROL | A_UNKNOWN):
            return b""
        return self._pieces[i]

    def decode_bytes(self, ids, special: bool = False) -> bytes:
        """The bytes of `ids`: pieces joined, and the leading space that encoding adds (after an
        optional BOS) removed from the first piece."""
        ids = [int(i) for i in ids]
        strip = self.add_space_prefix
        if ids and ids[0] == self.bos_id:
            head, ids = self.token_to_piece(ids[0], special), ids[1:]
        else:
            head = b""
        parts = [head]
        for j, i in enumerate(ids):
            p = self.token_to_piece(i, special)
            if j == 0 and strip and p.startswith(b" "):
                p = p[1:]
            parts.append(p)
        return b"".join(parts)

    def decode(self, ids, special: bool = False, errors: str = "replace") -> str:
        """Text of `ids` (see decode_bytes); byte tokens that do not form UTF-8 become U+FFFD
        (errors="replace", or as `errors` says)."""
        return self.decode_bytes(ids, special).decode("utf-8", errors)


def load_tokenizer(path):
    """The tokenizer of the GGUF file at `path` (a model or a vocabulary-only file): Tokenizer
    (SPM) or jitgraph.models.bpe.BpeTokenizer, as its tokenizer.ggml.model says. Errors name
    the file."""
    import os

    from ..formats.gguf_metadata import read_metadata
    path = os.fspath(path)
    md = read_metadata(path, ("tokenizer.", "general.name"))
    if K_MODEL not in md:
        raise ValueError(f"{path}: no tokenizer in the metadata ({K_MODEL} is missing)")
    return Tokenizer.from_metadata(md, source=path)


# ---- vocabularies for models trained from scratch --------------------------------------------
def _words(text: str) -> Counter:
    """Training units, roughly as SentencePiece splits them: "\u2581" + word (spaces escaped),
    runs of newlines on their own."""
    esc = SPACE + text.replace(" ", SPACE)
    return Counter(re.findall(f"{SPACE}[^{SPACE}\n]*|\n+|[^{SPACE}\n]+", esc))


def build_vocab(text: str, vocab_size: int = 512, min_char_count: int = 1) -> Tokenizer:
    """A llama (SPM) vocabulary learned from `text` by BPE: <unk> <s> </s>, the 256 byte tokens
    <0x00>..<0xFF> (byte fallback: any text encodes), "\u2581", the characters of `text` seen at
    least `min_char_count` times, then merges, most frequent pair first, until `vocab_size`
    tokens. A merge's score is minus its rank, so llama.cpp's SPM algorithm (best score first)
    applies the merges in the order they were learned; characters and special tokens score 0
    (never compared: they are never the result of a merge). Merges stay within words (a "\u2581"
    starts a word; runs of newlines are words of their own), as SentencePiece's do. A short text
    may run out of pairs before `vocab_size`: the vocabulary is then smaller."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    scores = [0.0] * len(tokens)
    if vocab_size < len(tokens) + 1:
        raise ValueError(f"build_vocab: vocab_size {vocab_size} is below the {len(tokens) + 1} "
                         f"fixed tokens (<unk> <s> </s>, 256 bytes, \u2581)")
    words = _words(text)
    chars = Counter()
    for w, c in words.items():
        for ch in w:
            chars[ch] += c
    seen = set(tokens)
    alphabet = [SPACE] + sorted((ch for ch, c in chars.items()
                                 if c >= min_char_count and ch != SPACE),
                                key=lambda ch: (-chars[ch], ch))
    for ch in alphabet:
        if len(tokens) >= vocab_size:
            break
        tokens.append(ch)
        types.append(NORMAL)
        scores.append(0.0)
        seen.add(ch)
    # BPE over the words' symbol sequences, with incremental pair counts
    seqs = [[ch for ch in w] for w in words]
    freq = list(words.values())
    pairs = Counter()
    where = defaultdict(set)
    for k, s in enumerate(seqs):
        for a, b in zip(s, s[1:]):
            if a in seen and b in seen:
                pairs[a, b] += freq[k]
                where[a, b].add(k)
    rank = 0
    while len(tokens) < vocab_size and pairs:
        (a, b), c = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        if c <= 0:
            break
        ab = a + b
        if ab not in seen:
            rank += 1
            tokens.append(ab)
            types.append(NORMAL)
            scores.append(-float(rank))
            seen.add(ab)
        for k in list(where.pop((a, b), ())):
            s, f = seqs[k], freq[k]
            for x, y in zip(s, s[1:]):              # remove this word's old pairs
                if x in seen and y in seen and (x, y) in pairs:
                    pairs[x, y] -= f
                    if pairs[x, y] <= 0:
                        del pairs[x, y]
                    where[x, y].discard(k)
            merged, j = [], 0
            while j < len(s):
                if j + 1 < len(s) and s[j] == a and s[j + 1] == b:
                    merged.append(ab)
                    j += 2
                else:
                    merged.append(s[j])
                    j += 1
            seqs[k] = merged
            for x, y in zip(merged, merged[1:]):
                if x in seen and y in seen:
                    pairs[x, y] += f
                    where[x, y].add(k)
        pairs.pop((a, b), None)
    return Tokenizer(tokens, scores, types, bos_id=1, eos_id=2, unk_id=0)
