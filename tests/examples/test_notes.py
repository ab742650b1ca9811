"""The audio task of the failing kind (issue 37): a fixed constant-Q front-end over raw audio, power, log,
a small CNN with one sigmoid per note; the default INT8 file collapses and keeping the front-end float
repairs it, on both paths.

Figures pinned below were measured on an AMD EPYC with AVX-512 VNNI (no AMX), 600 held-out clips,
the cached model trained on one thread. The task metric is the fraction of clips whose note set is
exactly right (every one of the 24 thresholded sigmoids); the fraction of labels right is dominated
by the 21-23 absent notes of each clip, so it moves less (FP32 99.9%, the collapsed file 97.6%).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from quantship.cli.main import main
from quantship.examples import digits, notes


def test_clips_are_deterministic_with_one_to_three_notes_each():
    a, b = notes.synthesize(16, seed=5), notes.synthesize(16, seed=5)
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert a.x.shape == (16, 1, notes.CLIP_SAMPLES) and a.y.shape == (16, notes.N_NOTES)
    assert set(a.y.sum(1).tolist()) <= {1.0, 2.0, 3.0}
    assert not torch.equal(a.x, notes.synthesize(16, seed=6).x)
    peaks_db = 20 * torch.log10(a.x.abs().amax(dim=(1, 2)))
    assert peaks_db.min() > notes.LEVEL_DB[0] - 3 and peaks_db.max() < notes.LEVEL_DB[1] + 3  # the noise moves peaks


def test_the_constant_q_front_end_is_fixed_and_finds_a_sine_at_its_bin():
    front = notes.ConstantQ()
    assert not any(p.requires_grad for p in front.parameters())
    assert len(front.octaves) == notes.OCTAVES
    bin_index, amplitude = 40, 0.25  # MIDI 76, E5
    frequency = 440.0 * 2 ** ((notes.FMIN_MIDI + bin_index - 69) / 12)
    t = torch.arange(notes.CLIP_SAMPLES, dtype=torch.float32) / notes.SAMPLE_RATE
    with torch.no_grad():
        log_power = front((amplitude * torch.sin(2 * math.pi * frequency * t)).reshape(1, 1, -1))
    assert log_power.shape == (1, 1, notes.N_BINS, notes.CLIP_SAMPLES // notes.HOP + 1)
    middle = log_power[0, 0, :, log_power.shape[-1] // 2].double()
    assert int(middle.argmax()) == bin_index
    power = (torch.exp(middle[bin_index]) - 1) / notes.LOG_GAIN
    assert abs(float(power.sqrt()) / amplitude - 1) < 0.02  # the kernels give a sine's amplitude


def test_training_is_deterministic():
    first, second = notes.train(epochs=1, n_train=128), notes.train(epochs=1, n_train=128)
    a, b = first.state_dict(), second.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return notes.write_files(tmp_path_factory.mktemp("notes"))


@pytest.fixture(scope="module")
def held_out_and_fp32(files):
    clips = notes.held_out()
    return clips, notes.run_file(files.float_onnx, clips.x)


def _quantize_onnx(files, out, *extra) -> None:
    assert main(["quantize-onnx", str(files.float_onnx), "--calib", str(files.calibration), "--out", str(out),
                 "--quiet", *extra]) == 0


@pytest.mark.slow
def test_training_is_cached_and_the_float_file_does_the_task(files, held_out_and_fp32):
    model = notes.trained_model()  # the fixture trained it (about 40 s of one core) or loaded it
    assert (digits.cache_dir() / f"notes_cqt_v{notes._CACHE_VERSION}.pt").is_file()
    again = notes.trained_model()
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())
    clips, fp32 = held_out_and_fp32
    held = np.load(files.held_out)
    assert np.array_equal(held["x"], clips.x.numpy()) and np.array_equal(held["y"], clips.y.numpy())
    assert np.load(files.calibration).shape == (notes.N_CALIBRATION, 1, notes.CLIP_SAMPLES)
    assert notes.output_sqnr_db(notes.predict(model, clips.x), fp32) > 100  # the float file is the model
    score = notes.score(fp32, clips.y)
    # measured: 582/600 clips exact (97.0%), 99.87% of labels
    assert score.exact_accuracy > 0.95 and score.label_accuracy > 0.99


@pytest.mark.slow
def test_the_plain_onnx_file_collapses_and_a_float_front_end_repairs_it(files, held_out_and_fp32, tmp_path):
    clips, fp32 = held_out_and_fp32
    fp32_exact = notes.score(fp32, clips.y).exact_accuracy
    _quantize_onnx(files, tmp_path / "int8.onnx", "--no-fidelity")  # the plain placement, not judged
    for optimized in (True, False):  # ONNX Runtime's default optimizations, and the file read literally
        out = notes.run_file(tmp_path / "int8.onnx", clips.x, optimized=optimized)
        # measured 5.9 dB and 405/600 clips exact (67.5%, 29.5 points under FP32) in both readings; the
        # bounds leave 6 dB and 14 points for another CPU or a retrained model, far from the repaired file
        assert notes.output_sqnr_db(fp32, out) < 12.0
        assert fp32_exact - notes.score(out, clips.y).exact_accuracy > 0.15
    front_end = notes.front_end_nodes(files.float_onnx)
    assert len(front_end) == notes.OCTAVES
    _quantize_onnx(files, tmp_path / "repaired.onnx", "--exclude", *front_end)
    out = notes.run_file(tmp_path / "repaired.onnx", clips.x)
    # measured 37.1 dB, 582/600 exact (as FP32)
    assert notes.output_sqnr_db(fp32, out) > 30.0
    assert fp32_exact - notes.score(out, clips.y).exact_accuracy <= 0.01


@pytest.mark.slow
def test_the_default_command_finds_the_collapse_and_repairs_it_alone(files, held_out_and_fp32, tmp_path, capsys):
    """No flag, no node named: the fidelity measurement sees the collapse on held-out calibration clips, and
    the repair's own-loss ranking puts the six front-end convolutions first (measured: step 0 4.7 dB; the
    chosen file 46.3 dB on the 12 held-out clips, 581/600 exact against FP32's 582)."""
    clips, fp32 = held_out_and_fp32
    fp32_exact = notes.score(fp32, clips.y).exact_accuracy
    out = tmp_path / "default.onnx"
    assert main(["quantize-onnx", str(files.float_onnx), "--calib", str(files.calibration), "--out", str(out),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    steps = report["repair"]["steps"]
    assert steps[0]["status"] == "missed" and steps[0]["sqnr_db"] < 12.0  # the collapse, measured
    assert report["fidelity_fp32"]["status"] == "met"
    front_end = set(notes.front_end_nodes(files.float_onnx))
    assert front_end <= set(report["repair"]["order"][:len(front_end) + 1])  # found by measurement
    for optimized in (True, False):
        got = notes.run_file(out, clips.x, optimized=optimized)
        assert fp32_exact - notes.score(got, clips.y).exact_accuracy <= 0.01
    assert main(["quantize-onnx", str(files.float_onnx), "--calib", str(files.calibration), "--out",
                 str(tmp_path / "refused.onnx"), "--no-repair", "--quiet"]) == 1
    assert not (tmp_path / "refused.onnx").exists()


@pytest.mark.slow
def test_the_pytorch_path_collapses_too_and_a_float_front_end_repairs_it(files, held_out_and_fp32, tmp_path):
    from quantship import Quantizer, export_qdq

    clips, fp32 = held_out_and_fp32
    fp32_exact = notes.score(fp32, clips.y).exact_accuracy
    model, calibration = notes.trained_model(), notes.calibration().x
    batches = [calibration[i:i + 8] for i in range(0, len(calibration), 8)]
    for skip, sqnr_bound in ((None, None), (["cqt"], 28.0)):
        quantized = Quantizer.for_target("onnxruntime-cpu", skip_activations=skip).quantize(model, batches)
        path = export_qdq(quantized, calibration[:8], tmp_path / f"pt_{bool(skip)}.onnx")
        out = notes.run_file(path, clips.x)
        if skip is None:
            # measured 1.9 dB, 169/600 exact (28.2%): this path also quantizes the power and the log's input
            assert notes.output_sqnr_db(fp32, out) < 8.0
            assert fp32_exact - notes.score(out, clips.y).exact_accuracy > 0.30
        else:
            # measured 34.1 dB, 582/600 exact (as FP32)
            assert notes.output_sqnr_db(fp32, out) > sqnr_bound
            assert fp32_exact - notes.score(out, clips.y).exact_accuracy <= 0.01
