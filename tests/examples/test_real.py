"""Real pretrained models shipped inside packages: loading, deterministic data kept under the cache
folder, and each FP32 metric with its interval (quantship.examples.real)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from quantship.examples import real
from quantship.intervals import wilson_interval


def _need(module: str) -> None:
    """Skip with the install command when a model's package is missing (never a traceback)."""
    try:
        real.require(module)
    except real.MissingPackage as exc:
        pytest.skip(str(exc))


def _session(path: Path):
    from quantship.inspect.run.consumers import ort_session

    return ort_session(path, optimized=True)


def _digest(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache folder, a working directory and a home folder of their own, to see every write."""
    cache, work, home = tmp_path / "cache", tmp_path / "work", tmp_path / "home"
    for folder in (work, home):
        folder.mkdir()
    monkeypatch.setenv("QUANTSHIP_CACHE", str(cache))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    return cache, work, home


def test_a_missing_package_names_its_install_command():
    with pytest.raises(real.MissingPackage, match=r"no_such_model_pkg is not installed: pip install no_such_model_pkg"):
        real.require("no_such_model_pkg")
    assert real.install_command("facenet_pytorch") == "pip install --no-deps facenet-pytorch==2.6.0"
    assert "rapidocr-onnxruntime==1.4.4" in real.install_command("rapidocr_onnxruntime")
    with pytest.raises(real.MissingPackage, match="has no models/nothing.onnx"):
        real.package_file("numpy", "models/nothing.onnx")


def test_every_model_file_loads_with_its_declared_input():
    from quantship.examples.real import magika_files, nudenet_yolo, ocr_cls, ocr_det

    expected = {ocr_cls: ("x", "tensor(float)"), ocr_det: ("x", "tensor(float)"),
                magika_files: ("bytes", "tensor(int32)"), nudenet_yolo: ("images", "tensor(float)")}
    for module, (name, dtype) in expected.items():
        _need(module.MODULE)
        first = _session(module.model_path()).get_inputs()[0]
        assert (first.name, first.type) == (name, dtype), module.__name__
    assert len(magika_files.labels_space()) == 214


def test_mtcnn_nets_load_the_wheels_weights():
    _need("facenet_pytorch")
    import torch

    from quantship.examples.real import mtcnn

    for name, size in mtcnn.NETS.items():
        net = mtcnn.FaceProbability(mtcnn.load_net(name))
        with torch.no_grad():
            p = net(torch.zeros(3, 3, size, size))
        assert p.shape == (3, 2) and torch.allclose(p.sum(1), torch.ones(3))
        # pretrained, not initialised: the weights are the wheel's (an untrained net gives ~0.5 / 0.5 everywhere)
        assert any(float(m.weight.detach().abs().sum()) > 0 for m in net.modules() if isinstance(m, torch.nn.Conv2d))


def test_generated_data_is_deterministic_and_stays_in_the_cache(fresh_cache):
    _need("rapidocr_onnxruntime")
    _need("nudenet")
    _need("magika")
    import sysconfig

    from quantship.examples.real import magika_files, nudenet_yolo, ocr_cls, ocr_det

    cache, work, home = fresh_cache
    stdlib = [Path(sysconfig.get_paths()["stdlib"]) / "json"]
    first = [_digest(ocr_cls.make_lines(6, seed=3).x), _digest(ocr_det.make_pages(1, seed=3).x),
             _digest(nudenet_yolo.make_images(2, seed=3).x), _digest(magika_files.make_files(5, seed=3, where=stdlib).x)]
    written = sorted(p.relative_to(cache) for p in cache.rglob("*") if p.is_file())
    assert written and all(p.parts[0] == "real" for p in written)
    # nothing outside the cache folder: not in the working directory, no data in the home folder (where
    # matplotlib and ONNX Runtime keep their own settings)
    assert not any(work.iterdir()) and not [p for p in home.rglob("*") if p.suffix in (".npz", ".npy", ".png")]
    for p in list(cache.rglob("*.npz")):
        p.unlink()  # generate again from scratch: the same bytes
    again = [_digest(ocr_cls.make_lines(6, seed=3).x), _digest(ocr_det.make_pages(1, seed=3).x),
             _digest(nudenet_yolo.make_images(2, seed=3).x), _digest(magika_files.make_files(5, seed=3, where=stdlib).x)]
    assert again == first
    assert _digest(ocr_cls.make_lines(6, seed=4).x) != first[0]  # the seed matters
    # calibration and evaluation draws of magika are disjoint by construction
    a = magika_files.make_files(3, seed=3, skip=0, where=stdlib)
    b = magika_files.make_files(5, seed=3, skip=3, where=stdlib)
    assert not set(a.paths) & set(b.paths)


def test_a_cached_file_draw_that_names_a_vanished_file_is_drawn_again(fresh_cache, tmp_path):
    """The cache folder outlives checkouts and package upgrades (CI failed on a draw naming files of an
    earlier venv): a draw is reused only while every file it names exists."""
    _need("magika")
    import shutil
    import sysconfig

    from quantship.examples.real import magika_files

    folder = tmp_path / "files"
    shutil.copytree(Path(sysconfig.get_paths()["stdlib"]) / "json", folder)
    first = magika_files.make_files(4, seed=3, where=[folder])
    cached = list((fresh_cache[0] / "real" / "magika").glob("*.npz"))
    assert len(cached) == 1
    os.unlink(first.paths[0])
    again = magika_files.make_files(4, seed=3, where=[folder])
    assert first.paths[0] not in again.paths and all(os.path.isfile(p) for p in again.paths)
    # another set of folders is another draw, never the cached one
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    moved = magika_files.make_files(4, seed=3, where=[other])
    assert all(p.startswith(str(other)) for p in moved.paths)


# FP32 accuracy of the orientation classifier on these 300 lines (seed 0), measured: 294/300 (98.0%, Wilson
# [95.7, 99.1]); 588/600 on the bench's 600. The bound 0.90 leaves room for a few lines more or less with
# another Pillow/FreeType, and fails a task that lost its ground truth: labels swapped score 6/300, lines
# never rotated score 50% (the classifier is robust to the normalisation itself: pixels / 255 alone give 296/300).
CLS_LOWER_BOUND = 0.90


def test_orientation_classifier_fp32_accuracy_with_its_interval():
    _need("rapidocr_onnxruntime")
    from quantship.examples.real import ocr_cls

    lines = ocr_cls.make_lines(300, seed=0)
    assert lines.x.shape == (300, *ocr_cls.INPUT_SHAPE) and lines.x.dtype == np.float32
    assert abs(int(lines.y.sum()) - 150) == 0  # half upside down
    session = _session(ocr_cls.model_path())
    logits = np.concatenate([session.run(None, {"x": lines.x[i:i + 100]})[0] for i in range(0, 300, 100)])
    count = ocr_cls.accuracy(logits, lines.y)
    low, _ = wilson_interval(count.k, count.n)
    assert low > CLS_LOWER_BOUND, str(count)
    flipped = ocr_cls.accuracy(logits, 1 - lines.y)  # the metric can fail: wrong labels score badly
    assert flipped.k < count.n - count.k + 1 and wilson_interval(flipped.k, flipped.n)[1] < 0.2


# magika's top-1 label against the extension's label on these 300 files, measured here: 279/300 (93.0%, Wilson
# [89.5, 95.4]); 1,849/2,000 on the bench's files. The files differ between machines (site-packages,
# /usr/share), hence the margin. The bound 0.80 fails features with the first and last 1,024 bytes swapped
# (238/300, Wilson low 74.4%) and labels shuffled (10/300); padding with 0 instead of magika's token 256 is
# not caught (270/300): the model barely depends on it.
MAGIKA_LOWER_BOUND = 0.80


@pytest.mark.slow
def test_magika_fp32_accuracy_on_this_machines_files():
    _need("magika")
    from quantship.examples.real import magika_files

    files = magika_files.make_files(300, seed=0, skip=300)
    assert files.x.shape == (300, 2048) and files.x.dtype == np.int32 and files.x.max() <= 256
    assert all(os.path.isfile(p) for p in files.paths)
    session = _session(magika_files.model_path())
    scores = session.run(None, {"bytes": files.x})[0]
    count = magika_files.accuracy(scores, files.y)
    assert wilson_interval(count.k, count.n)[0] > MAGIKA_LOWER_BOUND, str(count)
    assert magika_files.agreement(scores, scores).k == 300


def test_lifting_constants_keeps_the_classifier_exact():
    _need("rapidocr_onnxruntime")
    import onnx

    from quantship.examples.real import ocr_cls
    from quantship.examples.real.convert import lift_constants
    from quantship.inspect.run.consumers import ort_session

    model = onnx.load(str(ocr_cls.model_path()))
    lifted, n = lift_constants(model)
    assert n > 50 and not any(node.op_type == "Constant" for node in lifted.graph.node)
    x = ocr_cls.make_lines(8, seed=5).x
    before = ort_session(model).run(None, {"x": x})[0]
    after = ort_session(lifted).run(None, {"x": x})[0]
    assert np.array_equal(before, after)


def test_detector_finds_the_lines_of_a_rendered_page():
    _need("rapidocr_onnxruntime")
    from quantship.examples.real import ocr_det

    pages = ocr_det.make_pages(2, seed=0)
    session = _session(ocr_det.model_path())
    found = [ocr_det.detect(session.run(None, {"x": pages.x[i:i + 1]})[0]) for i in range(2)]
    recall, precision = ocr_det.recall_precision(found, pages.boxes)
    assert recall.n == sum(len(b) for b in pages.boxes) >= 12
    assert recall.k >= recall.n - 1 and precision.k >= precision.n - 1, (recall, precision)
    # the match can fail: boxes shifted by their own height do not count
    shifted = [b + np.array([0, 1, 0, 1], np.float32) * (b[:, 3:4] - b[:, 1:2]) for b in pages.boxes]
    assert ocr_det.recall_precision(found, shifted)[0].k == 0


def test_the_recognizer_converts_to_pytorch_with_its_batch_norms_ranked():
    """onnx2torch chooses BatchNorm1d/2d/3d from the input's rank; the recognizer's shape inference leaves three
    without one (after Reshapes of a computed shape) and onnx2torch refused the file ("spatial rank == -2"). With the
    ranks one ONNX Runtime run shows, the converted module reproduces the file, and torch.export can trace it."""
    _need("rapidocr_onnxruntime")
    _need("onnx2torch")
    import onnx
    import torch

    from quantship.examples.real import ocr_rec
    from quantship.examples.real.convert import lift_constants, rank_hints, to_torch

    x = ocr_rec.make_lines(3, seed=7).x
    model, _ = lift_constants(onnx.load(str(ocr_rec.model_path())))
    assert rank_hints(model, x[:1]) == 3
    module = to_torch(ocr_rec.model_path(), torch.from_numpy(x[:1]))
    with torch.no_grad():
        out = module(torch.from_numpy(x)).numpy()
    reference = _session(ocr_rec.model_path()).run(None, {"x": x})[0]
    np.testing.assert_allclose(out, reference, atol=1e-4)
    # its Slices read stored starts and ends as Python numbers: torch.export traces it (onnx2torch's own Slice calls
    # .numpy() on them at run time, which export refuses)
    exported = torch.export.export(module, (torch.from_numpy(x[:1]),), strict=False)
    assert any(n.target == torch.ops.aten.slice.Tensor for n in exported.graph.nodes)
