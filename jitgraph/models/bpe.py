"""llama.cpp's BPE tokenizer (GGUF `tokenizer.ggml.model = "gpt2"`, with the pre-tokenizer that
`tokenizer.ggml.pre` names), token for token: LLaMA 3 and 4, Qwen2 and 3.5, DeepSeek (LLM, Coder,
V3), Falcon, GPT-2, MPT, StarCoder, Command-R, SmolLM, Mistral's tekken and the other names of
jitgraph.models.pre_regexes.PRE_TYPES (all of llama.cpp's byte-level ones but kimi-k2, afmoe,
tiny_aya and cohere2moe, which it splits with code of its own).

Encoding follows src/llama-vocab.cpp (llama_vocab::impl::tokenize and the BPE tokenize loop):
  - special tokens are split out of the text first, longest first: user-defined ones always,
    control and unknown ones only with special=True (tokenizer_st_partition);
  - each remaining fragment is split into words (jitgraph.models.pretokenize), each word's UTF-8
    bytes are written as GPT-2's byte characters, and adjacent symbols are merged, the pair of
    lowest merge rank first (ties: leftmost); with `ignore_merges` (llama3) a word that is a
    token as a whole is that token;
  - a final symbol that is not a token gives the tokens of its single ASCII bytes, if any;
  - invalid UTF-8 reads as U+FFFD per bad byte, as llama.cpp's decoder does.
Decoding follows llama_token_to_piece and llama_detokenize (clean_spaces where the vocabulary
has it). Words already seen are cached, so text that repeats its words encodes fast.
"""
from __future__ import annotations

from itertools import chain

from .merging import merge_adjacent
from .pre_regexes import PRE_TYPES
from .pretokenize import PreTokenizer
from .special_tokens import (A_BYTE, A_CONTROL, A_NORMAL, A_UNKNOWN, A_USER, SpecialTokens,
                             check_metadata, fim_given, token_attrs)

_NONE = 1 << 62                             # the rank of a pair no merge joins


