"""Run a file in the runtimes that will consume it, where they can run here, and measure the runs.

``ort_session`` (over ``session_of``) is the one place an ONNX Runtime session is built (verification, export checks,
the demo and the benchmarks use it). ONNX Runtime loads and runs the file; OpenVINO compiles it on CPU (f32 inference precision: s8 QDQ
files do not compile otherwise on AMX CPUs) and runs it; TiGrIS compiles a plan with its CLI and
runs it on its host runtime (NHWC inputs). ``lsb_between`` measures a run against ONNX Runtime
executing the QDQ graph literally (no graph optimizations), in output LSB; the verdict on a
target's run (``run_consumer``) is the judge's, in ``quantship.inspect.judge.runs``.
"""

from __future__ import annotations

import collections
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx

from quantship.inspect.read import external
from quantship.inspect.read.lsb import lsb_error
from quantship.inspect.run import literal
from quantship.targets import Target

Inputs = dict[str, np.ndarray]
TIGRIS_MEMORY = "64M"  # a pool large enough that compiling never fails for lack of memory


def ort_session(model: str | Path | onnx.ModelProto, *, optimized: bool = False,
                optimized_model_filepath: str | Path | None = None, config: dict[str, str] | None = None,
                base_dir: str | Path | None = None):
    """A CPU ONNX Runtime session: the file read literally (``ORT_DISABLE_ALL``) unless ``optimized``.

    ``optimized=True`` is ONNX Runtime's default level (``ORT_ENABLE_ALL``): its fused integer
    kernels, i.e. what a user's ``InferenceSession(path)`` runs. ``optimized_model_filepath`` saves
    the graph ONNX Runtime builds; ``config``: session config entries (``inspect.run.weight_only``'s readings).
    ``base_dir``: as ``session_of``'s (default for an in-memory model: ``literal.tensors_in``'s). Read literally,
    a file whose dequantized weights exceed the part size (``literal.part_bytes``) comes back as a
    ``literal.SplitSession``: run a few layers at a time.
    """
    import onnxruntime as ort

    if base_dir is None and isinstance(model, onnx.ModelProto):
        base_dir = literal.tensors_folder()
    if not optimized and optimized_model_filepath is None and not config:
        split = literal.split_session(model, base_dir)
        if split is not None:
            return split

    options = ort.SessionOptions()
    options.log_severity_level = 3
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimized else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    if not optimized:
        # read literally, every weight's DequantizeLinear is ready at the first step and ORT runs them early: its
        # arena would keep that float copy (and the arena's growth margin) after the run; without it, it is freed
        options.enable_cpu_mem_arena = False
    if optimized_model_filepath is not None:
        options.optimized_model_filepath = str(optimized_model_filepath)
    return session_of(model, options, base_dir)


