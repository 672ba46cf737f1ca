"""The `jitgraph` command: its parser (one subcommand per command module: mnist.py, llama.py,
llama_train.py, tokenize.py; bench.py parses its own options) and `main`, which maps errors,
Ctrl-C and SIGTERM to messages and exit codes."""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import warnings

from jitgraph.passes.pipeline import IR_STAGES as STAGES   # the IRs `dump --stage` can print

from .common import (EXIT_ERROR, EXIT_INTERRUPT, EXIT_TERMINATED, HelpFormatter, Run, Terminated,
                     add_compile_flags, add_ftype, add_precision_flag, add_target_flags,
                     add_threads_flag, float_in, in_worker, int_at_least, raise_terminated)
from .llama import add_lora_options, export_lora, generate_text, score_perplexity
from .dump import add_picture_options
from .logs import add_log_option
from .mnist import add_data_options, dump, eval_mnist, train_mnist


def _given(parser, argv):
    """Dests of the options given on the command line `argv` (parsed again, defaults hidden)."""
    saved = [(a, a.default) for a in parser._actions]
    try:
        for a, _ in saved:
            a.default = argparse.SUPPRESS
        return set(vars(parser.parse_args(argv)))
    finally:
        for a, d in saved:
            a.default = d


def parser():
    from ..models import MODELS
    models = sorted(MODELS)
    p = argparse.ArgumentParser(
        prog="jitgraph", formatter_class=HelpFormatter,
        description="A JIT compiler for neural-network training graphs: train and evaluate "
                    "the MNIST models with compiled kernels.",
        epilog="exit status: 0 success, 1 a benchmark failed, 2 a usage or input error, "
               "130 Ctrl-C, 143 SIGTERM")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(name, help):
        return sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".",
                              formatter_class=HelpFormatter, allow_abbrev=False,
                              epilog=p.epilog)

    from .llama_train import add_dump_options, add_finetune, add_train_llama
    tr = command("train", "train a model with compiled kernels: an MNIST model, or a llama on "
                          "text")
    ts = tr.add_subparsers(dest="model", required=True, metavar="MODEL",
                           help=f"{', '.join(models)} (MNIST digits) or llama (a language model "
                                f"on text); `jitgraph train MODEL --help` lists its options")
    t = argparse.ArgumentParser(add_help=False)     # the MNIST models' options
    add_data_options(t)
    t.add_argument("--epochs", type=int_at_least(1), default=2, metavar="N",
                   help="epochs in all (with --resume: counting the checkpoint's)")
    t.add_argument("--batch-size", type=int_at_least(1), default=100, metavar="B",
                   help="samples per compiled step")
    t.add_argument("--logical-batch", type=int_at_least(1), default=None, metavar="L",
                   help="samples per optimizer step, a multiple of --batch-size (gradient "
                        "accumulation); default: the batch size")
    t.add_argument("--lr", type=float_in(0, lo_open=True), default=1e-3,
                   help="AdamW learning rate")
    t.add_argument("--val-split", type=float_in(0, 1), default=0.05, metavar="F",
                   help="fraction of the training data held out to validate after each epoch")
    t.add_argument("--out", metavar="MODEL.gguf",
                   help="save the trained model as GGUF (ggml's MNIST layout); default: not saved")
    t.add_argument("--checkpoint", metavar="CKPT.gguf",
                   help="save a training checkpoint after every epoch; default: none")
    t.add_argument("--resume", metavar="CKPT.gguf",
                   help="continue a checkpointed run bit for bit, with the checkpoint's training "
                        "options (batch sizes, --lr, --val-split, --seed, data); default: start "
                        "afresh")
    add_log_option(t)
    add_compile_flags(t)
    add_precision_flag(t)
    for m in models:
        h = f"train the MNIST model {m} with compiled kernels"
        mp = ts.add_parser(m, parents=[t], help=h, description=h[0].upper() + h[1:] + ".",
                           formatter_class=HelpFormatter, allow_abbrev=False, epilog=p.epilog)
        mp.set_defaults(fn=train_mnist, parser=mp)
    h = "train a llama language model from scratch on a text, with compiled kernels"
    add_train_llama(ts.add_parser("llama", help=h, description=h[0].upper() + h[1:] + ".",
                                  formatter_class=HelpFormatter, allow_abbrev=False,
                                  epilog=p.epilog))

    e = command("eval", "evaluate a GGUF model on the test set")
    e.add_argument("model_file", metavar="MODEL.gguf",
                   help="a model or checkpoint written by `jitgraph train` or by ggml's MNIST "
                        "example")
    add_data_options(e)
    e.add_argument("--batch-size", type=int_at_least(1), default=100, metavar="B",
                   help="samples per compiled step (every test sample is evaluated)")
    e.set_defaults(fn=eval_mnist, parser=e)

    d = command("dump", "print a model's IR after a compiler stage")
    d.add_argument("model", choices=models + ["llama"],
                   help=f"the model: {', '.join(models)}, llama")
    d.add_argument("--stage", choices=STAGES, default="kernels",
                   help=f"the stage: {', '.join(STAGES)}")
    d.add_argument("--batch-size", type=int_at_least(1), default=None, metavar="B",
                   help="samples per step (default: 100; llama: 16 windows of 128 tokens)")
    add_dump_options(d)
    add_picture_options(d)
    add_compile_flags(d)
    add_precision_flag(d)
    d.add_argument("--quiet", action="store_true", help="no compile progress bar")
    d.set_defaults(fn=dump, parser=d)

    q = command("perplexity", "perplexity of a llama GGUF model on a text, with llama.cpp's "
                              "method")
    q.add_argument("model_file", metavar="MODEL.gguf", help="a llama model in llama.cpp's GGUF "
                                                          "layout")
    q.add_argument("--text", metavar="FILE", help="the text to score (UTF-8); required")
    q.add_argument("--split", default="tail:0.1", metavar="SPEC",
                   help="which part of the file: tail:F (its last F of bytes: the held-out "
                        "split), head:F (the rest), all")
    q.add_argument("--ctx", type=int_at_least(3), default=128, metavar="N",
                   help="tokens per chunk (n_ctx); the second half of each chunk is scored")
    q.add_argument("--batch-size", type=int_at_least(1), default=8, metavar="B",
                   help="chunks per compiled forward pass")
    q.add_argument("--chunks", type=int_at_least(1), default=None, metavar="N",
                   help="score only the first N chunks (llama-perplexity's --chunks); "
                        "default: all")
    q.add_argument("--kv-f16", action="store_true",
                   help="round K, V, queries and attention probabilities to float16 as "
                        "llama.cpp's F16 KV cache does (slower)")
    q.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    q.add_argument("--quiet", action="store_true", help="print only the JSON / the result")
    add_target_flags(q)
    add_lora_options(q)
    q.set_defaults(fn=lambda a: in_worker(score_perplexity, a), parser=q)

    n = command("generate", "generate text with a llama GGUF model: one compiled decode "
                            "program over a KV cache, streaming the text")
    n.add_argument("model_file", metavar="MODEL.gguf", help="a llama model in llama.cpp's GGUF "
                                                          "layout, with its tokenizer")
    n.add_argument("--prompt", default="", metavar="TEXT",
                   help="the text to continue (BOS added as the vocabulary says); default: none")
    n.add_argument("-n", "--n-predict", type=int_at_least(0), default=128, metavar="N",
                   help="tokens to generate (fewer when EOS comes first)")
    n.add_argument("--ctx", type=int_at_least(1), default=None, metavar="C",
                   help="context: the KV cache's capacity in tokens, which the prompt and N "
                        "must fit; default: 512 or the model's context length if smaller")
    n.add_argument("--temp", type=float_in(0), default=0.8, metavar="T",
                   help="sampling temperature; 0: greedy (argmax)")
    n.add_argument("--top-k", type=int_at_least(0), default=40, metavar="K",
                   help="sample among the K most likely tokens (0: all)")
    n.add_argument("--top-p", type=float_in(0, 1, lo_open=True, hi_open=False), default=0.95,
                   metavar="P", help="then among the fewest most likely tokens whose "
                                     "probabilities reach P (1: all)")
    n.add_argument("--seed", type=int_at_least(0), default=None, metavar="S",
                   help="sampling seed; default: random (reported with --json)")
    n.add_argument("--chunk", type=int_at_least(1), default=16, metavar="B",
                   help="prompt tokens per prefill program call")
    n.add_argument("--ignore-eos", action="store_true",
                   help="go on after the end-of-sequence token (always N tokens)")
    n.add_argument("--no-kv-f16", action="store_true",
                   help="keep K, V, queries and attention probabilities in float32 (default: "
                        "rounded to float16 as llama.cpp's F16 KV cache does)")
    n.add_argument("--dot", choices=("exact", "ggml"), default="exact",
                   help="products with Q8_0, Q4_K, Q6_K and F16 weights: exact (x in float32 "
                        "times each dequantized weight) or ggml (x converted as llama.cpp's CPU "
                        "backend does: quantized to 8 bits per block, integer dots; rounded to "
                        "f16 for F16 weights): faster, llama.cpp's rounding")
    n.add_argument("--no-mmap", action="store_true",
                   help="read the weights into the program's memory instead of mapping the "
                        "file's pages: slower to load, faster decode where anonymous memory "
                        "gets huge pages (as llama.cpp's --no-mmap)")
    add_threads_flag(n)
    n.add_argument("--json", action="store_true",
                   help="print one JSON object as the last line (tokens/s, timings, the text)")
    n.add_argument("--quiet", action="store_true",
                   help="no streamed text and no summary line: only the JSON")
    add_lora_options(n)
    add_target_flags(n)
    n.set_defaults(fn=lambda a: in_worker(generate_text, a), parser=n)

    x = command("export", "merge a LoRA adapter into a llama GGUF model, as llama.cpp's "
                          "export-lora does")
    x.add_argument("model_file", metavar="BASE.gguf", help="the base llama model")
    add_lora_options(x, required=True)
    x.add_argument("--out", required=True, metavar="MERGED.gguf", help="the merged model to write")
    add_ftype(x, "the merged weight matrices (norms stay f32)")
    x.add_argument("--quiet", action="store_true", help="no summary line")
    x.set_defaults(fn=export_lora, parser=x)

    add_finetune(command("finetune", "finetune a llama GGUF model on a text: LoRA adapters on "
                                     "the frozen model, or every weight"))

    from .plot import add_plot
    add_plot(command("plot", "draw the training and validation loss of run logs (--log) as a "
                             "PNG, one colour per run"))

    from .tokenize import add_tokenize
    add_tokenize(command("tokenize", "print the token ids of a text under a GGUF model's "
                                     "tokenizer, as llama.cpp's llama-tokenize does"))

    sub.add_parser("bench", help="fused against unfused benchmark suite (see `jitgraph bench "
                                 "--help`)", add_help=False)
    return p


