"""``torch.export`` capture for pt2e, with a symbolic batch dimension whenever the model allows it.

A symbolic batch lets calibration batches of any size through (8, 8, 5) and lets the exported file
serve any batch. When the model's code fixes the batch (a guard such as ``Eq(s0, 8)``), the guard
and the user source line that added it are read from torch.export's own report, so the fallback
log (or the refusal) names the line to change.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.fx import GraphModule

from quantship.quantize.calibration import Inputs

BATCH_DIM_NAME = "batch"
# Set on a graph captured at a static batch: why torch.export could not keep the batch symbolic.
# quantship.export.qdq reads the same attribute name to refuse dynamic_batch=True with that reason.
STATIC_BATCH_ATTRIBUTE = "quantship_static_batch_reason"
BATCH_MODES = ("auto", "dynamic", "static")
_TORCH_DIR = str(Path(torch.__file__).parent)


@dataclass(frozen=True)
class Capture:
    """A captured graph and its batch dimension: ``static_batch`` is None when symbolic."""

    graph: GraphModule
    static_batch: int | None
    reason: str = ""  # why the batch is static ('' when symbolic or when static was asked for)

    @property
    def symbolic(self) -> bool:
        return self.static_batch is None


def contiguous(x: torch.Tensor | Inputs) -> torch.Tensor | Inputs:
    """``x`` in the default (NCHW, row-major) layout: strides and memory format never reach a graph."""
    if isinstance(x, Inputs):
        return Inputs(contiguous(each) for each in x)
    return x.contiguous(memory_format=torch.contiguous_format)


def _at_least_two(example: torch.Tensor | Inputs) -> torch.Tensor | Inputs:
    # torch.export specialises a dimension of size 0 or 1: a symbolic batch needs an example of 2 or more
    if isinstance(example, Inputs):
        return Inputs(_at_least_two(each) for each in example)
    if example.shape[0] >= 2:
        return example
    return torch.cat([example] * 2)[:2] if example.shape[0] == 1 else example


def _arguments(example: torch.Tensor | Inputs) -> tuple:
    """torch.export's positional arguments and their batch dimension, one symbolic name shared by all."""
    args = tuple(example) if isinstance(example, Inputs) else (example,)
    return args, tuple({0: torch.export.Dim(BATCH_DIM_NAME)} for _ in args)


def _is_constraint_violation(exc: BaseException) -> bool:
    kind = getattr(exc, "error_type", None)
    return getattr(kind, "name", "") == "CONSTRAINT_VIOLATION" or "Constraints violated" in str(exc)


def _user_frame(stack: list[dict], filenames: dict) -> str:
    """The innermost frame outside torch, as 'file:line in function: `code`'."""
    for frame in reversed(stack or []):
        name = filenames.get(frame.get("filename"), str(frame.get("filename")))
        if not str(name).startswith(_TORCH_DIR):
            code = (frame.get("loc") or "").strip()
            return f"{name}:{frame.get('line')} in {frame.get('name')}" + (f": `{code}`" if code else "")
    return ""


def batch_guard(model: torch.nn.Module, example: torch.Tensor, exc: BaseException) -> str:
    """The guard that fixed the batch and where the model's code added it, from torch.export's report.

    Falls back to the first line of torch.export's error when its draft report names no guard.
    """
    fallback = next((line.strip(" -") for line in str(exc).splitlines() if "specialized" in line), _first_line(exc))
    draft = getattr(torch.export, "draft_export", None)
    if draft is None:
        return fallback
    quiet = logging.getLogger("torch.export._draft_export")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        report = getattr(draft(model, _arguments(example)[0], dynamic_shapes=_arguments(example)[1],
                               strict=False), "_report", None)
    except Exception:  # the draft trace is a diagnosis only; torch.export's message still stands
        return fallback
    finally:
        quiet.setLevel(level)
    filenames = dict(getattr(report, "str_to_filename", {}) or {})
    # torch interns each file name once per process; names interned by an earlier trace live here
    interned = getattr(getattr(torch._logging, "structured", None), "INTERN_TABLE", {})
    filenames.update({index: name for name, index in interned.items() if index not in filenames})
    for failure in getattr(report, "failures", []):
        data = failure.data if isinstance(failure.data, dict) else {}
        if getattr(failure.failure_type, "name", "") != "GUARD_ADDED" or "expr" not in data:
            continue
        sources = ", ".join(f"{k} = {v}" for k, v in (data.get("symbol_to_sources") or {}).items())
        where = _user_frame(data.get("user_stack"), filenames)
        return f"guard {data['expr']}" + (f" ({sources})" if sources else "") + (f" added at {where}" if where else "")
    return fallback


def _export(model: torch.nn.Module, example: torch.Tensor, dynamic: bool) -> GraphModule:
    args, shapes = _arguments(example)
    return torch.export.export(model, args, dynamic_shapes=shapes if dynamic else None, strict=False).module()


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__


def _refuse_capture(model: torch.nn.Module, exc: BaseException) -> ValueError:
    return ValueError(
        f"pt2e could not capture {type(model).__name__} with torch.export ({type(exc).__name__}: "
        f"{_first_line(exc)}). "
        "pt2e needs a model torch.export can trace: remove data-dependent Python control flow, or use an "
        "FX backend (backend='x86')."
    )


def capture(model: torch.nn.Module, example: torch.Tensor, *, batch: str = "auto",
            log: Callable[[str], None] | None = None) -> Capture:
    """``torch.export`` the model; ``batch``: 'auto' (symbolic if possible, else static with a log line),
    'dynamic' (symbolic or a refusal naming the guard), 'static' (the example's batch size)."""
    if batch not in BATCH_MODES:
        raise ValueError(f"batch={batch!r}; valid values: {list(BATCH_MODES)}")
    say = log or (lambda message: None)
    example = contiguous(example)
    size = int(example.shape[0])
    reason = ""
    if batch != "static":
        symbolic_example = _at_least_two(example)
        try:
            return Capture(_export(model, symbolic_example, dynamic=True), None)
        except Exception as exc:  # torch.export raises many types; a guard on the batch is told apart
            if _is_constraint_violation(exc):
                reason = batch_guard(model, symbolic_example, exc)
            else:
                reason = f"torch.export failed with a symbolic batch ({type(exc).__name__}: {_first_line(exc)})"
            if batch == "dynamic":
                raise ValueError(
                    f"torch.export cannot keep the batch dimension of {type(model).__name__} symbolic: "
                    f"{reason}. Compute that size from x.shape[0] instead of a constant, or ask for a "
                    "static batch (export_qdq(dynamic_batch=False), quantship quantize --static-batch N)."
                ) from exc
    try:
        graph = _export(model, example, dynamic=False)
    except Exception as exc:
        raise _refuse_capture(model, exc) from exc
    if reason:
        say(f"pt2e: captured at a static batch of {size}: torch.export could not keep the batch symbolic "
            f"({reason}); the quantized model and its file run at batch {size} only")
    setattr(graph, STATIC_BATCH_ATTRIBUTE,
            f"captured at batch {size}: {reason or 'a static batch was asked for'}")
    return Capture(graph, size, reason)


def carry_static_batch(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Keep the static-batch record across a pass that returns a new module (convert_pt2e)."""
    reason = getattr(source, STATIC_BATCH_ATTRIBUTE, None)
    if reason is not None:
        setattr(target, STATIC_BATCH_ATTRIBUTE, reason)
