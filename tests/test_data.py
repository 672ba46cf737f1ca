"""jitgraph.formats.data: Dataset shuffling/batching/splitting, the MNIST IDX reader, synthetic digits."""
import gzip
import struct

import numpy as np
import pytest

from jitgraph import DataFormatError
from jitgraph.formats.data import Dataset, load_mnist, synthetic_digits


# ---- IDX files, written by hand from the format spec -------------------------------------------
def idx_bytes(magic, dims, payload):
    return struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in dims) + payload


def write(path, data):
    if path.endswith(".gz"):
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        with open(path, "wb") as f:
            f.write(data)
    return path


def make_mnist(d, prefix="train", n=5, gz=False, seed=0, images=None, labels=None):
    rng = np.random.default_rng(seed)
    img = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    lab = rng.integers(0, 10, n, dtype=np.uint8)
    ext = ".gz" if gz else ""
    ip = write(str(d / f"{prefix}-images-idx3-ubyte{ext}"),
               images if images is not None else idx_bytes(2051, (n, 28, 28), img.tobytes()))
    lp = write(str(d / f"{prefix}-labels-idx1-ubyte{ext}"),
               labels if labels is not None else idx_bytes(2049, (n,), lab.tobytes()))
    return img, lab, ip, lp


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("split,prefix", [("train", "train"), ("test", "t10k")])
def test_load_mnist_good_files(tmp_path, gz, split, prefix):
    img, lab, _, _ = make_mnist(tmp_path, prefix, n=7, gz=gz)
    ds = load_mnist(str(tmp_path), split)
    assert len(ds) == 7 and ds.x.dtype == np.float32 and ds.y.dtype == np.int32
    assert ds.x.shape == (7, 784)
    for i in range(7):
        for r in (0, 13, 27):
            for c in (0, 5, 27):
                assert ds.x[i, r * 28 + c] == np.float32(img[i, r, c]) / np.float32(255)
        assert ds.y[i] == lab[i]
    assert ds.x.min() >= 0 and ds.x.max() <= 1


def expect_error(tmp_path, path, *words):
    with pytest.raises(DataFormatError) as e:
        load_mnist(str(tmp_path), "train")
    msg = str(e.value)
    assert path in msg, msg
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("gz", [False, True])
def test_bad_magic(tmp_path, gz):
    good = np.zeros(3 * 784, np.uint8).tobytes()
    _, _, ip, _ = make_mnist(tmp_path, n=3, gz=gz, images=idx_bytes(2049, (3, 28, 28), good))
    expect_error(tmp_path, ip, "magic", "2049", "2051")


def test_bad_label_magic(tmp_path):
    _, _, _, lp = make_mnist(tmp_path, n=3, labels=idx_bytes(2051, (3,), bytes(3)))
    expect_error(tmp_path, lp, "magic")


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("cut", [1, 10, 784 * 2 + 3])
def test_truncated_images(tmp_path, gz, cut):
    data = idx_bytes(2051, (3, 28, 28), bytes(3 * 784))
    _, _, ip, _ = make_mnist(tmp_path, n=3, gz=gz, images=data[:-cut])
    expect_error(tmp_path, ip)


def test_trailing_data_and_wrong_dims(tmp_path):
    _, _, ip, _ = make_mnist(tmp_path, n=2, images=idx_bytes(2051, (2, 28, 28), bytes(2 * 784 + 1)))
    expect_error(tmp_path, ip, "trailing")
    _, _, ip, _ = make_mnist(tmp_path, n=2, images=idx_bytes(2051, (2, 27, 28), bytes(2 * 27 * 28)))
    expect_error(tmp_path, ip, "28x28")


def test_truncated_labels_and_count_mismatch(tmp_path):
    _, _, _, lp = make_mnist(tmp_path, n=4, labels=idx_bytes(2049, (4,), bytes(3)))
    expect_error(tmp_path, lp, "truncated")
    _, _, ip, lp = make_mnist(tmp_path, n=4, labels=idx_bytes(2049, (5,), bytes(5)))
    expect_error(tmp_path, lp, "4 images", "5 labels")
    _, _, _, lp = make_mnist(tmp_path, n=2, labels=idx_bytes(2049, (2,), bytes([3, 10])))
    expect_error(tmp_path, lp, "label 10")


