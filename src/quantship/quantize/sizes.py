"""How many bytes a model's weights take on disk: the serialized state dict, measured."""

from __future__ import annotations

import io

import torch


def state_dict_size(model: torch.nn.Module) -> int:
    """Bytes of ``torch.save(model.state_dict())``, written to memory (what a checkpoint costs).

    Quantized modules serialize their packed int8 weights, so FP32 vs INT8 compares real files.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"state_dict_size() needs a torch.nn.Module, got {type(model).__name__}")
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.getbuffer().nbytes
