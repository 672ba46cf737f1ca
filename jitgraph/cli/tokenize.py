"""`jitgraph tokenize MODEL.gguf (--prompt TEXT | --file F)`: the token ids of a text under a GGUF
model's tokenizer (SPM or BPE, read from its metadata alone), as llama.cpp's llama-tokenize
prints them."""
from __future__ import annotations

import json
import sys


def add_tokenize(p) -> None:
    p.add_argument("model_file", metavar="MODEL.gguf",
                   help="a GGUF model or vocabulary file (only its tokenizer metadata is read)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="the text to tokenize")
    src.add_argument("--file", metavar="F", help="tokenize this file's contents (UTF-8)")
    p.add_argument("--no-bos", action="store_true",
                   help="no BOS (nor EOS) even where the vocabulary adds them (llama.cpp's "
                        "add_special off)")
    p.add_argument("--special", action="store_true",
                   help="parse special tokens written in the text (<|eot_id|>, <s>, ...)")
    p.add_argument("--json", action="store_true",
                   help="print {\"ids\": [...], \"pieces\": [...]}: each token's text, special "
                        "tokens included, bytes that are not UTF-8 as U+FFFD")
    p.set_defaults(fn=tokenize_command, parser=p)


def tokenize_command(args) -> int:
    from ..models.tokenizer import load_tokenizer
    from .common import check_model_file
    check_model_file(args.model_file, "model")
    tok = load_tokenizer(args.model_file)
    if args.file is not None:
        with open(args.file, "rb") as f:
            text = f.read()
    else:
        text = args.prompt
    add = not args.no_bos
    ids = tok.encode(text, bos=add and tok.add_bos, eos=add and tok.add_eos,
                     special=args.special)
    if args.json:
        pieces = [tok.token_to_piece(i, special=True).decode("utf-8", "replace") for i in ids]
        json.dump({"ids": ids, "pieces": pieces}, sys.stdout, ensure_ascii=False)
        sys.stdout.write("\n")
    else:
        print("[" + ", ".join(map(str, ids)) + "]")
    return 0
