"""Run a file in OpenVINO inside its own process: ``python -m quantship.inspect.run.openvino_worker``.

OpenVINO's CPU plugin can crash the process on some files (a segfault was seen on a DenseNet-121
QDQ file). Running it in a child keeps that crash away from quantship's own process, so the user
gets a one-line verdict ("failed: OpenVINO crashed") instead of a dead interpreter.
"""

from __future__ import annotations

import sys

import numpy as np


def main(argv: list[str]) -> int:
    """argv: model, feeds (.npz), outputs (.npz), and optionally a JSON object of CPU properties to add."""
    import json

    model_path, feeds_path, out_path, *extra = argv
    properties = {"INFERENCE_PRECISION_HINT": "f32", **(json.loads(extra[0]) if extra else {})}
    import openvino as ov

    with np.load(feeds_path, allow_pickle=False) as archive:
        feeds: dict[int, dict[str, np.ndarray]] = {}
        for key in archive.files:
            index, _, name = key.partition(":")
            feeds.setdefault(int(index), {})[name] = archive[key]
    core = ov.Core()
    compiled = core.compile_model(core.read_model(model_path), "CPU", properties)
    request = compiled.create_infer_request()
    results = {}
    for index in sorted(feeds):
        out = request.infer(feeds[index])
        for j, port in enumerate(compiled.outputs):
            results[f"{index}:{j}"] = np.array(out[port])
    np.savez(out_path, **results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