def _byte_chars() -> list:
    """GPT-2's bytes_to_unicode: the character each byte is written as."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return [out[b] for b in range(256)]


BYTE_CHARS = _byte_chars()
_TO_BYTE_CHARS = {b: c for b, c in enumerate(BYTE_CHARS)}          # str.translate table
_FROM_BYTE_CHARS = {c: b for b, c in enumerate(BYTE_CHARS)}


def utf8_text(raw: bytes) -> str:
    """`raw` as text the way llama.cpp reads UTF-8 (unicode_cpts_from_utf8): a byte that does not
    start a complete sequence is U+FFFD; surrogates and overlong forms pass."""
    try:
        return raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        pass
    out, i, n = [], 0, len(raw)
    while i < n:
        b = raw[i]
        ln = 1 if b < 0x80 else 0 if b < 0xC0 else 2 if b < 0xE0 else 3 if b < 0xF0 else \
            4 if b < 0xF8 else 0
        if ln == 1:
            out.append(chr(b))
        elif ln and i + ln <= n and all(0x80 <= c < 0xC0 for c in raw[i + 1:i + ln]):
            cp = b & (0x7F >> ln)
            for c in raw[i + 1:i + ln]:
                cp = (cp << 6) | (c & 0x3F)
            out.append(chr(cp) if cp < 0x110000 else "\ufffd")
            i += ln
            continue
        else:
            out.append("\ufffd")
        i += 1
    return "".join(out)


class _WordCache(dict):
    """word -> its token ids; a miss runs the BPE merges."""

    def __init__(self, tok):
        super().__init__()
        self.tok = tok

    def __missing__(self, word):
        if len(word) > 256:                      # long words seldom repeat: not kept
            return self.tok._word(word)
        if len(self) > 1 << 20:
            self.clear()
        ids = self[word] = self.tok._word(word)
        return ids


class BpeTokenizer:
    """A llama.cpp BPE vocabulary: token texts (GPT-2 byte characters), merges ("left right",
    best first), llama token types, and the pre-tokenizer name."""

    def __init__(self, tokens, merges, types=None, pre: str | None = "default",
                 bos_id: int | None = 11, eos_id: int | None = 11, unk_id: int | None = None,
                 pad_id: int | None = None, add_bos: bool | None = None,
                 add_eos: bool | None = None, fim_ids: frozenset = frozenset(),
                 name: str | None = None, source: str = ""):
        where = f"{source}: " if source else ""
        kind = PRE_TYPES.get("default" if pre is None else pre)
        if kind is None:
            raise ValueError(f"{where}tokenizer.ggml.pre {pre!r} is not supported (BPE "
                             f"pre-tokenizers: {', '.join(sorted(PRE_TYPES))})")
        n = len(tokens)
        if n == 0:
            raise ValueError(f"{where}tokenizer: no tokens")
        if types is not None and len(types) != n:
            raise ValueError(f"{where}tokenizer: {n} tokens but {len(types)} token types")
        self.tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(map(str, tokens))]
        self.merges = [str(m) for m in merges]
        self.types = [1] * n if types is None else [int(t) for t in types]
        self.pre = pre
        self.pretokenizer = PreTokenizer(kind[0])
        flags = kind[1]
        self.clean_spaces = flags["clean_spaces"]
        self.ignore_merges = flags["ignore_merges"]
        self.add_bos = flags["add_bos"] if add_bos is None else bool(add_bos)
        self.add_eos = False if add_eos is None else bool(add_eos)
        self.add_space_prefix = False

        def valid(v):
            return None if v is None or not 0 <= int(v) < n else int(v)
        self.bos_id, self.eos_id = valid(bos_id), valid(eos_id)
        self.unk_id, self.pad_id = valid(unk_id), valid(pad_id)
        self._ids = {t: i for i, t in enumerate(self.tokens)}          # the last id wins
        self._ranks = {}
        for r, m in enumerate(self.merges):
            k = m.find(" ", 1)
            self._ranks.setdefault((m[:k], m[k + 1:]) if k >= 0 else ("", ""), r)
        self.attrs = token_attrs(self._ids, self.types, fim_ids, pre, name)
        self._special = SpecialTokens(self.tokens, self.attrs)
        self._pieces = [None] * n
        self._cache = _WordCache(self)

    # ---- GGUF metadata ---------------------------------------------------------------------
    @classmethod
    def from_metadata(cls, md: dict, source: str = "") -> "BpeTokenizer":
        """From a {key: value} dict of GGUF metadata with tokenizer.ggml.model = "gpt2"."""
        where = f"{source}: " if source else ""
        check_metadata(md, where)
        tokens = md.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError(f"{where}no tokenizer.ggml.tokens in the metadata")
        pre = md.get("tokenizer.ggml.pre")
        no_bos = PRE_TYPES.get("default" if pre is None else pre, ("", {}))[1].get("no_bos")
        merges = md.get("tokenizer.ggml.merges")
        if merges is None:
            raise ValueError(f"{where}the BPE vocabulary has no tokenizer.ggml.merges")

        def tid(key, default):                  # an id out of range keeps llama.cpp's default
            v = md.get(f"tokenizer.ggml.{key}_token_id")
            return v if v is not None and 0 <= int(v) < len(tokens) else default
        return cls(tokens, merges, md.get("tokenizer.ggml.token_type"),
                   pre=pre, bos_id=tid("bos", None if no_bos else 11), eos_id=tid("eos", 11),
                   unk_id=tid("unknown", None), pad_id=tid("padding", None),
                   add_bos=md.get("tokenizer.ggml.add_bos_token"),
                   add_eos=md.get("tokenizer.ggml.add_eos_token"), fim_ids=fim_given(md),
                   name=md.get("general.name"), source=source)

    def write_gguf(self, writer) -> None:
        """Add this vocabulary's metadata to a gguf.GGUFWriter (before its header is written)."""
        writer.add_tokenizer_model("gpt2")
        if self.pre is not None:
            writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_merges(self.merges)
        writer.add_token_types(self.types)
        for key, v in (("bos_token_id", self.bos_id), ("eos_token_id", self.eos_id),
                       ("unknown_token_id", self.unk_id), ("padding_token_id", self.pad_id)):
            if v is not None:
                writer.add_uint32(f"tokenizer.ggml.{key}", int(v))
        writer.add_bool("tokenizer.ggml.add_bos_token", bool(self.add_bos))
        writer.add_bool("tokenizer.ggml.add_eos_token", bool(self.add_eos))

    # ---- basics ----------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def __len__(self):
        return len(self.tokens)

    def token_to_id(self, text: str) -> int | None:
        return self._ids.get(text)

    # ---- encoding --------------------------------------------------------------------------
    def encode(self, text, bos: bool = True, eos: bool = False, special: bool = False) -> list:
        """Token ids of `text` (str, or UTF-8 bytes), as llama.cpp's llama_tokenize(text,
        add_special, parse_special=special) with add_special = bos (then EOS too if the
        vocabulary's add_eos). `eos=True` appends EOS regardless."""
        if not isinstance(text, str):
            text = utf8_text(bytes(text))
        out = []
        if bos:
            if self.bos_id is None:
                raise ValueError("tokenizer: BOS requested but the vocabulary has no BOS token")
            out.append(self.bos_id)
        for frag in self._partition(text, special):
            if isinstance(frag, int):
                out.append(frag)
            else:
                out.extend(chain.from_iterable(
                    map(self._cache.__getitem__, self.pretokenizer.split(frag))))
        if (eos or (bos and self.add_eos)) and self.eos_id is not None:
            out.append(self.eos_id)
        return out

    def _partition(self, text: str, special: bool) -> list:
        return self._special.split(text, special)

    def _word(self, word: str) -> tuple:
        """The token ids of one pre-tokenized word (llama.cpp's BPE merge loop)."""
        s = word.encode("utf-8", "surrogatepass").decode("latin-1").translate(_TO_BYTE_CHARS)
        ids = self._ids
        if self.ignore_merges and s in ids:
            return (ids[s],)
        syms = self._merge(list(s))
        out = []
        for sym in syms:
            t = ids.get(sym)
            if t is not None:
                out.append(t)
                continue
            for c in sym:                         # its single bytes: only ASCII ones can be
                if c < "\x80":                    # tokens (a token's text is valid UTF-8)
                    t = ids.get(c)
                    if t is not None:
                        out.append(t)
        return tuple(out)

    def _merge(self, syms: list) -> list:
        """Merge adjacent symbols, lowest rank first, ties leftmost (llama.cpp's work queue
        pops exactly that pair each time; no rank: _NONE)."""
        if len(syms) > 512:
            return self._merge_long(syms)
        ranks = self._ranks
        return merge_adjacent(syms, lambda a, b: ranks.get((a, b), _NONE), _NONE)

    def _merge_long(self, syms: list) -> list:
        """_merge with a heap of candidate pairs (linked symbols, stale entries skipped)."""
        import heapq
        ranks = self._ranks
        n = len(syms)
        text = list(syms)
        nxt = list(range(1, n)) + [-1]
        prv = list(range(-1, n - 1))
        heap = []

        def push(a, b):
            if a >= 0 and b >= 0:
                r = ranks.get((text[a], text[b]))
                if r is not None:
                    heapq.heappush(heap, (r, a, b, text[a] + text[b]))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, a, b, joined = heapq.heappop(heap)
            if not text[a] or not text[b] or nxt[a] != b or text[a] + text[b] != joined:
                continue
            text[a], text[b] = joined, ""
            nxt[a] = nxt[b]
            if nxt[b] >= 0:
                prv[nxt[b]] = a
            push(prv[a], a)
            push(a, nxt[a])
        return [t for t in text if t]

    # ---- decoding --------------------------------------------------------------------------
    def _piece(self, i: int) -> bytes:
        a, t = self.attrs[i], self.tokens[i]
        if a & (A_UNKNOWN | A_CONTROL | A_USER):
            return t.encode("utf-8", "surrogatepass")
        if a & A_NORMAL:                          # llama_decode_text
            out = bytearray()
            for c in t:
                b = _FROM_BYTE_CHARS.get(c)
                if b is not None:
                    out.append(b)
                else:
                    out += (b"[UNK_BYTE_0x" + c.encode("utf-8", "surrogatepass").hex().encode()
                            + t.encode("utf-8", "surrogatepass") + b"]")
            return bytes(out)
        if a & A_BYTE:
            try:
                return bytes([int(t[3:5], 16)])
            except ValueError:
                return b"\x00"
        return b""

    def token_to_piece(self, i: int, special: bool = False) -> bytes:
        """llama_token_to_piece: the bytes token `i` stands for (control and unknown tokens: b""
        unless special)."""
        if not 0 <= int(i) < len(self.tokens):
            raise IndexError(f"tokenizer: token id {i} out of range [0, {len(self.tokens)})")
        i = int(i)
        if not special and self.attrs[i] & (A_CONTROL | A_UNKNOWN):
            return b""
        p = self._pieces[i]
        if p is None:
            p = self._pieces[i] = self._piece(i)
        return p

    def decode_bytes(self, ids, special: bool = False) -> bytes:
        """llama_detokenize(ids, remove_special=False, unparse_special=special): the pieces
        joined, then llama.cpp's clean-up of spaces where the vocabulary asks for it."""
        text = b"".join(self.token_to_piece(i, special) for i in ids)
        return _clean_spaces(text) if self.clean_spaces and text else text

    def decode(self, ids, special: bool = False, errors: str = "replace") -> str:
        """Text of `ids` (see decode_bytes); bytes that do not form UTF-8 become U+FFFD."""
        return self.decode_bytes(ids, special).decode("utf-8", errors)


def _clean_spaces(t: bytes) -> bytes:
    """llama_detokenize's clean_spaces passes: " ?", " !", " .", " ," lose the space; a lone "'"
    between spaces loses both; " 's", " 'm", " 're", " 've" lose the space."""
    a = bytearray(t[:1])
    for i in range(1, len(t)):
        if t[i - 1] == 0x20 and t[i] in b"?!.,":
            a.pop()
        a.append(t[i])
    b = bytearray(a[:1])
    i = 1
    while i < len(a):                         # in place, as llama.cpp does: the dropped space
        x = a[i]                              # after the "'" reads as NUL from then on
        if x == 0x27 and i + 1 < len(a) and a[i - 1] == 0x20 and a[i + 1] == 0x20:
            b.pop()
            a[i + 1] = 0
            b.append(x)
            i += 2
            continue
        b.append(x)
        i += 1
    c = bytearray(b[:1])
    for i in range(1, len(b)):
        x = b[i]
        if b[i - 1] == 0x20 and x == 0x27 and i + 1 < len(b):
            x1 = b[i + 1]
            if x1 in b"sm" or (i + 2 < len(b) and bytes(b[i + 1:i + 3]) in (b"re", b"ve")):
                c.pop()
        c.append(x)
    return bytes(c)
