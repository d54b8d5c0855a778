"""Which patches exist: the index of declarations kept on disk (declarations) and loading
them by id, in canonical order (registry). What one patch is: patcher/model.py."""
