"""The command line as a user meets it: quantize, quantize-onnx, demo, and bad input (exit 2, one line)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from quantship.cli.main import main


@pytest.fixture(scope="module")
def calib_npy(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "cal.npy"
    np.save(path, np.random.default_rng(0).standard_normal((8, 3, 64, 64)).astype(np.float32))
    return path


@pytest.mark.slow
def test_quantize_torchvision_model_passes_check(calib_npy, tmp_path, capsys):
    """A torchvision:NAME model end to end. SqueezeNet 1.1 (26 convs, Concat, no Linear) rather than
    ResNet-18: the suite's ResNet-18 is quantized once (tests/conftest.py), and the onnxruntime-cpu
    preset on a residual network is tests/export/test_targets.py's."""
    import torchvision

    n_conv = sum(isinstance(m, torch.nn.Conv2d) for m in torchvision.models.squeezenet1_1().modules())
    out = tmp_path / "squeezenet.onnx"
    code = main(["quantize", "torchvision:squeezenet1_1", "--calib", str(calib_npy), "--out", str(out),
                 "--target", "onnxruntime-cpu", "--batch-size", "3", "--json"])  # batches of 3, 3, 2
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and out.is_file()
    assert report["batch"] == "any"
    from quantship.inspect.run.verify import ort_session, run_session

    for n in (1, 32):  # --batch-size is the calibration batch only: the file serves any batch
        x = np.random.default_rng(n).standard_normal((n, 3, 64, 64)).astype(np.float32)
        assert run_session(ort_session(out, optimized=True), [x])[0].shape == (n, 1000)
    assert n_conv == 26 and report["check"]["ok"] is True and report["qdq_stats"]["n_per_channel"] == n_conv
    assert report["spec"]["reduce_range"] is True and report["qdq_stats"]["n_uint8"] > 0
    assert main(["check", str(out), "--target", "onnxruntime"]) == 0


def test_quantize_python_factory_and_weights(tmp_path, capsys):
    src = tmp_path / "mymodel.py"
    src.write_text(
        "import torch.nn as nn\n"
        "def build():\n"
        "    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))\n"
    )
    from quantship.sources import load_model

    weights = tmp_path / "w.pt"
    torch.save(load_model(f"{src}:build").state_dict(), weights)
    calib = tmp_path / "c.npz"
    np.savez(calib, images=np.random.default_rng(1).standard_normal((4, 3, 16, 16)).astype(np.float32))
    out = tmp_path / "m.onnx"
    code = main(["quantize", f"{src}:build", "--weights", str(weights), "--calib", str(calib), "--out", str(out),
                 "--target", "tensorrt", "--batch-size", "2", "--quiet"])
    assert code == 0 and out.is_file()
    assert "check tensorrt" in capsys.readouterr().out


FACTORY = ("import torch.nn as nn\n"
           "def build():\n"
           "    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), "
           "nn.Linear(4, 2))\n")


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    from PIL import Image

    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(3)
    for i in range(5):
        Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return folder


