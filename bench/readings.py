"""Two readings of every preset's file on this CPU: ONNX Runtime literal vs fused, and OpenVINO.

Table 1: untrained torchvision models (``weights=None``, seed 0; where BatchNorm at init leaves the
output constant, as for MobileNetV2, its statistics are set on 32 random images), each quantized with the default
recipe (symmetric int8 activations, full-range int8 weights) and with every deployment preset
(presets that write the same graph share a row). ``export_qdq`` runs each file twice on its sample
batch (ONNX Runtime with optimizations off, and at its default level) and both readings are shown
as max error against the torch quantized model, in output LSB, with their gap. OpenVINO and TiGrIS
(where installed) are run on the same file against ORT's literal reading, on seeded random inputs.

Table 2: the reference task (a trained TinyResNet on scikit-learn's digits) with REAL inputs: the
360 held-out images through each consumer, against ORT's literal reading.

    python bench/readings.py [--models resnet18 resnet50 densenet121 mobilenet_v2] [--size 96]
    python bench/readings.py --smoke   # resnet18 at 32x32, batch 1, and the digits table (bench/_smoke.py)
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
import warnings
from pathlib import Path

import onnx
import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent))

SIZES = {"resnet18": 128, "resnet50": 96, "densenet121": 96, "mobilenet_v2": 128}


def bn_calibrated(model: torch.nn.Module, batches: list[torch.Tensor]) -> torch.nn.Module:
    """BatchNorm running statistics set from the data (an untrained model's BN at init would pass
    activations unscaled; MobileNetV2's output is then constant and every comparison vacuous)."""
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()
            m.momentum = None  # cumulative average over the batches
    model.train()
    with torch.no_grad():
        for b in batches:
            model(b)
    return model.eval()


def _quantized(model, target: str | None, calib):
    from quantship import Quantizer

    quantizer = Quantizer(backend="pt2e") if target is None else Quantizer.for_target(target)
    return quantizer.quantize(model, calib, max_calibration_samples=sum(len(c) for c in calib))


def _consumer(path: Path, target: str, **kwargs) -> str:
    from quantship.inspect import run_consumer

    r = run_consumer(path, target, **kwargs)
    if not r.ran:
        return "not run"
    if r.max_lsb is None:
        return r.status
    return f"{r.max_lsb:.1f} (mean {r.mean_lsb:.2f})"


def _constant_output(model: torch.nn.Module, x: torch.Tensor) -> bool:
    """The output does not move with the input (an untrained MobileNetV2's logits are ~1e-9 and
    vary by ~1e-10): every error would be counted in LSB of a constant."""
    with torch.no_grad():
        y = model(x)
    return bool(y.std(0).max() < 1e-6)


def _distinct_recipes() -> dict[str | None, list[str]]:
    """The default recipe and the presets, one entry per distinct request (spec and activation dtype)."""
    from quantship import PRESETS, resolve_spec

    default = (resolve_spec(backend="pt2e"), "int8")
    groups: dict = {default: (None, ["default recipe"])}
    for p in PRESETS:
        settings = (resolve_spec(**p.spec_kwargs), p.activation_dtype)
        groups.setdefault(settings, (p.target, []))[1].append(p.target)
    return dict(groups.values())


def torchvision_rows(models: list[str], size: int | None, batch: int, workdir: Path, bn: str) -> list[dict]:
    import torchvision

    from quantship import export_qdq

    rows = []
    for name in models:
        px = size or SIZES.get(name, 96)
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)(weights=None).eval()
        gen = torch.Generator().manual_seed(1)
        calib = [torch.randn(batch, 3, px, px, generator=gen) for _ in range(2)]
        sample = torch.randn(batch, 3, px, px, generator=gen)
        probe = [torch.randn(8, 3, px, px, generator=gen) for _ in range(4)]
        calibrated = bn == "always" or (bn == "if-constant" and _constant_output(model, probe[0]))
        if calibrated:
            model = bn_calibrated(model, probe)
        seen: dict[str, dict] = {}
        recipes = _distinct_recipes()
        for target in recipes:
            t0 = time.perf_counter()
            qmodel = _quantized(model, target, calib)
            label = " = ".join(recipes[target])
            path = export_qdq(qmodel, sample, workdir / f"{name}_{label.replace(' ', '_')}.onnx", target=target)
            digest = hashlib.sha256(onnx.load(str(path)).graph.SerializeToString()).hexdigest()
            if digest in seen:
                seen[digest]["recipe"] += f" = {label}"
                continue
            r = path.readings
            row = {"model": f"{name} {px}px{' (BN set)' if calibrated else ''}", "recipe": label, "literal": r.literal_lsb, "fused": r.fused_lsb,
                   "gap": r.gap_lsb, "openvino": _consumer(path, "openvino", n_inputs=4),
                   "tigris": _consumer(path, "tigris", n_inputs=4) if target in (None, "tigris") else "-",
                   "seconds": time.perf_counter() - t0}
            seen[digest] = row
            rows.append(row)
            print(_table1([row], header=len(rows) == 1), flush=True)
    return rows


