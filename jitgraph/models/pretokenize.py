"""llama.cpp's BPE pre-tokenizers: text -> words, as src/unicode.cpp unicode_regex_split does it
for the regex list of each `tokenizer.ggml.pre` (src/llama-vocab.cpp llm_tokenizer_bpe; the lists
and the names' flags are in pre_regexes.py, generated from it).

llama.cpp runs each regex of the list over the pieces the previous ones left (a match and the
text between matches each become a piece), in one of three ways, reproduced here:
  - its hand-written splitters for the GPT-2, llama3, qwen2 and qwen35 regexes (chosen by the
    exact regex string), with its own code point classes (src/unicode-data.cpp);
  - a regex with \\p{..} classes runs (std::regex) on the "collapsed" text: ASCII kept, every
    other code point replaced by one byte for its class (whitespace 0x0B, number 0xD1, letter
    0xD2, punctuation 0xD3, accent mark 0xD4, symbol 0xD5, anything else 0xD0), each \\p{X}
    by that byte plus the ASCII members of X;
  - any other regex runs (std::wregex) on the code points, non-ASCII whitespace as 0x0B.
Here every path is one Python `re` pattern over such a string of the text's length: the
splitters as the regexes they implement over the collapsed classes (their edge cases included),
the others translated from ECMAScript (\\s, \\S, \\d and $ as ASCII-only std::regex reads them).
"""
from __future__ import annotations

import re

import numpy as np

from .pre_regexes import REGEXES
from .unicode_classes import RUNS

# the collapsed class characters (the code units llama.cpp's collapsed text uses)
_CLASS = {"W": 0x0B, "N": 0xD1, "L": 0xD2, "P": 0xD3, "M": 0xD4, "S": 0xD5, "O": 0xD0}
_table = None


def _classes() -> np.ndarray:
    """uint8 [0x110000]: a code point's collapsed character (ASCII maps to itself)."""
    global _table
    if _table is None:
        runs = re.findall(r"([0-9a-f]+)([A-Z])", "".join(RUNS))
        starts = [0] + [int(s, 16) for s, _ in runs] + [0x110000]
        t = np.empty(0x110000, np.uint8)
        t[:128] = np.arange(128)
        for (s, c), e in zip(runs, starts[2:]):
            t[int(s, 16):e] = _CLASS[c]
        _table = t
    return _table


def _codepoints(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)


def collapse(text: str) -> str:
    """llama.cpp's collapsed text: one character per code point (see the module docstring)."""
    if text.isascii():
        return text
    return _classes()[_codepoints(text)].tobytes().decode("latin-1")


def widen(text: str) -> str:
    """The code points std::wregex sees: non-ASCII whitespace as 0x0B."""
    if text.isascii():
        return text
    cp = _codepoints(text).copy()
    cp[(cp >= 128) & (_classes()[cp] == 0x0B)] = 0x0B
    return cp.tobytes().decode("utf-32-le", "surrogatepass")


# ---- the hand-written splitters, as regexes over the collapsed classes ----------------------
_L, _N, _M, _WS = "A-Za-z\xd2", "0-9\xd1", "\xd4", "\t-\r "
_RUN_WS = f"[{_WS}]+(?![^{_WS}])|[{_WS}]+|."     # \s+(?!\S) as written in C++, \s+, one char
_CI = "'[sStTmMdD]|'(?:[rR][eE]|[vV][eE]|[lL][lL])"   # (?i:'s|'t|'re|'ve|'m|'ll|'d)
_CUSTOM = {
    # unicode_regex_split_custom_gpt2
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)":
        f"'[stmd]|'(?:re|ve|ll)| ?[{_L}]+| ?[{_N}]+| ?[^{_WS}{_L}{_N}]+|{_RUN_WS}",
    # unicode_regex_split_custom_llama3 (both spellings)
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
    "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+":
        f"{_CI}|[^\r\n{_L}{_N}]?[{_L}]+|[{_N}]{{1,3}}| ?[^{_WS}{_L}{_N}]+[\r\n]*"
        f"|[{_WS}]*[\r\n]+|{_RUN_WS}",
    # unicode_regex_split_custom_qwen2
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
    "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+":
        f"{_CI}|[^\r\n{_L}{_N}]?[{_L}]+|[{_N}]| ?[^{_WS}{_L}{_N}]+[\r\n]*"
        f"|[{_WS}]*[\r\n]+|{_RUN_WS}",
    # unicode_regex_split_custom_qwen35: letter runs take accent marks too
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?"
    "[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+":
        f"{_CI}|[^\r\n{_L}{_N}]?[{_L}{_M}]+|[{_N}]| ?[^{_WS}{_L}{_M}{_N}]+[\r\n]*"
        f"|[{_WS}]*[\r\n]+|{_RUN_WS}",
}
_CUSTOM["(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}"
        "\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"] = _CUSTOM[
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
    "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"]

