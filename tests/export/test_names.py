"""The INT8 file keeps the float model's interface (issue 38, item 4): the forward's argument names as
input names, and one stable output name for a single tensor, the same in the float file and the INT8
file whatever the torch graph called the node that made it (never ``dequantize_per_tensor_<n>``)."""

import onnx
import pytest
import torch

from quantship import Quantizer, export_onnx, export_qdq
from quantship.export.named_outputs import SINGLE_OUTPUT_NAME


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, image):
        return self.head(self.conv(image).mean((2, 3)))


def _interface(path) -> tuple[list[str], list[str]]:
    graph = onnx.load(str(path), load_external_data=False).graph
    return [i.name for i in graph.input], [o.name for o in graph.output]


@pytest.fixture(scope="module")
def quantized():
    torch.manual_seed(0)
    model = Classifier().eval()
    sample = torch.randn(4, 3, 8, 8)
    return model, Quantizer().quantize(model, [sample]), sample


@pytest.mark.parametrize("target", [None, "onnxruntime-cpu"])
def test_int8_file_keeps_the_float_files_names(quantized, target, tmp_path):
    model, qmodel, sample = quantized
    float_path = export_onnx(model, sample, tmp_path / "fp32.onnx")
    int8_path = export_qdq(qmodel, sample, tmp_path / "int8.onnx", target=target)
    assert _interface(float_path) == (["image"], [SINGLE_OUTPUT_NAME]) == (["image"], ["output"])
    assert _interface(int8_path) == _interface(float_path)


def test_output_names_given_still_win(quantized, tmp_path):
    _, qmodel, sample = quantized
    path = export_qdq(qmodel, sample, tmp_path / "int8.onnx", output_names=["logits"])
    assert _interface(path) == (["image"], ["logits"])
