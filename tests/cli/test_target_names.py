"""Every command's --target reads the one registry: `onnxruntime` and `onnxruntime-cpu` are both accepted
and mean the same rules."""

from __future__ import annotations

import pytest
import torch

from quantship.cli.main import SUBCOMMANDS, build_parser, main

ARGS = {  # the positional arguments each command needs before --target
    "check": ["model.onnx"],
    "compare": ["float.onnx", "int8.onnx"],
    "quantize": ["torchvision:resnet18", "--calib", "cal.npy", "--out", "x.onnx"],
    "quantize-onnx": ["float.onnx", "--calib", "cal.npy", "--out", "x.onnx"],
    "demo": [],
    "sensitivity": ["torchvision:resnet18", "--calib", "cal.npy", "--out-dir", "report"],
}


def _takes_target(command: str) -> bool:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return any("--target" in a.option_strings for a in sub._actions)


def test_the_commands_with_a_target_are_the_ones_listed():
    assert sorted(c for c in SUBCOMMANDS if _takes_target(c)) == sorted(ARGS)


@pytest.mark.parametrize("command", sorted(ARGS))
@pytest.mark.parametrize("name", ["onnxruntime", "onnxruntime-cpu"])
def test_both_names_parse(command, name):
    args = build_parser().parse_args([command, *ARGS[command], "--target", name])
    assert args.target == name


@pytest.mark.parametrize("command", sorted(ARGS))
def test_an_unknown_name_lists_both(command, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([command, *ARGS[command], "--target", "tpu"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "'onnxruntime'" in err and "'onnxruntime-cpu'" in err


def test_check_gives_the_same_verdict_under_both_names(tmp_path, capsys):
    from quantship import Quantizer, export_qdq
    from tests.conftest import ResidualNet

    torch.manual_seed(0)
    calib = [torch.randn(4, 1, 8, 8) for _ in range(2)]
    qmodel = Quantizer.for_target("onnxruntime").quantize(ResidualNet().eval(), calib)
    path = export_qdq(qmodel, calib[0], tmp_path / "m.onnx")
    outputs = []
    for name in ("onnxruntime", "onnxruntime-cpu"):
        assert main(["check", str(path), "--target", name, "--json"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and '"ok": true' in outputs[0]
