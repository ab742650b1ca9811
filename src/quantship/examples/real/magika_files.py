"""magika 1.0.3's file-type model (``standard_v3_3``): what kind of file is this?

Task: files found on this machine (the Python standard library, the running environment's
site-packages, ``/usr/share``, ``/usr/lib``, ``/usr/include``, ``/etc``), with a label from an
unambiguous extension (``.py`` -> python, ``.so`` -> elf, ``.gz`` -> gzip ...; a table below, every
label one of magika's own). Files are drawn round-robin over labels with a seeded generator, so
no label dominates. Features are magika's own (``Magika._extract_features_from_seekable`` with
the model's config: first and last 1,024 bytes after stripping whitespace, padding token 256);
a file too small for the model (magika answers those without it) is left out. The score is the
model's top-1 label (before magika's thresholds and overwrite map), against the extension's label,
and against FP32. Only the list of paths and the feature array are written, under the cache folder.
"""

from __future__ import annotations

import functools
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quantship.examples.real import Count, data_dir, package_file, require, save_npz

MODULE = "magika"
MODEL_FILE = "models/standard_v3_3/model.onnx"
CONFIG_FILE = "models/standard_v3_3/config.min.json"
_VERSION = 1

# extension -> magika label; only extensions whose content type is not in doubt
EXTENSION_LABELS = {
    ".py": "python", ".pyc": "pythonbytecode", ".json": "json", ".html": "html", ".htm": "html", ".png": "png",
    ".so": "elf", ".gz": "gzip", ".c": "c", ".cpp": "cpp", ".cc": "cpp", ".js": "javascript", ".css": "css",
    ".xml": "xml", ".svg": "svg", ".yaml": "yaml", ".yml": "yaml", ".toml": "toml", ".md": "markdown",
    ".rst": "rst", ".sql": "sql", ".php": "php", ".pl": "perl", ".pm": "perl", ".sh": "shell", ".jar": "jar",
    ".whl": "zip", ".zip": "zip", ".deb": "deb", ".pdf": "pdf", ".jpg": "jpeg", ".jpeg": "jpeg", ".gif": "gif",
    ".java": "java", ".go": "go", ".rs": "rust", ".rb": "ruby", ".ts": "typescript", ".cmake": "cmake",
    ".xz": "xz", ".bz2": "bzip", ".tar": "tar", ".ttf": "ttf", ".otf": "otf", ".ico": "ico", ".bmp": "bmp",
    ".wav": "wav", ".csv": "csv", ".lua": "lua", ".tcl": "tcl", ".po": "po", ".npy": "npy", ".npz": "npz",
    ".onnx": "onnx", ".ipynb": "ipynb", ".pem": "pem", ".woff": "woff", ".woff2": "woff2", ".tiff": "tiff",
}


def model_path() -> Path:
    """magika's ONNX file inside the installed package."""
    return package_file(MODULE, MODEL_FILE)


@functools.cache
def config() -> dict:
    return json.loads(package_file(MODULE, CONFIG_FILE).read_text())


def labels_space() -> list[str]:
    """The model's output labels, in output order (magika's ``target_labels_space``)."""
    return list(config()["target_labels_space"])


def roots() -> list[Path]:
    """Where files are looked for, in this order."""
    found = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"]),
             Path("/usr/share"), Path("/usr/lib"), Path("/usr/include"), Path("/etc")]
    return [r for r in found if r.is_dir()]


def label_of(path: Path) -> str | None:
    name = path.name.lower()
    if ".so." in name and not name.endswith((".py", ".gz")):
        return "elf"  # libfoo.so.6
    return EXTENSION_LABELS.get(path.suffix.lower())


