"""No user file is ever overwritten by accident (issue 38's data-loss cases).

``--out`` equal to an input (the same path, a symlink or a hard link), not ending in ``.onnx`` (the
calibration data, the model's source), or an existing non-regular file (a named pipe, a character
device): refused in one line, exit 2, before any work, and the file is byte-for-byte what it was.
The API (``export_qdq``, ``export_onnx``, ``quantize_onnx_file``) refuses the same paths.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from quantship.cli.main import main
from quantship.errors import ExportRefused
from quantship.export import export_onnx
from quantship.export.artifact import refuse_unsafe_destination

MODEL_PY = """
import torch.nn as nn

def build():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
"""


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("mine")
    (d / "net.py").write_text(MODEL_PY)
    np.save(d / "cal.npy", np.random.default_rng(0).standard_normal((8, 3, 16, 16)).astype(np.float32))
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    export_onnx(model.eval(), torch.randn(2, 3, 16, 16), d / "float.onnx", opset_version=18)
    os.link(d / "float.onnx", d / "hardlink.onnx")
    (d / "symlink.onnx").symlink_to(d / "float.onnx")
    os.mkfifo(d / "pipe.onnx")
    return {p.name: p for p in d.iterdir()}


def _refused(capsys, argv: list[str], protected: Path, says: str) -> None:
    before = _digest(protected) if protected.is_file() else None
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and says in err[0], err
    if before is not None:
        assert _digest(protected) == before
    assert not [p for p in protected.parent.iterdir() if p.name.startswith(".quantship-")]


@pytest.mark.parametrize("out", ["float.onnx", "hardlink.onnx", "symlink.onnx"])
def test_quantize_onnx_out_on_its_input(inputs, capsys, out):
    _refused(capsys, ["quantize-onnx", str(inputs["float.onnx"]), "--calib", str(inputs["cal.npy"]),
                      "--out", str(inputs[out])], inputs["float.onnx"], "is the input")


def test_quantize_onnx_out_on_the_calibration_data(inputs, capsys):
    _refused(capsys, ["quantize-onnx", str(inputs["float.onnx"]), "--calib", str(inputs["cal.npy"]),
                      "--out", str(inputs["cal.npy"])], inputs["cal.npy"], "does not end in .onnx")


def test_export_onnx_out_on_the_model_source(inputs, capsys):
    _refused(capsys, ["export-onnx", f"{inputs['net.py']}:build", "--shape", "1,3,16,16",
                      "--out", str(inputs["net.py"])], inputs["net.py"], "does not end in .onnx")


def test_quantize_out_on_the_model_source(inputs, capsys):
    _refused(capsys, ["quantize", f"{inputs['net.py']}:build", "--calib", str(inputs["cal.npy"]),
                      "--out", str(inputs["net.py"])], inputs["net.py"], "does not end in .onnx")


def test_out_on_a_named_pipe(inputs, capsys):
    pipe = inputs["pipe.onnx"]
    _refused(capsys, ["quantize-onnx", str(inputs["float.onnx"]), "--calib", str(inputs["cal.npy"]),
                      "--out", str(pipe)], pipe, "named pipe")
    assert pipe.is_fifo()


def test_out_on_a_character_device():
    with pytest.raises(ExportRefused, match="character device"):
        refuse_unsafe_destination("/dev/null")
    # a device under an .onnx name (a symlink to one) is refused for what it is
    link = Path(os.environ.get("TMPDIR", "/tmp")) / f"quantship-device-{os.getpid()}.onnx"
    link.symlink_to("/dev/null")
    try:
        with pytest.raises(ExportRefused, match="character device"):
            refuse_unsafe_destination(link)
    finally:
        link.unlink()
    assert Path("/dev/null").is_char_device()


def test_api_refuses_the_same_paths(inputs):
    from quantship.quantize_onnx import quantize_onnx_file

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    before = _digest(inputs["net.py"])
    with pytest.raises(ExportRefused, match="does not end in .onnx"):
        export_onnx(model, torch.randn(2, 3, 16, 16), inputs["net.py"])
    assert _digest(inputs["net.py"]) == before
    float_digest = _digest(inputs["float.onnx"])
    with pytest.raises(ExportRefused, match="is the input"):
        quantize_onnx_file(inputs["float.onnx"], inputs["hardlink.onnx"],
                           np.load(inputs["cal.npy"]), target="onnxruntime-cpu")
    assert _digest(inputs["float.onnx"]) == float_digest


def test_export_qdq_refuses_a_source_path(tmp_path):
    from quantship import export_qdq

    src = tmp_path / "x.py"
    src.write_text("print('mine')\n")
    with pytest.raises(ExportRefused, match="does not end in .onnx"):
        export_qdq(nn.Linear(2, 2), torch.randn(1, 2), src)  # refused before the model is even looked at
    assert src.read_text() == "print('mine')\n"
