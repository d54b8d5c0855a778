"""Transform: run the selected codemods over a file's source, all of a file's edits in one
libcst traversal (combined), with what each patch's run says (outcomes) and a cache keyed by
the code's fingerprint (transforms). The codemod base and shapes are patcher/codemod.py and
patcher/shapes.py: patches import them by name."""
