"""bench/ calls quantship's public API only (docs/layout.md, "Public names"), read with ``ast``.

A name is public when it is in the ``__all__`` of one of ``PUBLIC_PACKAGES``, or is a public
package itself, or is a name without a leading underscore of a built-in example module
(``quantship.examples`` and ``quantship.examples.real``, and the modules in them). Every import
of every bench script counts, at module level and inside functions. bench/_*.py are bench's own
modules and may be imported freely. A second test checks that each public name a script imports
is defined where the package's table of names says (read from the source, nothing imported but the
light package ``__init__`` files), so a renamed function fails here rather than in a bench run.
"""

from __future__ import annotations

import ast
import functools
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SRC = ROOT / "src"

# the packages that declare a public surface in __all__ (keep in step with docs/layout.md)
PUBLIC_PACKAGES = ("quantship", "quantship.quantize", "quantship.inspect", "quantship.export", "quantship.quantize_onnx",
                   "quantship.targets", "quantship.progress")
EXAMPLES = ("quantship.examples", "quantship.examples.real")


@functools.cache
def _module_path(module: str) -> Path | None:
    base = SRC.joinpath(*module.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def _is_example_module(module: str) -> bool:
    return any(module == e or module.startswith(e + ".") for e in EXAMPLES) and _module_path(module) is not None


def _is_public_module(module: str) -> bool:
    return module in PUBLIC_PACKAGES or _is_example_module(module)


def _public(module: str, name: str) -> bool:
    """Is ``from module import name`` an import of a public name?"""
    if _is_public_module(f"{module}.{name}"):
        return True
    if module in PUBLIC_PACKAGES:
        return name in getattr(importlib.import_module(module), "__all__", ())
    return _is_example_module(module) and not name.startswith("_")


@functools.cache
def _bench_imports() -> tuple[tuple[str, int, str, str | None]]:
    """Every import of quantship in bench/*.py: (file, line, module, name or None for ``import module``)."""
    found = []
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(path.name, node.lineno, a.name, None) for a in node.names
                          if a.name.split(".")[0] == "quantship"]
            elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "quantship":
                found += [(path.name, node.lineno, node.module, a.name) for a in node.names]
    return tuple(found)


def _offenders() -> list[str]:
    out = []
    for file, line, module, name in _bench_imports():
        public = (module == "quantship" or _is_public_module(module)) if name is None else _public(module, name)
        if not public:
            out.append(f"bench/{file}:{line}: " + (f"import {module}" if name is None else f"from {module} import {name}"))
    return out


def test_the_check_sees_bench_imports():
    imports = _bench_imports()
    assert len(imports) > 100 and any(name == "Quantizer" for *_, name in imports)
    assert not _public("quantship.inspect.run.consumers", "ort_session")
    assert not _public("quantship.quantize_onnx.quantizer", "quantize_onnx_file")
    assert _public("quantship.quantize_onnx", "quantize_onnx_file")
    assert _public("quantship.examples.real", "mtcnn") and not _public("quantship.examples.real", "_nothing")


def test_bench_imports_only_public_names():
    offenders = _offenders()
    assert not offenders, "bench imports names outside the public API (docs/layout.md):\n" + "\n".join(offenders)


@functools.cache
def _top_level_names(module: str) -> set[str]:
    """Names a module's source defines or imports at top level (its ``if``/``try`` blocks included)."""
    path = _module_path(module)
    assert path is not None, f"{module}: no such module under src/"
    names: set[str] = set()
    body = list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try)):
            body += node.body + node.orelse + getattr(node, "finalbody", [])
            body += [s for h in getattr(node, "handlers", []) for s in h.body]
    return names


@functools.cache
def _lazy_table(module: str) -> dict[str, str]:
    """A package's table of public name -> defining module (``_PUBLIC``, quantship/lazy.py), read from its source."""
    for node in ast.parse(_module_path(module).read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == "_PUBLIC" and node.value is not None:
            return ast.literal_eval(node.value)
    return {}


def _defining(module: str, name: str) -> str:
    """The module that defines ``name``, following the tables (a package's table may name another package)."""
    seen = {module}
    while name in _lazy_table(module):
        module = _lazy_table(module)[name]
        assert module not in seen, f"{name}: the tables of {sorted(seen)} name each other"
        seen.add(module)
    return module


def test_every_public_name_bench_imports_is_defined_where_its_table_says():
    missing = []
    for file, line, module, name in _bench_imports():
        if name is None or _module_path(f"{module}.{name}") is not None:
            continue  # a module: its existence under src/ is what _is_public_module checked
        defining = _defining(module, name)
        if name not in _top_level_names(defining):
            missing.append(f"bench/{file}:{line}: {name} is not defined in {defining}")
    assert not missing, "\n".join(missing)


def test_every_name_of_a_public_table_is_defined_where_it_says():
    missing = []
    for package in PUBLIC_PACKAGES:
        for name in _lazy_table(package):
            defining = _defining(package, name)
            if name not in _top_level_names(defining):
                missing.append(f"{package}.{name}: not defined in {defining}")
    assert not missing, "\n".join(missing)
