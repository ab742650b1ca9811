"""The precision grammar: one frozen record of a request, one support matrix, one validator.

Every request is checked against ``SUPPORT_MATRIX`` before any work happens. A request that no
backend can honour is refused with a ``ValueError`` naming the argument, the value, the backend,
and the backends that can honour it. Nothing is ever replaced by a nearby precision.

This module imports only ``quantship.errors`` and ``quantship.lazy`` from quantship (see STYLE.md: imports flow one way).
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from quantship.errors import SpecRefused
from quantship.lazy import load_public

FLOAT_BITS = 16  # "stays floating point" in a label: W8A16 is INT8 weight-only
SPEC_ATTRIBUTE = "_quantship_spec"  # where a produced model carries its QuantSpec
ALGORITHMS_ATTRIBUTE = "_quantship_algorithms"  # ... and {algorithm: its record} (SmoothQuant), for export_qdq
TARGET_ATTRIBUTE = "_quantship_target"  # and the deployment preset it was made for
METADATA_KEY = "quantship.spec"  # the ONNX metadata_props key that carries it in a file

PLACEMENTS = ("per_op", "skip_conv_add")
ACT_OBSERVERS = ("histogram", "minmax", "percentile", "mse")
WEIGHT_ALGORITHMS = ("gptq",)  # how weights are rounded, besides to nearest (None)


@dataclass(frozen=True)
class Cell:
    """One precision a backend can apply: a row of the support matrix."""

    backend: str
    method: str
    weight_bits: int
    act_bits: int
    qschemes: tuple[str, ...]  # first is the default
    symmetric: tuple[bool, ...]  # first is the default
    layer_bits: bool  # accepts a per-layer ``weight_bits`` dict
    exports: bool  # ``export_qdq`` can write it
    act_observers: tuple[str | None, ...] = (None,)  # first is the default
    reduce_range: tuple[bool, ...] = (False,)  # 7-bit weights ([-63, 63]) allowed; first is the default
    default_group_size: int | None = None
    weight_algorithms: tuple[str | None, ...] = (None,)  # None: round to nearest; first is the default
    # the token embedding table quantized as the weights (True), kept float (False), or None: the backend's rule
    # for the model (``quantize.torchao_backend.embedding_rule``); first is the default
    quantize_embedding: tuple[bool | None, ...] = (None,)
    note: str = ""

    @property
    def label(self) -> str:
        return f"W{self.weight_bits}A{self.act_bits}"


_FX_NOTE = "FX graph mode (torch.ao, deprecated upstream); affine observers, uint8 activations"
_PT2E_NOTE = "quantship's own annotator on torchao pt2e; the one cell export_qdq writes"


def _fx_rows(backend: str, qschemes: tuple[str, ...]) -> list[Cell]:
    return [
        Cell(backend, method, 8, 8, qschemes, (False,), True, False, note=_FX_NOTE)
        for method in ("static", "dynamic", "qat")
    ]


# The support matrix: the one table every validation, refusal and printout reads.
SUPPORT_MATRIX: tuple[Cell, ...] = (
    Cell("pt2e", "static", 8, 8, ("per_channel", "per_tensor"), (True, False), False, True,
         ACT_OBSERVERS, (False, True), note=_PT2E_NOTE),
    Cell("pt2e", "qat", 8, 8, ("per_channel", "per_tensor"), (True, False), False, True,
         ("minmax",), (False, True), note="pt2e quantization-aware training (QuantizeCallback)"),
    *_fx_rows("x86", ("per_channel", "per_tensor")),
    *_fx_rows("fbgemm", ("per_channel", "per_tensor")),
    *_fx_rows("onednn", ("per_channel", "per_tensor")),
    *_fx_rows("qnnpack", ("per_tensor",)),
    Cell("torchao", "int8_weight_only", 8, 16, ("per_channel", "per_group"), (True,), True, True,
         quantize_embedding=(None, True, False),
         note="activations stay float; per-layer dict over Linear layers; exports int8 + DequantizeLinear "
              "(opset 21), or MatMulNBits for target='onnxruntime-cpu'"),
    Cell("torchao", "int8_dynamic", 8, 8, ("per_channel",), (True,), False, False,
         note="int8 weights, activation scales computed at run time"),
    Cell("torchao", "int4_weight_only", 4, 16, ("per_group",), (True,), False, True,
         default_group_size=128, weight_algorithms=(None, "gptq"), quantize_embedding=(None, True, False),
         note="grouped int4 weights (IntxWeightOnlyConfig, CPU kernels); exports int4 + block-wise "
              "DequantizeLinear (opset 21), or MatMulNBits (groups >= 16); weight_algorithm='gptq' "
              "(calibrated)"),
)

BACKENDS: tuple[str, ...] = tuple(dict.fromkeys(c.backend for c in SUPPORT_MATRIX))
FX_BACKENDS: tuple[str, ...] = ("x86", "fbgemm", "onednn", "qnnpack")


def _cells(backend: str | None = None, method: str | None = None) -> list[Cell]:
    return [
        c for c in SUPPORT_MATRIX
        if (backend is None or c.backend == backend) and (method is None or c.method == method)
    ]


def _backends_where(pred) -> list[str]:
    return list(dict.fromkeys(c.backend for c in SUPPORT_MATRIX if pred(c)))


def _can(names: list[str]) -> str:
    if not names:
        return "No backend can honour it."
    return "The backend(s) that can: " + ", ".join(repr(n) for n in names) + "."


def _can_at(cell: Cell, accepts) -> str:
    """Backends honouring ``accepts`` at the cell's precision, else at any other precision."""
    same = _backends_where(lambda c: c.label == cell.label and accepts(c))
    if same:
        return _can(same)
    other = [c for c in SUPPORT_MATRIX if accepts(c)]
    if not other:
        return f"No backend can honour it (at {cell.label} or any other precision)."
    found = ", ".join(f"{c.backend!r} at {c.label}" for c in {(c.backend, c.label): c for c in other}.values())
    return f"No {cell.label} backend can honour it; at another precision: {found}."


