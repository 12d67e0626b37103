"""A GPU's linear layers at a decode step's few rows through the project's Triton kernel
(triton_gemv.py), where it is faster than cuBLAS: `fuse_few_rows` times both per layer shape and
row count, each over every layer of that shape in one run (the engine's timer replays it from a
CUDA graph: as a decode step reads the layers, one after another, never from a warm cache), and
swaps the layers whose shape it won at some row count.
A swapped layer takes the kernel at the row counts it won and cuBLAS at any other; nanogpt/layers.py
`project` lets it apply its GELU or ReLU in the same pass (its `fused`).

A layer fed by a layer norm (a block's `norm_fed`: the attention's q, k, v projection, the MLP's first
matmul) may also take the kernel that normalizes its rows as it reads them (`norm_linear`), in place
of the norm's kernel and its own: `fuse_norm_linears` times the two against the one, and
nanogpt/layers.py `norm_project` calls the layer's `norm_fused`. A model's layers import none of this.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn as nn
from torch.nn import functional as F

from nanogpt.kernels import triton_gemv
from nanogpt.kernels.epilogue import activation_name
from nanogpt.kernels.triton_gemv import MAX_ROWS, Config, block_rows

log = logging.getLogger(__name__)

ROW_COUNTS = (1, 2, 4, 8)  # the row blocks timed: a step of 3 rows takes the kernel of 4
_timed: dict[tuple, Config | None] = {}  # (out, in, dtype, bias, device, rows) -> what `fastest` found


class FewRows:
    """What a swapped linear layer adds to its class: its forward and `fused` take the kernel at the
    row blocks of `kernel_rows` (rows rounded up to a power of two -> the block sizes it won with)."""

    kernel_rows: dict[int, Config] = {}
    norm_rows: dict[int, Config] = {}  # the same for `norm_fused`

    def _config(self, x: torch.Tensor, table: dict[int, Config] | None = None) -> Config | None:
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or x.dtype != self.weight.dtype:
            return None
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return (self.kernel_rows if table is None else table).get(block_rows(rows)) if 0 < rows <= MAX_ROWS else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        config = self._config(x)
        if config is None:
            return super().forward(x)
        y = triton_gemv.linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias, None, config)
        return y.view(*x.shape[:-1], self.out_features)

    def fused(self, x: torch.Tensor, activation: nn.Module | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """activation(self(x)) by the kernel; elsewhere what the layer's own class fuses (None: nothing)."""
        config, name = self._config(x), activation_name(activation)
        if config is None or residual is not None or name is False:
            parent = getattr(super(), "fused", None)
            return parent(x, activation, residual) if parent is not None else None
        y = triton_gemv.linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias, name, config)
        return y.view(*x.shape[:-1], self.out_features)


    def norm_fused(self, x: torch.Tensor, y: torch.Tensor | None, norm: nn.Module,
                   activation: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x + y, activation(self(norm(x + y)))) by one kernel (x without y); None where it does not
        apply: a row block it was not chosen for, a norm that is no affine nn.LayerNorm of the rows'
        dtype, an activation with no epilogue here."""
        config, name = self._config(x, self.norm_rows), activation_name(activation)
        if config is None or name is False or not _affine(norm, x) or (y is not None and (y.shape != x.shape or y.dtype != x.dtype)):
            return None
        width = x.shape[-1]
        total, out = triton_gemv.norm_linear(x.reshape(-1, width), None if y is None else y.reshape(-1, width),
                                             norm.weight, norm.bias, norm.eps, self.weight, self.bias, name, config)
        return total.view(x.shape), out.view(*x.shape[:-1], self.out_features)


def _affine(norm: nn.Module, like: torch.Tensor) -> bool:
    """Whether `norm` is an affine nn.LayerNorm the kernel reads for rows like `like` (its width, its dtype)."""
    return isinstance(norm, nn.LayerNorm) and norm.weight is not None and norm.normalized_shape == (like.shape[-1],) \
        and norm.weight.dtype == like.dtype


@functools.cache
def _few_rows(cls: type) -> type:
    return type(f"FewRows{cls.__name__}", (FewRows, cls), {})


@torch.no_grad()
def fuse_few_rows(model: nn.Module, timer, row_counts=ROW_COUNTS) -> dict[str, dict[int, str]]:
    """Swap every nn.Linear of `model` on a GPU whose shape the kernel serves faster than cuBLAS at
    some of `row_counts`, as `timer(run)` times a run (in place: the module's class changes, its
    parameters stay). Returns, per shape "out x in dtype", the kernel's blocks at each row count it won."""
    groups: dict[tuple, list[nn.Linear]] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear) and not isinstance(module, FewRows) and module.weight.is_cuda \
                and module.weight.stride(1) == 1:
            key = (module.out_features, module.in_features, module.weight.dtype, module.bias is not None)
            groups.setdefault(key, []).append(module)
    if not groups or not triton_gemv.available():
        return {}
    chosen = {}
    for (n, k, dtype, bias), layers in groups.items():
        won = {}
        for rows in row_counts:
            device = layers[0].weight.device
            key = (n, k, dtype, bias, device, rows)
            if key not in _timed:  # once per process: an engine built again over the same model finds it
                try:
                    with torch.cuda.device(device):  # graphs record on the current device
                        _timed[key] = fastest(layers, rows, timer)
                except Exception as err:  # timing cuBLAS itself failed: the layers stay as they are
                    log.warning("timing the few-row matmuls failed; cuBLAS serves them",
                                extra={"shape": (n, k), "rows": rows, "error": f"{type(err).__name__}: {err}"})
                    _timed[key] = None
            config = _timed[key]
            if config is not None:
                won[block_rows(rows)] = config
        if won:
            for module in layers:
                module.__class__ = _few_rows(type(module))
                module.kernel_rows = won
            chosen[f"{n}x{k} {str(dtype).removeprefix('torch.')}"] = {r: "n{}k{}w{}".format(*c) for r, c in won.items()}
    return chosen


