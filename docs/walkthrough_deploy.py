"""Walk-through 3: one trained model, four runtimes. A preset per target, its check, the three-way check.

Run it:  .venv/bin/python docs/walkthrough_deploy.py [--out-dir DIR]

The model is the reference task's CNN (scikit-learn digits). For each deployment target quantship
picks the precision that target runs (its preset), writes the file, checks the file against the
target's rules, runs the target where it runs on this machine, and compares float vs INT8 vs
target in output LSB. TensorRT needs a GPU: its rules are checked statically.
"""

from pathlib import Path

from _walkthrough import run

from quantship import Quantizer, export_onnx, export_qdq, qdq_stats
from quantship.examples import digits
from quantship.inspect.judge.check import check_file
from quantship.inspect.judge.compare import compare_files
from quantship.precision import PRESETS

BATCH = 40


def main(out_dir: Path) -> None:
    model = digits.trained_model()
    split = digits.load_split()
    calibration = [split.x_train[i:i + BATCH] for i in range(0, 200, BATCH)]
    # any batch, like the preset files (tigris: batch 1), so the three-way check feeds both the same inputs
    fp32 = export_onnx(model, split.x_test[:BATCH], out_dir / "digits_fp32.onnx", dynamic_batch=True)
    for p in PRESETS:
        print(f"\n== {p.target}: {p.why}")
        qmodel = Quantizer.for_target(p).quantize(model, calibration, max_calibration_samples=200)
        int8 = export_qdq(qmodel, split.x_test[:BATCH], out_dir / f"digits_{p.target}.onnx", target=p)
        stats = qdq_stats(int8)
        print(f"file: {int8.name}, {stats.n_uint8} uint8 Q/DQ, {stats.n_nonzero_zero_point} non-zero zero-points")
        report = check_file(int8, p, run=True)
        print(f"check {p.target}: {report.verdict if report.ok else 'REFUSED'}")  # "not run" where it cannot run here
        for finding in report.findings:
            print(f"  [{finding.severity}] {finding.rule}: {finding.message}")
        for consumer_run in report.runs:
            print(f"  run {consumer_run}")
        # three-way check on real held-out images (random inputs overstate what quantization costs)
        real = split.x_test[:200].numpy()
        for row in compare_files(fp32, int8, target=p, inputs=real).rows:
            print(f"  {row}")
    # the same file is not good for every target: the ORT preset's uint8 file against TensorRT's rules
    ort_file = out_dir / "digits_onnxruntime-cpu.onnx"
    trt = check_file(ort_file, "tensorrt")
    print(f"\nonnxruntime-cpu file checked against tensorrt: {'accepted' if trt.ok else 'REFUSED'} "
          f"({', '.join(sorted({f.rule for f in trt.errors}))})")


if __name__ == "__main__":
    run(main)
