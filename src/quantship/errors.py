"""Every error quantship raises on purpose, in one vocabulary.

All of them are ``ValueError`` subclasses, so code written against the plain ``ValueError`` of
earlier releases keeps working; callers who want to tell refusals apart catch the family
(``QuantshipError``) or one member. The CLI maps this hierarchy to exit codes in one place
(``quantship.cli.main``).

This module imports nothing (``precision`` and every other layer may import it).
"""

from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_MAX_LINE = 400


class QuantshipError(ValueError):
    """A request quantship refuses, with a message that says what to do instead."""


class SpecRefused(QuantshipError):
    """A precision request that no backend honours, or a model the request cannot apply to."""


class Int16Uncovered(SpecRefused):
    """A 16-bit name (``int16``) that covers no quantized activation; ``name`` is it."""

    def __init__(self, message: str, name: str):
        super().__init__(message)
        self.name = name


class DataRefused(QuantshipError):
    """Calibration, evaluation or probe data that cannot be used (empty, non-finite, wrong shape)."""


class ModelRefused(QuantshipError):
    """A model that cannot be built or loaded by name (``quantship.sources``): unknown source, missing file,
    a factory that fails, weights that do not fit."""


class ExportRefused(QuantshipError):
    """A file could not be written faithfully; nothing was left at the destination."""


class OpsetRefused(ExportRefused):
    """The graph cannot be declared at the requested opset without changing what it computes."""


class KernelShapeRefused(ExportRefused):
    """A Conv whose ``kernel_shape`` cannot be read from its weight."""


class ActivationDtypeRefused(ExportRefused):
    """The activation dtype rewrite (int8 -> uint8) could not be proven exact."""


class OutputsRefused(QuantshipError):
    """A model output that cannot be exported and compared by name (a None or non-tensor leaf, names that
    coincide)."""


class TargetRefused(QuantshipError):
    """An unknown deployment target, or a file that its target's rules do not accept."""


class FileRefused(QuantshipError):
    """A file that cannot be read as what it claims to be (not ONNX, truncated, malformed fields)."""


class NoOutputScale(QuantshipError):
    """An INT8 file none of whose outputs comes from a per-tensor DequantizeLinear: no output LSB to
    measure an error in (a float tail, or not an INT8 file); its fidelity to FP32 can still be judged."""


class FidelityMissed(QuantshipError):
    """No file kept the fidelity budget against the float model; nothing was written. ``.record`` holds
    every step measured (a dict, as the JSON report gives it). The CLI exits 1: a verdict, not bad input."""

    def __init__(self, message: str, record: dict | None = None):
        super().__init__(message)
        self.record = record or {}


class SpeedMissed(QuantshipError):
    """``require_faster``: the INT8 file ran slower than its float reference on this CPU (or its speed could not
    be measured); nothing was written. ``.reading`` holds the measurement. The CLI exits 1: a verdict."""

    def __init__(self, message: str, reading: object = None):
        super().__init__(message)
        self.reading = reading


def one_line(exc: BaseException, limit: int = _MAX_LINE) -> str:
    """The first non-empty line of an exception's message, without terminal colour codes.

    Falls back to the exception's type name when the message is empty; cut at ``limit`` characters.
    """
    text = _ANSI.sub("", str(exc)).strip()
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if not first:
        return type(exc).__name__
    return first if len(first) <= limit else first[: limit - 3] + "..."


def cause(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line`` of a third-party exception, for quoting it inside our own message."""
    text = one_line(exc, limit)
    name = type(exc).__name__
    return name if text == name else f"{name}: {text}"
