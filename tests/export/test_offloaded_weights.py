"""A large graph's weights kept in a data file while ``export_qdq``'s passes run (issue 40, the PyTorch path's
memory): every check maps them instead of holding a copy per graph state. The file written is the one written
with them in memory, nothing is left beside it, and its readings are the same."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import numpy_helper

import quantship.export.qdq as qdq
from quantship import export_qdq
from quantship.inspect.read import external


def _content(path: Path) -> tuple:
    model = onnx.load(str(path))
    tensors = {t.name: (t.data_type, list(t.dims), numpy_helper.to_array(t).tobytes()) for t in model.graph.initializer}
    nodes = [n.SerializeToString() for n in model.graph.node]
    meta = {p.key: p.value for p in model.metadata_props}
    return tensors, nodes, meta, [(o.domain, o.version) for o in model.opset_import]


def test_offloaded_weights_write_the_same_file_and_leave_nothing(tiny_pt2e, tiny_calib, tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    # uint8 activations: the passes change the graph, so each change is checked (onnx.checker, an identical
    # literal run, in parts as a large model's) on the graph whose weights are in the data file
    in_memory = export_qdq(tiny_pt2e, tiny_calib[0], tmp_path / "a" / "m.onnx", activation_dtype="uint8")
    folders = []
    real = qdq.weights_to_disk

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        folders.append(Path(out[1]))
        assert external.external_tensors(out[0]), "no weight went to the data file"
        return out

    monkeypatch.setattr(qdq, "weights_to_disk", spy)
    monkeypatch.setattr(qdq, "LARGE_MODEL_BYTES", 0)
    monkeypatch.setattr(qdq, "OFFLOADED_FROM", 4096)  # the 4.6 and 9.2 kB weights go, the 2.3 kB ones stay
    monkeypatch.setattr(qdq, "EXPORT_PART_BYTES", 20_000)  # every literal reading a few layers at a time
    offloaded = export_qdq(tiny_pt2e, tiny_calib[0], tmp_path / "b" / "m.onnx", activation_dtype="uint8")

    assert len(folders) == 1 and not folders[0].exists()  # the data file went with the work folder
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["m.onnx"]
    assert not external.external_tensors(onnx.load(str(offloaded), load_external_data=False))  # one file
    assert _content(offloaded) == _content(in_memory)
    for field in ("literal_lsb", "fused_lsb", "gap_lsb", "n_values"):
        assert getattr(offloaded.readings, field) == getattr(in_memory.readings, field), field
