"""Error classes of jitgraph's file loaders: each loader ends in its own class on bad input (and
only there), a `ValueError` whose message names the file and what was wrong. Missing files and
permission errors stay `OSError`s. `GraphFormatError` (graph JSON) lives in serialize.py.
`NonFiniteError` is a model that loads but computes NaN/Inf."""


class ModelFormatError(ValueError):
    """A GGUF model or checkpoint file that is malformed, truncated, or not the expected model."""


class DataFormatError(ValueError):
    """A data file (MNIST IDX, raw or gzip) that is malformed, truncated or inconsistent."""


class NonFiniteError(ValueError):
    """A model whose logits came out NaN or infinite (generate, perplexity): the message names the
    likely cause (a weight or adapter tensor holding NaN/Inf, or an adapter scale that
    overflows)."""
