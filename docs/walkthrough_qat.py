"""Walk-through 2: quantization-aware training inside a fastai fit, then the INT8 file.

Run it:  .venv/bin/python docs/walkthrough_qat.py [--out-dir DIR]

The reference task's CNN (scikit-learn digits) is fine-tuned three ways, seed-matched: float,
FX x86 QAT, and pt2e QAT. The pt2e result is the graph `export_qdq` writes; it is exported and
checked against PyTorch in output LSB. Accuracy is reported as k/n with a Wilson interval.
"""

import copy
from pathlib import Path

import torch
from _walkthrough import run
from fastai.data.core import DataLoaders
from fastai.learner import Learner
from fastai.torch_core import set_seed

from quantship import QuantizeCallback, export_qdq, qdq_stats, quant_spec, state_dict_size
from quantship.cli.common import format_accuracy
from quantship.examples import digits
from quantship.inspect import compare_logits, verify_qdq

BS = 60  # pt2e captures a symbolic batch, so any BS works (a shorter last batch too); 60 divides 360


def learner(split, model, bs=BS):
    train = list(zip(split.x_train[:300], split.y_train[:300]))
    valid = list(zip(split.x_test, split.y_test))
    dls = DataLoaders.from_dsets(train, valid, bs=bs, device="cpu")
    return Learner(dls, model, loss_func=torch.nn.CrossEntropyLoss())


def main(out_dir: Path) -> None:
    split = digits.load_split()
    base = digits.trained_model()

    arms = {}
    for name, cbs in [("FP32", []), ("x86 QAT", [QuantizeCallback(backend="x86")]),
                      ("pt2e QAT", [QuantizeCallback(backend="pt2e", verbose=True)])]:
        set_seed(0)
        learn = learner(split, copy.deepcopy(base))
        with learn.no_logging():
            learn.fit(1, 1e-3, cbs=cbs)
        arms[name] = learn.model
        k, n = digits.evaluate(learn.model, split.x_test, split.y_test, batch_size=BS)
        spec = quant_spec(learn.model)
        print(f"{name}: {format_accuracy(k, n)}" + (f"  spec {spec.as_dict()}" if spec else ""))

    print(f"state dict: FP32 {state_dict_size(arms['FP32']) / 1e3:.1f} kB, "
          f"x86 INT8 {state_dict_size(arms['x86 QAT']) / 1e3:.1f} kB")

    qat = arms["pt2e QAT"]
    path = export_qdq(qat, split.x_test[:BS], out_dir / "digits_qat_int8.onnx")
    print("qdq_stats:", qdq_stats(path).as_dict())
    n_batches = len(split.y_test) // BS
    print(f"file vs torch: {verify_qdq(qat, path, split.x_test, n_batches=n_batches):.3f} argmax agreement, "
          f"{compare_logits(qat, path, split.x_test, n_batches=n_batches)}")


if __name__ == "__main__":
    run(main)
