"""Run an ONNX file like a PyTorch module (``ONNXModel``) and check it against one (``verify_onnx``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from quantship.errors import FileRefused, cause


def _as_inputs(sample: Any) -> tuple:
    return tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)


class ONNXModel:
    """An ONNX Runtime session called like a PyTorch module: tensors in, tensor (or tuple) out."""

    def __init__(self, path: str | Path, device: str = "cpu"):
        providers = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}
        if device not in providers:
            raise ValueError(f"device={device!r}; valid values: {list(providers)}")
        if device == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
            raise ValueError("device='cuda' but this onnxruntime build has no CUDA provider; use device='cpu'")
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such file")
        try:
            self.session = ort.InferenceSession(str(path), providers=providers[device])
        except Exception as exc:  # ORT's Fail / InvalidGraph / NoSuchFile: the file, not the caller, is wrong
            raise FileRefused(f"{self.path}: ONNX Runtime cannot load it ({cause(exc)})") from exc
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]

    def __call__(self, *inputs: Any) -> Any:
        import torch

        if len(inputs) != len(self.input_names):
            raise ValueError(f"{self.path.name} takes {len(self.input_names)} input(s) {self.input_names}, "
                             f"got {len(inputs)}")
        feeds = {name: (x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x))
                 for name, x in zip(self.input_names, inputs)}
        outputs = [torch.from_numpy(o) for o in self.session.run(None, feeds)]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)


def verify_onnx(model: Any, path: str | Path, sample: Any, rtol: float = 1e-3, atol: float = 1e-5) -> bool:
    """Whether every output of the file matches the PyTorch model on ``sample`` within ``rtol``/``atol``."""
    import torch

    model.eval()
    with torch.no_grad():
        expected = model(*_as_inputs(sample))
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    got = ONNXModel(path)(*_as_inputs(sample))
    got = list(got) if isinstance(got, tuple) else [got]
    if len(got) != len(expected):
        return False
    return all(
        g.shape == e.shape and np.allclose(g.numpy(), e.detach().cpu().numpy(), rtol=rtol, atol=atol)
        for g, e in zip(got, expected)
    )
