"""Pallas GPU kernels behind jattn. Each kernel family lives in its own sub-package."""
