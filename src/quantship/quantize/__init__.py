"""Apply a validated precision to a model: pt2e, FX backends, torchao, QAT callback."""

from quantship.noise import silence_library_noise

silence_library_noise()  # before torchao loads

from quantship.quantize.quantizer import Quantizer  # noqa: E402

__all__ = ["Quantizer"]
