"""What keeping chosen layers in float buys, measured: quantize with and without ``skip_activations``.

Above ``quantizer`` (it quantizes twice with a ``Quantizer``); ``layer_error`` below it says which
layers to try (``suggest_skip``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from quantship.fidelity import sqnr_db
from quantship.quantize.quantizer import Quantizer


@dataclass(frozen=True)
class SkipEffect:
    """What keeping ``names`` in float buys: model-output SQNR and accuracy, before and after."""

    names: tuple[str, ...]
    sqnr_before_db: float
    sqnr_after_db: float
    correct_before: int | None
    correct_after: int | None
    n: int

    def as_dict(self) -> dict:
        return asdict(self)


def measure_skip(model: torch.nn.Module, calib: Sequence, eval_inputs: Sequence, names: Sequence[str],
                 **quantizer_kwargs) -> SkipEffect:
    """Quantize ``model`` with and without ``skip_activations=names`` and measure both on ``eval_inputs``.

    ``eval_inputs``: tensors, or ``(x, y)`` tuples (then accuracy is counted too), at the
    calibration batch size.
    """
    if not names:
        raise ValueError("names is empty: pass module names to keep in float, e.g. suggest_skip(report, k)")
    base = Quantizer(backend="pt2e", **quantizer_kwargs).quantize(model, calib)
    skip = Quantizer(backend="pt2e", skip_activations=list(names), **quantizer_kwargs).quantize(model, calib)
    labelled = all(isinstance(b, (tuple, list)) for b in eval_inputs)
    model = model.eval()
    energy = {"ref": 0.0, "base": 0.0, "skip": 0.0}
    correct = {"base": 0, "skip": 0}
    n = 0
    with torch.no_grad():
        for batch in eval_inputs:
            x = batch[0] if isinstance(batch, (tuple, list)) else batch
            ref = model(x).double()
            energy["ref"] += float((ref * ref).sum())
            for key, qm in (("base", base), ("skip", skip)):
                out = qm(x).double()
                energy[key] += float(((out - ref) ** 2).sum())
                if labelled:
                    correct[key] += int((out.argmax(-1) == batch[1]).sum())
            n += x.shape[0]
    return SkipEffect(
        names=tuple(names), sqnr_before_db=sqnr_db(energy["ref"], energy["base"]),
        sqnr_after_db=sqnr_db(energy["ref"], energy["skip"]),
        correct_before=correct["base"] if labelled else None,
        correct_after=correct["skip"] if labelled else None, n=n,
    )
