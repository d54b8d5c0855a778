"""The DeepSeek-V3 family on vLLM 0.16.0's CPU build: what the CPU can show of it.

The tiny DeepSeek-V3 and Kimi-K2.5 checkpoints of workbench/tiny_moe.py through the patched
speculators 0.3.0, as the GPU run (bench/gpu/gpu_run.py --models ...) takes them, with one
difference said here: vLLM's CPU build has no MLA ("MLA is not supported on CPU."), so these runs
set VLLM_MLA_DISABLE=1 and vLLM runs the same attention decompressed (DeepseekV2Attention: the
same q/kv projections, head size 192) instead of FLASH_ATTN_MLA. The MoE (grouped top-4 of 16
routed experts plus a shared one, vLLM's CPU MoE) and the wrapper are the ones the GPU runs.
Shown here: the wrapper's decoder is found (v20), every prompt comes back whole, in order, with
its own rows, matching transformers within the tolerance and the MoE median tolerance; without
v20 the guard refuses Kimi-K2.5 on 0.16 (it declares SupportsEagle3 only from vLLM 0.18).

Not shown on the CPU: MLA kernels, Triton or Marlin MoE, and the INT4 checkpoint's run (vLLM's CPU
build has no int4 MoE kernel: `'_OpNamespace' '_C' object has no attribute 'gptq_marlin_repack'`
while the workers process the loaded weights); here the INT4 checkpoint's packing is checked
against compressed-tensors' own decompression instead. docs/models.md has the GPU part.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support.e2e import error_of, extract, patch_as, rolled_back_overlay, summary

pytestmark = pytest.mark.vllm

CPU_ENV = {"VLLM_MLA_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


def checkpoint(demo_python: Path, kind: str) -> Path:
    from workbench.tiny_moe import ensure_tiny_moe

    return ensure_tiny_moe(demo_python, kind, progress=lambda message: None)


@pytest.fixture(scope="module")
def target(tmp_path_factory, demo_python: Path):
    with rolled_back_overlay(tmp_path_factory.mktemp("moe"), demo_python) as python:
        yield python


def assert_whole_in_order_and_matching(report: dict, calls: int) -> None:
    assert report["error"] is None, summary(report)
    assert len(report["calls"]) == calls
    for call in report["calls"]:
        for p in call["prompts"]:
            assert p["rows"] == [p["prompt_tokens"]] * len(report["layer_ids"]), (call["call"], p)
            assert p["input_ids_ok"] and p["status"] == "ok", (call["call"], p)
            assert p["max_rel_diff"] <= report["tolerance"], (call["call"], p)
    # a wrong MoE moves every row: the median is held to the checkpoint's own tolerance
    assert report["median_tolerance"] == 0.05 and report["median_rel_diff"] <= 0.05, report["median_rel_diff"]
    assert report["median_ok"] and report["ok"]


def test_deepseek_v3_every_prompt_whole_in_order_and_matching(target: Path, demo_python: Path):
    model = checkpoint(demo_python, "deepseek-v3")
    states = patch_as(target)
    assert states["v20"] == "applied" and states["v8"] == "applied", states
    # calls 1, 2 and 4: prefixes shared within and across calls, prompts repeated; call 3 (a batch
    # split across scheduler steps) is the GPU run's: here its transformers reference alone would
    # take minutes of the suite's budget
    report = extract(target, model, "1,2,4", "deepseek-v3 (cpu, MLA off)", env=CPU_ENV)
    assert_whole_in_order_and_matching(report, 3)


def test_kimi_k25_wrapper_decoder_is_found(target: Path, demo_python: Path):
    model = checkpoint(demo_python, "kimi-k25")
    patch_as(target)
    report = extract(target, model, "1,2", "kimi-k25 (cpu, MLA off)", env=CPU_ENV)
    assert report["reference"].endswith("reference")  # transformers' DeepseekV3 of the text weights
    assert_whole_in_order_and_matching(report, 2)


def test_kimi_k25_at_tensor_parallel_2(target: Path, demo_python: Path):
    """The wrapper, the MoE (16 routed experts split over two ranks, vLLM's CPU MoE with gloo) and
    the decompressed attention at tensor parallel 2: only rank 0 captures, and every prompt of the
    two calls still comes back whole, in order, matching transformers."""
    model = checkpoint(demo_python, "kimi-k25")
    patch_as(target)
    report = extract(target, model, "1,2", "kimi-k25 (cpu, MLA off) at TP 2", env=CPU_ENV, tensor_parallel=2)
    assert report["tensor_parallel_size"] == 2 and report["cpu_thread_binding"], report["cpu_thread_binding"]
    assert_whole_in_order_and_matching(report, 2)


def test_without_v20_kimi_k25_is_refused_before_vllm_0_18(target: Path, demo_python: Path):
    model = checkpoint(demo_python, "kimi-k25")
    patch_as(target, "v20")
    error = error_of(extract(target, model, "1", "kimi-k25 without v20", env=CPU_ENV))
    assert error["phase"] == "init", error
    assert "Model KimiK25ForConditionalGeneration does not support hidden state extraction" in error["message"]


DECOMPRESS = """
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
from compressed_tensors.compressors.quantized_compressors.pack_quantized import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs

model = Path(sys.argv[1])
config = json.loads((model / "config.json").read_text())
qc = config["text_config"]["quantization_config"]
args = QuantizationArgs(**qc["config_groups"]["group_0"]["weights"])
served = load_file(str(model / "model.safetensors"))
reference = load_file(str(model / "reference" / "model.safetensors"))
compressor = PackedQuantizationCompressor(config=None)
checked = 0
for name in [n for n in served if n.endswith(".weight_packed")]:
    base = name[: -len(".weight_packed")]
    data = {k: served[f"{base}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape")}
    weight = compressor.decompress_weight(data, quantization_args=args).to(torch.bfloat16)
    assert torch.equal(weight, reference[base.removeprefix("language_model.") + ".weight"]), name
    checked += 1
plain = [n for n in served if n.endswith(".weight") and ".mlp.experts." in n]
print(json.dumps({"checked": checked, "unquantized_experts": len(plain), "format": qc["format"]}))
"""


def test_int4_checkpoint_decompresses_to_its_reference(demo_python: Path):
    """The INT4 checkpoint as compressed-tensors itself reads it: every routed expert's packed
    weights decompress to exactly the reference's weights (the CPU build cannot run it)."""
    model = checkpoint(demo_python, "kimi-k25-int4")
    proc = subprocess.run([str(demo_python), "-c", DECOMPRESS, str(model)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # 3 MoE layers x 16 experts x gate/up/down; no routed expert left unquantized
    assert result == {"checked": 3 * 16 * 3, "unquantized_experts": 0, "format": "pack-quantized"}