def describe(model: nn.Module) -> str | None:
    """The layers that take the kernel, by shape, and at which row blocks (None: none), for a log line."""
    shapes: dict[tuple[str, str], set[int]] = {}
    for module in model.modules():
        if isinstance(module, FewRows):
            for kind, rows in (("few-row kernel", module.kernel_rows), ("norm-fed kernel", module.norm_rows)):
                if rows:
                    shapes.setdefault((f"{module.out_features}x{module.in_features}", kind), set()).update(rows)
    return "; ".join(f"{shape} {kind} at {','.join(map(str, sorted(rows)))} rows"
                     for (shape, kind), rows in shapes.items()) or None


def fastest(layers: list[nn.Linear], rows: int, timer) -> Config | None:
    """The kernel's fastest blocks for `rows` rows through `layers` (one shape), where faster than
    cuBLAS's F.linear and giving what it gives; None where cuBLAS is as fast, or the kernel fails
    or disagrees (said in the log). timer(run): how long run() takes."""
    first = layers[0]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, first.in_features, generator=generator).to(first.weight.device, first.weight.dtype)
    want = F.linear(x, first.weight, first.bias).float()
    close = dict(rtol=1e-4, atol=1e-4) if first.weight.dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    return _fastest("few-row matmul", {"shape": tuple(first.weight.shape), "rows": rows}, triton_gemv.configs(rows),
                    timer(lambda: [F.linear(x, m.weight, m.bias) for m in layers]),
                    lambda c: torch.allclose(triton_gemv.linear(x, first.weight, first.bias, None, c).float(), want, **close),
                    lambda c: timer(lambda: [triton_gemv.linear(x, m.weight, m.bias, None, c) for m in layers]))


def _fastest(kernel: str, what: dict, candidates: list[Config], baseline: float, agrees, took) -> Config | None:
    """The fastest of a kernel's `candidates` blocks where faster than `baseline` (the layers as they
    are, in seconds): each run once against them (agrees(config)), then timed (took(config)); one
    that disagrees or fails to run (a Triton or GPU that cannot build or run those blocks) is said
    in the log and not taken."""
    best, best_time = None, baseline
    for config in candidates:
        where = {**what, "config": tuple(config)}
        try:
            if not agrees(config):
                log.warning(f"the {kernel} kernel disagreed with the layers as they are; not taken", extra=where)
                continue
            seconds = took(config)
        except Exception as err:
            log.warning(f"the {kernel} kernel failed to run; not taken", extra={**where, "error": f"{type(err).__name__}: {err}"})
            continue
        if seconds < best_time:
            best, best_time = config, seconds
    return best