def is_pattern(name: str) -> bool:
    """Whether a ``skip_activations`` / ``int16`` name is a glob pattern (``*``, ``?``, ``[``: characters no
    module or op name holds), as the ONNX path's ``--exclude`` takes them."""
    return any(c in name for c in "*?[")


def names_match(name: str, given: str) -> bool:
    """Whether ``given`` (a name, or a glob pattern, ``is_pattern``) names ``name`` itself."""
    return name == given or (is_pattern(given) and fnmatch.fnmatchcase(name, given))


def under_modules(path: str, names: Iterable[str]) -> bool:
    """Whether the module at dotted ``path`` is one of ``names`` or inside one of them: what a
    ``skip_activations`` name covers (a module and everything below it); a glob pattern covers every module
    it matches and everything below them."""
    parts = path.split(".")
    above = [".".join(parts[:k]) for k in range(1, len(parts) + 1)]  # the module and each one above it
    return any(names_match(module, n) for n in names for module in above)


def smallest_names(modules: Sequence[str], ops: Sequence[str]) -> list[str]:
    """For each op (``ops[i]``, traced under module ``modules[i]``; '' at top level), the smallest name
    ``skip_activations`` and ``int16`` take to change it alone: its module when no other of these ops is in that
    module or below it, else the op's own name."""
    return [m if m and sum(under_modules(other, (m,)) for other in modules) == 1 else op
            for m, op in zip(modules, ops)]


def outside_modules(names: Iterable[str], modules: Iterable[str]) -> tuple[str, ...]:
    """``names`` less those ``modules`` cover (``under_modules``): a module kept float is not also in 16 bits."""
    covering = tuple(modules)
    return tuple(n for n in names if not under_modules(n, covering))


