"""Data sets for training: `Dataset` (shuffle by shards, fixed-size batches, train/validation split,
in the spirit of ggml_opt_dataset), the MNIST IDX reader, and a built-in procedural digit set."""
from __future__ import annotations

import gzip
import math
import os
import zlib

import numpy as np

from ..errors import DataFormatError


class Dataset:
    """Samples `x[i]` with labels `y[i]` (both along axis 0).

    shard_size: `shuffle` permutes blocks of this many consecutive samples (ggml's ndata_shard);
    1 shuffles single samples.
    """

    def __init__(self, x, y, shard_size: int = 1):
        x, y = np.asarray(x), np.asarray(y)
        if x.ndim == 0 or y.ndim == 0 or len(x) != len(y):
            raise ValueError(f"Dataset: x {x.shape} and y {y.shape} must hold the same number of "
                             f"samples along axis 0")
        if int(shard_size) < 1:
            raise ValueError(f"Dataset: shard_size must be >= 1, got {shard_size}")
        self.x, self.y, self.shard_size = x, y, int(shard_size)

    def __len__(self) -> int:
        return len(self.x)

    def __repr__(self) -> str:
        return (f"<Dataset {len(self)} samples: x {self.x.dtype}{list(self.x.shape[1:])}, "
                f"y {self.y.dtype}{list(self.y.shape[1:])}>")

    def _take(self, idx) -> "Dataset":
        return Dataset(self.x[idx], self.y[idx], self.shard_size)

    def shuffle(self, seed: int) -> "Dataset":
        """A new Dataset with the shards in a random order (samples keep their order in a shard)."""
        n, s = len(self), self.shard_size
        nshards = -(-n // s)
        rank = np.empty(nshards, np.int64)
        rank[np.random.default_rng(seed).permutation(nshards)] = np.arange(nshards)
        return self._take(np.argsort(rank[np.arange(n) // s], kind="stable"))

    def split(self, val_fraction: float, seed: int) -> tuple["Dataset", "Dataset"]:
        """(train, val): shuffle with `seed`, the last round(n * val_fraction) samples validate."""
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"split: val_fraction must be in [0, 1), got {val_fraction}")
        shuffled = self.shuffle(seed)
        ntrain = len(self) - int(round(len(self) * val_fraction))
        return shuffled._take(slice(0, ntrain)), shuffled._take(slice(ntrain, None))

    def num_batches(self, batch_size: int, drop_last: bool = True) -> int:
        return len(self) // batch_size if drop_last else -(-len(self) // batch_size)

    def batches(self, batch_size: int, drop_last: bool = True):
        """Yield (x, y) views of `batch_size` consecutive samples; the last, shorter batch only
        with drop_last=False."""
        if int(batch_size) < 1:
            raise ValueError(f"batches: batch_size must be >= 1, got {batch_size}")
        for i in range(self.num_batches(batch_size, drop_last)):
            sl = slice(i * batch_size, (i + 1) * batch_size)
            yield self.x[sl], self.y[sl]


# ---- MNIST IDX files ---------------------------------------------------------------------------
_IDX = {"images": (2051, 3, "idx3"), "labels": (2049, 1, "idx1")}
_PREFIX = {"train": "train", "test": "t10k"}
_DEFLATE_MAX_RATIO = 1032     # deflate never expands more: 258 bytes from a 2-bit code


def _find(directory, split, kind):
    base = os.path.join(directory, f"{_PREFIX[split]}-{kind}-{_IDX[kind][2]}-ubyte")
    for path in (base, base + ".gz"):
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"MNIST {split} {kind} not found: expected {base} or {base}.gz")


def _fail(path, msg):
    raise DataFormatError(f"{path}: {msg}")


def _read_upto(f, n):
    """At most n bytes from a (gzip) stream, read in chunks so that memory grows with the data
    that is really there, not with what a header declares."""
    chunks, got = [], 0
    while got < n:
        chunk = f.read(min(n - got, 1 << 22))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_idx(path, kind: str) -> np.ndarray:
    """One IDX file ("images": u8 [n, rows, cols], magic 2051; "labels": u8 [n], magic 2049),
    raw or gzip-compressed (by the .gz suffix). The header's counts are checked against the file's
    length before anything is allocated (a raw file must hold exactly the declared bytes; a gzip
    file must be big enough to hold them at deflate's best ratio, and is decompressed no further
    than the declared size plus one byte). Missing or unreadable files raise OSError; anything
    wrong inside one, jitgraph.DataFormatError (a ValueError) naming the file."""
    path, (magic, ndim, _) = os.fspath(path), _IDX[kind]
    header = 4 + 4 * ndim
    gz = path.endswith(".gz")
    with open(path, "rb") as raw:
        size = os.fstat(raw.fileno()).st_size
        try:
            f = gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw
            head = _read_upto(f, header)
            if len(head) < header:
                _fail(path, f"truncated header ({len(head)} bytes, expected {header})")
            got = int.from_bytes(head[:4], "big")
            if got != magic:
                _fail(path, f"bad magic number {got} (expected {magic} for MNIST {kind})")
            dims = tuple(int.from_bytes(head[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
            if kind == "images" and dims[1:] != (28, 28):
                _fail(path, f"images are {dims[1]}x{dims[2]}, expected 28x28")
            body = math.prod(dims)
            what = f"{dims[0]} {kind}"
            if not gz and header + body != size:
                _fail(path, f"{size} bytes, expected {header + body} for {what} "
                            f"({'truncated' if size < header + body else 'trailing data'})")
            if gz and header + body > _DEFLATE_MAX_RATIO * size:
                _fail(path, f"the header declares {what} ({header + body} bytes), more than a "
                            f"{size}-byte gzip file can hold; truncated or corrupt")
            data = _read_upto(f, body)
            if len(data) < body:
                _fail(path, f"{header + len(data)} bytes, expected {header + body} for {what} "
                            f"(truncated)")
            if gz and f.read(1):          # at the end, this also checks the gzip CRC and length
                _fail(path, f"more than the {header + body} bytes declared for {what} "
                            f"(trailing data)")
        except (OSError, EOFError, zlib.error) as e:     # gzip: bad header, CRC, cut stream
            _fail(path, f"cannot read MNIST {kind} file ({type(e).__name__}: {e})")
    return np.frombuffer(data, np.uint8).reshape(dims)


def load_mnist(directory, split: str = "train") -> Dataset:
    """MNIST from `directory` ({train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]): x f32 [n, 784]
    scaled to [0, 1], y i32 [n]."""
    if split not in _PREFIX:
        raise ValueError(f"load_mnist: split must be 'train' or 'test', got {split!r}")
    ipath, lpath = _find(directory, split, "images"), _find(directory, split, "labels")
    images, labels = read_idx(ipath, "images"), read_idx(lpath, "labels")
    if len(images) != len(labels):
        raise DataFormatError(f"{ipath} holds {len(images)} images but {lpath} holds "
                              f"{len(labels)} labels")
    if labels.size and labels.max() > 9:
        raise DataFormatError(f"{lpath}: label {labels.max()} out of range (expected 0..9)")
    x = images.reshape(len(images), -1).astype(np.float32) / np.float32(255)
    return Dataset(x, labels.astype(np.int32))


# ---- built-in procedural digits ----------------------------------------------------------------
# Glyphs in a canonical frame: x right, y down, the digit spans y in [-1, 1]. A stroke is a line
# ("L", x0, y0, x1, y1) or an elliptical arc ("A", cx, cy, rx, ry, deg0, deg1), angles clockwise on
# screen from +x. Each digit has one or more variants (handwriting styles).
def L(x0, y0, x1, y1): return ("L", x0, y0, x1, y1)
def A(cx, cy, rx, ry, t0, t1): return ("A", cx, cy, rx, ry, t0, t1)


GLYPHS = {
    0: [[A(0, 0, 0.55, 0.95, -90, 270)], [A(0, 0, 0.5, 0.95, -100, 290)]],
    1: [[L(0.05, -0.95, -0.05, 0.95)],
        [L(-0.3, -0.65, 0.05, -0.95), L(0.05, -0.95, 0, 0.95)],
        [L(-0.3, -0.65, 0.05, -0.95), L(0.05, -0.95, 0, 0.95), L(-0.3, 0.95, 0.3, 0.95)]],
    2: [[A(0, -0.45, 0.5, 0.5, 190, 400), L(0.38, -0.13, -0.5, 0.95), L(-0.5, 0.95, 0.55, 0.95)],
        [A(0, -0.45, 0.5, 0.5, 190, 380), A(-0.9, -0.3, 1.35, 1.25, 0, 60),
         L(-0.22, 0.8, 0.6, 0.9)]],
    3: [[A(0, -0.5, 0.45, 0.45, 200, 450), A(0, 0.45, 0.5, 0.5, 270, 520)],
        [L(-0.45, -0.95, 0.45, -0.95), L(0.45, -0.95, -0.05, -0.1),
         A(0, 0.42, 0.5, 0.53, 265, 520)]],
    4: [[L(0.3, -0.95, -0.55, 0.35), L(-0.55, 0.35, 0.6, 0.35), L(0.3, -0.45, 0.3, 0.95)],
        [L(-0.45, -0.95, -0.5, 0.3), L(-0.5, 0.3, 0.55, 0.3), L(0.35, -0.95, 0.35, 0.95)]],
    5: [[L(0.5, -0.95, -0.35, -0.95), L(-0.35, -0.95, -0.42, 0.05), A(0, 0.4, 0.55, 0.55, 220, 510)],
        [L(-0.35, -0.95, -0.42, 0.05), L(-0.35, -0.95, 0.5, -0.9), A(0, 0.4, 0.5, 0.55, 210, 500)]],
    6: [[A(0.55, 0.45, 1.05, 1.4, -95, -180), A(0, 0.45, 0.5, 0.5, 0, 360)],
        [L(0.35, -0.95, -0.5, 0.45), A(0, 0.45, 0.5, 0.5, 0, 360)]],
    7: [[L(-0.5, -0.95, 0.55, -0.95), L(0.55, -0.95, -0.1, 0.95)],
        [L(-0.5, -0.95, 0.55, -0.95), L(0.55, -0.95, -0.1, 0.95), L(-0.1, 0, 0.5, 0)],
        [L(-0.5, -0.7, -0.5, -0.95), L(-0.5, -0.95, 0.55, -0.95), A(-1.3, -0.95, 1.85, 1.9, 0, 60)]],
    8: [[A(0, -0.5, 0.42, 0.45, 0, 360), A(0, 0.45, 0.52, 0.5, 0, 360)],
        [A(0.06, -0.5, 0.4, 0.45, 0, 360), A(-0.06, 0.45, 0.5, 0.5, 0, 360)]],
    9: [[A(0, -0.45, 0.5, 0.5, 0, 360), L(0.5, -0.45, 0.35, 0.95)],
        [A(0, -0.45, 0.5, 0.5, 0, 360), A(-0.6, -0.45, 1.1, 1.4, 0, 75)]],
}
_SEGMENTS = 96      # line segments per glyph (padding has zero length, so zero weight)
_CHUNK = 1024       # samples rendered at once (a constant: the output must not depend on it)
_RANGES = {         # per-sample distortions, each uniform in [lo, hi]
    "warp_ax": (0, 0.18), "warp_ay": (0, 0.18),                     # smooth sinusoidal warp
    "fxx": (-3, 3), "fxy": (-3, 3), "fyx": (-3, 3), "fyy": (-3, 3),
    "phx": (0, 2 * np.pi), "phy": (0, 2 * np.pi),
    "rot": (-20, 20), "shear": (-0.35, 0.35),                        # degrees; x += shear * y
    "scale": (0.75, 1.15), "log_aspect": (-0.15, 0.15),
    "dx": (-2.5, 2.5), "dy": (-2.5, 2.5),                            # pixels from the centre
    "sigma": (0.6, 1.1), "gain": (1.0, 1.8),                         # stroke blur and contrast
    "noise": (0, 0.3),                                               # pixel noise std
    "gap_start": (0, _SEGMENTS), "gap_len": (0, 20),                 # a break in the pen stroke
}


def _stroke_points(s, n):
    t = np.linspace(0.0, 1.0, n)
    if s[0] == "L":
        _, x0, y0, x1, y1 = s
        return np.stack([x0 + t * (x1 - x0), y0 + t * (y1 - y0)], 1)
    _, cx, cy, rx, ry, t0, t1 = s
    th = np.radians(t0 + t * (t1 - t0))
    return np.stack([cx + rx * np.cos(th), cy + ry * np.sin(th)], 1)


def _glyph_segments(strokes):
    """[_SEGMENTS, end, xy] segment endpoints, spread over the strokes by arc length."""
    fine = [_stroke_points(s, 1024) for s in strokes]
    arcs = [np.concatenate([[0], np.cumsum(np.hypot(*np.diff(f, axis=0).T))]) for f in fine]
    total = sum(arc[-1] for arc in arcs)
    segs = np.zeros((_SEGMENTS, 2, 2))
    i = 0
    for f, arc in zip(fine, arcs):
        k = max(1, int((_SEGMENTS - len(strokes)) * arc[-1] / total))
        at = np.linspace(0, arc[-1], k + 1)
        pts = np.stack([np.interp(at, arc, f[:, 0]), np.interp(at, arc, f[:, 1])], 1)
        segs[i:i + k, 0], segs[i:i + k, 1] = pts[:-1], pts[1:]
        i += k
    return segs


_SEGS = np.stack([_glyph_segments(v) for d in range(10) for v in GLYPHS[d]]).astype(np.float32)
_SEGS_X, _SEGS_Y = np.ascontiguousarray(_SEGS[..., 0]), np.ascontiguousarray(_SEGS[..., 1])
_NVARIANTS = np.array([len(GLYPHS[d]) for d in range(10)])
_FIRST_VARIANT = np.concatenate([[0], np.cumsum(_NVARIANTS)[:-1]])


def synthetic_digits(n: int, seed: int = 0) -> Dataset:
    """`n` procedurally drawn 28x28 digits (x f32 [n, 784] in [0, 1], y i32 [n], classes balanced),
    deterministic from `seed`: a random handwriting variant per digit, a smooth random warp,
    rotation, anisotropic scale, shear and translation, random stroke width and contrast, and
    pixel noise (ranges in _RANGES)."""
    rng = np.random.default_rng(seed)
    y = rng.permutation(np.arange(n) % 10).astype(np.int32)
    variant = _FIRST_VARIANT[y] + (rng.random(n) * _NVARIANTS[y]).astype(np.int64)
    params = {k: rng.uniform(lo, hi, (n, 1, 1)).astype(np.float32) for k, (lo, hi) in _RANGES.items()}
    x = np.empty((n, 784), np.float32)
    for lo in range(0, n, _CHUNK):
        sl = slice(lo, lo + _CHUNK)
        x[sl] = _render(variant[sl], {k: v[sl] for k, v in params.items()}, rng).reshape(-1, 784)
    return Dataset(x, y)


_GRID = np.arange(28, dtype=np.float32)


def _render(variant, p, rng):
    """Each glyph is a chain of short segments splatted as Gaussians weighted by their length (a
    blurred line integral); the Gaussian is separable, so the chunk renders as one batched matmul."""
    x0, y0 = _SEGS_X[variant], _SEGS_Y[variant]                             # [c, S, end]
    x1 = x0 + p["warp_ax"] * np.sin(p["fxx"] * x0 + p["fxy"] * y0 + p["phx"])
    y1 = y0 + p["warp_ay"] * np.sin(p["fyx"] * x0 + p["fyy"] * y0 + p["phy"])
    rot = np.radians(p["rot"])
    c, s, sh = np.cos(rot), np.sin(rot), p["shear"]                         # R @ Shear @ diag(sx, sy)
    sx = 9.5 * p["scale"] * np.exp(p["log_aspect"])
    sy = 9.5 * p["scale"] * np.exp(-p["log_aspect"])
    col = c * sx * x1 + (c * sh - s) * sy * y1 + (13.5 + p["dx"])
    row = s * sx * x1 + (s * sh + c) * sy * y1 + (13.5 + p["dy"])
    weight = np.hypot(col[..., 1] - col[..., 0], row[..., 1] - row[..., 0])   # [c, S]
    weight /= np.sqrt(2 * np.pi) * p["sigma"][:, :, 0]
    k = np.arange(_SEGMENTS) - p["gap_start"][:, :, 0]
    weight[(k >= 0) & (k < p["gap_len"][:, :, 0])] = 0
    col, row = col.mean(-1), row.mean(-1)                                   # segment midpoints
    inv = 1 / (2 * p["sigma"] ** 2)
    gx = np.exp(-inv * (_GRID - col[:, :, None]) ** 2)                      # [c, S, 28]
    gy = np.exp(-inv * (_GRID[:, None] - row[:, None, :]) ** 2)             # [c, 28, S]
    gy *= weight[:, None, :]
    img = np.matmul(gy, gx)                                                 # [c, row, col]
    img *= p["gain"]
    img += p["noise"] * rng.standard_normal(img.shape, dtype=np.float32)
    return np.clip(img, 0.0, 1.0, out=img)
