"""Fused CUDA kernels for the hot ops of a training step (CuPy's ``RawModule`` and
``ElementwiseKernel``, compiled on first use and cached by CuPy).

A GPU step is bound by the host: each CuPy call costs ~20 µs of Python and a launch, whatever
its size. These kernels do in one or two launches what the generic ``xp`` code does in many:

- ``cross_entropy_rows`` / ``cross_entropy_rows_backward``: ``cross_entropy`` over ``(N, C)``
  logits with class-index targets, no class weight and no label smoothing (the common case):
  2 launches forward (one warp per row writes the log-probabilities, the loss and the weight
  of each row; one block reduces the rows, deterministically) and 1 backward, where the
  generic code takes ~25 and ~8;
- ``threshold_backward``: ReLU's gradient in 1 launch (3 generic);
- ``add_scaled_``: ``x += alpha * other`` in 1 launch (2 generic);
- ``sum_leading``: a bias gradient (the sum over the batch) in 1 launch of ~10 µs host time
  (CuPy's reduction: ~40 µs).

Semantics are the generic code's: NaN propagates, an ignored target weighs 0, a class index
out of range weighs NaN (no host check: that would block the host on the GPU).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

_ROWS_SOURCE = r"""
template <typename T>
__global__ void ce_rows(const T* __restrict__ x, const long long* __restrict__ target,
                        T* __restrict__ log_probs, T* __restrict__ losses,
                        T* __restrict__ weights, long long rows, long long classes,
                        long long ignore_index) {
    long long row = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (row >= rows) return;  // a whole warp at once: the shuffles below stay converged
    const T* xr = x + row * classes;
    T* lr = log_probs + row * classes;
    T m = -__int_as_float(0x7f800000);  // -inf
    bool nan = false;
    for (long long j = lane; j < classes; j += 32) {
        T v = xr[j];
        nan |= isnan(v);
        m = v > m ? v : m;
    }
    for (int o = 16; o > 0; o >>= 1) {
        T other = __shfl_xor_sync(0xffffffffu, m, o);
        m = other > m ? other : m;
    }
    // As NumPy's max: a NaN propagates.
    if (__any_sync(0xffffffffu, nan)) m = __int_as_float(0x7fffffff);
    T s = 0;
    for (long long j = lane; j < classes; j += 32) s += exp(xr[j] - m);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    T log_s = log(s);
    for (long long j = lane; j < classes; j += 32) lr[j] = (xr[j] - m) - log_s;
    if (lane == 0) {
        long long t = target[row];
        T w = 1;
        if (t == ignore_index) { w = 0; t = 0; }
        else if (t < 0 || t >= classes) { w = __int_as_float(0x7fffffff); t = 0; }  // NaN
        losses[row] = -(w * ((xr[t] - m) - log_s));
        weights[row] = w;
    }
}

template <typename T>
__global__ void ce_reduce(const T* __restrict__ losses, const T* __restrict__ weights,
                          T* __restrict__ out, long long rows, int mean) {
    __shared__ T sl[256];
    __shared__ T sw[256];
    T a = 0, b = 0;
    for (long long i = threadIdx.x; i < rows; i += 256) { a += losses[i]; b += weights[i]; }
    sl[threadIdx.x] = a;
    sw[threadIdx.x] = b;
    __syncthreads();
    for (int s = 128; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            sl[threadIdx.x] += sl[threadIdx.x + s];
            sw[threadIdx.x] += sw[threadIdx.x + s];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        out[0] = mean ? sl[0] / sw[0] : sl[0];
        out[1] = sw[0];
    }
}

