"""The error function on arrays (NumPy has none, and SciPy is no dependency)."""

from __future__ import annotations

from typing import Any

import numpy

from aioautograd._typing import Array

# W. J. Cody, "Rational Chebyshev approximations for the error function", Math. Comp. 23
# (1969), as in Netlib SPECFUN's CALERF: erf on |x| <= 0.46875, erfc on (0.46875, 4] and
# on (4, inf). Relative error below 1e-15 in float64.
_ERF_A = (
    3.16112374387056560e00,
    1.13864154151050156e02,
    3.77485237685302021e02,
    3.20937758913846947e03,
    1.85777706184603153e-1,
)
_ERF_B = (
    2.36012909523441209e01,
    2.44024637934444173e02,
    1.28261652607737228e03,
    2.84423683343917062e03,
)
_ERFC_C = (
    5.64188496988670089e-1,
    8.88314979438837594e00,
    6.61191906371416295e01,
    2.98635138197400131e02,
    8.81952221241769090e02,
    1.71204761263407058e03,
    2.05107837782607147e03,
    1.23033935479799725e03,
    2.15311535474403846e-8,
)
_ERFC_D = (
    1.57449261107098347e01,
    1.17693950891312499e02,
    5.37181101862009858e02,
    1.62138957456669019e03,
    3.29079923573345963e03,
    4.36261909014324716e03,
    3.43936767414372164e03,
    1.23033935480374942e03,
)
_ERFC_P = (
    3.05326634961232344e-1,
    3.60344899949804439e-1,
    1.25781726111229246e-1,
    1.60837851487422766e-2,
    6.58749161529837803e-4,
    1.63153871373020978e-2,
)
_ERFC_Q = (
    2.56852019228982242e00,
    1.87295284992346047e00,
    5.27905102951428412e-1,
    6.05183413124413191e-2,
    2.33520497626869185e-3,
)
_INV_SQRT_PI = 5.6418958354775628695e-1


def erf(xp: Any, x: Array) -> Array:
    """The error function of an array, elementwise (NumPy has none, and SciPy is no dependency).

    On NumPy each of Cody's three intervals is evaluated on its own elements only (gathered
    by a mask, the results scattered back): a third of the passes of evaluating all three
    everywhere. Other array modules (CuPy) evaluate all three on clipped copies of ``|x|``
    (so none overflows) and select per element: no data-dependent shapes on a device.
    """
    if x.dtype.kind in "biu":
        x = x.astype(xp.float64)
    y = xp.abs(x)
    if xp is not numpy:
        erf_large = xp.sign(x) * (
            1
            - xp.where(
                y <= 4.0,
                _erfc_mid(xp, xp.clip(y, 0.46875, 4.0)),
                _erfc_big(xp, xp.clip(y, 4.0, 27.0)),
            )
        )
        return xp.where(y <= 0.46875, _erf_small(xp.clip(x, -0.46875, 0.46875)), erf_large)
    out = numpy.empty_like(x)
    small = y <= 0.46875
    if small.all():  # (the common case of small activations: no gather, no scatter)
        out[...] = _erf_small(x)
        return out
    within = y <= 4.0
    mid = within & ~small
    # NaN compares false everywhere: it lands with the large values, and stays NaN.
    big = ~within
    if small.any():
        out[small] = _erf_small(x[small])
    if mid.any():
        part = x[mid]
        out[mid] = numpy.copysign(1 - _erfc_mid(numpy, numpy.abs(part)), part)
    if big.any():
        part = x[big]
        # Past 27 erfc underflows to 0 in float64; clipping keeps 1 / big**2 finite.
        clipped = numpy.clip(numpy.abs(part), 4.0, 27.0)
        out[big] = numpy.copysign(1 - _erfc_big(numpy, clipped), part)
    return out


def _erf_small(x: Array) -> Array:
    """erf on |x| <= 0.46875."""
    z = x * x
    num, den = _ERF_A[4] * z, z
    for a, b in zip(_ERF_A[:3], _ERF_B[:3], strict=True):
        num, den = (num + a) * z, (den + b) * z
    return x * (num + _ERF_A[3]) / (den + _ERF_B[3])


def _erfc_mid(xp: Any, y: Array) -> Array:
    """erfc on 0.46875 <= y <= 4."""
    num, den = _ERFC_C[8] * y, y
    for c, d in zip(_ERFC_C[:7], _ERFC_D[:7], strict=True):
        num, den = (num + c) * y, (den + d) * y
    return _exp_neg_square(xp, y) * ((num + _ERFC_C[7]) / (den + _ERFC_D[7]))


def _erfc_big(xp: Any, y: Array) -> Array:
    """erfc on 4 <= y <= 27 (0 in float64 past it)."""
    z = 1 / (y * y)
    num, den = _ERFC_P[5] * z, z
    for p, q in zip(_ERFC_P[:4], _ERFC_Q[:4], strict=True):
        num, den = (num + p) * z, (den + q) * z
    ratio = z * (num + _ERFC_P[4]) / (den + _ERFC_Q[4])
    return _exp_neg_square(xp, y) * ((_INV_SQRT_PI - ratio) / y)


def _exp_neg_square(xp: Any, y: Array) -> Array:
    # exp(-y*y) without the rounding error of y*y: split y at a multiple of 1/16.
    head = xp.trunc(y * 16) / 16
    return xp.exp(-head * head) * xp.exp(-(y - head) * (y + head))
