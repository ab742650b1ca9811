"""GPTQ (Frantar et al. 2022) for grouped int4 weight-only Linear layers, written from the paper.

Per Linear, in the order the model runs them (sequential: each layer's inputs are those the
already-quantized earlier layers produce): the Hessian H = 2 X X^T / n of its inputs over the
calibration batches, dampened by 1% of its mean diagonal; the upper Cholesky factor of H^-1; then
the columns quantized in order, each one's error spread over the columns not yet quantized, with
lazy updates of ``BLOCK`` columns. A group's scale is chosen when its first column comes up, from
the weights as updated so far, by torchao's own ``choose_qparams_affine`` (symmetric, [-8, 7]):
the int4 grid and group layout of ``int4_weight_only``, so the result is exactly representable.

Columns are taken in their natural order (no act-order): a group is then a contiguous run of
columns quantized together, the layout torchao and both ONNX forms hold.

Memory: the Hessians (in_features^2 float64) of the layers reading one input (q/k/v: three) and one
weight copy at a time. One forward per such set of layers, stopped once their inputs are read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from quantship.errors import DataRefused

BLOCK = 128  # lazy batch update width (columns), at least one group
DAMPING = 0.01  # lambda, as a fraction of the mean diagonal of H
INT4_MIN, INT4_MAX = -8, 7


@dataclass(frozen=True)
class GptqWeight:
    """One layer's GPTQ result on the int4 grid: codes in [-8, 7] and one scale per group."""

    codes: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, K // group]
    group: int

    @property
    def dequantized(self) -> torch.Tensor:
        """codes * scale, float32 [N, K]: what torch multiplies by."""
        return self.codes.float() * self.scale.repeat_interleave(self.group, dim=1)


def group_scale(weights: torch.Tensor) -> torch.Tensor:
    """The scale torchao's int4 path chooses for one group of columns [N, group]: float32 [N, 1]."""
    from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine

    scale, _ = choose_qparams_affine(weights.float(), MappingType.SYMMETRIC, (1, weights.shape[1]),
                                     target_dtype=torch.int8, quant_min=INT4_MIN, quant_max=INT4_MAX,
                                     zero_point_dtype=torch.int8, keepdim=True)
    return scale.reshape(-1, 1).float()


