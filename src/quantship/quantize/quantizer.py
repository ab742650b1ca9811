"""``Quantizer``: name a precision, get it validated, apply it to a model.

The request is validated against the support matrix at construction (``precision.resolve_spec``),
before any model is seen. ``quantize`` returns a new model tagged with the spec; the input model
is never modified.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch

from quantship import targets
from quantship.errors import DataRefused, SpecRefused
from quantship.precision import ALGORITHMS_ATTRIBUTE, QuantSpec, outside_modules, quant_spec, resolve_spec, tag_model
from quantship.quantize import accuracy
from quantship.quantize import equalize as equalizing
from quantship.quantize import smooth_quant as smoothing
from quantship.quantize.algorithms.rounding import iterations_of as adaround_iterations
from quantship.quantize.calibration import Inputs, collect_batches
from quantship.quantize.distributed import agree_on_batches  # in a process group: a shard per rank
from quantship.quantize.pt2e import MERGE_ATTRIBUTE, annotation_report
from quantship.recipe import takes_algorithms
from quantship.targets import Target

# backend -> module that implements it (one function `quantize(model, spec, batches, log=, verbose=)`)
_BACKEND_MODULES = {
    "pt2e": "quantship.quantize.pt2e",
    "x86": "quantship.quantize.fx",
    "fbgemm": "quantship.quantize.fx",
    "qnnpack": "quantship.quantize.fx",
    "onednn": "quantship.quantize.fx",
    "torchao": "quantship.quantize.torchao_backend",
}
_NEEDS_CALIBRATION = {"static"}


# recipe.Algorithms fields this class spells otherwise (its keywords predate the request object)
RENAMED = {"observer": "act_observer", "exclude": "skip_activations"}


class Quantizer:
    """A validated precision request and the verb that applies it.

    pt2e: ops the annotator has no INT8 rule for are quantized around and named, by module path, in
    ``report`` after ``quantize`` (and in the verbose log); ``strict=True`` refuses such a model. In a
    torch.distributed process group, ``merged`` is the observer merge across ranks (observers, floats sent, seconds).

    >>> Quantizer(backend='pt2e').spec.label
    'W8A8'
    """

    @takes_algorithms(RENAMED)
    def __init__(
        self,
        backend: str = "pt2e",
        method: str | None = None,
        *,
        max_accuracy_drop: float | None = None,
        verbose: bool = False,
        strict: bool = False,
        smooth_quant: float | None = None,
        equalize: bool = False,
        bias_correction: bool = False,
        seq_mse: bool = False,
        adaround: bool | int = False,
        **request: Any,
    ):
        """``request``: the other keywords of ``quantship.resolve_spec`` (``weight_bits``, ``act_bits``, ``int16``:
        modules whose activations are stored in 16 bits, ...).
        ``smooth_quant``: SmoothQuant's alpha in [0, 1] (``quantize.smooth_quant``); ``equalize``: cross-layer
        equalization of conv pairs before capture (``quantize.equalize``); ``bias_correction``: each quantized
        conv / linear bias corrected for the shift of its output mean (``quantize.bias_correction``);
        ``seq_mse``: each conv / linear weight's scale per output channel searched for the least layer-output
        error; ``adaround``: each weight's up/down rounding learned (True: the default steps per layer, an int:
        that many) (``quantize.rounding``; rounding first, then bias correction). pt2e static only, each
        recorded in ``algorithms`` and the exported file's provenance."""
        self.spec: QuantSpec = resolve_spec(backend, method, **request)
        if smooth_quant is not None:
            smoothing.check_alpha(smooth_quant)
        for name, value in (("equalize", equalize), ("bias_correction", bias_correction), ("seq_mse", seq_mse)):
            if not isinstance(value, bool):
                raise TypeError(f"{name}={value!r} must be True or False")
        self.adaround_iterations = adaround_iterations(adaround)
        asked = [n for n, on in (("smooth_quant", smooth_quant is not None), ("equalize", equalize),
                                 ("bias_correction", bias_correction), ("seq_mse", seq_mse),
                                 ("adaround", self.adaround_iterations > 0)) if on]
        if asked and (self.spec.backend, self.spec.method) != ("pt2e", "static"):
            raise SpecRefused(f"{asked[0]} needs backend='pt2e' static quantization (it works on the calibration "
                              f"data and the pt2e graph); backend={self.spec.backend!r} method={self.spec.method!r}")
        self.smooth_quant = smooth_quant
        self.smoothing = None  # the quantize.smooth_quant.Smoothing of the last quantize(), when smooth_quant is set
        self.equalize = equalize
        self.bias_correction = bias_correction
        self.seq_mse = seq_mse
        self.algorithms: dict[str, dict] = {}  # name -> what it changed, for the last quantize() (as in the file)
        self.verbose = verbose
        if max_accuracy_drop is not None and (self.spec.backend, self.spec.method) != ("pt2e", "static"):
            raise SpecRefused(
                f"max_accuracy_drop needs backend='pt2e' static quantization (it keeps layers in float with "
                f"skip_activations); backend={self.spec.backend!r} method={self.spec.method!r} cannot")
        self.max_accuracy_drop = max_accuracy_drop
        self.accuracy_search = None  # the AccuracySearch of the last quantize() with a budget
        if not isinstance(strict, bool):
            raise TypeError(f"strict={strict!r} must be True or False")
        if strict and self.spec.backend != "pt2e":
            raise SpecRefused(f"strict=True refuses ops quantship's pt2e annotator has no rule for; backend="
                              f"{self.spec.backend!r} does not use it: use backend='pt2e' or strict=False")
        self.strict = strict
        self.report = None  # pt2e: what the annotator did on the last quantize() (ops left float, by module)
        self.merged = None  # pt2e in a process group: the last quantize()'s observer merge (MergeReport)
        self.preset: Target | None = None  # set by for_target: the model carries it to export_qdq
        if self.spec.backend == "pt2e" and not self.spec.symmetric:
            warnings.warn(
                "symmetric=False: activations are affine, so the exported file will carry non-zero "
                "zero-points (TensorRT refuses them; ONNX Runtime CPU runs them fastest as uint8)",
                UserWarning,
                stacklevel=2,
            )

    @classmethod
    def for_target(cls, target: str | Target, *, verbose: bool = False, **overrides: Any) -> Quantizer:
        """The deployment preset for ``target`` (a name, an alias, or its ``Target``; see
        ``quantship.targets``), with optional overrides."""
        p = targets.get(target)
        preset = dict(p.spec_kwargs)
        asked = overrides.get("algorithms")
        if asked is not None and getattr(asked, "observer", None) is not None:
            preset.pop("act_observer", None)  # the request's observer replaces the preset's, as a keyword would
        kwargs = {**preset, **overrides}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a preset's affine choice is deliberate
            q = cls(verbose=verbose, **kwargs)
        why = p.int16_refusal(f"int16={list(q.spec.int16)}") if q.spec.int16 else None
        if why is not None:
            raise SpecRefused(why)
        q.preset = p
        return q

    @property
    def target(self) -> str | None:
        """The name of the preset ``for_target`` resolved (``None`` for a plain ``Quantizer``)."""
        return self.preset.target if self.preset is not None else None

    def __repr__(self) -> str:
        return f"Quantizer({self.spec.label}, {self.spec.as_dict()})"

    def _log(self, message: str) -> None:
        if self.verbose:
            print(message, flush=True)

    def prepared_float(self, model: torch.nn.Module, batches: list, *, record: bool = False) -> torch.nn.Module:
        """The float model as ``quantize`` captures it: an equalized and/or smoothed copy when those are asked
        (the same function, other per-channel scales), else ``model`` itself. Deterministic for the same
        batches, so a per-layer comparison with the quantized model can be made against it afterwards (an
        equalized model's inner activations are rescaled per channel: compared with the caller's model they
        rank the wrong layers). ``record``: log and keep what each algorithm did (``quantize``'s call)."""
        if self.equalize:  # an equalized copy: the caller's model is left as it was
            model, equalized = equalizing.equalize(model, batches)
            if record:
                self.algorithms["equalize"] = equalized.as_dict()
                self._log(f"equalize: {len(equalized.pairs)} conv pair(s), {equalized.pairs_changed} rescaled in "
                          f"{equalized.sweeps} sweep(s), float outputs moved by {equalized.max_abs_diff:.3g} at most")
        if self.smooth_quant is not None:  # a smoothed copy: the caller's model is left as it was
            model, smoothed = smoothing.smooth(model, batches, self.smooth_quant)
            if record:
                self.smoothing = smoothed
                self.algorithms["smooth_quant"] = smoothed.as_dict()
                self._log(f"smooth_quant: {len(smoothed.smoothed)} Linear layer(s) smoothed, "
                          f"{len(smoothed.skipped)} skipped (alpha {smoothed.alpha:g})")
        return model

    def quantize(
        self,
        model: torch.nn.Module,
        calibration_dl: object = None,
        max_calibration_samples: int = 100,
        labelled_data: object = None,
        metric: Callable[[torch.nn.Module], float] | None = None,
    ) -> torch.nn.Module:
        """Return a quantized copy of ``model`` tagged with ``self.spec`` as applied (``quant_spec(result)``;
        torchao's weight-only methods settle ``quantize_embedding`` for the model).

        With ``max_accuracy_drop`` (percentage points), ``labelled_data`` (``(x, y)`` batches) is
        required: layers are kept in float, most sensitive first, until the top-1 drop against FP32
        fits the budget (``self.accuracy_search`` records every step), or ``AccuracyBudgetMissed``
        is raised with the best set found. ``metric(model) -> float`` (higher is better: mAP, F1,
        negative WER...) replaces top-1, the budget then in its units (``labelled_data`` optional).
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"quantize() needs a torch.nn.Module, got {type(model).__name__}")
        spec = self.spec
        if spec.method == "qat":
            raise ValueError(
                f"method='qat' with backend={spec.backend!r} trains through fake-quantizers inside a "
                "fit: use quantship.QuantizeCallback(quantizer) with a fastai Learner, not quantize()"
            )
        batches = None
        if spec.weight_algorithm is not None and calibration_dl is None:
            raise DataRefused(f"weight_algorithm={spec.weight_algorithm!r} rounds the weights against calibration "
                              "inputs: pass calibration_dl (an iterable of input batches) to quantize()")
        if spec.method in _NEEDS_CALIBRATION or spec.weight_algorithm is not None:

            batches = agree_on_batches(lambda: collect_batches(calibration_dl, max_calibration_samples), spec.backend)
            refuse_algorithms_on_several_inputs(batches, {
                "equalize": self.equalize, "smooth_quant": self.smooth_quant is not None,
                "bias_correction": self.bias_correction, "seq_mse": self.seq_mse,
                "adaround": bool(self.adaround_iterations), "max_accuracy_drop": self.max_accuracy_drop is not None})
        elif calibration_dl is not None:
            self._log(f"{spec.backend}: method={spec.method!r} needs no calibration data; ignoring it")
        self.algorithms = {}
        model = self.prepared_float(model, batches, record=True)
        backend = importlib.import_module(_BACKEND_MODULES[spec.backend])
        extra = {"strict": True} if self.strict else {}
        if self.bias_correction:
            extra["bias_correction"] = True
        if self.seq_mse:
            extra["seq_mse"] = True
        if self.adaround_iterations:
            extra["adaround_iterations"] = self.adaround_iterations
        if spec.backend == "pt2e" and self.preset is not None:
            extra["target"] = self.preset  # its placement knowledge, the ONNX path's for the same target

        def run(chosen: QuantSpec) -> torch.nn.Module:
            quantized = backend.quantize(model, chosen, batches, log=self._log, verbose=self.verbose, **extra)
            if chosen.backend == "pt2e":

                self.report = annotation_report(quantized)
                self.merged = getattr(quantized, MERGE_ATTRIBUTE, None)
            # the backend's own records (seq_mse, adaround, bias_correction), after the ones run before capture
            self.algorithms.update(getattr(quantized, ALGORITHMS_ATTRIBUTE, None) or {})
            if self.algorithms:  # export_qdq writes them into the file's provenance
                setattr(quantized, ALGORITHMS_ATTRIBUTE, dict(self.algorithms))
            if chosen.backend == "torchao":  # its spec as applied: the rules it resolved on the model (the embedding's)
                chosen = quant_spec(quantized) or chosen
            return tag_model(quantized, chosen, self.preset)

        if self.max_accuracy_drop is None:
            if labelled_data is not None:
                self._log("labelled_data is only used with max_accuracy_drop; ignoring it")
            return run(spec)
        if labelled_data is None and metric is None:
            raise DataRefused("max_accuracy_drop needs labelled_data: (x, y) batches to measure top-1 on (or "
                              "metric=callable(model) -> float, higher is better)")

        def quantize_without(excluded: tuple[str, ...]) -> torch.nn.Module:
            skip = tuple(sorted({*(spec.skip_activations or ()), *excluded})) or None
            wide = outside_modules(spec.int16 or (), skip or ()) or None  # float wins
            return run(dataclasses.replace(spec, skip_activations=skip, int16=wide))

        quantized, self.accuracy_search = accuracy.search(quantize_without, model, labelled_data, self.max_accuracy_drop,
                                                          metric=metric, inputs=batches or (), log=self._log)
        return quantized


def refuse_algorithms_on_several_inputs(batches: list, asked: dict[str, bool]) -> None:
    """The algorithms run on one input tensor: a model calibrated on ``Inputs`` (several) is refused them."""
    on = [name for name, value in asked.items() if value]
    if on and batches and isinstance(batches[0], Inputs):
        raise SpecRefused(f"{', '.join(on)} run on models with one input; this one takes {len(batches[0])}: "
                          "quantize it without them")


def _public_signature() -> inspect.Signature:
    """``Quantizer``'s signature as ``help()`` and IDEs that read ``__signature__`` show it: its own options
    plus every precision keyword of ``resolve_spec``, which it forwards (one list of names, not two)."""
    own = inspect.signature(Quantizer.__init__).parameters
    spec = inspect.signature(resolve_spec).parameters
    params = [own["self"], spec["backend"], spec["method"]]
    params += [p for p in spec.values() if p.kind is p.KEYWORD_ONLY]
    params += [p for p in own.values() if p.kind is p.KEYWORD_ONLY]
    return inspect.Signature(params)


Quantizer.__init__.__signature__ = _public_signature()
