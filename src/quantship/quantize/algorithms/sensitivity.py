"""Per-layer sensitivity's format-neutral records: one quantized layer output's SQNR against float, with
what it reads upstream (so its own loss can be told from what it inherits), and the report over all of
them (worst rows, JSON, markdown, a PNG chart). The front-ends measure: ``quantize.layer_error`` on a
converted pt2e graph, ``quantize_onnx.sensitivity`` per node of a written file.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from quantship.fidelity import own_loss_db


@dataclass(frozen=True)
class LayerError:
    """One quantized layer output: graph position, names, and its SQNR against float."""

    order: int
    node: str
    module: str
    op: str
    sqnr_db: float
    upstream_db: float = math.inf  # the worst SQNR among the quantized layer outputs it reads (inf: none)
    # the name that keeps this output alone float or in 16 bits: its module when no other row is in it, else its op
    unit: str = ""

    @property
    def own_loss_db(self) -> float:
        """What this layer itself loses (``fidelity.own_loss_db``)."""
        return own_loss_db(self.upstream_db, self.sqnr_db)



@dataclass
class LayerErrorReport:
    """SQNR of every quantized layer output, in graph order, plus the model output's."""

    rows: list[LayerError]
    output_sqnr_db: float
    n_samples: int
    unmatched: list[str] = field(default_factory=list)

    def worst(self, k: int = 3) -> list[LayerError]:
        """The ``k`` rows with the lowest SQNR, worst first."""
        return sorted(self.rows, key=lambda r: r.sqnr_db)[:k]

    def as_dict(self) -> dict:
        return {"version": 1, "n_samples": self.n_samples, "output_sqnr_db": self.output_sqnr_db,
                "rows": [asdict(r) for r in self.rows], "worst": [r.node for r in self.worst()],
                "unmatched": list(self.unmatched)}

    def to_markdown(self, worst: int = 3) -> str:
        """A table in graph order; the ``worst`` lowest-SQNR rows are marked."""
        marked = {r.node for r in self.worst(worst)}
        lines = ["| # | node | module | op | SQNR (dB) |", "|---:|---|---|---|---:|"]
        for r in self.rows:
            flag = " **worst**" if r.node in marked else ""
            lines.append(f"| {r.order} | {r.node} | {r.module or '(top)'} | {r.op} | {r.sqnr_db:.1f}{flag} |")
        lines.append(f"\nmodel output SQNR: {self.output_sqnr_db:.1f} dB over {self.n_samples} sample(s)")
        return "\n".join(lines)

    def plot(self, path: str | Path, worst: int = 3) -> Path:
        """Write a PNG bar chart of SQNR per layer (graph order), the worst layers named."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        marked = {r.node for r in self.worst(worst)}
        values = [r.sqnr_db if math.isfinite(r.sqnr_db) else 99.0 for r in self.rows]
        colours = ["tab:red" if r.node in marked else "tab:blue" for r in self.rows]
        fig, ax = plt.subplots(figsize=(max(6.0, 0.25 * len(self.rows) + 2), 3.6))
        ax.bar(range(len(values)), values, color=colours)
        for i, r in enumerate(self.rows):
            if r.node in marked:
                ax.annotate(r.module or r.node, (i, values[i]), rotation=60, fontsize=7,
                            textcoords="offset points", xytext=(0, 3))
        ax.margins(y=0.25)
        ax.axhline(self.output_sqnr_db, color="grey", linestyle="--", linewidth=1, label="model output")
        ax.set_xlabel("quantized layer output (graph order)")
        ax.set_ylabel("SQNR vs float (dB)")
        ax.set_title(f"Per-layer SQNR, {self.n_samples} samples (worst in red)")
        ax.legend(loc="lower left", fontsize=8)
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
