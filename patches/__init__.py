"""Patch declarations, one module per patch (installed as `patcher.patches`).

The registry finds every module named `vN_*` here; no hand-kept list.
"""
