"""bench/zoo.py's records file: a model name two families share (efficientnet_b0 is in torchvision and timm)
keeps one record per family, saved and rendered in its own section."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))  # bench/zoo.py imports its siblings (_zoo_families, _zoo_render) by name

import zoo  # noqa: E402


def test_a_name_two_families_share_keeps_a_record_in_each(tmp_path):
    path = tmp_path / "zoo_results.json"
    order = [(family, model) for family, names in zoo.zoos().items() for model in names]
    torchvision_row = zoo.ZooRow("efficientnet_b0", 5.3, 32, family="torchvision", lsb_literal=0.0, seconds=21.0)
    timm_row = zoo.ZooRow("efficientnet_b0", 4.0, 32, family="timm", lsb_literal=1.0, seconds=56.0)
    zoo.save_records([torchvision_row], order, path)
    records = zoo.save_records([timm_row], order, path)  # the second family's save must not replace the first's
    assert records == zoo.load_records(path)
    assert records[("torchvision", "efficientnet_b0")] == torchvision_row
    assert records[("timm", "efficientnet_b0")] == timm_row
    text = zoo.render_all(records)
    torchvision_part, timm_part = text.split("\n## timm\n")[0], text.split("\n## timm\n")[1].split("\n## hf\n")[0]
    assert "| efficientnet_b0 | 5.3 | 32 | " in torchvision_part and "| efficientnet_b0 | 4.0 |" not in torchvision_part
    assert "| efficientnet_b0 | 4.0 | 32 | " in timm_part and "| efficientnet_b0 | 5.3 |" not in timm_part
