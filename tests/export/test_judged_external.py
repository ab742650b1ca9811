"""A PyTorch-path file over the single-file limit (``artifact.EXTERNAL_DATA_THRESHOLD``, lowered here) written by
the command's flow (``quantize_export_judged``: made in a scratch folder, committed from another): its data file
goes with it, renamed for the destination. Found on the 2 GB encoder with 31 of 40 blocks kept float (a 1.7 GB
file): the graph was moved without its data and the commit refused it ("the exporter wrote no step0.onnx....data")."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch

import quantship.export.artifact as artifact
from quantship import Budget, Quantizer
from quantship.export import quantize_export_judged
from quantship.inspect.read import external
from quantship.targets import get


def test_a_judged_file_over_the_limit_keeps_its_data_beside_it(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(), torch.nn.Conv2d(16, 16, 3)).eval()
    data = torch.rand(40, 3, 12, 12)
    monkeypatch.setattr(artifact, "EXTERNAL_DATA_THRESHOLD", 0)
    out = tmp_path / "out" / "q.onnx"
    out.parent.mkdir()
    judged = quantize_export_judged(model, [data[:32]], data[:1], out, target=get("onnxruntime-cpu"), overrides={},
                                    held=[data[32:]], held_label="held", budget=Budget(),
                                    make_quantizer=Quantizer.for_target, speed=False)
    (location,) = external.locations(onnx.load(str(out), load_external_data=False))
    assert location.startswith("q.onnx.") and location.endswith(".data")
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(["q.onnx", location])
    assert judged.fidelity.status == "met"
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: data[:4].numpy()})[0]
    with torch.no_grad():
        expected = model(data[:4]).numpy()
    assert 10 * np.log10((expected ** 2).sum() / ((expected - got) ** 2).sum()) > 25