@dataclass(frozen=True)
class QuantSpec:
    """A resolved precision request: frozen, hashable, comparable.

    ``layer_bits`` is a sorted tuple of ``(layer name, bits)`` pairs; ``skip_activations`` a
    sorted tuple of module names; ``int16`` one of the modules whose activations are stored in 16 bits
    (the activations they read and write, weights int8; none inside a ``skip_activations`` module). Build one with ``resolve_spec`` (or ``Quantizer``), which
    validates it against the support matrix.
    """

    backend: str
    method: str
    weight_bits: int
    act_bits: int
    qscheme: str
    symmetric: bool
    group_size: int | None = None
    layer_bits: tuple[tuple[str, int], ...] | None = None
    qdq_placement: str | None = None
    skip_activations: tuple[str, ...] | None = None
    engine: str | None = None
    act_observer: str | None = None
    reduce_range: bool = False  # weights use 7 bits, [-63, 63] (no u8s8 saturation on x86 without VNNI)
    weight_algorithm: str | None = None  # "gptq": weights rounded by GPTQ on calibration data; None: to nearest
    # weight-only: the token embedding table stored in the weights' bits (True) or float (False); None before the
    # backend applied its rule to a model (a quantized model's spec holds what was done)
    quantize_embedding: bool | None = None
    int16: tuple[str, ...] | None = None

    @property
    def label(self) -> str:
        """``W{w}A{a}``; 16 means the tensor stays floating point."""
        return f"W{self.weight_bits}A{self.act_bits}"

    @property
    def cell(self) -> Cell:
        for c in _cells(self.backend, self.method):
            return c
        raise SpecRefused(f"no support-matrix cell for backend={self.backend!r} method={self.method!r}")

    @property
    def exports(self) -> bool:
        """Whether ``export_qdq`` can write this precision as QDQ ONNX."""
        return self.cell.exports

    def as_dict(self) -> dict[str, Any]:
        """A plain dict in field order (lists for the tuple fields)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "layer_bits" and value is not None:
                value = {name: bits for name, bits in value}
            elif f.name in ("skip_activations", "int16") and value is not None:
                value = list(value)
            out[f.name] = value
        return out

    def to_json(self) -> str:
        return json.dumps(self.as_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QuantSpec:
        """Rebuild a spec from ``as_dict()`` output (e.g. read back from an ONNX file)."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise SpecRefused(f"unknown QuantSpec field(s) {sorted(unknown)}; known: {sorted(known)}")
        kwargs = dict(data)
        if kwargs.get("layer_bits") is not None:
            kwargs["layer_bits"] = tuple(sorted((str(k), int(v)) for k, v in kwargs["layer_bits"].items()))
        for name in ("skip_activations", "int16"):
            if kwargs.get(name) is not None:
                kwargs[name] = tuple(kwargs[name])
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> QuantSpec:
        return cls.from_dict(json.loads(text))


def _resolve_method(backend: str, method: str | None, weight_bits: int | None, act_bits: int | None) -> Cell:
    """Pick the matrix cell for (backend, method, widths), refusing impossible combinations."""
    rows = _cells(backend)
    methods = list(dict.fromkeys(c.method for c in rows))
    if method is not None and method not in methods:
        others = _backends_where(lambda c: c.method == method)
        raise SpecRefused(
            f"method={method!r} is not available with backend={backend!r}. "
            f"Valid methods for {backend!r}: {methods}. {_can(others)}"
        )
    candidates = [c for c in rows if method is None or c.method == method]
    if weight_bits is not None:
        candidates = [c for c in candidates if c.weight_bits == weight_bits]
    if act_bits is not None:
        candidates = [c for c in candidates if c.act_bits == act_bits]
    if not candidates:
        w = weight_bits if weight_bits is not None else "?"
        a = act_bits if act_bits is not None else "?"
        wanted = f"W{w}A{a}"
        any_backend = _backends_where(
            lambda c: (weight_bits is None or c.weight_bits == weight_bits)
            and (act_bits is None or c.act_bits == act_bits)
        )
        if not any_backend:
            known = sorted({c.label for c in SUPPORT_MATRIX})
            raise SpecRefused(
                f"weight_bits={weight_bits}, act_bits={act_bits}: no backend runs {wanted}. "
                f"Supported precisions: {known} (16 = stays floating point)."
            )
        offered = sorted({f"{c.label} ({c.method})" for c in rows})
        what = f"method={method!r} " if method else ""
        raise SpecRefused(
            f"backend={backend!r} {what}cannot run {wanted} (weight_bits={weight_bits}, "
            f"act_bits={act_bits}); it offers {offered}. {_can(any_backend)}"
        )
    return candidates[0]


