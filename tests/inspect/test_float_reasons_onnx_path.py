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


def test_the_repair_sets_aside_a_node_whose_float_gives_no_file_and_names_what_it_kept_float(tmp_path, capsys):
    """openvino runs no 16-bit activations, so after the algorithms (none keeps the budget here) the repair keeps
    ranked nodes float. Its first-ranked node, the head conv, kept float alone makes the outputs infinite (the
    log of a front output that int8 rounded to exactly 0): no file. Every longer prefix holds it too, so the
    repair used to stop with nothing written (exit 1); it now sets that node aside and tries the next, the
    front conv, which keeps the budget. ``inspect`` on the written file names it kept float by the repair."""
    export_onnx(Collapsing().eval(), torch.randn(2, 3, 16, 16), tmp_path / "float.onnx", opset_version=18)
    np.save(tmp_path / "cal.npy", np.random.default_rng(0).standard_normal((40, 3, 16, 16)).astype(np.float32))
    out = tmp_path / "q.onnx"
    assert main(["quantize-onnx", str(tmp_path / "float.onnx"), "--calib", str(tmp_path / "cal.npy"), "--out",
                 str(out), "--target", "openvino", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    repair = report["repair"]
    chosen = repair["steps"][repair["chosen"]]
    assert repair["set_aside"] == ["node_conv2d_1"] and chosen["excluded"] == ["node_Conv_4"], repair
    assert report["fidelity_fp32"]["status"] == "met"
    assert _inspect(out, capsys) == {"node_Conv_4": WHY_REPAIR}
