"""Log lines of the libraries quantship loads that tell a quantship user nothing they can act on.

A leaf module (it imports nothing of quantship's, nor torch), so the library (``quantship.quantize``)
and the command line both silence them from one place.
"""

from __future__ import annotations

import logging


def silence_library_noise() -> None:
    """Raise the loggers of known noise to ERROR.

    torchao registers an Enum with torch's pytree when it loads, and torch logs a deprecation line
    for it (``W... _pytree.py ... KernelPreference``) on stderr.
    """
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
