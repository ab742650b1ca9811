"""A quantized model the caller lets go of after its export is freed, weights and all. Two process-wide caches
kept every one alive: torchao's and torch.ao's per-module device caches (``functools.cache`` on the module, filled
by prepare/convert and the passes after them) and the pattern matchers of onnxscript's default rewrite rules
(each keeps the last graph it matched, whose tensors are the exported model's own). A repair or a placement that
quantizes a large model several times held each discarded model's weights (0.47 GiB apiece at 2 GB of float
weights). Run in a fresh process: an earlier test's exports would only have moved what the caches hold."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import gc, sys, weakref
    import torch
    from quantship import Quantizer, export_qdq

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)).eval()
    batches = [torch.randn(4, 32) for _ in range(2)]
    held = []
    for k in range(2):  # a repair's second attempt: the first model must not outlive its export either
        qmodel = Quantizer.for_target("onnxruntime-cpu").quantize(model, batches)
        export_qdq(qmodel, batches[0][:1], sys.argv[1] + f"/q{k}.onnx", target="onnxruntime-cpu")
        held += [weakref.ref(qmodel)] + [weakref.ref(t) for t in [*qmodel.parameters(), *qmodel.buffers()]
                                         if t.dtype == torch.int8]
        del qmodel
    gc.collect()
    alive = [ref for ref in held if ref() is not None]
    print(len(held), len(alive))
""")


def test_a_quantized_model_let_go_after_its_export_is_freed(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    held, alive = (int(v) for v in done.stdout.split()[-2:])
    assert held >= 6, "the model, then its int8 weights, for each attempt"
    assert alive == 0, f"{alive} of {held} quantized models and int8 weights still referenced after gc"
