"""A seeded, bounded fuzzer for the file readers (``inspect_file``, ``check_file``, ``qdq_stats``).

``mutants(seed_bytes, n, seed)`` yields ``n`` mutated copies of a small QDQ file: byte-level
(flips, truncations, insertions, an empty file) and structured (element types, dims, scales,
zero-points, attributes, domains, opsets, metadata). ``read_all(path)`` puts one file through
every reader and returns the uncaught exceptions: a documented refusal (``QuantshipError``,
``FileNotFoundError``) is an answer, anything else is a bug.

A fresh run outside the suite (the suite runs ~300 files in ``test_fuzz.py``)::

    PYTHONPATH=src:. python -m tests.inspect.fuzzing SMALL_QDQ.onnx --n 1000 --seed 20261130
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

TARGETS = ("onnxruntime", "openvino", "tigris", "tensorrt")
_ODD_FLOATS = (float("nan"), float("inf"), -float("inf"), 0.0, -0.5, 1e-45, 1e38, 3.4e38)
_MARK = "\u00e9-not-utf8"  # same length as its broken form, so every length prefix still holds
_BROKEN_MARK = b"\xc3\x28-not-utf8"
_ODD_INTS = (-(2 ** 63), -(2 ** 40), -5, -1, 0, 1, 7, 255, 2 ** 31, 2 ** 40, 2 ** 62)


def _byte_mutant(data: bytes, rng: random.Random) -> bytes:
    kind = rng.choice(("flip", "flip", "truncate", "insert", "zero_run", "empty"))
    if kind == "empty":
        return b""
    if kind == "truncate":
        return data[: rng.randrange(0, len(data))]
    buf = bytearray(data)
    if kind == "insert":
        at = rng.randrange(0, len(buf))
        buf[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    elif kind == "zero_run":
        at = rng.randrange(0, len(buf))
        buf[at:at + rng.randint(1, 64)] = b"\0" * len(buf[at:at + rng.randint(1, 64)])
    else:
        for _ in range(rng.randint(1, 24)):
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    return bytes(buf)


def _set_values(tensor: onnx.TensorProto, values: np.ndarray) -> None:
    tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))


def _qdq_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]


def _structured_mutant(model: onnx.ModelProto, rng: random.Random) -> None:
    """One edit, in place."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    kind = rng.choice((
        "elem_type", "init_dtype", "dims", "declared_dims", "scale", "scale", "zero_point", "axis",
        "attribute", "domain", "op_type", "opset", "metadata", "metadata", "drop_input", "raw_data",
        "drop_node", "rename_input",
    ))
    nodes = list(graph.node)
    if kind == "elem_type":
        values = [*graph.input, *graph.output, *graph.value_info]
        if values:
            rng.choice(values).type.tensor_type.elem_type = rng.choice((0, 8, 14, 15, 24, 30, 99, 1 << 20))
    elif kind == "init_dtype":
        tensor = rng.choice(list(graph.initializer))
        tensor.data_type = rng.choice((0, 2, 3, 6, 8, 12, 16, 21, 26, 77))
    elif kind == "dims":
        tensor = rng.choice(list(graph.initializer))
        dims = list(tensor.dims) or [1]
        dims[rng.randrange(len(dims))] = rng.choice(_ODD_INTS)
        del tensor.dims[:]
        tensor.dims.extend(dims)
    elif kind == "declared_dims":
        value = rng.choice([*graph.input, *graph.output])
        shape = value.type.tensor_type.shape
        if shape.dim:
            shape.dim[rng.randrange(len(shape.dim))].dim_value = rng.choice(_ODD_INTS)
    elif kind == "scale":
        node = rng.choice(_qdq_nodes(model))
        tensor = inits.get(node.input[1])
        if tensor is not None:
            values = numpy_helper.to_array(tensor).copy()
            flat = values.reshape(-1)
            flat[rng.randrange(flat.size)] = rng.choice(_ODD_FLOATS)
            _set_values(tensor, values)
    elif kind == "zero_point":
        node = rng.choice(_qdq_nodes(model))
        tensor = inits.get(node.input[2]) if len(node.input) > 2 else None
        if tensor is not None:
            values = numpy_helper.to_array(tensor)
            dtype = rng.choice((np.int8, np.uint8, np.int16, np.int32, np.float32))
            _set_values(tensor, (values.astype(np.int64) + rng.choice((0, 1, 128, 300))).astype(dtype))
    elif kind == "axis":
        node = rng.choice(_qdq_nodes(model))
        for attr in node.attribute:
            if attr.name == "axis":
                attr.i = rng.choice((-9, -5, -2, 2, 3, 4, 5, 9, 2 ** 40))
    elif kind == "attribute":
        node = rng.choice(nodes)
        if node.attribute:
            attr = rng.choice(list(node.attribute))
            if attr.type == onnx.AttributeProto.INTS and attr.ints:
                attr.ints[rng.randrange(len(attr.ints))] = rng.choice(_ODD_INTS)
            elif attr.type == onnx.AttributeProto.INT:
                attr.i = rng.choice(_ODD_INTS)
            elif attr.type == onnx.AttributeProto.FLOAT:
                attr.f = rng.choice(_ODD_FLOATS)
            else:
                attr.type = rng.choice((1, 2, 3, 7, 20))
        else:
            node.attribute.append(onnx.helper.make_attribute("axis", rng.choice(_ODD_INTS)))
    elif kind == "domain":
        rng.choice(nodes).domain = rng.choice(("com.acme", "com.microsoft", "ai.onnx.ml", "x" * 300))
    elif kind == "op_type":
        rng.choice(nodes).op_type = rng.choice(("Conv", "QLinearConv", "FooBar", "Gemm", "MatMul", "", "Loop"))
    elif kind == "opset":
        model.opset_import[0].version = rng.choice((1, 7, 10, 12, 13, 21, 23, 30, 10 ** 6))
    elif kind == "metadata":
        text = rng.choice((
            "[" * 100_000 + "]" * 100_000, '{"a": ' * 5000 + "1" + "}" * 5000, '{"backend": NaN}',
            '{"backend": Infinity}', "not json", '"a string"', "[1, 2, 3]", json.dumps({"backend": 1e308 * 10}),
        ))
        onnx.helper.set_model_props(model, {"quantship.spec": text})
    elif kind == "drop_input":
        node = rng.choice(nodes)
        if node.input:
            del node.input[rng.randrange(len(node.input))]
    elif kind == "raw_data":
        tensor = rng.choice(list(graph.initializer))
        if tensor.raw_data:
            tensor.raw_data = tensor.raw_data[: rng.randrange(len(tensor.raw_data))]
    elif kind == "drop_node":
        del graph.node[rng.randrange(len(graph.node))]
    else:
        node = rng.choice(nodes)
        if node.input:
            node.input[rng.randrange(len(node.input))] = rng.choice(("missing", "x", node.output[0] if node.output else ""))