def round_to_grid(column: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Codes of one column [N] on its group's scale [N], as torchao rounds (times the reciprocal)."""
    return torch.clamp(torch.round(column * (1.0 / scale)), INT4_MIN, INT4_MAX)


def rtn(weight: torch.Tensor, group: int) -> GptqWeight:
    """Round-to-nearest on the same grid (what ``int4_weight_only`` does without GPTQ): the baseline."""
    n, k = weight.shape
    scales = torch.cat([group_scale(weight[:, g:g + group]) for g in range(0, k, group)], dim=1)
    codes = torch.clamp(torch.round(weight.float() * (1.0 / scales.repeat_interleave(group, dim=1))),
                        INT4_MIN, INT4_MAX)
    return GptqWeight(codes.to(torch.int8), scales, group)


def inverse_cholesky(hessian: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor of (H + lambda I)^-1; dead inputs (zero diagonal) get a unit diagonal."""
    h = hessian.clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    damping = DAMPING * torch.diagonal(h).mean()
    for _ in range(4):  # a Hessian that is not positive definite after 1% gets 10x more, at most 3 times
        try:
            lower = torch.linalg.cholesky(h + damping * torch.eye(h.shape[0], dtype=h.dtype))
            inverse = torch.cholesky_solve(torch.eye(h.shape[0], dtype=h.dtype), lower)  # (cholesky_inverse is slow here)
            return torch.linalg.cholesky(inverse, upper=True)
        except torch.linalg.LinAlgError:
            damping = damping * 10
    raise DataRefused("GPTQ: the inputs' Hessian stays singular after 1000x damping; give more, or more "
                      "varied, calibration batches")


def quantize_weight(weight: torch.Tensor, hessian: torch.Tensor, group: int) -> GptqWeight:
    """GPTQ on one weight [N, K] with the Hessian of its inputs [K, K] (float64)."""
    n, k = weight.shape
    if k % group:
        raise ValueError(f"GPTQ: group {group} does not divide in_features {k}")
    block = max(BLOCK, group)  # groups are powers of two: a block holds whole groups
    u = inverse_cholesky(hessian).float()
    w = weight.detach().float().clone()
    codes = torch.zeros(n, k, dtype=torch.float32)
    scales = torch.zeros(n, k // group, dtype=torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the column loop is thousands of tiny ops: threads only add overhead
    try:
        for start in range(0, k, block):
            end = min(start + block, k)
            w_block = w[:, start:end].clone()
            errors = torch.zeros_like(w_block)
            u_block = u[start:end, start:end]
            for i in range(end - start):
                col = start + i
                if col % group == 0:  # a group starts: its scale from the weights as updated so far
                    scale = group_scale(w_block[:, i:i + group])[:, 0]
                    scales[:, col // group] = scale
                q = round_to_grid(w_block[:, i], scale)
                codes[:, col] = q
                err = (w_block[:, i] - q * scale) / u_block[i, i]
                w_block[:, i + 1:].addr_(err, u_block[i, i + 1:], alpha=-1)
                errors[:, i] = err
            w[:, end:].addmm_(errors, u[start:end, end:], alpha=-1)  # the lazy update of every later column
    finally:
        torch.set_num_threads(threads)
    return GptqWeight(codes.to(torch.int8), scales, group)


class _Captured(Exception):
    """Raised by an input hook once the next layers' inputs are read: the rest of the forward is not needed."""


def next_hessians(model: nn.Module, pending: dict[str, nn.Linear],
                  batches: list[torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
    """H = 2 X X^T / n (float64 [K, K]) and n for the next pending layers the model runs: the first one,
    and those after it that read the very same input tensor (q/k/v, gate/up), in one forward per batch."""
    sums: dict[str, torch.Tensor] = {}
    rows: dict[str, int] = {}
    first: list[torch.Tensor] = []  # the input tensor of the first pending layer in this batch

    def hook_for(name: str, k: int):
        def hook(_module, inputs):
            x = inputs[0]
            if first and x is not first[0]:
                raise _Captured
            first[:] = [x]
            flat = x.detach().reshape(-1, k).float()
            product = (flat.T @ flat).double()  # float32 products of one batch, summed over batches in float64
            sums[name] = sums[name] + product if name in sums else product
            rows[name] = rows.get(name, 0) + flat.shape[0]
        return hook

    handles = [layer.register_forward_pre_hook(hook_for(name, layer.in_features)) for name, layer in pending.items()]
    try:
        with torch.no_grad():
            for x in batches:
                first.clear()
                try:
                    model(x)
                except _Captured:
                    pass
    finally:
        for handle in handles:
            handle.remove()
    return {name: ((2.0 / rows[name]) * h, rows[name]) for name, h in sums.items()}


def quantize_layers(model: nn.Module, names: list[str], group: int, batches: list[torch.Tensor],
                    *, log: Callable[[str], None]) -> dict[str, GptqWeight]:
    """GPTQ on the Linear layers ``names`` of ``model``, in the order the model runs them.

    Each layer's float weight is replaced in ``model`` by its GPTQ weight before the Hessians of the
    layers after it are collected, so later layers see the quantized earlier ones. Returns the results.
    """
    if not batches:
        raise DataRefused("GPTQ needs calibration batches: pass calibration_dl to quantize()")
    modules = dict(model.named_modules())
    pending = {n: modules[n] for n in modules if n in set(names)}
    out: dict[str, GptqWeight] = {}
    passes = 0
    while pending:
        hessians = next_hessians(model, pending, batches)
        passes += 1
        if not hessians:
            raise DataRefused(f"GPTQ: layer(s) {sorted(pending)} never ran on the calibration batches, so they have "
                              "no Hessian; leave them float with a weight_bits dict or give inputs that reach them")
        for name, (hessian, _rows) in hessians.items():
            layer = pending.pop(name)
            result = quantize_weight(layer.weight, hessian, group)
            with torch.no_grad():
                layer.weight.copy_(result.dequantized.to(layer.weight.dtype))
            out[name] = result
    log(f"gptq: {len(out)} Linear layer(s) in {passes} calibration passes, groups of {group}, "
        f"{sum(b.shape[0] for b in batches)} calibration samples")
    return out
