"""A torch model's outputs as a flat, named list of tensors, in the order the ONNX exporter writes them.

A forward may return a tensor, a tuple or list of tensors, a dict (``OrderedDict``), or a
transformers ``ModelOutput`` (an ordered mapping of its fields that are not None), nested or not.
The exporter flattens that structure with torch's pytree: mappings in key order, sequences in index
order; the names here follow the same walk. A dict key names its tensor (``out``, ``aux``,
``logits``), a position of the top-level tuple is ``output_<i>``, a nested one is ``<parent>.<i>``.
A single tensor keeps the exporter's name (``names_of`` returns None). A leaf that is not a tensor
(None, a number, a string) has nothing to export or compare and is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from quantship.errors import OutputsRefused

__all__ = ["flatten_outputs", "names_of", "output_arrays"]


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _walk(value: Any, name: str, out: list[tuple[str, Any]], what: str) -> None:
    if _is_tensor(value):
        out.append((name, value))
        return
    where = f"output {name!r}" if name else "the output"
    if isinstance(value, Mapping):  # dict, OrderedDict, transformers ModelOutput (its non-None fields)
        items = [(f"{name}.{key}" if name else str(key), item) for key, item in value.items()]
    elif isinstance(value, (tuple, list)):
        items = [(f"{name}.{i}" if name else f"output_{i}", item) for i, item in enumerate(value)]
    else:
        kind = "None" if value is None else f"of type {type(value).__name__}"
        raise OutputsRefused(
            f"{where} of {what} is {kind}, not a tensor: only tensor outputs can be exported and compared; "
            f"return tensors only (a wrapper whose forward drops or converts it)")
    if not items:
        raise OutputsRefused(f"{where} of {what} is an empty {type(value).__name__}: return at least one tensor")
    for child, item in items:
        _walk(item, child, out, what)


def flatten_outputs(output: Any, what: str = "the model") -> list[tuple[str, Any]]:
    """``(name, tensor)`` for every tensor of a forward's ``output``, in the exporter's order.

    A single tensor is ``[("", tensor)]``. Refuses (``OutputsRefused``) a None or non-tensor leaf, an
    empty container, and two leaves whose names coincide (keys that print the same)."""
    leaves: list[tuple[str, Any]] = []
    _walk(output, "", leaves, what)
    names = [name for name, _ in leaves]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise OutputsRefused(f"the outputs of {what} repeat the name(s) {repeated}: give the dict keys distinct "
                             "string names")
    return leaves


def names_of(output: Any, what: str = "the model") -> list[str] | None:
    """The graph output names a forward's ``output`` gives (None for a single tensor: the exporter's own)."""
    leaves = flatten_outputs(output, what)
    return None if len(leaves) == 1 and leaves[0][0] == "" else [name for name, _ in leaves]


def output_arrays(model: Any, batches: list[Any]) -> tuple[list[str] | None, list[np.ndarray]]:
    """Every output of a torch model over ``batches`` (a tensor or a tuple of tensors each), each
    concatenated along the batch: ``(names, arrays)``, names as ``names_of`` gives them."""
    import torch

    what = f"the model ({type(model).__name__})"
    names: list[str] | None = None
    parts: list[list[np.ndarray]] = []
    with torch.no_grad():
        for i, batch in enumerate(batches):
            y = model(*batch) if isinstance(batch, (tuple, list)) else model(batch)
            leaves = flatten_outputs(y, what)
            here = [name for name, _ in leaves]
            if i == 0:
                names, parts = here, [[] for _ in leaves]
            elif here != names:
                raise OutputsRefused(f"{what} returns outputs {here} on one batch and {names} on another: "
                                     "return the same outputs whatever the input")
            for part, (_, tensor) in zip(parts, leaves):
                part.append(tensor.detach().float().cpu().numpy() if tensor.is_floating_point()
                            else tensor.detach().cpu().numpy())
    if names is None:
        raise OutputsRefused(f"no batch to run {what} on")
    keyed = None if len(names) == 1 and names[0] == "" else names
    return keyed, [np.concatenate(part) for part in parts]
