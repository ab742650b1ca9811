"""The import direction of src/quantship, read with ``ast`` (no module is imported).

Layers, lowest first (docs/layout.md): ``errors``; the leaves (``lazy``, ``noise``, ``progress``,
``ranks``, ``interrupts``, ``locks``, ``calibration``, ``report_json``, ``intervals``, ``heap``); ``precision`` and
``fidelity`` and ``search_engine``; ``targets`` (one module per runtime) and ``repair_loop``; ``quantize`` and ``inspect`` (neither
imports the other); ``export``; ``quantize_onnx``; ``examples``; ``sources`` (models by name);
``cli`` on top; nothing imports ``cli``. Inside ``inspect``, three jobs, lowest first: ``read`` (a file),
``run`` (it, in runtimes), ``judge`` (it, for a target); every module of ``inspect`` lives in one of them.
A module imports only from lower layers or from its own package, with no cycle, counting the
imports inside functions too. A function-level import of our own modules is allowed only in the
CLI (``--help`` answers before torch, onnx and numpy load) or where listed below, and each one
carries a comment saying why.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "quantship"

LAYERS: dict[str, int] = {
    "quantship.errors": 0,
    **dict.fromkeys(("quantship.lazy", "quantship.noise", "quantship.progress", "quantship.ranks",
                     "quantship.interrupts", "quantship.locks", "quantship.calibration",
                     "quantship.report_json", "quantship.intervals", "quantship.heap"), 1),
    "quantship.precision": 2,
    "quantship.fidelity": 2,  # the one judgement of outputs against FP32: numpy, errors and intervals only
    "quantship.recipe": 3,  # one algorithm request (Algorithms) for every entry point: errors and precision only
    "quantship.search_engine": 2,  # one greedy search for the repair, the accuracy and the speed search: no front-end
    "quantship.targets": 3,  # one module per runtime: precision only
    "quantship.repair_loop": 3,  # the fidelity repair, once for both front-ends: fidelity and the search engine
    "quantship.quantize": 4,
    "quantship.inspect": 4,
    "quantship.export": 5,
    "quantship.quantize_onnx": 6,
    "quantship.examples": 7,
    "quantship.sources": 8,  # models by name (torchvision, timm, file.py:factory, hf:), for the CLI, bench, docs
    "quantship.cli": 9,
    "quantship.__main__": 10,
}
# inside inspect: a job imports only from the jobs below it (and from its own)
INSPECT = "quantship.inspect"
INSPECT_JOBS: dict[str, int] = {f"{INSPECT}.read": 0, f"{INSPECT}.run": 1, f"{INSPECT}.judge": 2}
ROOT = "quantship"  # the package itself: ``__version__`` and a table of names loaded on first use

# function-level imports of our modules outside the CLI, and why each stays inside its function
LATE_OUTSIDE_CLI: dict[tuple[str, str], str] = {
    ("quantship.examples.real", "quantship.examples.digits"): "the cache folder's one definition; digits imports torch, "
                                                              "which reading the real models' files does not need",
    # the ONNX front-end imports no torch until a file is made (import quantship.quantize_onnx.quantizer stays light)
    ("quantship.quantize_onnx.calibrate", "quantship.quantize.annotator"): "torchao's observers, loaded to calibrate",
    ("quantship.quantize_onnx.quantizer", "quantship.quantize.algorithms.rounding"): "the rounding math is torch's",
    ("quantship.quantize_onnx.quantizer", "quantship.quantize_onnx.rounding"): "the rounding pass is torch's",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _layer_key(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The quantship modules an import statement loads (a name imported from a package that is a
    module of ours counts as that module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == ROOT]
    base = module.split(".")
    if MODULES[module].name != "__init__.py":
        base = base[:-1]
    if node.level:
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != ROOT:
        return []
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target for a in node.names]


def _comment_lines(source: str) -> set[int]:
    return {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT}


def _has_reason(body: list[ast.stmt], i: int, comments: set[int]) -> bool:
    """A comment on the line above the run of import statements holding ``body[i]``, or on one of its lines."""
    start = end = i
    while start > 0 and isinstance(body[start - 1], (ast.Import, ast.ImportFrom)):
        start -= 1
    while end + 1 < len(body) and isinstance(body[end + 1], (ast.Import, ast.ImportFrom)):
        end += 1
    return any(line in comments for line in range(body[start].lineno - 1, body[end].end_lineno + 1))


def _walk(module: str, body: list[ast.stmt], inside: bool, comments: set[int], found: list) -> None:
    for i, stmt in enumerate(body):
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            found.extend((t, stmt.lineno, inside, _has_reason(body, i, comments)) for t in _targets(module, stmt))
            continue
        if isinstance(stmt, ast.If) and not inside and "TYPE_CHECKING" in ast.unparse(stmt.test):
            _walk(module, stmt.orelse, inside, comments, found)  # annotations only: never run
            continue
        nested = isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for name in ("body", "orelse", "finalbody"):
            block = getattr(stmt, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                _walk(module, block, inside or nested, comments, found)
        for handler in getattr(stmt, "handlers", []):
            _walk(module, handler.body, inside, comments, found)
        for case in getattr(stmt, "cases", []):
            _walk(module, case.body, inside, comments, found)


def _imports() -> dict[str, list[tuple[str, int, bool, bool]]]:
    """Per module: every import of ours as (target, line, inside a function, with a reason comment)."""
    out = {}
    for module, path in MODULES.items():
        source = path.read_text()
        found: list = []
        _walk(module, ast.parse(source).body, False, _comment_lines(source), found)
        out[module] = found
    return out


IMPORTS = _imports()


def test_every_module_has_a_layer():
    assert [m for m in MODULES if m != ROOT and _layer_key(m) not in LAYERS] == []


def test_imports_flow_down_the_layers():
    upward = []
    for module, found in IMPORTS.items():
        if module == ROOT:
            assert {t for t, *_ in found} <= {"quantship.lazy"}, found  # the root only loads names lazily
            continue
        mine = _layer_key(module)
        for target, line, *_ in found:
            theirs = _layer_key(target)
            if target == ROOT or theirs == mine:
                continue
            if LAYERS[theirs] >= LAYERS[mine]:
                upward.append(f"{module}:{line} imports {target}")
    assert upward == []


def _job(module: str) -> str | None:
    return ".".join(module.split(".")[:3]) if module.startswith(f"{INSPECT}.") else None


def test_every_inspect_module_lives_in_one_job():
    assert [m for m in MODULES if m.startswith(f"{INSPECT}.") and _job(m) not in INSPECT_JOBS] == []


def test_inspect_jobs_import_only_the_jobs_below():
    upward = [f"{m}:{line} imports {t}" for m, found in IMPORTS.items() if _job(m) in INSPECT_JOBS
              for t, line, *_ in found if _job(t) in INSPECT_JOBS and INSPECT_JOBS[_job(t)] > INSPECT_JOBS[_job(m)]]
    assert upward == []


def test_nothing_imports_the_cli():
    outside = [f"{m}:{line} imports {t}" for m, found in IMPORTS.items() if not m.startswith(("quantship.cli", "quantship.__main__"))
               for t, line, *_ in found if t.startswith("quantship.cli")]
    assert outside == []


def test_no_import_cycle_counting_imports_inside_functions():
    graph = {m: {t for t, *_ in found if t in MODULES and t != m} for m, found in IMPORTS.items()}
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    assert cycles == []


def test_function_level_imports_only_where_listed_and_each_with_its_reason():
    late = [(m, t, line, reason) for m, found in IMPORTS.items() for t, line, inside, reason in found if inside]
    outside_cli = {(m, t) for m, t, _, _ in late if not m.startswith("quantship.cli")}
    assert outside_cli == set(LATE_OUTSIDE_CLI)
    unexplained = [f"{m}:{line} imports {t}" for m, t, line, reason in late
                   if not reason and m.startswith("quantship.cli")]
    assert unexplained == []


# A target is defined in one module of ``quantship.targets``; elsewhere its name is never compared (==, !=,
# in, a dict key, a table of names, a match case): code reads the ``Target``'s fields instead. The CLI's
# argument parsing (``add_arguments``) may name targets; these strings mean something else where listed.
TARGET_NAMES = frozenset({"onnxruntime-cpu", "onnxruntime", "tensorrt", "openvino", "tigris"})
TARGET_CONSTANTS = frozenset({"ORT_CPU"})
NOT_A_TARGET_NAME: dict[tuple[str, str], str] = {
    ("quantship.cli.main", "onnxruntime"): "the Python package an exception came from (a runtime's own error)",
    ("quantship.cli.main", "openvino"): "the Python package an exception came from (a runtime's own error)",
}


def _target_names_in(node: ast.AST) -> list[str]:
    """The target names a comparison operand, dict key or table literal spells (strings or ORT_CPU)."""
    if isinstance(node, ast.Constant) and node.value in TARGET_NAMES:
        return [node.value]
    if isinstance(node, ast.Name) and node.id in TARGET_CONSTANTS or \
            isinstance(node, ast.Attribute) and node.attr in TARGET_CONSTANTS:
        return [ast.unparse(node)]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [name for element in node.elts for name in _target_names_in(element)]
    return []


def compared_target_names(source: str, parsing_allowed: bool = False) -> list[tuple[int, str]]:
    """(line, name) of each target name compared in ``source`` (inside an ``add_arguments`` function
    too, unless ``parsing_allowed``)."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if parsing_allowed and isinstance(node, ast.FunctionDef) and node.name.startswith("add_") \
                and node.name.endswith(("arguments", "argument")):
            return
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.Dict):
            operands = [key for key in node.keys if key is not None]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            operands = [node]
        elif isinstance(node, ast.MatchValue):
            operands = [node.value]
        else:
            operands = []
        found.extend((node.lineno, name) for operand in operands for name in _target_names_in(operand))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return sorted(set(found))