// Column sums of a C-contiguous (rows, cols) array, accumulated in double: a block of 32x32
// threads per 32 columns, each thread a strided share of the rows, then the 32 partial sums
// of a column in a fixed order (deterministic).
template <typename T>
__global__ void sum_rows(const T* __restrict__ x, T* __restrict__ out, long long rows,
                         long long cols) {
    __shared__ double part[32][33];
    long long c = blockIdx.x * 32LL + threadIdx.x;
    double s = 0;
    if (c < cols) {
        for (long long r = threadIdx.y; r < rows; r += 32) s += (double)x[r * cols + c];
    }
    part[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < cols) {
        double t = 0;
        for (int k = 0; k < 32; ++k) t += part[k][threadIdx.x];
        out[c] = (T)t;
    }
}
"""

_CTYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
_REDUCTIONS = {"mean": 0, "sum": 1, "none": 2}


class FusedKernels:
    """The fused kernels of one CuPy module; methods return ``None`` where a case is not
    covered (the caller then runs the generic code)."""

    def __init__(self, cupy: Any) -> None:
        self.cupy = cupy

    @functools.cached_property
    def _rows_module(self) -> Any:
        kernels = ("ce_rows", "ce_reduce", "sum_rows")
        names = [f"{k}<{t}>" for k in kernels for t in _CTYPES.values()]
        return self.cupy.RawModule(code=_ROWS_SOURCE, name_expressions=names)

    @functools.cached_property
    def _rows_backward(self) -> Any:
        return self.cupy.ElementwiseKernel(
            "T lp, raw int64 target, raw T weight, raw T g, raw T denominator, "
            "int64 classes, int32 mode",
            "T grad",
            """
            long long row = i / classes;
            T w = weight[row];
            T d = denominator[0] == (T)0 ? (T)1 : denominator[0];  // all weights 0: grad 0
            T scale = mode == 2 ? g[row] : (mode == 1 ? g[0] : g[0] / d);
            T p = exp(lp) * w;
            grad = (i - row * classes == target[row] ? p - w : p) * scale;
            """,
            "aioautograd_cross_entropy_rows_backward",
        )

    @functools.cached_property
    def _threshold_backward(self) -> Any:
        return self.cupy.ElementwiseKernel(
            "G g, O out",
            "G y",
            "y = out <= (O)0 ? (G)0 : g",
            "aioautograd_threshold_backward",
        )

    @functools.cached_property
    def _add_scaled(self) -> Any:
        return self.cupy.ElementwiseKernel(
            "T other, T alpha",
            "T x",
            "T scaled = other * alpha; x = x + scaled",
            "aioautograd_add_scaled",
        )

    def cross_entropy_rows(
        self, x: Any, target: Any, ignore_index: int, reduction: str
    ) -> tuple[Any, Any, Any, Any] | None:
        """``cross_entropy`` of ``(N, C)`` logits and ``(N,)`` int64 class indices:
        ``(loss, log_probs, row_weights, denominator)``, the last a 0-d array (the number
        of rows not ignored)."""
        cupy = self.cupy
        ctype = _CTYPES.get(x.dtype)
        if ctype is None or x.ndim != 2 or target.dtype != np.int64 or target.ndim != 1:
            return None
        rows, classes = x.shape
        x = cupy.ascontiguousarray(x)
        target = cupy.ascontiguousarray(target)
        log_probs = cupy.empty_like(x)
        losses = cupy.empty(rows, x.dtype)
        weights = cupy.empty(rows, x.dtype)
        module = self._rows_module
        if rows:
            module.get_function(f"ce_rows<{ctype}>")(
                ((rows * 32 + 255) // 256,),
                (256,),
                (
                    x,
                    target,
                    log_probs,
                    losses,
                    weights,
                    np.int64(rows),
                    np.int64(classes),
                    np.int64(ignore_index),
                ),
            )
        if reduction == "none":
            return losses, log_probs, weights, cupy.asarray(rows, x.dtype)
        out = cupy.empty(2, x.dtype)
        module.get_function(f"ce_reduce<{ctype}>")(
            (1,), (256,), (losses, weights, out, np.int64(rows), np.int32(reduction == "mean"))
        )
        return out[0], log_probs, weights, out[1]

    def cross_entropy_rows_backward(
        self,
        grad: Any,
        log_probs: Any,
        target: Any,
        weights: Any,
        denominator: Any,
        reduction: str,
    ) -> Any | None:
        """The gradient of :meth:`cross_entropy_rows`'s loss for its logits, given the
        loss's gradient ``grad``."""
        if grad.dtype != log_probs.dtype:
            return None
        grad = self.cupy.ascontiguousarray(grad)
        return self._rows_backward(
            log_probs,
            target,
            weights,
            grad,
            denominator,
            np.int64(log_probs.shape[1]),
            np.int32(_REDUCTIONS[reduction]),
        )

    def sum_leading(self, x: Any, lead: int) -> Any | None:
        """``x.sum(axis=tuple(range(lead)))`` for a C-contiguous float array (the bias
        gradient of a linear layer): one launch, where CuPy's reduction costs several times
        its host time."""
        ctype = _CTYPES.get(x.dtype)
        if ctype is None or not x.flags.c_contiguous or x.size == 0:
            return None
        shape = x.shape[lead:]
        cols = 1
        for size in shape:
            cols *= size
        out = self.cupy.empty(shape, x.dtype)
        self._rows_module.get_function(f"sum_rows<{ctype}>")(
            ((cols + 31) // 32,), (32, 32), (x, out, np.int64(x.size // cols), np.int64(cols))
        )
        return out

    def threshold_backward(self, grad: Any, out: Any) -> Any:
        """``grad`` where ``out > 0`` (or NaN), else 0: ReLU's gradient."""
        return self._threshold_backward(grad, out)

    def add_scaled_(self, x: Any, other: Any, alpha: float) -> bool:
        """``x += alpha * other`` in place; ``False`` (nothing done) unless both are float
        arrays of one dtype, ``other`` broadcasts to ``x`` and overlaps it exactly or not
        at all."""
        if (
            not isinstance(other, self.cupy.ndarray)
            or other.dtype != x.dtype
            or x.dtype not in _CTYPES
            or other.ndim > x.ndim
        ):
            return False
        if self.cupy.may_share_memory(x, other) and not (
            other.data.ptr == x.data.ptr and other.strides == x.strides
        ):
            return False  # a partly overlapping view: read before written, as the generic
        try:
            self._add_scaled(other, x.dtype.type(alpha), x)
        except ValueError:  # shapes that do not broadcast: the generic code raises the error
            return False
        return True
