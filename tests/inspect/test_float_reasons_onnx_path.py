"""``quantship inspect`` on a file of the ONNX path says why each float op is float, from the file alone.

The ONNX path's records name nodes, not modules, whether or not the file carries module scopes (ours does;
a file from another exporter does not): ``--exclude`` in the spec's ``skip_activations``, the fidelity repair's chosen step in
``quantship.repair``. Before, every such op read "its input is not quantized; the file does not record why",
though the file recorded it (nudenet's repaired file: 23 Convs so described).
"""

from __future__ import annotations

import json

import numpy as np
import torch

from quantship.cli.main import main
from quantship.export import export_onnx
from quantship.inspect.read.float_ops import WHY_REPAIR, WHY_REQUESTED

from ..quantize_onnx.test_fidelity_repair import Collapsing


def _inspect(path, capsys) -> dict[str, str]:
    """Each float node's reason, as ``quantship inspect --json`` gives it (grouped by module, here one node each)."""
    assert main(["inspect", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    return {node: g["why"] for g in report["float_ops"]["by_module"] for node in g["nodes"]}


def test_an_excluded_node_is_named_kept_float_on_request(tmp_path, capsys):
    export_onnx(Collapsing().eval(), torch.randn(2, 3, 16, 16), tmp_path / "float.onnx", opset_version=18)
    np.save(tmp_path / "cal.npy", np.random.default_rng(0).standard_normal((40, 3, 16, 16)).astype(np.float32))
    base = ["quantize-onnx", str(tmp_path / "float.onnx"), "--calib", str(tmp_path / "cal.npy"), "--plain-placement"]

    # kept float on request: the front conv by its node name
    asked = tmp_path / "asked.onnx"
    assert main([*base, "--out", str(asked), "--exclude", "node_Conv_4", "--no-fidelity", "--json"]) == 0
    capsys.readouterr()
    why = _inspect(asked, capsys)
    assert why == {"node_Conv_4": WHY_REQUESTED}, why



def test_a_node_the_repair_kept_float_is_named_so(tmp_path, capsys):
    """The repair's record, written by ``repair_loop.Repair`` as the quantizers write it, on a file whose front
    conv is float: the repairs measured on this collapsing model choose bias correction or 16-bit steps (and
    nudenet's, which keeps 23 Convs float, takes minutes), so the float step's record is written here by the
    same code over the file that step gives."""
    import onnx

    from quantship.fidelity import Budget
    from quantship.repair_loop import Repair, RepairStep

    export_onnx(Collapsing().eval(), torch.randn(2, 3, 16, 16), tmp_path / "float.onnx", opset_version=18)
    np.save(tmp_path / "cal.npy", np.random.default_rng(0).standard_normal((40, 3, 16, 16)).astype(np.float32))
    out = tmp_path / "q.onnx"
    assert main(["quantize-onnx", str(tmp_path / "float.onnx"), "--calib", str(tmp_path / "cal.npy"), "--out",
                 str(out), "--plain-placement", "--exclude", "node_Conv_4", "--no-fidelity", "--json"]) == 0
    capsys.readouterr()
    record = Repair(Budget(), steps=[
        RepairStep("as asked", (), (), (), -4.6, 0.25, -14.6, "missed", 1.0),
        RepairStep("float for 1 node(s)", (), ("node_Conv_4",), (), 30.0, 1.0, 20.0, "met", 1.0)], chosen=1)
    model = onnx.load(str(out))
    for key, text in record.metadata().items():
        model.metadata_props.add(key=key, value=text)
    onnx.save(model, str(out))
    assert _inspect(out, capsys) == {"node_Conv_4": WHY_REPAIR}
