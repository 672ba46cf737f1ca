"""jitgraph.models: MNIST graphs (shapes, params, outputs) and their ggml layout, checked against a
numpy forward pass written in ggml's own terms (mnist-common.cpp)."""
import math

import numpy as np
import pytest

import jitgraph as jg
from jitgraph.formats.data import synthetic_digits
from jitgraph.models import MODELS, mnist_cnn, mnist_fc
from jitgraph.testing import check_grad

SHAPES = {
    "mnist-fc": {"fc1.weight": (784, 500), "fc1.bias": (500,), "fc2.weight": (500, 10),
                 "fc2.bias": (10,)},
    "mnist-cnn": {"conv1.kernel": (8, 1, 3, 3), "conv1.bias": (8, 1, 1),
                  "conv2.kernel": (16, 8, 3, 3), "conv2.bias": (16, 1, 1),
                  "dense.weight": (784, 10), "dense.bias": (10,)},
}
FAN_IN = {"fc1": 784, "fc2": 500, "conv1": 9, "conv2": 72, "dense": 784}


def feed(batch, seed=0):
    ds = synthetic_digits(batch, seed)
    return {"x": ds.x, "y": ds.y}


def test_registry():
    assert MODELS["mnist-fc"].build is mnist_fc and MODELS["mnist-cnn"].build is mnist_cnn
    assert set(MODELS) == {"mnist-fc", "mnist-cnn"}


@pytest.mark.parametrize("name,count", [("mnist-fc", 784 * 500 + 500 + 500 * 10 + 10),
                                        ("mnist-cnn", 8 * 9 + 8 + 16 * 8 * 9 + 16 + 784 * 10 + 10)])
def test_graph_signature(name, count):
    g = MODELS[name](32)
    types = {k: (g.nodes[i].type.dtype, g.nodes[i].type.shape) for k, i in g.inputs.items()}
    assert types == {"x": ("f32", (32, 784)), "y": ("i32", (32,))}
    shapes = {k: g.nodes[i].type.shape for k, i in g.params.items()}
    assert shapes == SHAPES[name]
    assert sum(math.prod(s) for s in shapes.values()) == count
    assert set(g.trainable_params()) == set(shapes)
    out = {k: (g.nodes[i].type.dtype, g.nodes[i].type.shape) for k, i in g.outputs.items()}
    assert out == {"loss": ("f32", ()), "logits": ("f32", (32, 10)), "correct": ("i32", ())}
    assert MODELS[name].param_shapes == shapes
    g.validate()


@pytest.mark.parametrize("name", list(MODELS))
def test_init_like_pytorch(name):
    p = MODELS[name](1).init_params(seed=3)
    for k, a in p.items():
        bound = 1 / math.sqrt(FAN_IN[k.split(".")[0]])
        assert a.dtype == np.float32 and np.abs(a).max() <= bound, k
        if a.size >= 100:   # uniform on [-b, b]: std b/sqrt(3)
            assert abs(a.std() - bound / math.sqrt(3)) < 0.15 * bound, k
    q = MODELS[name](1).init_params(seed=4)
    assert all(not np.array_equal(p[k], q[k]) for k in p)


# ---- the forward pass as ggml computes it, on params in ggml's layout ---------------------------
def ggml_mul_mat(a, b):
    """ggml_mul_mat(a, b): ne [k, m] x ne [k, n] -> ne [m, n]; in numpy terms b @ a.T."""
    return b @ a.T


def ggml_conv_2d_pad1(kernel, x):
    """ggml_conv_2d(kernel ne [3,3,C,O], x ne [W,H,C,B], stride 1, padding 1): cross-correlation."""
    b, _, h, w = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = np.zeros((b, kernel.shape[0], h, w))
    for i in range(3):
        for j in range(3):
            out += np.einsum("oc,bchw->bohw", kernel[:, :, i, j], xp[:, :, i:i + h, j:j + w])
    return out


