"""Write files a runtime loads: ``export_qdq`` (faithful QDQ from pt2e) and the float path ``export_onnx``."""

from quantship.export.onnx_float import ONNXModel, export_onnx, verify_onnx
from quantship.export.qdq import export_qdq

__all__ = ["export_qdq", "export_onnx", "ONNXModel", "verify_onnx"]
