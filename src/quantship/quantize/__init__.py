"""Apply a validated precision to a model: pt2e, FX backends, torchao, QAT callback."""

import logging

# torchao registers an Enum with torch's pytree at import, and torch logs a deprecation line for it
# (``W... _pytree.py ... KernelPreference``) on stderr: noise a quantship user cannot act on.
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)

from quantship.quantize.quantizer import Quantizer  # noqa: E402

__all__ = ["Quantizer"]
