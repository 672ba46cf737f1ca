"""ModelSpec: a zoo model's graph builder and its parameter layout in ggml's GGUF files."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class GGMLTensor:
    """How one param is stored for ggml. `ne` is ggml's dimension order (fastest first: what
    ggml_new_tensor_Nd takes and gguf reports); the stored data is the jitgraph array viewed as
    `split` (default: its own shape) and transposed by `axes`. axes=None: same element order, only
    the shape differs."""
    ne: tuple
    axes: tuple | None = None
    split: tuple | None = None

    def to_ggml(self, a: np.ndarray) -> np.ndarray:
        if self.axes is not None:
            a = a.reshape(self.split or a.shape).transpose(self.axes)
        return np.ascontiguousarray(a).reshape(self.ne[::-1])

    def from_ggml(self, t: np.ndarray, shape: tuple) -> np.ndarray:
        if self.axes is not None:
            split = self.split or shape
            t = t.reshape([split[i] for i in self.axes]).transpose(np.argsort(self.axes))
        return np.ascontiguousarray(t).reshape(shape)


@dataclass(frozen=True)
class ModelSpec:
    """A model of the zoo: `spec(batch)` builds its graph; `ggml` maps each param name (ggml's
    tensor name) to its GGUF layout."""
    name: str
    build: Callable
    ggml: dict

    def __call__(self, batch: int):
        return self.build(batch)

    @cached_property
    def param_shapes(self) -> dict:
        g = self.build(1)
        return {k: g.nodes[i].type.shape for k, i in g.params.items()}

    def _check(self, arrays: dict, shapes: dict, what: str, bf16: bool = False):
        """`arrays` are the model's `what` by name, each float of its shape (bf16: or bf16
        bits, uint16)."""
        if set(arrays) != set(shapes):
            missing, extra = sorted(set(shapes) - set(arrays)), sorted(set(arrays) - set(shapes))
            raise ValueError(f"{self.name}: {what} do not match the model (missing {missing}, "
                             f"unexpected {extra})")
        for k, shape in shapes.items():
            a = np.asarray(arrays[k])
            if a.shape != tuple(shape) or not (a.dtype.kind == "f" or
                                                (bf16 and a.dtype == np.uint16)):
                raise ValueError(f"{self.name}: {what[:-1]} {k} is {a.dtype}{list(a.shape)}, "
                                 f"expected float{list(shape)}"
                                 f"{' or bf16 bits (uint16)' if bf16 else ''}")

    def to_ggml(self, params: dict, keep_bf16: bool = False) -> dict:
        """jitgraph param arrays -> f32 arrays in ggml's layout (numpy shape = reversed ne);
        keep_bf16: bf16 ones (uint16 bits) stay bf16 bits (a checkpoint's bf16 master
        weights)."""
        self._check(params, self.param_shapes, "params", keep_bf16)

        def values(a):
            a = np.asarray(a)
            return a if keep_bf16 and a.dtype == np.uint16 else np.asarray(a, np.float32)
        return {k: t.to_ggml(values(params[k])) for k, t in self.ggml.items()}

    def from_ggml(self, tensors: dict) -> dict:
        """ggml-layout tensors (f32, or a checkpoint's bf16 bits) -> jitgraph param arrays."""
        self._check(tensors, {k: t.ne[::-1] for k, t in self.ggml.items()}, "tensors", True)
        return {k: t.from_ggml(tensors[k], self.param_shapes[k]) for k, t in self.ggml.items()}