def mutants(data: bytes, n: int, seed: int) -> Iterator[tuple[str, bytes]]:
    """``n`` (label, bytes) mutants of ``data``: a third byte-level, two thirds structured (1-3 edits)."""
    rng = random.Random(seed)
    for index in range(n):
        if rng.random() < 1 / 3:
            yield f"{index}:bytes", _byte_mutant(data, rng)
            continue
        model = onnx.ModelProto()
        model.ParseFromString(data)
        for _ in range(rng.choice((1, 1, 2, 3))):
            try:
                _structured_mutant(model, rng)
            except Exception:  # noqa: BLE001 - an earlier edit left nothing this one can work on
                pass
        blob = model.SerializeToString()
        if rng.random() < 0.1:  # a name or the spec that is not UTF-8 (protobuf reads it back as bytes)
            target = rng.choice([n for n in model.graph.node] + [p for p in model.metadata_props])
            if isinstance(target, onnx.NodeProto):
                target.name = _MARK
            else:
                target.value = _MARK
            blob = model.SerializeToString().replace(_MARK.encode(), _BROKEN_MARK)
        yield f"{index}:structured", blob


def _strict_json(text: str) -> None:
    json.loads(text, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(f"non-JSON constant {name}")))


def read_all(path: Path, lenient: bool = False) -> list[str]:
    """Every reader on ``path``; the uncaught exceptions as ``reader: Type: message`` (empty: all fine),
    plus ``qdq_stats: refused`` / ``inspect: refused`` when those refused the file.

    ``lenient`` also takes a plain ``ValueError`` from inspect/judge/check as a refusal (the measure before
    ``quantship.errors`` existed); ``qdq_stats`` must raise only the documented refusals either way.
    """
    from quantship.errors import QuantshipError
    from quantship.inspect.judge.check import check_file
    from quantship.inspect.read.graph import inspect_file
    from quantship.inspect.read.stats import qdq_stats

    calls = [("inspect", lambda: _strict_json(inspect_file(path).to_json())), ("qdq_stats", lambda: qdq_stats(path))]
    calls += [(f"check {t}", lambda t=t: _strict_json(check_file(path, t).to_json())) for t in TARGETS]
    problems = []
    for name, call in calls:
        try:
            call()
        except (QuantshipError, FileNotFoundError):
            if name in ("qdq_stats", "inspect"):
                problems.append(f"{name}: refused")
        except ValueError as exc:
            if not (lenient and name != "qdq_stats" and type(exc) is ValueError):
                problems.append(f"{name}: {type(exc).__name__}: {_first(exc)}")
            elif name == "inspect":
                problems.append("inspect: refused")
        except Exception as exc:  # noqa: BLE001 - the fuzzer's job is to catch everything else
            problems.append(f"{name}: {type(exc).__name__}: {_first(exc)}")
    return problems


