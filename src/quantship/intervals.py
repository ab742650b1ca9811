"""The Wilson score interval of an accuracy counted as k/n (a leaf: imports nothing of quantship's).

`examples` and the public ``quantship.inspect.wilson_interval`` read it; the CLI prints it with
``cli.common.format_accuracy``.
"""

from __future__ import annotations

import math


def wilson_interval(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The Wilson score interval for k successes in n trials (95% by default)."""
    if n <= 0:
        raise ValueError(f"n={n}: an interval needs at least one trial")
    if not 0 <= k <= n:
        raise ValueError(f"k={k} must lie between 0 and n={n}")
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)

