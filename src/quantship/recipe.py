"""``Algorithms``: one algorithm request, the same object for every entry point that quantizes.

Which algorithms run (equalization, SmoothQuant, bias correction, seq-MSE, AdaRound), the activation
observer, the nodes kept float (``exclude``) and those whose activations are stored in 16 bits (``int16``),
validated once here. ``Quantizer``, ``quantize_onnx_file``, ``quantize_onnx``, ``search_onnx`` and
``speed_search_onnx`` take it as ``algorithms=`` (``takes_algorithms``), and the CLI builds it from its flags;
each entry point still takes the same choices as separate keywords, and giving one both ways is refused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from quantship.errors import SpecRefused
from quantship.precision import ACT_OBSERVERS


def _names(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, Iterable) or not all(isinstance(v, str) for v in value):
        raise SpecRefused(f"{what}={value!r}: give a list of node names, name globs or op types")
    return tuple(value)


@dataclass(frozen=True)
class Algorithms:
    """An algorithm request (module docstring). ``smooth_quant``: SmoothQuant's alpha in [0, 1], None off;
    ``adaround``: True (the default steps per layer), False, or a number of steps >= 1; ``observer``: an
    activation observer name (``precision.ACT_OBSERVERS``), None for the target's own."""

    equalize: bool = False
    bias_correction: bool = False
    smooth_quant: float | None = None
    seq_mse: bool = False
    adaround: bool | int = False
    observer: str | None = None
    exclude: tuple[str, ...] = ()
    int16: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("equalize", "bias_correction", "seq_mse"):
            if not isinstance(getattr(self, name), bool):
                raise SpecRefused(f"{name}={getattr(self, name)!r}: give True or False")
        alpha = self.smooth_quant
        if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1):
            raise SpecRefused(f"smooth_quant={alpha!r}: give the migration strength alpha in [0, 1], or None (off)")
        steps = self.adaround
        if not isinstance(steps, bool) and (not isinstance(steps, int) or steps < 1):
            raise SpecRefused(f"adaround={steps!r}: give True, False or a number of steps per layer >= 1")
        if self.observer is not None and self.observer not in ACT_OBSERVERS:
            raise SpecRefused(f"observer={self.observer!r} is unknown; valid observers: {list(ACT_OBSERVERS)}")
        object.__setattr__(self, "exclude", _names(self.exclude, "exclude"))
        object.__setattr__(self, "int16", _names(self.int16, "int16"))

    def asked(self) -> dict[str, Any]:
        """The fields that differ from the defaults (what was asked for)."""
        default = Algorithms()
        return {k: v for k, v in asdict(self).items() if v != getattr(default, k)}

    def describe(self) -> str:
        asked = self.asked()
        return ", ".join(f"{k}={v!r}" for k, v in asked.items()) or "no algorithm, the target's observer"


FIELDS = tuple(f.name for f in fields(Algorithms))


def takes_algorithms(renamed: Mapping[str, str] | None = None) -> Callable:
    """Let a function that takes the algorithm choices as keywords also take ``algorithms=Algorithms(...)``.

    ``renamed``: field -> the function's keyword where it spells one differently (``Quantizer``'s
    ``act_observer``, ``skip_activations``). A keyword given both ways is refused; the object's defaults leave
    the keywords as they are."""
    spelled = {name: (renamed or {}).get(name, name) for name in FIELDS}

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args: Any, algorithms: Algorithms | None = None, **kwargs: Any) -> Any:
            if algorithms is None:
                return fn(*args, **kwargs)
            if not isinstance(algorithms, Algorithms):
                raise SpecRefused(f"algorithms={algorithms!r}: give a quantship.Algorithms")
            where = getattr(fn, "__qualname__", "this entry point").replace(".__init__", "")
            for name, value in algorithms.asked().items():
                key = spelled[name]
                if key in kwargs:
                    raise SpecRefused(f"{where}: {key} given both as a keyword and in algorithms; give it once")
                kwargs[key] = list(value) if key in ("skip_activations", "int16") else value
            return fn(*args, **kwargs)

        return call

    return wrap