def _first(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else ""


def run(seed_file: Path, n: int, seed: int, workdir: Path, lenient: bool = False) -> dict:
    """Fuzz ``n`` mutants of ``seed_file``; a summary dict (files, refusals, uncaught, seconds)."""
    workdir.mkdir(parents=True, exist_ok=True)
    data = seed_file.read_bytes()
    uncaught: list[tuple[str, str]] = []
    n_refused = n_disagree = 0  # files qdq_stats refused (the others were read through to the end)
    start = time.perf_counter()
    for label, blob in mutants(data, n, seed):
        path = workdir / "mutant.onnx"
        path.write_bytes(blob)
        found = read_all(path, lenient)
        n_refused += "qdq_stats: refused" in found
        # qdq_stats counting a file that inspect refuses (or the reverse): two answers for one file
        n_disagree += ("qdq_stats: refused" in found) != ("inspect: refused" in found)
        uncaught += [(label, p) for p in found if not p.endswith(": refused")]
    seconds = time.perf_counter() - start
    kinds = Counter(p.split(":")[0] + ": " + p.split(": ")[1] for _, p in uncaught)
    return {"files": n, "seed": seed, "lenient": lenient, "refused_by_qdq_stats": n_refused,
            "qdq_stats_vs_inspect_disagree": n_disagree, "uncaught": len(uncaught),
            "files_with_uncaught": len({label for label, _ in uncaught}), "kinds": dict(kinds),
            "examples": uncaught[:12], "seconds": round(seconds, 1),
            "per_file_ms": round(1000 * seconds / max(n, 1), 1) if not math.isnan(seconds) else None}


if __name__ == "__main__":
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("seed_file", type=Path)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--lenient", action="store_true", help="a plain ValueError from inspect/judge/check is a refusal")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        summary = run(args.seed_file, args.n, args.seed, Path(tmp), args.lenient)
    json.dump(summary, sys.stdout, indent=2, default=str)
    print()