@pytest.mark.parametrize("target, batch", [("tensorrt", "any"), ("tigris", 1)])
def test_quantize_from_an_image_folder(target, batch, image_folder, tmp_path, capsys):
    """Images load HWC; the calibration batches (2, 2, 1) must reach the model contiguous, or the global
    average pool keeps a float mean and the tensorrt/tigris checks refuse the file."""
    src = tmp_path / "net.py"
    src.write_text(FACTORY)
    out = tmp_path / "m.onnx"
    code = main(["quantize", f"{src}:build", "--calib", str(image_folder), "--resize", "16", "--crop", "16",
                 "--out", str(out), "--target", target, "--batch-size", "2", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["check"]["ok"] is True and report["batch"] == batch


def test_static_batch_option(image_folder, tmp_path, capsys):
    from quantship.inspect.read.feeds import IMAGENET_MEAN, IMAGENET_STD, Preprocessing, load_images

    assert load_images(str(image_folder), Preprocessing(16, 16, IMAGENET_MEAN, IMAGENET_STD), 5).flags.c_contiguous
    src = tmp_path / "net.py"
    src.write_text(FACTORY)
    out = tmp_path / "m.onnx"
    code = main(["quantize", f"{src}:build", "--calib", str(image_folder), "--resize", "16", "--crop", "16",
                 "--out", str(out), "--static-batch", "3", "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["batch"] == 3
    assert main(["quantize", f"{src}:build", "--calib", str(image_folder), "--resize", "16", "--crop", "16",
                 "--out", str(out), "--static-batch", "9"]) == 2
    assert "--static-batch 9" in capsys.readouterr().err


def test_quantize_onnx_for_tigris_fits(tmp_path, capsys):
    from quantship.inspect.run.consumers import tigris_analyze, tigris_executable

    if tigris_executable() is None:
        pytest.skip("the tigris CLI (tigris-ml) is not installed")
    from torchvision.models import mobilenet_v2

    from quantship import export_onnx

    torch.manual_seed(0)
    fp32 = export_onnx(mobilenet_v2(weights=None).eval(), torch.randn(1, 3, 96, 96), tmp_path / "mv2.onnx",
                       dynamic_batch=False)
    cal = tmp_path / "cal.npy"
    np.save(cal, np.random.default_rng(0).standard_normal((8, 3, 96, 96)).astype(np.float32))
    out = tmp_path / "mv2_int8.onnx"
    # --no-fidelity: an untrained MobileNetV2's logits are about 1e-10 (BatchNorm at init), a float output with
    # nothing in it to be faithful to; this test is about the file TiGrIS compiles
    code = main(["quantize-onnx", str(fp32), "--calib", str(cal), "--out", str(out), "--target", "tigris", "--quiet",
                 "--no-fidelity"])
    # an untrained MobileNetV2 answers the same for every input: its check --run is inconclusive, and a
    # writing command exits 1 for that (README, exit codes); the file is written and TiGrIS compiles it
    assert code == 1 and out.exists()
    assert "inconclusive (TiGrIS)" in capsys.readouterr().out
    analysis = tigris_analyze(out)
    assert analysis and "error" not in json.dumps(analysis).lower()[:200]
    done = subprocess.run([tigris_executable(), "compile", str(out), "-m", "256K", "-o",
                           str(tmp_path / "plan.tgrs")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr or done.stdout


BAD_INPUT = [
    (["quantize", "torchvision:resnet18", "--calib", "missing.npy", "--out", "x.onnx"], "does not exist"),
    (["quantize", "torchvision:notamodel", "--calib", "CAL", "--out", "x.onnx"], "unknown torchvision model"),
    (["quantize", "resnet18", "--calib", "CAL", "--out", "x.onnx"], "must be torchvision:NAME"),
    (["quantize", "torchvision:resnet18", "--calib", "CAL", "--out", "x.onnx", "--target", "tpu"], "invalid choice: 'tpu'"),
    (["quantize", "torchvision:resnet18", "--calib", "BAD", "--out", "x.onnx"], "cannot run on a calibration batch"),
    (["quantize-onnx", "missing.onnx", "--calib", "CAL", "--out", "x.onnx"], "missing.onnx"),
    (["check", "missing.onnx", "--target", "tigris"], "missing.onnx"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUT, ids=[" ".join(a[:2]) + " " + m for a, m in BAD_INPUT])
def test_bad_input_exit_2_one_line(argv, message, calib_npy, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "bad.npy", np.zeros((8, 64), np.float32))
    argv = [{"CAL": str(calib_npy), "BAD": str(tmp_path / "bad.npy")}.get(a, a) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "x.onnx").exists()


def test_bad_input_through_a_real_process(tmp_path):
    done = subprocess.run([sys.executable, "-m", "quantship", "quantize", "torchvision:nope", "--calib",
                           str(tmp_path / "none.npy"), "--out", str(tmp_path / "x.onnx")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_help_imports_nothing_heavy():
    """--help answers at once because torch/onnx are imported inside the commands, never at parse time."""
    code = ("import sys; from quantship.cli.main import build_parser; build_parser().format_help(); "
            "heavy = sorted(m for m in ('torch', 'onnx', 'onnxruntime', 'torchvision', 'numpy') if m in sys.modules); "
            "print(','.join(heavy))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "", done.stdout + done.stderr


_FACTORIES = (
    "import torch.nn as nn\n"
    "def build():\n"
    "    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))\n"
    "def constant():\n"
    "    model = build()\n"
    "    model[0].bias.data.fill_(-1e3)  # the ReLU is always off: the output is the Linear's bias\n"
    "    return model\n"
)


@pytest.mark.parametrize("factory, code, verdict", [("build", 0, "accepted"), ("constant", 1, "inconclusive")])
def test_quantize_verdict_is_check_run_on_the_calibration_inputs(tmp_path, capsys, factory, code, verdict):
    """quantize's summary is `check --run`'s verdict (ONNX Runtime runs here), on the calibration data;
    a model whose output never changes is inconclusive (exit 1), never a pass. The file is written."""
    src = tmp_path / "models.py"
    src.write_text(_FACTORIES)
    calib = tmp_path / "c.npy"
    np.save(calib, np.random.default_rng(1).standard_normal((8, 3, 16, 16)).astype(np.float32))
    out = tmp_path / f"{factory}.onnx"
    assert main(["quantize", f"{src}:{factory}", "--calib", str(calib), "--out", str(out), "--target",
                 "onnxruntime-cpu", "--batch-size", "2", "--json"]) == code
    report = json.loads(capsys.readouterr().out)
    assert out.is_file() and report["verdict"] == verdict == report["check"]["verdict"]
    (run,) = report["check"]["runs"]
    # the file serves any batch, so every one of the 8 calibration samples is its own run input
    assert report["batch"] == "any"
    assert run["consumer"] == "ONNX Runtime" and run["inputs"] == "given" and run["n_inputs"] == 8
    readings = report["ort_readings"]
    assert readings["literal_lsb"] is not None and readings["fused_lsb"] is not None
    assert main(["check", str(out), "--target", "onnxruntime", "--run", "--inputs", str(calib)]) == code
    assert verdict in capsys.readouterr().out


def test_onnx_front_end_imports_no_torch():
    """The ONNX quantizer's modules load without torch and torchao (issue 36): a user of the ONNX path pays
    for them only when a file is calibrated (torchao's observers)."""
    code = ("import sys; import quantship.quantize_onnx.quantizer, quantship.quantize_onnx.repair, "
            "quantship.quantize_onnx.sensitivity, quantship.quantize_onnx.search; "
            "print(','.join(m for m in ('torch', 'torchao') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "", done.stdout + done.stderr
