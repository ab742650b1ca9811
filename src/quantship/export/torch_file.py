"""A PyTorch model to a checked file: its calibration data, the export sample, and what is read back from
the written file (its batch, its error against the quantized model, what it leaves float). The flow itself
is ``judged.quantize_export_judged``; ``quantship quantize`` parses, calls these and prints.

Data (``read_calibration``): an ``.npz`` keyed by the forward's argument names (several inputs, int64
token ids and masks, each in its dtype: ``data.forward_inputs``), a ``.npy`` or an image folder for a
single input, all read by the one loader; or, for a model that embeds token ids, generated ids
(``generated_ids``: within the embedding's rows, masks of ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quantship import heap
from quantship.errors import DataRefused, QuantshipError, cause
from quantship.export.data import forward_arguments, forward_inputs, npz_keys, read_held_out, split_held_out
from quantship.export.judged import file_outputs
from quantship.fidelity import HELD_OUT_MAX
from quantship.inspect.read.feeds import Preprocessing, cut
from quantship.inspect.read.float_ops import float_ops
from quantship.inspect.read.lsb import lsb_error, output_scales
from quantship.inspect.run.consumers import ort_session
from quantship.inspect.run.outputs import output_arrays
from quantship.precision import under_modules
from quantship.quantize.calibration import Inputs


@dataclass
class Calibration:
    """The batches a model is calibrated on, those fidelity is judged on, what they are, and the names."""

    batches: list  # each a tensor (one input) or a tuple in the forward's order
    held: list | None
    held_label: str
    names: list[str]  # the forward's arguments fed, in order: the file's input names
    source: str  # where the data came from, for the report
    feeds: list[dict] = field(default_factory=list)  # every sample (calibration and held out), by name

    def whole(self) -> dict[str, np.ndarray]:
        """Every sample by input name: the real inputs the written file is run on."""
        return {n: np.concatenate([f[n] for f in self.feeds]) for n in self.names}


def as_torch(feed: dict, names: list[str]):
    """One batch as the model is called: a tensor for one input, ``Inputs`` in the forward's order for several."""
    tensors = tuple(torch.from_numpy(np.ascontiguousarray(feed[n])) for n in names)
    return tensors[0] if len(tensors) == 1 else Inputs(tensors)


