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

from .pretokenize import PRE_TYPES, PreTokenizer

# llama_token_type (tokenizer.ggml.token_type) -> llama_token_attr bits
A_UNKNOWN, A_UNUSED, A_NORMAL, A_CONTROL, A_USER, A_BYTE = 1, 2, 4, 8, 16, 32
A_LSTRIP, A_RSTRIP = 128, 256
_TYPE_ATTR = {1: A_NORMAL, 2: A_UNKNOWN, 3: A_CONTROL, 4: A_USER, 5: A_UNUSED, 6: A_BYTE}
_WS = " \t\n\v\f\r"                        # C isspace: what LSTRIP / RSTRIP remove
_NONE = 1 << 62                             # the rank of a pair no merge joins

# texts llama.cpp's loader marks as control tokens whatever their type (end of generation)
_EOG = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
        "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>",
        "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>",
        "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[")
# and, when its id is not in the metadata, one token of each fill-in-the-middle kind
_FIM = {
    ("fim_pre", "prefix"): ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>",
                            "<\uff5cfim\u2581begin\uff5c>", "<PRE>", "\u2581<PRE>",
                            "<|code_prefix|>", "<|prefix|>"),
    ("fim_suf", "suffix"): ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>",
                            "<\uff5cfim\u2581hole\uff5c>", "<SUF>", "\u2581<SUF>",
                            "<|code_suffix|>", "<|suffix|>"),
    ("fim_mid", "middle"): ("<|fim_middle|>", "<fim-middle>", "<fim_middle>",
                            "<\uff5cfim\u2581end\uff5c>", "<MID>", "\u2581<MID>",
                            "<|code_middle|>", "<|middle|>"),
    ("fim_pad", None): ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    ("fim_rep", None): ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    ("fim_sep", None): ("<|file_sep|>",),
}
_ALWAYS_USER = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")   # gpt-oss


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


def fim_given(md: dict) -> frozenset:
    """The fill-in-the-middle kinds whose token id the metadata gives."""
    return frozenset(k for (k, old) in _FIM if f"tokenizer.ggml.{k}_token_id" in md
                     or (old and f"tokenizer.ggml.{old}_token_id" in md))


def token_attrs(ids: dict, types, fim_ids=frozenset(), pre=None, name=None) -> list:
    """llama_token_attr of every token: from its type, then the loader's fixes by token text
    (llama_vocab::impl::load): end-of-generation and fill-in-the-middle tokens become control
    tokens, gpt-oss's markers user-defined; phi-3's special tokens strip the spaces after them,
    jina-v2's <mask> those before it. `ids` maps token text to id."""
    attrs = [_TYPE_ATTR.get(int(t), 0) for t in types]
    for t in _EOG:
        if t in ids:
            attrs[ids[t]] |= A_CONTROL
    for key, texts in _FIM.items():
        found = [ids[t] for t in texts if t in ids]
        if found and key[0] not in fim_ids:
            attrs[min(found)] |= A_CONTROL
    for t in _ALWAYS_USER:
        if t in ids:
            attrs[ids[t]] = A_USER
    if all(t in ids for t in ("<|return|>", "<|call|>", "<|end|>")):
        attrs[ids["<|end|>"]] = A_USER
    if pre in ("jina-v2-de", "jina-v2-es", "jina-v2-code") and "<mask>" in ids:
        attrs[ids["<mask>"]] |= A_LSTRIP
    elif name and ("phi-3" in name.lower() or "phi3" in name.lower()):
        for i, a in enumerate(attrs):
            if a & (A_CONTROL | A_USER | A_UNKNOWN):
                attrs[i] |= A_RSTRIP
        for t, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
            if t in ids:
                attrs[ids[t]] = attrs[ids[t]] | A_RSTRIP if on else attrs[ids[t]] & ~A_RSTRIP
    return attrs


def special_tokens(tokens, attrs) -> list:
    """The ids tokenizer_st_partition tries, longest text first."""
    special = [i for i, a in enumerate(attrs) if a & (A_CONTROL | A_USER | A_UNKNOWN)]
    special.sort(key=lambda i: -len(tokens[i].encode("utf-8", "surrogatepass")))
    return special


