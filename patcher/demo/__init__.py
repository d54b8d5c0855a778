"""The demo: a real vLLM 0.16.0 (CPU build) environment with speculators 0.3.0, a tiny Llama made
on the spot (patcher/run_check/tiny_model.py, cached by model_cache), and the driver that extracts
hidden states and checks them against transformers (patcher/run_check/extract.py).

`environment` and `model_cache` use only the standard library and run in patcher's interpreter.
The tiny MoE checkpoints the GPU bench and the tests run are made by workbench/tiny_moe.py, a
checkout's tool (not installed), with model_cache.
"""