# ---- ECMAScript -> Python for the std::regex paths ------------------------------------------
# k_ucat_map: the collapsed byte of each class and its ASCII members
_UCAT = {"N": "\xd10-9", "L": "\xd2A-Za-z", "P": "\xd3!-#%-*,-/:-;?-@\\[-\\]_\\{\\}",
         "M": "\xd4", "S": "\xd5\\$\\+<->\\^`\\|~"}
_UCAT.update({k: _UCAT["L"] for k in ("Lu", "Ll", "Lt", "Lm", "Lo")})
_ESC = {"s": ("\\t-\\r ", False), "S": ("\\t-\\r ", True), "d": ("0-9", False)}


def _translate(rx: str) -> str:
    """A std::regex (ECMAScript, ASCII \\s \\d, $ only at the end) in Python's spelling, its
    \\p{X} classes as llama.cpp's collapsed classes."""
    out, i, inside = [], 0, False
    while i < len(rx):
        c = rx[i]
        if c == "\\" and i + 1 < len(rx):
            m = re.match(r"\\p\{(\w+)\}", rx[i:])
            if m:
                if m.group(1) not in _UCAT:
                    raise ValueError(f"pre-tokenizer regex: class \\p{{{m.group(1)}}} is not "
                                     f"supported")
                body = _UCAT[m.group(1)]
                out.append(body if inside else f"[{body}]")
                i += m.end()
                continue
            e = rx[i + 1]
            if e in _ESC:
                body, neg = _ESC[e]
                if inside and neg:
                    raise ValueError("pre-tokenizer regex: \\S inside [...] is not supported")
                out.append(body if inside else f"[{'^' if neg else ''}{body}]")
            else:
                out.append(rx[i:i + 2])
            i += 2
            continue
        if c == "[" and not inside:
            inside = True
        elif c == "]" and inside and rx[i - 1] != "[" and rx[i - 2:i] != "[^":
            inside = False
        elif c == "$" and not inside:
            c = "\\Z"
        elif c == "(" and not inside and rx[i + 1:i + 2] != "?":
            c = "(?:"                           # no groups: findall gives the whole matches
        out.append(c)
        i += 1
    return "".join(out)


_HAS_UCAT = re.compile(r"\\p\{(N|L|P|M|S|Lu|Ll|Lt|Lm|Lo)\}")

class PreTokenizer:
    """Splits text into words as llama.cpp does for the given pre-tokenizer type (a key of
    REGEXES: "LLAMA3", "QWEN2", ...)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.steps = []                     # (compiled pattern, runs on the collapsed text)
        self._memo = {}                     # (step, piece) -> its words
        self.tiles = REGEXES[kind][-1] in _CUSTOM   # a splitter's regex ends in "|."
        for rx in REGEXES[kind]:
            if rx in _CUSTOM:
                self.steps.append((re.compile(_CUSTOM[rx], re.S), True))
            else:
                self.steps.append((re.compile(_translate(rx), re.S), bool(_HAS_UCAT.search(rx))))

    def split(self, text: str) -> list:
        """The words of `text` (str; their concatenation is `text`)."""
        if not text:
            return []
        ascii_ = text.isascii()
        if len(self.steps) == 1 and self.tiles:     # its matches cover the text: no gaps
            pat, collapsed = self.steps[0]
            if ascii_:
                return pat.findall(text)
            words = pat.findall(collapse(text) if collapsed else widen(text))
            out, pos = [], 0
            for w in words:
                out.append(text[pos:pos + len(w)])
                pos += len(w)
            return out
        views = {True: text, False: text} if ascii_ else {True: collapse(text),
                                                          False: widen(text)}
        if len(self._memo) > 1 << 20:
            self._memo.clear()
        out = []
        self._split(0, 0, len(text), text, views, out)
        return out

    def _split(self, k, a, b, text, views, out):
        """Append the words steps k.. make of text[a:b]. A piece's split by the later steps
        depends on its characters alone (no pattern looks behind its start), so it is kept
        by (k, piece): a word met again costs one look-up."""
        if k == len(self.steps):
            out.append(text[a:b])
            return
        key = (k, text[a:b]) if k and b - a <= 64 else None     # short pieces repeat
        if key is not None:
            words = self._memo.get(key)
            if words is not None:
                out.extend(words)
                return
        start = len(out)
        pat, collapsed = self.steps[k]
        pos = a
        for m in pat.finditer(views[collapsed], a, b):
            i, j = m.span()
            if i == j:                          # an empty match still cuts (superbpe's)
                if i > pos:
                    self._split(k + 1, pos, i, text, views, out)
                    pos = i
                continue
            if i > pos:
                self._split(k + 1, pos, i, text, views, out)
            self._split(k + 1, i, j, text, views, out)
            pos = j
        if pos < b:
            self._split(k + 1, pos, b, text, views, out)
        if key is not None:
            self._memo[key] = out[start:]
