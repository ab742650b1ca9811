"""torchao's QAT conv-bn patterns (prepare_qat_pt2e's fusion, convert_pt2e's fold), run only where a graph
can match them.

torchao 0.18's ``convert_pt2e`` folds QAT conv-bn pairs whenever the graph holds any batch norm: it
traces 24 match/replace patterns with torch.export for each of conv1d, conv2d, conv_transpose1d and
conv_transpose2d (96 exports; 14-29 s on 2 cores for a graph holding one BatchNorm2d) whatever the
graph contains. The patterns are the structure ``prepare_qat_pt2e`` writes around a conv followed by
a batch norm, so they cannot match:

- in a graph from ``prepare_pt2e`` (post-training): it folds eval-mode conv-bn pairs into the conv
  at prepare time, and a batch norm left (one after a pooling, an activation, an input: DenseNet's
  pre-activations) has no QAT conv structure around it;
- in a QAT graph, for a conv kind with no node in the graph.

Those patterns are skipped; every other step of the fold runs as torchao writes it. The same holds
for ``prepare_qat_pt2e``'s fusion (3 patterns per conv kind): the kinds the graph does not hold are
skipped. The patterns that can match are traced once per process (torchao traces them anew on every
prepare and convert: about 7 s for conv2d's 24 at convert): their graphs depend on the pattern's
flags and the example inputs' shapes only, and the rewrite copies them into the model without
changing them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch


def _conv_kinds_absent(graph: torch.fx.GraphModule | None) -> set:
    """The conv functions torchao writes patterns for that have no node in ``graph`` (all when None)."""
    import torch.nn.functional as F

    aten = torch.ops.aten
    ops_of = {F.conv1d: {aten.conv1d.default}, F.conv2d: {aten.conv2d.default},
              F.conv_transpose1d: {aten.conv_transpose1d.default},
              F.conv_transpose2d: {aten.conv_transpose2d.input}}
    targets = {n.target for n in graph.graph.nodes if n.op == "call_function"} if graph is not None else set()
    return {fn for fn, ops in ops_of.items() if not ops & targets}


@contextlib.contextmanager
def _skipping(helper_name: str, absent: set, skipped: Any) -> Iterator[None]:
    """Inside, torchao's per-conv-kind ``helper_name`` returns ``skipped(m)`` for the conv kinds in ``absent``,
    and every pattern it traces is traced once per process."""
    from torchao.quantization.pt2e import qat_utils

    original = getattr(qat_utils, helper_name, None)  # None: another torchao layout, every kind runs

    def helper(m: torch.fx.GraphModule, conv_fn: Any, *args: Any, **kwargs: Any) -> torch.fx.GraphModule:
        return skipped(m) if conv_fn in absent else original(m, conv_fn, *args, **kwargs)

    if original is not None:
        setattr(qat_utils, helper_name, helper)
    try:
        with patterns_traced_once():
            yield
    finally:
        if original is not None:
            setattr(qat_utils, helper_name, original)


def fold_what_can_match(graph: torch.fx.GraphModule, *, qat: bool) -> contextlib.AbstractContextManager:
    """Inside, ``convert_pt2e`` folds QAT conv-bn patterns only for the conv kinds ``graph`` holds, and
    none when the graph was prepared for post-training quantization (``qat=False``)."""
    return _skipping("_fold_conv_bn_qat_helper", _conv_kinds_absent(graph if qat else None), lambda m: m)


def _unmatched(m: torch.fx.GraphModule) -> torch.fx.GraphModule:
    # what torchao's fusion helper leaves of a graph its patterns do not match
    m.graph.eliminate_dead_code()
    m.recompile()
    return m


def fuse_what_can_match(graph: torch.fx.GraphModule) -> contextlib.AbstractContextManager:
    """Inside, ``prepare_qat_pt2e`` fuses conv-bn pairs for QAT only for the conv kinds ``graph`` holds
    (torchao traces 3 patterns for each of the 4 kinds)."""
    return _skipping("_fuse_conv_bn_qat_helper", _conv_kinds_absent(graph), _unmatched)


@contextlib.contextmanager
def patterns_traced_once() -> Iterator[None]:
    """Inside, torchao's QAT conv-bn patterns (``prepare_qat_pt2e``'s fusion, ``convert_pt2e``'s fold) are
    traced once per process and reused."""
    from torchao.quantization.pt2e import qat_utils

    trace = getattr(qat_utils, "_get_aten_graph_module_for_pattern", None)
    if trace is None or isinstance(trace, functools.partial):  # another layout, or already inside
        yield
        return
    qat_utils._get_aten_graph_module_for_pattern = functools.partial(_traced_once, trace)
    try:
        yield
    finally:
        qat_utils._get_aten_graph_module_for_pattern = trace


_PATTERNS: dict[tuple, tuple[torch.fx.GraphModule, str]] = {}  # key -> (traced pattern, its code when traced)


def _shape_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type)
    return ("value", value)


def _traced_once(trace: Any, pattern: Any, example_inputs: tuple, is_cuda: bool = False, **kwargs: Any) -> Any:
    """torchao's pattern trace, kept per pattern code, closure flags and input shapes (once per process)."""
    try:
        # torchao wraps each pattern function in a stateless module (``WrapperModule(fn)``)
        fn = pattern.fn if isinstance(pattern, torch.nn.Module) and not list(pattern.state_dict()) else pattern
        closure = tuple(cell.cell_contents for cell in fn.__closure__ or ())
        key = (type(pattern), fn.__code__, closure, is_cuda, tuple(_shape_key(x) for x in example_inputs),
               tuple(sorted((k, _shape_key(v)) for k, v in kwargs.items())))
        hash(key)
    except (AttributeError, TypeError, ValueError):  # not a plain closure over hashable flags: trace it
        return trace(pattern, example_inputs, is_cuda, **kwargs)
    kept = _PATTERNS.get(key)
    if kept is None or kept[0].code != kept[1]:  # never traced, or changed by whoever used it: trace anew
        traced = trace(pattern, example_inputs, is_cuda, **kwargs)
        kept = _PATTERNS[key] = (traced, traced.code)
    return kept[0]