def embedding_rows(model: Any) -> int | None:
    """Rows of the smallest ``nn.Embedding`` in ``model`` (the range of its token ids); None when it has none."""
    rows = [m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    return min(rows) if rows else None


def generated_ids(model: Any, n: int, seq_len: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``n`` seeded samples of ``seq_len`` tokens for a model that embeds token ids: ids in [0, rows of its
    embedding) for each required argument, ones for one named like a mask."""
    rows = embedding_rows(model)
    if rows is None:
        raise DataRefused(f"{type(model).__name__} has no embedding to generate token ids for: give --calib data")
    rng = np.random.default_rng(seed)
    names, _ = forward_arguments(model)
    return {name: (np.ones((n, seq_len), np.int64) if "mask" in name else rng.integers(0, rows, (n, seq_len)))
            for name in names}


def read_calibration(model: Any, calib: str | None, *, batch_size: int, max_samples: int, key: str | None = None,
                     preprocessing: Preprocessing | None = None, fidelity_data: str | None = None,
                     judged: bool = True, multiple: int = 1, seq_len: int = 128) -> Calibration:
    """``calib`` read for ``model`` (module docstring; None: generated token ids), cut into batches, with
    the held-out part fidelity is judged on; a model that cannot run on the first batch is refused here."""
    if calib is None:
        arrays = generated_ids(model, max_samples + (HELD_OUT_MAX if judged else 0), seq_len)
        inputs, declare = forward_inputs(model, "generated ids", list(arrays))
        specs = declare(arrays)
        kept, held, said = split_held_out(arrays, max_samples, multiple, "generated") if judged else (arrays, None, "")
        source = f"generated token ids ({', '.join(f'{k}: {v.shape[1]} tokens' for k, v in arrays.items())})"
        batches = cut(specs, kept, batch_size=batch_size, max_samples=max_samples, source=source)
        held_batches = None if held is None else cut(specs, held, batch_size=batch_size, max_samples=1 << 62,
                                                     source=source)
    else:
        given = sorted(set(npz_keys(calib)) | set(npz_keys(fidelity_data or "")))
        inputs, declare = forward_inputs(model, calib, given)
        batches, held_batches, said = read_held_out(calib, inputs, batch_size=batch_size, max_samples=max_samples,
                                                    key=key, preprocessing=preprocessing, fidelity_data=fidelity_data,
                                                    judged=judged, multiple=multiple, declare=declare)
        source = calib
    names = list(batches[0])
    torch_batches = [as_torch(f, names) for f in batches]
    first = torch_batches[0]
    try:
        output_arrays(model, [first])
    except QuantshipError:
        raise  # quantship's own refusal of the model's outputs says what to do: not wrapped, not cut
    except Exception as exc:  # the user's model on the user's data: its failure is bad input
        shapes = {n: list(batches[0][n].shape) for n in names}
        raise DataRefused(f"{type(model).__name__} cannot run on a calibration batch {shapes}: {cause(exc)}") from None
    label = f"sample(s): {said}" if not fidelity_data and held_batches is not None else said
    return Calibration(torch_batches, None if held_batches is None else [as_torch(f, names) for f in held_batches],
                       label if held_batches is not None else "", names, source, [*batches, *(held_batches or [])])


def export_sample(batches: list, static_batch: int | None):
    """The export sample and ``dynamic_batch``: the preset's choice, or a file fixed at ``static_batch``."""
    if static_batch is None:
        return batches[0], None
    several = isinstance(batches[0], Inputs)
    columns = list(zip(*batches)) if several else [batches]
    samples = [torch.cat(list(c)) for c in columns]
    if len(samples[0]) < static_batch:
        raise DataRefused(f"--static-batch {static_batch}: the calibration data holds {len(samples[0])} sample(s); "
                          "give at least that many, or a smaller --static-batch")
    cut_ = tuple(s[:static_batch] for s in samples)
    return (Inputs(cut_) if several else cut_[0]), False


def output_error(qmodel: Any, path: str | Path, sample: Any, served: int | None = None):
    """The file read literally in ONNX Runtime against the quantized torch model on the first output (on the
    first ``served`` samples: the file's static batch): an ``LSBError`` in output steps, or a dict in absolute
    terms when the output stays float (no output scale). A large model's session and read of the file are
    freed back to the kernel (``heap.large_blocks_mapped``, which trims the heap on leaving)."""
    if served is not None:
        sample = Inputs(x[:served] for x in sample) if isinstance(sample, Inputs) else sample[:served]
    with heap.large_blocks_mapped(heap.module_bytes(qmodel)):
        _, (reference, *_) = output_arrays(qmodel, [sample])
        got = file_outputs(ort_session(path), [sample], None)[0]
        scale = next(iter(output_scales(path).values()), None)
    if scale is not None:
        return lsb_error(reference, got, scale)
    diff = np.abs(reference - got)
    return {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()),
            "describe": f"float output: max abs {diff.max():.4g}, mean abs {diff.mean():.4g} (no output scale)"}


def left_float(quantizer: Any, facts: Any, for_speed: Sequence[str] = ()) -> dict:
    """The compute ops the written file leaves in float, by module path and why (the list ``inspect`` prints
    for the file, with what only the quantizer knows: which modules its annotator had no INT8 rule for),
    plus every torch op the annotator left float, compute or not (``no_int8_rule``)."""
    report = getattr(quantizer, "report", None)
    no_rule = report.float_ops_by_module() if report is not None else {}
    out = float_ops(facts, no_rule_modules=no_rule, for_speed=for_speed)
    out["no_int8_rule"] = no_rule
    floated = [f.module for f in facts.float_compute if f.module is not None]
    floated_ops = {f.op for f in facts.float_compute}
    requested = [m for m in ((facts.spec.get("skip_activations") or []) if isinstance(facts.spec, dict) else [])
                 if m not in for_speed]
    # a module kept float whose compute ops all read and write INT8 in the file: the ops around it quantize
    # its inputs and outputs for their own sake (e.g. a conv whose ReLU is another module)
    out["requested_but_int8"] = [name for name in requested if name not in floated_ops
                                 and not any(under_modules(m, (name,)) for m in floated)]
    return out