def candidates(where: list[Path] | None = None) -> dict[str, list[str]]:
    """Every regular file under ``where`` (default ``roots()``) with an extension label, by label, sorted,
    no duplicates."""
    seen: set[str] = set()
    by_label: dict[str, list[str]] = {}
    space = set(labels_space())
    min_size = config()["min_file_size_for_dl"]
    for root in where or roots():
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            for name in sorted(files):
                path = Path(folder) / name
                label = label_of(path)
                if label is None or label not in space or path.is_symlink():
                    continue
                try:
                    if not path.is_file() or path.stat().st_size < min_size or not os.access(path, os.R_OK):
                        continue
                except OSError:
                    continue
                key = str(path.resolve())
                if key not in seen:
                    seen.add(key)
                    by_label.setdefault(label, []).append(str(path))
    return {k: sorted(v) for k, v in sorted(by_label.items())}


def features(path: str | Path) -> np.ndarray | None:
    """magika's own feature extraction: 2,048 int32 (or None when magika would not run the model)."""
    require(MODULE)
    from magika import Magika
    from magika.types.seekable import Seekable

    cfg = config()
    with open(path, "rb") as stream:
        seekable = Seekable(stream)
        if seekable.size < cfg["min_file_size_for_dl"]:
            return None
        feats = Magika._extract_features_from_seekable(
            seekable, cfg["beg_size"], cfg["mid_size"], cfg["end_size"], cfg["padding_token"], cfg["block_size"],
            cfg["use_inputs_at_offsets"])
    if feats.beg[cfg["min_file_size_for_dl"] - 1] == cfg["padding_token"]:
        return None  # too few bytes after stripping: magika answers without the model
    return np.asarray(feats.beg[:cfg["beg_size"]] + feats.end[-cfg["end_size"]:], dtype=np.int32)


@dataclass(frozen=True)
class Files:
    """``x``: N x 2048 int32 (the model's ``bytes`` input); ``y``: index into ``labels_space()``; ``paths``."""

    x: np.ndarray
    y: np.ndarray
    paths: list[str]


def make_files(n: int, seed: int = 0, skip: int = 0, where: list[Path] | None = None) -> Files:
    """``n`` files drawn round-robin over labels (after the first ``skip`` of the same draw, so two
    calls with different ``skip`` ranges are disjoint), cached under ``cache_dir()/real/magika``.
    ``where``: folders to look in instead of ``roots()``."""
    import hashlib

    # The cache is keyed by the folders searched (a new venv or checkout has other paths) and is used only
    # while every file it names still exists: the cache folder outlives checkouts and upgraded packages.
    tag = hashlib.sha256("\n".join(map(str, where or roots())).encode()).hexdigest()[:8]
    path = data_dir("magika") / f"files_v{_VERSION}_seed{seed}_skip{skip}_n{n}_{tag}.npz"
    if path.exists():
        with np.load(path) as f:
            cached = Files(f["x"], f["y"], [str(p) for p in f["paths"]])
        if all(os.path.isfile(p) for p in cached.paths):
            return cached
    rng = np.random.default_rng([seed, 25])
    pools = {label: [paths[i] for i in rng.permutation(len(paths))] for label, paths in candidates(where).items()}
    space = {label: i for i, label in enumerate(labels_space())}
    xs, ys, chosen, kept = [], [], [], 0
    while len(chosen) < n and any(pools.values()):
        for label in list(pools):
            if not pools[label] or len(chosen) >= n:
                continue
            file = pools[label].pop(0)
            try:
                feats = features(file)
            except OSError:
                continue
            if feats is None:
                continue
            kept += 1
            if kept <= skip:
                continue
            xs.append(feats)
            ys.append(space[label])
            chosen.append(file)
    if len(chosen) < n:
        raise ValueError(f"only {len(chosen)} labelled files found on this machine under {where or roots()} "
                         f"(asked {n})")
    files = Files(np.stack(xs), np.asarray(ys, np.int64), chosen)
    save_npz(path, x=files.x, y=files.y, paths=np.asarray(chosen))
    return files


def accuracy(scores: np.ndarray, labels: np.ndarray) -> Count:
    """The model's top-1 label against the extension's label."""
    return Count(int((np.asarray(scores).argmax(-1) == labels).sum()), int(len(labels)))


def agreement(scores: np.ndarray, reference: np.ndarray) -> Count:
    return Count(int((np.asarray(scores).argmax(-1) == np.asarray(reference).argmax(-1)).sum()), int(len(scores)))
