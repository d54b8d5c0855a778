"""The demo: a real vLLM 0.16.0 (CPU build) environment with speculators 0.3.0, a tiny Llama made
on the spot, and a driver that extracts hidden states and checks them against transformers.

`environment` and the host-side helpers of `tiny_model` use only the standard library and run in
patcher's interpreter; `tiny_model` (as a script) and `extract` run inside the demo environment.
"""
