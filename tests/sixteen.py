"""A target whose runtime computes on 16-bit activations in integer kernels. None of quantship's four does (ONNX
Runtime's CPU runs an op between 16-bit pairs in float), so the fidelity repair and the labelled search try 16 bits
before float for none of them (``Target.repairs_with_int16``). The tests of that mechanism run it on the
onnxruntime-cpu preset with this one fact changed; its files are the preset's, read in ONNX Runtime as any other."""

from __future__ import annotations

import dataclasses

from quantship import targets

INT16_KERNELS = dataclasses.replace(targets.get("onnxruntime-cpu"), int16_kernels=True)
