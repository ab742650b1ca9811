"""Apply a validated precision to a model: pt2e, FX backends, torchao, QAT callback."""

from quantship.quantize.quantizer import Quantizer

__all__ = ["Quantizer"]