@torch.no_grad()
def fuse_norm_linears(model: nn.Module, timer, served, row_counts=ROW_COUNTS) -> dict[str, dict[int, str]]:
    """Give the linear layers of `model` on a GPU fed by a layer norm (its blocks' `norm_fed()`:
    (norm, layer, activation) each) the kernel that normalizes as it reads, at the row counts where
    it runs faster than the norm's add-and-norm and the layer as they are (after fuse_layer_norms and
    fuse_few_rows), timed by `timer(run)` over every such layer of a shape at once. served(x, y, norm,
    layer, activation) -> (x + y, activation(layer(norm(x + y)))) as they serve: nanogpt/layers.py
    `norm_project`, which the caller passes (the kernels import no layer). Returns, per shape
    "out x in dtype", the kernel's blocks at each row count it won."""
    groups: dict[tuple, list[tuple]] = {}
    for module in model.modules():
        for norm, layer, activation in getattr(module, "norm_fed", lambda: ())():
            if isinstance(layer, nn.Linear) and layer.weight.is_cuda and layer.weight.stride(1) == 1 \
                    and _affine(norm, layer.weight) and activation_name(activation) is not False:
                key = (layer.out_features, layer.in_features, layer.weight.dtype, layer.bias is not None,
                       norm.bias is not None, activation_name(activation))
                groups.setdefault(key, []).append((norm, layer, activation))
    if not groups or not triton_gemv.available():
        return {}
    chosen = {}
    for (n, k, dtype, *_), fed in groups.items():
        won = {}
        for rows in row_counts:
            device = fed[0][1].weight.device
            try:
                with torch.cuda.device(device):
                    config = fastest_norm(fed, rows, timer, _norm_candidates(fed[0][1], rows), served)
            except Exception as err:  # timing the layers as they are failed: they stay so
                log.warning("timing the norm-fed matmuls failed; the norm runs on its own",
                            extra={"shape": (n, k), "rows": rows, "error": f"{type(err).__name__}: {err}"})
                config = None
            if config is not None:
                won[block_rows(rows)] = config
        if won:
            for _, layer, _ in fed:
                if not isinstance(layer, FewRows):
                    layer.__class__ = _few_rows(type(layer))
                layer.norm_rows = won
            chosen[f"{n}x{k} {str(dtype).removeprefix('torch.')}"] = {r: "n{}k{}w{}".format(*c) for r, c in won.items()}
    return chosen


def _norm_candidates(layer: nn.Module, rows: int) -> list[Config]:
    """The blocks the norm-fed kernel is timed with at `rows` rows: those the layer's own few-row kernel
    won with there (the same reads of the weight), else the first two that fit. Each variant is a
    Triton compile at a machine's first start, which trying every block would multiply."""
    won = layer.kernel_rows.get(block_rows(rows)) if isinstance(layer, FewRows) else None
    return [won] if won is not None else triton_gemv.configs(rows)[:2]


def fastest_norm(fed: list[tuple], rows: int, timer, candidates: list[Config], served) -> Config | None:
    """The fastest of the norm-fed kernel's `candidates` blocks for `rows` rows through `fed` ((norm,
    layer, activation) of one shape), where faster than the norms and layers as they serve
    (`served`, as fuse_norm_linears takes it), and giving what those give; None otherwise (a kernel
    that fails or disagrees is said in the log)."""
    norm, first, activation = fed[0]
    generator = torch.Generator().manual_seed(0)
    x, y = (torch.randn(rows, first.in_features, generator=generator).to(first.weight.device, first.weight.dtype)
            for _ in range(2))
    total, want = served(x, y, norm, first, activation)
    want = want.float()
    close = dict(rtol=1e-4, atol=1e-4) if first.weight.dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    name = activation_name(activation)

    def fused(config, layers=fed):
        return [triton_gemv.norm_linear(x, y, n.weight, n.bias, n.eps, layer.weight, layer.bias, name, config)
                for n, layer, _ in layers]

    def agrees(config):
        (got_total, got), = fused(config, fed[:1])
        return torch.allclose(got_total.float(), total.float(), **close) and torch.allclose(got.float(), want, **close)

    return _fastest("norm-fed matmul", {"shape": tuple(first.weight.shape), "rows": rows}, candidates,
                    timer(lambda: [served(x, y, n, layer, a) for n, layer, a in fed]),
                    agrees, lambda config: timer(lambda: fused(config)))