def digits_rows(workdir: Path) -> list[dict]:
    """The reference task with real inputs: each preset's file through its consumers."""
    from quantship import export_qdq
    from quantship.examples import digits

    batch = 40
    split = digits.load_split()
    model = digits.trained_model()
    calib = [split.x_train[i:i + batch] for i in range(0, 200, batch)]
    real = split.x_test.numpy()
    rows = []
    for target in (None, "openvino", "tigris"):
        qmodel = _quantized(model, target, calib)
        label = target or "default recipe"
        path = export_qdq(qmodel, split.x_test[:batch], workdir / f"digits_{label.replace(' ', '_')}.onnx",
                          target=target)
        r = path.readings
        rows.append({"recipe": label, "literal": r.literal_lsb, "fused": r.fused_lsb, "gap": r.gap_lsb,
                     "ort_fused": _consumer(path, "onnxruntime", inputs=real),
                     "openvino": _consumer(path, "openvino", inputs=real),
                     "tigris": _consumer(path, "tigris", inputs=real)})
    return rows


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _table1(rows: list[dict], header: bool = True) -> str:
    lines = ["| model | recipe | ORT literal vs torch | ORT fused vs torch | fused vs literal | OpenVINO vs ORT "
             "literal | TiGrIS vs ORT literal | s |", "|---|---|---|---|---|---|---|---|"] if header else []
    for r in rows:
        lines.append(f"| {r['model']} | {r['recipe']} | {_f(r['literal'])} | {_f(r['fused'])} | {_f(r['gap'])} | "
                     f"{r['openvino']} | {r['tigris']} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def _table2(rows: list[dict]) -> str:
    lines = ["| recipe | ORT literal vs torch | ORT fused vs torch | ORT fused vs literal | OpenVINO vs ORT literal "
             "| TiGrIS vs ORT literal |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['recipe']} | {_f(r['literal'])} | {_f(r['fused'])} | {r['ort_fused']} | {r['openvino']} "
                     f"| {r['tigris']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import _smoke

    from quantship.inspect import cpu_info

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SIZES))
    parser.add_argument("--size", type=int, default=None, help="input size for every model (default per model)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--skip-digits", action="store_true")
    parser.add_argument("--bn", choices=["if-constant", "always", "never"], default="if-constant",
                        help="set BatchNorm statistics on random images: only where the output is otherwise "
                             "constant (default; MobileNetV2), always, or never")
    args = _smoke.parse_args(parser, argv, models=["resnet18"], size=32, batch=1)
    cpu, flags = cpu_info()
    wanted = ["avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8"]
    print(f"CPU: {cpu}; flags: {', '.join(f for f in wanted if f in flags) or 'none of ' + ', '.join(wanted)}")
    print(f"max error in output LSB; batch {args.batch}, seeded random inputs\n", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = torchvision_rows(args.models, args.size, args.batch, Path(tmp), args.bn)
        print("\n" + _table1(rows))
        if not args.skip_digits:
            print("\nreference task (digits, trained), 360 real held-out images, batch 40:\n")
            print(_table2(digits_rows(Path(tmp))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