def _interrupted(cmd, how, code):
    saved = []
    if Run.out:
        saved.append(f"{Run.out[0]} holds {Run.out[1]}")
    if Run.checkpoint:
        saved.append(f"last checkpoint: {Run.checkpoint} ({Run.unit} {Run.epoch}), continue "
                     f"with --resume {Run.checkpoint}")
    if Run.unsaved:
        saved.append("nothing was saved (neither --out nor --checkpoint was given)")
    start = "\n" if sys.stderr.isatty() else ""       # off the line of a progress bar or ^C
    print(f"{start}jitgraph {cmd}: {how}{''.join('; ' + s for s in saved)}", file=sys.stderr,
          flush=True)
    return code


def _show_warning(message, category, filename, lineno, file=None, line=None):
    print(f"jitgraph: warning: {message}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cmd = argv[0] if argv and not argv[0].startswith("-") else "jitgraph"
    Run.reset()
    old_handler = None
    with contextlib.suppress(ValueError):       # (only the main thread can set handlers)
        old_handler = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            if argv[:1] == ["bench"]:           # the suite parses its own options
                from .bench import main as bench_main
                return bench_main(argv[1:])
            p = parser()
            args = p.parse_args(argv)
            from ..runtime.cpu.threading import requested_threads
            try:
                if not getattr(args, "threads", None):    # (--threads replaces it)
                    requested_threads()
            except ValueError as e:
                args.parser.error(str(e))
            # the options given (a resume's overrides; --epochs's exclusions), train MODEL: its
            # own parser
            if args.cmd in ("train", "finetune") and (args.resume or getattr(args, "epochs", None)):
                args.given = _given(args.parser, argv[2:] if args.cmd == "train" else argv[1:])
            try:
                return args.fn(args)
            except BrokenPipeError:             # `jitgraph dump ... | head`: not an error
                with contextlib.suppress(OSError, ValueError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return 0
            except (ValueError, OSError) as e:
                print(f"jitgraph {args.cmd}: error: {_message(e)}", file=sys.stderr)
                return EXIT_ERROR
            except MemoryError as e:
                print(f"jitgraph {args.cmd}: error: {str(e) or 'out of memory'}; "
                      f"{_smaller(args)}", file=sys.stderr)
                return EXIT_ERROR
    except KeyboardInterrupt:
        return _interrupted(cmd, "interrupted (Ctrl-C)", EXIT_INTERRUPT)
    except Terminated:
        return _interrupted(cmd, "terminated (SIGTERM)", EXIT_TERMINATED)
    finally:
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)


def command(argv=None) -> None:
    """The `jitgraph` command's process entry (the console script and `python -m jitgraph.cli`):
    `main`, then exit with its status. After Ctrl-C or SIGTERM the process ends at once
    (os._exit, once stdout and stderr are flushed): the interpreter's finalisation would free
    the memory of a compiled call the signal cut short while the kernel's worker threads may
    still be in it, a segmentation fault instead of the exit status. Every file is written
    atomically, so nothing is left half written."""
    code = main(argv)
    if code in (EXIT_INTERRUPT, EXIT_TERMINATED):
        for f in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                f.flush()
        os._exit(code)
    sys.exit(code)


# the options that size each command's programs, named when a program does not fit in memory
_SIZES = {"train": "--batch-size", "train llama": "--ctx, --batch-size, --dim or --layers (or "
          "--recompute sqrt)", "finetune": "--ctx or --batch-size (or --recompute sqrt)",
          "generate": "--ctx", "perplexity": "--ctx or --batch-size", "eval": "--batch-size",
          "dump": "--batch-size"}


def _smaller(args) -> str:
    cmd = "train llama" if args.cmd == "train" and args.model == "llama" else args.cmd
    return f"try a smaller {_SIZES[cmd]}" if cmd in _SIZES else "try smaller sizes"


def _message(e) -> str:
    """An error in the user's terms: OSErrors as `path: reason`."""
    if isinstance(e, OSError) and e.strerror and e.filename:
        return f"{e.filename}: {e.strerror}"
    return str(e)