def ggml_pool_max_2(x):
    b, c, h, w = x.shape
    return x.reshape(b, c, h // 2, 2, w // 2, 2).max(axis=(3, 5))


def ggml_logits(arch, t, images):
    """mnist_model_build from mnist-common.cpp; `t` holds numpy arrays of shape reversed(ne)."""
    relu = lambda v: np.maximum(v, 0)  # noqa: E731
    if arch == "mnist-fc":
        fc1 = relu(ggml_mul_mat(t["fc1.weight"], images) + t["fc1.bias"])
        return ggml_mul_mat(t["fc2.weight"], fc1) + t["fc2.bias"]
    x = images.reshape(-1, 1, 28, 28)                                 # ggml_reshape_4d(28, 28, 1, B)
    x = ggml_pool_max_2(relu(ggml_conv_2d_pad1(t["conv1.kernel"], x) + t["conv1.bias"]))
    x = ggml_pool_max_2(relu(ggml_conv_2d_pad1(t["conv2.kernel"], x) + t["conv2.bias"]))
    dense_in = x.transpose(0, 2, 3, 1).reshape(len(x), -1)           # permute(1, 2, 0, 3) + cont
    return ggml_mul_mat(t["dense.weight"], dense_in) + t["dense.bias"]


@pytest.mark.parametrize("name", list(MODELS))
def test_forward_matches_ggml_on_converted_params(name):
    spec, b = MODELS[name], 16
    g = spec(b)
    params = g.init_params(seed=1)
    inputs = feed(b)
    out = jg.interp.run(g, inputs, params)
    tensors = {k: v.astype(np.float64) for k, v in spec.to_ggml(params).items()}
    ref = ggml_logits(name, tensors, inputs["x"].astype(np.float64))
    np.testing.assert_allclose(out["logits"], ref, rtol=1e-4, atol=1e-5)
    assert np.array_equal(out["logits"].argmax(1), ref.argmax(1))
    # loss and correct from the logits, by their definitions
    z = ref - ref.max(1, keepdims=True)
    ce = np.mean(np.log(np.exp(z).sum(1)) - z[np.arange(b), inputs["y"]])
    assert out["loss"] == pytest.approx(ce, rel=1e-4)
    assert out["correct"] == int(np.sum(ref.argmax(1) == inputs["y"]))


@pytest.mark.parametrize("name", list(MODELS))
def test_ggml_conversion_round_trip_and_checks(name):
    spec = MODELS[name]
    params = spec(1).init_params(seed=2)
    t = spec.to_ggml(params)
    assert {k: a.shape[::-1] for k, a in t.items()} == {k: v.ne for k, v in spec.ggml.items()}
    back = spec.from_ggml(t)
    assert all(np.array_equal(back[k], params[k]) for k in params)
    with pytest.raises(ValueError, match="missing"):
        spec.to_ggml({k: v for k, v in params.items() if not k.endswith("bias")})
    bad = dict(params)
    k0 = next(iter(bad))
    bad[k0] = bad[k0][..., :1]
    with pytest.raises(ValueError, match=k0):
        spec.to_ggml(bad)


def test_cnn_dense_weight_order():
    """ggml's dense.weight[k, (h*7 + w)*16 + c] is jitgraph's dense.weight[c*49 + h*7 + w, k]."""
    spec = MODELS["mnist-cnn"]
    params = spec(1).init_params(seed=5)
    wg = spec.to_ggml(params)["dense.weight"]
    wj = params["dense.weight"]
    rng = np.random.default_rng(0)
    for _ in range(200):
        k, h, w, c = rng.integers(10), rng.integers(7), rng.integers(7), rng.integers(16)
        assert wg[k, (h * 7 + w) * 16 + c] == wj[c * 49 + h * 7 + w, k]


@pytest.mark.parametrize("name", list(MODELS))
def test_model_gradients(name):
    g = MODELS[name](2)
    params = g.init_params(seed=0)
    check_grad(g, feed(2, seed=3), params, loss="loss", max_elements=12, rtol=1e-5, atol=1e-8)
