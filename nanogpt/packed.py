"""Moved to nanogpt/kernels.py (which now chooses among several packed kernels per machine);
this name stays until worker/engine.py imports `pack_linears` from there."""
from nanogpt.kernels import pack_linears  # noqa: F401