def _resolve_flag(name: str, value: bool | None, cell: Cell, column: str, where: str, why: str) -> bool:
    """A boolean request checked against one column of the cell (``None`` = the cell's default)."""
    allowed: tuple[bool, ...] = getattr(cell, column)
    if value is None:
        return allowed[0]
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False")
    if value not in allowed:
        raise SpecRefused(f"{where} cannot honour {name}={value}: {why}. "
                         f"{_can_at(cell, lambda c: value in getattr(c, column))}")
    return value


def resolve_spec(
    backend: str = "pt2e",
    method: str | None = None,
    *,
    weight_bits: int | Mapping[str, int] | None = None,
    act_bits: int | None = None,
    qscheme: str | None = None,
    symmetric: bool | None = None,
    group_size: int | None = None,
    qdq_placement: str | None = None,
    skip_activations: Iterable[str] | None = None,
    act_observer: str | None = None,
    reduce_range: bool | None = None,
    weight_algorithm: str | None = None,
    quantize_embedding: bool | None = None,
    int16: Iterable[str] | None = None,
) -> QuantSpec:
    """Validate a request against the support matrix and return the resolved ``QuantSpec``.

    ``None`` means "the cell's default". Raises ``ValueError`` naming the argument, the value,
    the backend, and the backends that can honour the request.
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise SpecRefused(f"backend={backend!r} is not a quantship backend; valid backends: {list(BACKENDS)}")

    layer_bits: tuple[tuple[str, int], ...] | None = None
    if isinstance(weight_bits, Mapping):
        if not weight_bits:
            raise SpecRefused("weight_bits={} is empty: give an int, or a dict {layer name: 8 or 16}")
        bad = {k: v for k, v in weight_bits.items() if not isinstance(k, str) or v not in (8, FLOAT_BITS)}
        if bad:
            raise SpecRefused(
                f"weight_bits dict entries {bad} are invalid: keys are layer names (str), values are 8 "
                f"(quantize) or {FLOAT_BITS} (leave float)"
            )
        layer_bits = tuple(sorted((k, int(v)) for k, v in weight_bits.items()))
        weight_bits = 8
    elif weight_bits is not None and (isinstance(weight_bits, bool) or not isinstance(weight_bits, int)):
        raise TypeError(f"weight_bits={weight_bits!r} must be an int or a dict {{layer name: bits}}")
    if act_bits is not None and (isinstance(act_bits, bool) or not isinstance(act_bits, int)):
        raise TypeError(f"act_bits={act_bits!r} must be an int (8, or 16 for float activations)")

    cell = _resolve_method(backend, method, weight_bits, act_bits)
    where = f"backend={backend!r} {cell.label} ({cell.method})"

    if layer_bits is not None and not cell.layer_bits:
        raise SpecRefused(
            f"{where} cannot honour a per-layer weight_bits dict. "
            f"{_can(_backends_where(lambda c: c.layer_bits))}"
        )

    if qscheme is None:
        qscheme = cell.qschemes[0]
    elif qscheme not in cell.qschemes:
        known = sorted({q for c in SUPPORT_MATRIX for q in c.qschemes})
        if qscheme not in known:
            raise SpecRefused(f"qscheme={qscheme!r} is unknown; valid values: {known}")
        raise SpecRefused(
            f"{where} cannot honour qscheme={qscheme!r}; it offers {list(cell.qschemes)}. "
            f"{_can_at(cell, lambda c: qscheme in c.qschemes)}"
        )

    symmetric = _resolve_flag("symmetric", symmetric, cell, "symmetric", where, (
        "its observers are affine by construction: activations carry a non-zero zero-point"
        if cell.symmetric == (False,) else "its kernels are symmetric only"))

    if qscheme == "per_group":
        if group_size is None:
            group_size = cell.default_group_size or 128
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or group_size & (group_size - 1):
            raise SpecRefused(f"group_size={group_size!r} must be a positive power of two (e.g. 32, 64, 128)")
    elif group_size is not None:
        raise SpecRefused(
            f"group_size={group_size} only applies to qscheme='per_group'; {where} resolved "
            f"qscheme={qscheme!r}. {_can(_backends_where(lambda c: 'per_group' in c.qschemes))}"
        )

    pt2e_only = lambda c: c.backend == "pt2e"  # noqa: E731
    if backend == "pt2e":
        qdq_placement = "per_op" if qdq_placement is None else qdq_placement
        if qdq_placement not in PLACEMENTS:
            raise SpecRefused(f"qdq_placement={qdq_placement!r} is unknown; valid values: {list(PLACEMENTS)}")
    elif qdq_placement is not None:
        raise SpecRefused(
            f"qdq_placement={qdq_placement!r}: {where} does not let you place Q/DQ pairs. "
            f"{_can(_backends_where(pt2e_only))}"
        )

    skip = _module_names("skip_activations", skip_activations, backend, where, "keep chosen activations float")
    wide = _module_names("int16", int16, backend, where, "store chosen activations in 16 bits")
    covered = [n for n in wide or () if under_modules(n, skip or ())]
    if covered:
        raise SpecRefused(f"int16={covered}: skip_activations keeps {'it' if len(covered) == 1 else 'them'} float; "
                          "name each module in one of the two")
    if wide is not None and cell.method != "static":
        raise SpecRefused(f"int16={list(wide)}: {where} has no activation pairs to widen; 16-bit activations "
                          "need static quantization (method='static')")

    if act_observer is None:
        act_observer = cell.act_observers[0]
    elif act_observer not in cell.act_observers:
        if act_observer not in ACT_OBSERVERS:
            raise SpecRefused(f"act_observer={act_observer!r} is unknown; valid values: {list(ACT_OBSERVERS)}")
        offered = [o for o in cell.act_observers if o]
        offers = f"it offers {offered}" if offered else "it uses its backend's own default observers"
        raise SpecRefused(
            f"{where} cannot honour act_observer={act_observer!r}; {offers}. "
            f"{_can(_backends_where(lambda c: act_observer in c.act_observers))}"
        )

    reduce_range = _resolve_flag("reduce_range", reduce_range, cell, "reduce_range", where,
                                 "it has no 7-bit weight option")

    if weight_algorithm is not None and weight_algorithm not in cell.weight_algorithms:
        if weight_algorithm not in WEIGHT_ALGORITHMS:
            raise SpecRefused(f"weight_algorithm={weight_algorithm!r} is unknown; valid values: "
                              f"{list(WEIGHT_ALGORITHMS)} (or None: round to nearest)")
        raise SpecRefused(
            f"{where} cannot honour weight_algorithm={weight_algorithm!r}: it applies to grouped int4 "
            f"weight-only. {_can_at(cell, lambda c: weight_algorithm in c.weight_algorithms)} "
            "Use method='int4_weight_only', or drop weight_algorithm"
        )

    if quantize_embedding is not None and not isinstance(quantize_embedding, bool):
        raise TypeError(f"quantize_embedding={quantize_embedding!r} must be True, False or None (the backend's rule)")
    if quantize_embedding not in cell.quantize_embedding:
        raise SpecRefused(f"{where} cannot honour quantize_embedding={quantize_embedding}: the token embedding table is "
                          "stored in low bits by the weight-only methods only. "
                          f"{_can_at(cell, lambda c: quantize_embedding in c.quantize_embedding)} Drop quantize_embedding")

    engine = backend if backend in FX_BACKENDS else None
    return QuantSpec(
        backend=backend, method=cell.method, weight_bits=cell.weight_bits, act_bits=cell.act_bits,
        qscheme=qscheme, symmetric=symmetric, group_size=group_size, layer_bits=layer_bits,
        qdq_placement=qdq_placement, skip_activations=skip, engine=engine, act_observer=act_observer,
        reduce_range=reduce_range, weight_algorithm=weight_algorithm, quantize_embedding=quantize_embedding,
        int16=wide,
    )


def _module_names(name: str, given: Iterable[str] | None, backend: str, where: str, what: str) -> tuple[str, ...] | None:
    """A list of module names as a sorted tuple (None when not given or empty); pt2e only."""
    if given is None:
        return None
    if isinstance(given, str):
        raise TypeError(f"{name}={given!r} must be a list of module names, not a string")
    names = tuple(sorted(dict.fromkeys(given)))
    if not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"{name}={list(names)} must hold non-empty module names (str)")
    if backend != "pt2e":
        raise SpecRefused(f"{name}={list(names)}: {where} cannot {what}. "
                          f"{_can(_backends_where(lambda c: c.backend == 'pt2e'))}")
    return names or None


def precision_table() -> str:
    """The support matrix as a Markdown table (the one printed in the docs)."""
    head = ("| backend | method | label | qscheme (first = default) | symmetric | per-layer weight_bits | "
            "reduce_range | exports | notes |")
    rule = "|---|---|---|---|---|---|---|---|---|"
    rows = [
        f"| `{c.backend}` | {c.method} | {c.label} | {', '.join(c.qschemes)} | "
        f"{', '.join(str(s) for s in c.symmetric)} | {'yes' if c.layer_bits else 'no'} | "
        f"{'optional' if True in c.reduce_range else 'no'} | {'yes' if c.exports else 'no'} | {c.note} |"
        for c in SUPPORT_MATRIX
    ]
    return "\n".join([head, rule, *rows])


def tag_model(model: Any, spec: QuantSpec, target: Preset | None = None) -> Any:
    """Attach ``spec`` (and the resolved deployment preset it was made for) to a produced model, so
    the precision and the target travel with it to ``export_qdq``."""
    if target is not None and not isinstance(target, Preset):
        raise TypeError(f"tag_model(target={target!r}): give the resolved Target (quantship.targets.get)")
    setattr(model, SPEC_ATTRIBUTE, spec)
    setattr(model, TARGET_ATTRIBUTE, target)
    return model


def quant_preset(model: Any) -> Preset | None:
    """The deployment preset a model was quantized for (``Quantizer.for_target``), else ``None``."""
    found = getattr(model, TARGET_ATTRIBUTE, None)
    return found if isinstance(found, Preset) else None


def quant_target(model: Any) -> str | None:
    """The name of the deployment preset a model was quantized for, else ``None``."""
    found = quant_preset(model)
    return found.target if found is not None else None


def quant_spec(model: Any) -> QuantSpec | None:
    """The ``QuantSpec`` a quantship ``Quantizer``/``QuantizeCallback`` attached to ``model``.

    Returns ``None`` for a model quantship did not produce (documented: no error is raised, so
    callers can test ``quant_spec(m) is None``).
    """
    spec = getattr(model, SPEC_ATTRIBUTE, None)
    return spec if isinstance(spec, QuantSpec) else None


# ---------------------------------------------------------------------------------------------
# Deployment presets: what a target quantizes with and how its file is written. Each target's own
# preset lives in its module of ``quantship.targets`` (a ``Target`` is a ``Preset``).


@dataclass(frozen=True)
class Preset:
    """A deployment preset: the request to quantize with, and how to write the file.

    ``target`` is the one name of the runtime everywhere inside quantship. Other spellings
    (``targets.ALIASES``) are resolved at the edge, by ``targets.get``.
    """

    target: str
    spec_kwargs: Mapping[str, Any] = field(default_factory=dict)
    activation_dtype: str = "int8"
    why: str = ""
    dynamic_batch: bool = False  # True: the file serves any batch; False: a static batch-1 file

    @property
    def check_target(self) -> str:
        """The deployability rule set the file must pass: the target's own name (kept for callers of
        earlier releases; one name per runtime)."""
        return self.target

    def as_dict(self) -> dict[str, Any]:
        """The preset's own fields (a ``Target`` adds its runtime's; they are not part of the preset)."""
        return {f.name: getattr(self, f.name) for f in fields(Preset)}


# The target registry of earlier releases, now ``quantship.targets``: served on first use, so that this
# module imports nothing of ours when it loads (tests/test_architecture.py reads this table).
MOVED_TO_TARGETS = ("PRESETS", "TARGET_ALIASES", "target_names", "preset", "resolve_target", "file_settings",
                    "same_file_as")


def __getattr__(name: str) -> Any:
    return load_public(__name__, dict.fromkeys(MOVED_TO_TARGETS, "quantship.targets"), name)
