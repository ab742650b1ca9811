"""Which models ``export_qdq`` can write, and which activation dtype a request resolves to.

A refusal names the precision label, the backend, and the way out; nothing is written.
"""

from __future__ import annotations

from typing import Any

from quantship.errors import ExportRefused
from quantship.precision import Preset, QuantSpec, quant_spec

ACTIVATION_DTYPES = ("int8", "uint8")
_QD_NAMESPACE = "quantized_decomposed"

# torchao weight-only (W8A16, W4A16) exports through export.weight_only; these are what stays refused
_WHY_NOT = {
    "int8_dynamic": "dynamic activation quantization computes its scales at run time, so the file would have "
                    "no static activation scale to carry",
}


def has_pt2e_ops(model: Any) -> bool:
    """Whether ``model`` is a graph carrying pt2e ``quantized_decomposed`` quantize/dequantize calls."""
    graph = getattr(model, "graph", None)
    nodes = getattr(graph, "nodes", ())
    return any(_QD_NAMESPACE in str(getattr(n, "target", "")) for n in nodes)


def exportable_spec(model: Any) -> QuantSpec:
    """The spec ``export_qdq`` will write for ``model``; refuses anything it cannot write faithfully."""
    spec = quant_spec(model)
    if spec is None:
        if has_pt2e_ops(model):
            raise ExportRefused(
                "export_qdq: this graph carries pt2e quantize/dequantize operators but no quantship spec, "
                "so the file could not say what precision it holds. Quantize it with "
                "quantship.Quantizer(backend='pt2e') (which tags the result), then export it."
            )
        raise ExportRefused(
            f"export_qdq: {type(model).__name__} carries no quantship precision spec: it is a float model "
            "(or was quantized outside quantship). Export a float model with quantship.export_onnx, or "
            "quantize it first with quantship.Quantizer(backend='pt2e')."
        )
    if spec.exports:
        return spec
    why = _WHY_NOT.get(spec.method)
    if why is None:  # the FX backends
        why = (f"FX graph mode ({spec.backend}) converts to affine uint8 quantized kernels that the dynamo "
               "exporter cannot translate into a QDQ graph")
    raise ExportRefused(
        f"export_qdq cannot write this model: it was quantized {spec.label} ({spec.method}) with "
        f"backend={spec.backend!r}. {why}. Quantize with quantship.Quantizer(backend='pt2e') for a graph "
        "export_qdq can write (or backend='torchao' with a weight-only method)."
    )


def resolve_activation_dtype(activation_dtype: str | None, target: Preset | None) -> str:
    """``activation_dtype`` as given, else the target preset's, else ``'int8'``; conflicts are refused."""
    if activation_dtype is not None and activation_dtype not in ACTIVATION_DTYPES:
        raise ExportRefused(f"activation_dtype={activation_dtype!r} is not supported; valid values: {list(ACTIVATION_DTYPES)}")
    if target is None:
        return activation_dtype or "int8"
    wanted = target.activation_dtype
    if activation_dtype is not None and activation_dtype != wanted:
        raise ExportRefused(
            f"activation_dtype={activation_dtype!r} conflicts with target={target.target!r}, whose preset writes "
            f"{wanted!r} activations: drop one of the two arguments"
        )
    return wanted
