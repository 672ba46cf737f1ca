"""The jitgraph command line: train, eval, dump, perplexity, generate, export, finetune, tokenize,
bench.

Exit status: 0 success, 1 a benchmark failed, 2 a usage or input error (one line naming the
option or file), 130 interrupted by Ctrl-C, 143 terminated by SIGTERM. Every option and output
path is checked before anything is compiled or trained.

One module per job: main.py (the parser and `main`), common.py (option types and helpers every
command shares), mnist.py (train / eval / dump of the MNIST models), llama.py (perplexity,
generate, export), llama_train.py (train llama, finetune, dump llama), tokenize.py, bench.py
(with workloads.py, roofline.py, report.py). `jitgraph.cli.main` is the function (it returns the exit
status), not the module main.py; `jitgraph.cli.command` is the console script's entry point.
"""
from .main import command, main, parser  # noqa: F401
