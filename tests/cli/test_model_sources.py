"""Where `quantship quantize` gets a model's weights from (issue 16): files, hub names, pickles."""

from __future__ import annotations

import pytest
import torch

from quantship.errors import ModelRefused
from quantship.sources import load_model, weights_origin

FACTORY = (
    "import torch.nn as nn\n"
    "from blocks import head\n"  # a neighbour module: imported as when the file runs as a script
    "def build():\n"
    "    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), head())\n"
)
BLOCKS = "import torch.nn as nn\ndef head():\n    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))\n"


@pytest.fixture
def factory(tmp_path):
    (tmp_path / "blocks.py").write_text(BLOCKS)
    (tmp_path / "net.py").write_text(FACTORY)
    return f"{tmp_path / 'net.py'}:build"


def test_factory_imports_its_neighbours(factory):
    model = load_model(factory)
    assert isinstance(model[2][2], torch.nn.Linear) and not model.training


def test_state_dict_and_checkpoint_wrapper(factory, tmp_path):
    reference = load_model(factory)
    torch.save(reference.state_dict(), tmp_path / "sd.pt")
    torch.save({"state_dict": reference.state_dict(), "epoch": 3}, tmp_path / "ckpt.pt")
    for name in ("sd.pt", "ckpt.pt"):
        loaded = load_model(factory, str(tmp_path / name))
        assert torch.equal(loaded[0].weight, reference[0].weight)


def test_pickled_model_needs_trust(factory, tmp_path):
    reference = load_model(factory)
    torch.save(reference, tmp_path / "whole.pt")
    with pytest.raises(ModelRefused, match="--trust-pickle"):
        load_model(factory, str(tmp_path / "whole.pt"))
    trusted = load_model(factory, str(tmp_path / "whole.pt"), trust_pickle=True)
    assert torch.equal(trusted[0].weight, reference[0].weight)


def test_mismatched_and_garbage_weights_are_one_line_refusals(factory, tmp_path):
    torch.save({"nope": torch.zeros(1)}, tmp_path / "bad.pt")
    with pytest.raises(ModelRefused, match="cannot load"):
        load_model(factory, str(tmp_path / "bad.pt"))
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(ModelRefused, match="cannot read"):
        load_model(factory, str(tmp_path / "junk.pt"))


def test_torchvision_weight_names_from_the_local_hub_cache(tmp_path, monkeypatch):
    import torchvision

    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    with pytest.raises(ModelRefused, match=r"not in the local torch hub cache.*resnet18-f37072fd\.pth"):
        load_model("torchvision:resnet18", "IMAGENET1K_V1")
    with pytest.raises(ModelRefused, match="has no weights 'IMAGENET9K'"):
        load_model("torchvision:resnet18", "IMAGENET9K")
    # a file put where the refusal said is read (here: a state_dict we made, saved under that name)
    enum = torchvision.models.ResNet18_Weights.IMAGENET1K_V1
    cached = tmp_path / "hub" / "checkpoints" / enum.url.rsplit("/", 1)[1]
    cached.parent.mkdir(parents=True)
    state = torchvision.models.resnet18(weights=None).state_dict()
    state["fc.bias"] = torch.full_like(state["fc.bias"], 0.25)
    torch.save(state, cached)
    model = load_model("torchvision:resnet18", "DEFAULT")
    assert torch.all(model.fc.bias == 0.25)


def test_summary_says_random_weights():
    assert weights_origin("torchvision:resnet18", None).startswith("random weights")
    assert weights_origin("torchvision:resnet18", "sd.pt") == "sd.pt"
