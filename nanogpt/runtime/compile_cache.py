"""A compile cache that outlives the process, so that a second start of a compiled model takes
seconds instead of minutes.

torch.compile keeps what inductor generated for a graph in an on-disk cache (its FX graph cache
and AOTAutograd cache) keyed by the traced graph and its inputs' shapes and dtypes, not by the
weights' values. A later start traces the model again (dynamo, seconds) and loads the rest. Two
things defeat it, and this module takes care of both:

- where it lives: by default under /tmp/torchinductor_<user>, which a container or a reboot
  empties. `enable()` puts it under ~/.cache/nanoserve/torch-compile (or NANOSERVE_COMPILE_CACHE);
  a deployment keeps that directory on a volume. Inside it, a directory per version of the code
  that is traced (nanogpt/'s sources, `code_key`) and of torch: an entry written by older code could
  bring back its shape guards and narrow a new graph, so an upgrade never reads one.
- weight freezing (`torch._inductor.config.freezing`): a frozen graph's packed weights are
  oneDNN tensors, which the cache cannot store, so every start compiles from scratch. The packed
  kernels of nanogpt/kernels/ give a compiled graph the same prepacked matmuls without
  freezing (as the opaque op `nanoserve::linear`), so a compiled model should not freeze:
  `torch.compile(model.forward_decode)` after `pack_linears(model)` (nanogpt/kernels/planner.py) and `enable()`.
"""
from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

ENV = "NANOSERVE_COMPILE_CACHE"


def default_directory() -> Path:
    base = Path(os.environ.get(ENV) or Path.home() / ".cache" / "nanoserve" / "torch-compile")
    return base / code_key()


@functools.cache
def code_key(root: Path = Path(__file__).resolve().parent.parent) -> str:
    """torch's version and a hash of the model code's sources (every file under nanogpt/)."""
    import torch

    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cpp", ".h") and "__pycache__" not in p.parts):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return f"torch{torch.__version__.replace('+', '_')}-{digest.hexdigest()[:12]}"


def enable(directory: str | Path | None = None) -> Path:
    """Keep torch.compile's caches in `directory` (default: $NANOSERVE_COMPILE_CACHE, else
    ~/.cache/nanoserve/torch-compile), unless TORCHINDUCTOR_CACHE_DIR already names another than
    inductor's temporary default; switch the FX graph and AOTAutograd caches on. Call before the
    first compile. Returns the directory."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # inductor writes its default into the environment the first time it looks
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if directory is not None or chosen in (None, os.path.abspath(default_cache_dir())):
        path = Path(directory) if directory is not None else default_directory()
        path.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)  # read by inductor at each compile
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
