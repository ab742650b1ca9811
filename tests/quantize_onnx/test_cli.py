"""``quantship quantize-onnx`` on the new engine: good runs, and bad input as one line, exit 2, nothing written."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from quantship.cli.main import main
from tests.quantize_onnx import graphs


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("qonnx_cli")
    float_path = graphs.save(graphs.conv_relu_conv(), d / "float.onnx")
    ids_path = graphs.save(graphs.integer_ids(), d / "ids.onnx")
    np.save(d / "cal.npy", graphs.images(5))  # fewer samples than the default --batch-size 8
    np.save(d / "ids.npy", np.random.default_rng(0).integers(0, 257, (6, 5)).astype(np.int32))
    np.save(d / "ids_float.npy", np.full((6, 5), 2.5, np.float32))  # fractions: no exact int cast
    np.save(d / "rank3.npy", np.zeros((4, 3, 8), np.float32))
    np.savez(d / "named.npz", ids=np.load(d / "ids.npy"))
    assert main(["quantize-onnx", str(float_path), "--calib", str(d / "cal.npy"), "--out", str(d / "int8.onnx"),
                 "--quiet"]) == 0
    external = onnx.load(str(float_path))
    onnx.save_model(external, str(d / "external.onnx"), save_as_external_data=True, location="external.data",
                    size_threshold=0)
    escaping = onnx.load(str(d / "external.onnx"), load_external_data=False)  # one weight points out of the folder
    for entry in escaping.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = "../external.data"
    onnx.save_model(escaping, str(d / "external.onnx"))
    return {"FLOAT": float_path, "IDS": ids_path, "CAL": d / "cal.npy", "IDS_CAL": d / "ids.npy",
            "IDS_FLOAT": d / "ids_float.npy", "RANK3": d / "rank3.npy", "NAMED": d / "named.npz",
            "INT8": d / "int8.onnx", "EXTERNAL": d / "external.onnx"}


def _argv(argv, files, out):
    return [str(files[a]) if a in files else str(out) if a == "OUT" else a for a in argv]


def test_fewer_samples_than_the_batch_size_is_one_shorter_batch(files, tmp_path, capsys):
    out = tmp_path / "q.onnx"
    # --plain-placement: the profile would keep a toy Conv float on a CPU where it times slower in int8
    assert main(["quantize-onnx", str(files["FLOAT"]), "--calib", str(files["CAL"]), "--out", str(out), "--json",
                 "--plain-placement"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["engine"] == "quantship" and report["census"]["integer"] == {"QLinearConv": 2}
    assert report["verdict"] == "accepted" and report["path"] == str(out.resolve())
    assert onnx.load(str(out)).metadata_props  # provenance travels with the file
    meta = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert meta["quantship.engine"] == "quantize_onnx" and json.loads(meta["quantship.spec"])["reduce_range"]


def test_an_integer_input_calibrates_from_npy_and_from_npz_keyed_by_name(files, tmp_path):
    for calib in ("IDS_CAL", "NAMED"):
        out = tmp_path / f"{calib}.onnx"
        assert main(["quantize-onnx", str(files["IDS"]), "--calib", str(files[calib]), "--out", str(out),
                     "--quiet"]) == 0
        assert out.is_file()


def test_engine_ort_still_runs_onnx_runtime_s_quantizer(files, tmp_path):
    out = tmp_path / "ort.onnx"
    assert main(["quantize-onnx", str(files["FLOAT"]), "--calib", str(files["CAL"]), "--out", str(out),
                 "--engine", "ort", "--quiet"]) == 0
    meta = {p.key for p in onnx.load(str(out)).metadata_props}
    assert "quantship.engine" not in meta


BAD = [
    ("already quantized", ["quantize-onnx", "INT8", "--calib", "CAL", "--out", "OUT"], "already quantized"),
    ("external data outside the folder", ["quantize-onnx", "EXTERNAL", "--calib", "CAL", "--out", "OUT"],
     "outside the model's folder"),
    ("fractions for an int32 input", ["quantize-onnx", "IDS", "--calib", "IDS_FLOAT", "--out", "OUT"], "with a fraction"),
    ("wrong rank", ["quantize-onnx", "FLOAT", "--calib", "RANK3", "--out", "OUT"], "rank 4"),
    ("unknown exclude", ["quantize-onnx", "FLOAT", "--calib", "CAL", "--out", "OUT", "--exclude", "conv9"],
     "matches no node"),
    ("unknown observer", ["quantize-onnx", "FLOAT", "--calib", "CAL", "--out", "OUT", "--observer", "max"],
     "invalid choice"),
]


@pytest.mark.parametrize("argv, message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(argv, message, files, tmp_path, capsys):
    out = tmp_path / "q.onnx"
    assert main(_argv(argv, files, out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0], err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".quantship-")]