def session_of(model: str | Path | onnx.ModelProto, options, base_dir: str | Path | None = None):
    """A CPU ONNX Runtime session of a file (by path: ONNX Runtime finds its external data beside it) or of
    an in-memory model. A model too large for one protobuf goes through a temporary folder, graph plus one
    data file (``save_with_external_data``: one tensor at a time, the model unchanged). ``base_dir``: the
    folder an in-memory model's external tensors are relative to (ONNX Runtime maps them from there)."""
    import onnxruntime as ort

    if not isinstance(model, onnx.ModelProto):
        return ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    if base_dir is not None:
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(base_dir))
    if external.fits_one_file(model):
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    with tempfile.TemporaryDirectory(prefix="quantship-session-") as tmp:
        path = Path(tmp) / "model.onnx"
        external.save_with_external_data(model, path, "model.onnx.data")
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run_session(session, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Run ``session`` on positional ``inputs`` (one array per graph input, in order)."""
    names = [i.name for i in session.get_inputs()]
    if len(names) != len(inputs):
        raise ValueError(f"the file has {len(names)} input(s) {names}, but {len(inputs)} array(s) were given")
    return session.run(None, dict(zip(names, inputs)))


def ort_optimized_ops(path: str | Path) -> collections.Counter:
    """What ONNX Runtime really runs: operator counts of the graph it builds at its default level."""
    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "optimized.onnx"
        ort_session(path, optimized=True, optimized_model_filepath=saved)
        return collections.Counter(n.op_type for n in onnx.load(str(saved), load_external_data=False).graph.node)


def cpu_info() -> tuple[str, set[str]]:
    """This CPU's model name and feature flags (Linux /proc/cpuinfo; ``('unknown', set())`` elsewhere).

    x86 int8 kernels differ by flag: with VNNI/AMX u8 x s8 products accumulate in 32 bits; with
    AVX2 alone they pass through saturating int16 pair sums.
    """
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown", set()
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "unknown")
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    return name, set(flags)


def run_onnxruntime(path: str | Path, feeds: list[Inputs], *, optimize: bool = False) -> list[list[np.ndarray]]:
    """Outputs (in graph order) for each feed; ``optimize=False`` runs the QDQ graph literally."""
    return literal.run_feeds(ort_session(path, optimized=optimize), feeds)


def run_openvino(path: str | Path, feeds: list[Inputs], properties: dict[str, str] | None = None) -> list[list[np.ndarray]]:
    """Compile on CPU with f32 inference precision (and ``properties``, e.g. ``inspect.run.weight_only``'s
    readings) and run each feed, in a child process (a crash inside OpenVINO's plugin becomes an error here,
    not the end of this process)."""
    import importlib.util

    if importlib.util.find_spec("openvino") is None:
        raise ModuleNotFoundError("openvino is not installed (pip install openvino)")
    with tempfile.TemporaryDirectory(prefix="quantship-ov-") as tmp:
        feeds_path, out_path = Path(tmp) / "feeds.npz", Path(tmp) / "outputs.npz"
        np.savez(feeds_path, **{f"{i}:{name}": array for i, feed in enumerate(feeds) for name, array in feed.items()})
        extra = [json.dumps(properties)] if properties else []
        done = subprocess.run([sys.executable, "-m", "quantship.inspect.run.openvino_worker", str(path), str(feeds_path),
                               str(out_path), *extra], capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            if done.returncode < 0:
                raise RuntimeError(f"OpenVINO crashed on this file (signal {-done.returncode}) while compiling or running it")
            lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
            raise RuntimeError(f"OpenVINO could not run the file: {lines[-1] if lines else f'exit {done.returncode}'}")
        with np.load(out_path, allow_pickle=False) as archive:
            outputs: dict[int, dict[int, np.ndarray]] = {}
            for key in archive.files:
                i, _, j = key.partition(":")
                outputs.setdefault(int(i), {})[int(j)] = archive[key]
    return [[outputs[i][j] for j in sorted(outputs[i])] for i in range(len(feeds))]


def tigris_executable() -> str | None:
    """The ``tigris`` CLI installed beside this Python, else on PATH."""
    beside = Path(sys.executable).parent / "tigris"
    return str(beside) if beside.exists() else shutil.which("tigris")


def _tigris(*args: str) -> subprocess.CompletedProcess:
    exe = tigris_executable()
    if exe is None:
        raise FileNotFoundError("the tigris CLI is not installed (pip install tigris-ml)")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=600)


def tigris_analyze(path: str | Path, memory: str = TIGRIS_MEMORY) -> dict:
    """``tigris analyze --json`` on the file, parsed."""
    done = _tigris("analyze", str(path), "-m", memory, "--json")
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        raise ValueError(f"tigris analyze failed: {_last_line(done)}") from None


def _last_line(done: subprocess.CompletedProcess) -> str:
    lines = [ln.strip() for ln in (done.stderr + "\n" + done.stdout).splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.lower().startswith("error")]
    return (errors or lines or [f"exit code {done.returncode}"])[-1]


def _tigris_reason(path: str | Path) -> str:
    """Why TiGrIS cannot compile the file, from ``tigris analyze``: the unsupported operators, each with
    TiGrIS's own reason (the first two; how many there are), or "" when it names none."""
    try:
        unsupported = tigris_analyze(path).get("model", {}).get("unsupported_operators") or []
    except (ValueError, OSError, subprocess.SubprocessError):
        return ""
    if not unsupported:
        return ""
    shown = "; ".join(str(u) for u in unsupported[:2])
    more = f" (and {len(unsupported) - 2} more)" if len(unsupported) > 2 else ""
    return f"{len(unsupported)} operator(s) it does not support: {shown}{more}"


def run_tigris(path: str | Path, feeds: list[Inputs], model: onnx.ModelProto) -> list[list[np.ndarray]]:
    """Compile a plan with the tigris CLI, then run it on the host runtime with channels-last inputs."""
    from tigris.runtime import Session

    names = [o.name for o in model.graph.output]
    declared = {o.name: tuple(d.dim_value if d.HasField("dim_value") else None for d in o.type.tensor_type.shape.dim)
                for o in model.graph.output}
    with tempfile.TemporaryDirectory(prefix="quantship-tigris-") as tmp:
        plan = Path(tmp) / "plan.tgrs"
        _compile_plan(path, model, plan)
        results = []
        with Session(plan) as session:
            wants = {info["name"]: tuple(info["shape"]) for info in session.inputs}
            for feed in feeds:
                out = session.run({k: channels_last(v, wants.get(k)) for k, v in feed.items()})
                results.append([channels_first(out[n], declared.get(n)) for n in names])
        return results


_LAST_PLAN: dict[str, bytes] = {}  # the last plan compiled in this process, by the digest of the file's bytes


def _compile_plan(path: str | Path, model: onnx.ModelProto, plan: Path) -> None:
    """``tigris compile`` the file into ``plan``. A file of the same bytes as the last one compiled in this process
    gets that plan again (quantize's runtime check and its fidelity confirmation read one file: one compile);
    a file with external data is compiled every time (its bytes are not all in the file)."""
    external_data = any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
    digest = None if external_data else f"{TIGRIS_MEMORY}:{hashlib.sha256(Path(path).read_bytes()).hexdigest()}"
    if digest is not None and digest in _LAST_PLAN:
        plan.write_bytes(_LAST_PLAN[digest])
        return
    done = _tigris("compile", str(path), "-m", TIGRIS_MEMORY, "-o", str(plan))
    if done.returncode != 0 or not plan.exists():
        raise RuntimeError(f"tigris compile refused the file: {_tigris_reason(path) or _last_line(done)}")
    _LAST_PLAN.clear()
    if digest is not None:
        _LAST_PLAN[digest] = plan.read_bytes()


Runner = Callable[[str | Path, list[Inputs], onnx.ModelProto], list[list[np.ndarray]]]

# a target's ``runner`` names one of these (``quantship.targets``): how a file runs in its runtime here
RUNNERS: dict[str, Runner] = {
    "onnxruntime-fused": lambda path, feeds, model: run_onnxruntime(path, feeds, optimize=True),
    "openvino-cpu": lambda path, feeds, model: run_openvino(path, feeds),
    "tigris-cli": run_tigris,
}


def channels_last(value: np.ndarray, wanted: tuple | None) -> np.ndarray:
    """An input in the layout a TiGrIS plan reads: its channel axis (1) moved last where that gives the plan's shape
    (NCHW -> NHWC; a rank-3 [N, C, L] -> [N, L, C] too), else as given."""
    if value.ndim >= 3 and wanted is not None and tuple(value.shape) != wanted:
        moved = np.moveaxis(value, 1, -1)
        if tuple(moved.shape) == wanted:
            return np.ascontiguousarray(moved)
    return value


def channels_first(out: np.ndarray, dims: tuple | None) -> np.ndarray:
    """A TiGrIS output (channels last) in the file's own layout: its channel axis moved back to 1 for a
    4-D output, and for any other rank where that gives the shape the file declares (YOLO's [1, 22, 2100])."""
    if out.ndim == 4:
        return out.transpose(0, 3, 1, 2)
    if out.ndim >= 3 and dims and len(dims) == out.ndim and all(isinstance(d, int) and d > 0 for d in dims):
        moved = np.moveaxis(out, -1, 1)
        if tuple(moved.shape) == tuple(dims) and tuple(out.shape) != tuple(dims):
            return moved
    return out


def lsb_between(reference: list[list[np.ndarray]], candidate: list[list[np.ndarray]],
                scales: list[float | None]) -> tuple[float | None, float | None]:
    """Max and mean disagreement over all feeds and quantized outputs, in output LSB."""
    maxima, means = [], []
    for ref_outs, cand_outs in zip(reference, candidate):
        for ref, cand, scale in zip(ref_outs, cand_outs, scales):
            if isinstance(scale, np.ndarray):  # one unit per slice (a Concat of parts at different units)
                diff = np.abs(np.asarray(ref, np.float64) - np.asarray(cand, np.float64).reshape(np.shape(ref))) / scale
                maxima.append(float(diff.max()))
                means.append(float(diff.mean()))
            elif scale:
                err = lsb_error(ref, np.asarray(cand).reshape(np.shape(ref)), scale)
                maxima.append(err.max_lsb)
                means.append(err.mean_lsb)
    if not maxima:
        return None, None
    return max(maxima), float(np.mean(means))


def constant_reference(reference: list[list[np.ndarray]]) -> bool:
    """Whether every output of the reference is the same for every input row (or there is one row):
    then no comparison against it can tell a faithful run from a broken one. One output that varies
    (a detector's boxes beside a constant score) is enough to tell."""
    for k in range(len(reference[0]) if reference else 0):
        rows = np.concatenate([np.asarray(outs[k]).reshape(np.shape(outs[k])[0] if np.ndim(outs[k]) else 1, -1)
                               for outs in reference])
        if len(rows) < 2:
            return True
        if not np.all(rows == rows[:1]):
            return False
    return True


def joined(per_feed: list[list[np.ndarray]]) -> list[np.ndarray]:
    """Each output over every feed, concatenated along the batch (a 0-d output: the first feed's)."""
    return [np.concatenate([o[k] for o in per_feed]) if np.ndim(per_feed[0][k]) else per_feed[0][k]
            for k in range(len(per_feed[0]))]


RUNTIME_NAMES = {"openvino-cpu": "OpenVINO (CPU, f32 inference precision)", "tigris-cli": "TiGrIS's host runtime"}


def runtime_here(runner: str) -> bool:
    """Whether the runtime a runner names is installed on this machine."""
    import importlib.util

    if runner == "openvino-cpu":
        return importlib.util.find_spec("openvino") is not None
    if runner == "tigris-cli":
        return tigris_executable() is not None and importlib.util.find_spec("tigris") is not None
    return runner in RUNNERS


def native_runtime(p: Target) -> tuple[Runner, str] | None:
    """The target's own runtime, when it is not ONNX Runtime and runs here: its runner and its name. The
    fidelity of such a file is confirmed there (``quantize_onnx.quantizer.fidelity_in_runtime``)."""
    if p.runtime_is_onnxruntime or p.runner is None or p.runner not in RUNTIME_NAMES or not runtime_here(p.runner):
        return None
    return RUNNERS[p.runner], RUNTIME_NAMES[p.runner]


def fidelity_reading(p: Target) -> tuple[bool, str]:
    """How an INT8 file is read when judged against FP32: ONNX Runtime at its default optimizations for the
    target it serves (what a user runs: ``optimized=True``), read literally for the other targets (the
    arithmetic the Q/DQ pairs describe): the repair's steps for every target; a chosen file whose target has its
    own runtime here is then confirmed there (``native_runtime``)."""
    if p.runtime_is_onnxruntime:
        return True, "ONNX Runtime (default optimizations)"
    return False, "ONNX Runtime read literally (the target's runtime is checked against it by check --run)"