def test_the_architecture_test_sees_a_compared_target_name():
    assert compared_target_names("if t.target == 'tigris':\n    pass") == [(1, "tigris")]
    assert compared_target_names("ok = name not in ('tensorrt', 'openvino')") == [(1, "openvino"), (1, "tensorrt")]
    assert compared_target_names("RUNNERS = {ORT_CPU: run}") == [(1, "ORT_CPU")]
    assert compared_target_names("x = p.target != precision.ORT_CPU") == [(1, "precision.ORT_CPU")]
    assert compared_target_names("def f(target='tigris'):\n    return get(target)") == []  # a default, not a test
    parse = "def add_arguments(p):\n    if d == 'tigris':\n        pass"
    assert compared_target_names(parse, parsing_allowed=True) == [] and compared_target_names(parse) == [(2, "tigris")]


def test_no_target_name_is_compared_outside_targets():
    found = []
    for module, path in MODULES.items():
        if module == "quantship.targets" or module.startswith("quantship.targets."):
            continue
        hits = compared_target_names(path.read_text(), parsing_allowed=module.startswith("quantship.cli"))
        found += [f"{module}:{line} compares {name!r}" for line, name in hits
                  if (module, name) not in NOT_A_TARGET_NAME]
    assert found == []


# each algorithm's format-neutral part: no front-end, no model capture, no graph IR
ALGORITHMS = "quantship.quantize.algorithms"
FRONT_END_LIBRARIES = ("torch.export", "torch.fx", "torchao", "onnx", "onnx_ir", "onnxruntime", "onnxscript")


def _third_party(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
    return found


def test_algorithms_import_no_front_end():
    modules = [m for m in MODULES if m.startswith(ALGORITHMS)]
    assert len(modules) >= 5, modules  # the package exists and holds the shared algorithms
    ours = [(m, t) for m in modules for t, *_ in IMPORTS[m]
            if t.startswith(("quantship.quantize.", "quantship.quantize_onnx", "quantship.export", "quantship.inspect"))
            and not t.startswith(ALGORITHMS)]
    assert ours == []
    libraries = [(m, lib) for m in modules for lib in _third_party(MODULES[m])
                 if lib == "onnx" or lib.startswith(FRONT_END_LIBRARIES)]
    assert libraries == []


CLI_MAX_LINES = 250  # the CLI parses, calls one library function and prints: nothing more fits a module


def test_every_cli_module_is_at_most_250_lines():
    long = {p.name: n for p in sorted((PACKAGE / "cli").glob("*.py"))
            if (n := len(p.read_text().splitlines())) > CLI_MAX_LINES}
    assert long == {}, f"move flow logic into the library: {long}"