class SpecialTokens:
    """The tokens llama.cpp's tokenizer_st_partition splits out of a text, longest first, with
    an index by their first characters: a text is searched only for the tokens it holds (some
    vocabularies have thousands, most never in a given text)."""

    def __init__(self, tokens, attrs):
        self.ids = special_tokens(tokens, attrs)
        self.tokens, self.attrs = tokens, attrs
        self._groups = {}

    def _candidates(self, special: bool, isbytes: bool) -> list:
        g = self._groups.get((special, isbytes))
        if g is None:
            groups = {}
            for order, sid in enumerate(self.ids):
                if not special and self.attrs[sid] & (A_CONTROL | A_UNKNOWN):
                    continue
                t = self.tokens[sid]
                t = t.encode("utf-8", "surrogatepass") if isbytes else t
                groups.setdefault(t[:4], []).append((order, sid, t))
            g = self._groups[special, isbytes] = list(groups.items())
        return g

    def split(self, text, special: bool) -> list:
        """`text` (str or bytes) as fragments: special token ids (ints) and the text between
        them; control and unknown tokens only if `special`."""
        if not text:
            return []
        present = []
        for prefix, members in self._candidates(special, isinstance(text, bytes)):
            if prefix in text:
                present.extend(m for m in members if m[2] in text)
        if not present:
            return [text]
        present.sort()
        ws = _WS.encode() if isinstance(text, bytes) else _WS
        frags = [text]
        for _, sid, tok in present:
            a = self.attrs[sid]
            new = []
            for frag in frags:
                if isinstance(frag, int) or tok not in frag:
                    new.append(frag)
                    continue
                parts = frag.split(tok)
                last = len(parts) - 1
                for j, part in enumerate(parts):
                    if j:
                        new.append(sid)
                    if a & A_LSTRIP and j < last:
                        part = part.rstrip(ws)
                    if a & A_RSTRIP and j > 0:
                        part = part.lstrip(ws)
                    if part:
                        new.append(part)
            frags = new
        return frags


_KINDS = {"tokens": (list, str), "merges": (list, str), "token_type": (list, int),
          "scores": (list, (int, float)), "pre": (str, None), "model": (str, None),
          "add_bos_token": ((bool, int), None), "add_eos_token": ((bool, int), None),
          "add_space_prefix": ((bool, int), None)}


def check_metadata(md: dict, where: str = "") -> None:
    """Each tokenizer.ggml.* value the tokenizers read has the type llama.cpp reads it as:
    a one-line ValueError naming the key otherwise (ids: non-negative integers)."""
    for key, v in md.items():
        if not key.startswith("tokenizer.ggml."):
            continue
        name = key[len("tokenizer.ggml."):]
        if name.endswith("_token_id"):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{where}{key} must be a token id (an unsigned integer), got "
                                 f"{v!r:.40}")
            continue
        kind = _KINDS.get(name)
        if kind is None:
            continue
        outer, inner = kind
        if not isinstance(v, outer) or (inner and not all(isinstance(x, inner) for x in v)):
            what = outer.__name__ if isinstance(outer, type) else "a boolean"
            raise ValueError(f"{where}{key} must be {what}"
                             f"{' of ' + inner.__name__ if isinstance(inner, type) else ''}"
                             f", got {type(v).__name__}")


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
        pops exactly that pair each time). The pairs' ranks sit in a list (no rank: _NONE)
        that each merge updates at its two new pairs only."""
        if len(syms) > 512:
            return self._merge_long(syms)
        ranks = self._ranks
        pr = [ranks.get(pair, _NONE) for pair in zip(syms, syms[1:])]
        while pr:
            best = min(pr)
            if best == _NONE:
                break
            at = pr.index(best)
            m = syms[at] + syms[at + 1]
            syms[at:at + 2] = [m]
            del pr[at]
            if at:
                pr[at - 1] = ranks.get((syms[at - 1], m), _NONE)
            if at < len(pr):
                pr[at] = ranks.get((m, syms[at + 1]), _NONE)
        return syms

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