def test_corrupt_gzip(tmp_path):
    make_mnist(tmp_path, n=2, gz=True)
    ip = str(tmp_path / "train-images-idx3-ubyte.gz")
    with open(ip, "rb") as f:
        data = f.read()
    with open(ip, "wb") as f:                       # a gzip stream cut in the middle
        f.write(data[: len(data) // 2])
    expect_error(tmp_path, ip)
    with open(ip, "wb") as f:                       # not gzip at all
        f.write(b"this is not gzip data" * 10)
    expect_error(tmp_path, ip)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        load_mnist(str(tmp_path), "train")
    with pytest.raises(ValueError, match="split"):
        load_mnist(str(tmp_path), "validation")


def test_real_mnist(testdata):
    """tests/data's MNIST subset (the first 6,000 train and 2,000 test images) against the IDX
    bytes read here with gzip and numpy, and MNIST's well-known first labels."""
    for split, prefix, n, first in (("train", "train", 6000, [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]),
                                    ("test", "t10k", 2000, [7, 2, 1, 0, 4, 1, 4, 9, 5, 9])):
        ds = load_mnist(testdata.mnist, split)
        with gzip.open(testdata.mnist / f"{prefix}-images-idx3-ubyte.gz") as f:
            images = f.read()
        with gzip.open(testdata.mnist / f"{prefix}-labels-idx1-ubyte.gz") as f:
            labels = f.read()
        assert struct.unpack(">4I", images[:16]) == (2051, n, 28, 28)
        assert struct.unpack(">2I", labels[:8]) == (2049, n)
        assert ds.x.shape == (n, 784) and ds.y.shape == (n,)
        np.testing.assert_array_equal(
            ds.x, np.frombuffer(images, np.uint8, offset=16).reshape(n, 784) / np.float32(255))
        np.testing.assert_array_equal(ds.y, np.frombuffer(labels, np.uint8, offset=8))
        assert ds.y[:10].tolist() == first
        assert ds.x.min() == 0 and ds.x.max() == 1
        counts = np.bincount(ds.y, minlength=10)
        assert counts.sum() == n and counts.min() > 0.08 * n and counts.max() < 0.12 * n


# ---- Dataset -----------------------------------------------------------------------------------
def numbered(n, shard_size=1):
    """x[i] = [i, -i], y[i] = i: every sample says where it came from."""
    i = np.arange(n)
    return Dataset(np.stack([i, -i], 1).astype(np.float32), i.astype(np.int32), shard_size)


def test_dataset_checks_lengths():
    with pytest.raises(ValueError, match="same number"):
        Dataset(np.zeros((3, 2)), np.zeros(4))
    with pytest.raises(ValueError, match="shard_size"):
        Dataset(np.zeros((3, 2)), np.zeros(3), shard_size=0)


def test_shuffle_is_a_seeded_permutation():
    ds = numbered(100)
    a, b, c = ds.shuffle(1), ds.shuffle(1), ds.shuffle(2)
    assert sorted(a.y) == list(range(100))
    assert np.array_equal(a.x[:, 0], a.y) and np.array_equal(a.x[:, 1], -a.y)   # pairs kept
    assert np.array_equal(a.y, b.y) and not np.array_equal(a.y, c.y)
    assert not np.array_equal(a.y, ds.y)
    assert np.array_equal(ds.y, np.arange(100))                                   # input untouched


@pytest.mark.parametrize("n,s", [(100, 10), (103, 10), (7, 3), (5, 8)])
def test_shuffle_moves_whole_shards(n, s):
    ds = numbered(n, shard_size=s)
    y = ds.shuffle(3).y
    assert sorted(y) == list(range(n))
    # split the output into runs of consecutive indices: each run is exactly one shard
    pos = 0
    shards = []
    while pos < n:
        start = y[pos]
        assert start % s == 0, y
        length = min(s, n - start)
        assert list(y[pos:pos + length]) == list(range(start, start + length)), y
        shards.append(start // s)
        pos += length
    assert sorted(shards) == list(range(-(-n // s)))
    if n // s >= 4:
        assert shards != sorted(shards)


def test_batches():
    ds = numbered(23)
    bs = list(ds.batches(5))
    assert len(bs) == ds.num_batches(5) == 4
    assert all(x.shape == (5, 2) and y.shape == (5,) for x, y in bs)
    assert np.array_equal(np.concatenate([y for _, y in bs]), np.arange(20))
    tail = list(ds.batches(5, drop_last=False))
    assert len(tail) == ds.num_batches(5, drop_last=False) == 5 and tail[-1][1].tolist() == [20, 21, 22]
    assert list(numbered(4).batches(5)) == []
    with pytest.raises(ValueError):
        list(ds.batches(0))


def test_split():
    ds = numbered(50)
    tr, va = ds.split(0.2, seed=4)
    assert len(tr) == 40 and len(va) == 10
    assert sorted(np.concatenate([tr.y, va.y])) == list(range(50))
    tr2, va2 = ds.split(0.2, seed=4)
    assert np.array_equal(tr.y, tr2.y) and np.array_equal(va.y, va2.y)
    assert len(ds.split(0.0, seed=0)[1]) == 0
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="val_fraction"):
            ds.split(bad, seed=0)


# ---- synthetic digits --------------------------------------------------------------------------
def test_synthetic_digits_deterministic_and_balanced():
    a, b, c = synthetic_digits(1003, seed=7), synthetic_digits(1003, seed=7), synthetic_digits(1003, 8)
    assert a.x.shape == (1003, 784) and a.x.dtype == np.float32 and a.y.dtype == np.int32
    assert np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y)
    assert not np.array_equal(a.x, c.x)
    counts = np.bincount(a.y, minlength=10)
    assert counts.max() - counts.min() <= 1
    assert a.x.min() >= 0 and a.x.max() <= 1
    ink = (a.x > 0.5).mean(1)                      # every image has a drawn digit, none is filled
    assert ink.min() > 0.02 and ink.max() < 0.5


def test_synthetic_digits_learnable_but_not_trivial():
    """A nearest-class-mean classifier: far above chance, yet far from perfect (it gets ~82 % on
    real MNIST), so the classes differ but a model has to learn more than templates."""
    tr, te = synthetic_digits(3000, seed=0), synthetic_digits(1000, seed=1)
    means = np.stack([tr.x[tr.y == k].mean(0) for k in range(10)])
    pred = ((te.x[:, None, :] - means[None]) ** 2).sum(-1).argmin(1)
    acc = (pred == te.y).mean()
    assert 0.35 < acc < 0.9, acc
