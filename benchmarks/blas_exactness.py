"""Which ways of parallelising a matrix product this BLAS computes bitwise as one whole call.

The engine computes a large product in blocks on several threads only where the blocks are
bitwise the whole product (``cpu_budget._cuts_exactly``: spec §5, results do not depend on
the load). This script shows, for the BLAS NumPy loaded (``OPENBLAS_CORETYPE`` picks
OpenBLAS's kernels), per dtype and shape:

- ``rows@N`` / ``cols@N``: the product cut in two at row (column) ``N``, each part on one
  BLAS thread, equals the whole product on one thread;
- ``2 threads``: the whole product on 2 BLAS threads equals it on one.

    PYTHONPATH=. python benchmarks/blas_exactness.py
    OPENBLAS_CORETYPE=Haswell PYTHONPATH=. python benchmarks/blas_exactness.py   # AMD, Intel without AVX-512
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

SHAPES = [  # (m, k, n): the `mlp` step's products, and others
    (256, 784, 1024),
    (256, 1024, 1024),
    (1024, 256, 784),
    (1024, 256, 1024),
    (256, 784, 512),
    (512, 512, 512),
    (333, 517, 901),
    (128, 16, 128),
]
CUTS = (12, 16, 48, 64, 96, 128)


def check(dtype: Any, shape: tuple[int, int, int], rng: np.random.Generator) -> dict[str, bool]:
    """Each way of computing ``a @ b`` against the whole product on one BLAS thread."""
    m, k, n = shape
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    result: dict[str, bool] = {}
    with threadpool_limits(1, "blas"):
        whole = a @ b
        for cut in CUTS:
            if cut < m:
                rows = np.concatenate([a[:cut] @ b, a[cut:] @ b])
                result[f"rows@{cut}"] = bool(np.array_equal(rows, whole))
            if cut < n:
                cols = np.concatenate([a @ b[:, :cut], a @ b[:, cut:]], axis=1)
                result[f"cols@{cut}"] = bool(np.array_equal(cols, whole))
    with threadpool_limits(2, "blas"):
        result["2 threads"] = bool(np.array_equal(a @ b, whole))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.parse_args()
    blas = [
        {"api": info["internal_api"], "arch": info.get("architecture"), "version": info["version"]}
        for info in threadpool_info()
        if info["user_api"] == "blas"
    ]
    print(json.dumps({"figure": "env", "numpy": np.__version__, "blas": blas}))
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        for shape in SHAPES:
            line = {"dtype": np.dtype(dtype).name, "shape": shape, **check(dtype, shape, rng)}
            print(json.dumps(line))


if __name__ == "__main__":
    main()
