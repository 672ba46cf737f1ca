"""llama.cpp's special tokens, shared by the SPM and BPE tokenizers: each token's attributes
(llama_token_attr) as llama_vocab::impl::load sets them, from its type and then by its text
(end-of-generation and fill-in-the-middle tokens made control tokens, gpt-oss's markers
user-defined, phi-3's special tokens stripping the spaces after them), the type checks of the
tokenizer metadata, and tokenizer_st_partition, which splits them out of a text."""
from __future__ import annotations

# llama_token_type (tokenizer.ggml.token_type) -> llama_token_attr bits
A_UNKNOWN, A_UNUSED, A_NORMAL, A_CONTROL, A_USER, A_BYTE = 1, 2, 4, 8, 16, 32
A_LSTRIP, A_RSTRIP = 128, 256
_TYPE_ATTR = {1: A_NORMAL, 2: A_UNKNOWN, 3: A_CONTROL, 4: A_USER, 5: A_UNUSED, 6: A_BYTE}
_WS = " \t\n\v\f\r"                        # C isspace: what LSTRIP / RSTRIP remove

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
        # the distinct element types, not each element: a vocabulary's lists are long
        if not isinstance(v, outer) or (inner and not all(issubclass(t, inner)
                                                         for t in set(map(type, v)))):
            what = outer.__name__ if isinstance(outer, type) else "a boolean"
            raise ValueError(f"{where}{key} must be {what}"
                             f"{' of ' + inner.__name__ if isinstance(inner, type) else ''}"
                             f", got {type(v).__name__}")
