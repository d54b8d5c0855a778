"""v17's local causal-mask function against transformers' own `_prepare_4d_causal_attention_mask`,
in the vLLM 0.16 environment (transformers 4.57.6 still has it): the same mask, bit for bit, for
padded batches, a KV cache offset and a sliding window."""

from __future__ import annotations

import subprocess

import pytest

from patcher.patches.v17_attn_mask_utils import FALLBACK

pytestmark = pytest.mark.vllm

PROBE = """
import torch
from transformers.modeling_attn_mask_utils import _prepare_4d_causal_attention_mask as real
namespace = {"torch": torch}
exec(FALLBACK.split("except ImportError:", 1)[1].split("\\n", 1)[1].replace("\\n    ", "\\n").strip(), namespace)
ours = namespace["_prepare_4d_causal_attention_mask"]
torch.manual_seed(0)
checked = 0
for dtype in (torch.float32, torch.bfloat16):
    for batch, length, past in ((1, 5, 0), (3, 7, 0), (2, 4, 6)):
        for window in (None, 3):
            embeds = torch.zeros(batch, length, 8, dtype=dtype)
            mask = (torch.rand(batch, past + length) > 0.3).long()
            mask[:, -1] = 1
            for attention_mask in (mask, None):
                expected = real(attention_mask, (batch, length), embeds, past, sliding_window=window)
                got = ours(attention_mask, (batch, length), embeds, past, sliding_window=window)
                assert got.dtype == expected.dtype and got.shape == expected.shape, (got.shape, expected.shape)
                assert torch.equal(got, expected), (dtype, batch, length, past, window, got, expected)
                checked += 1
print(checked)
"""


def test_fallback_mask_equals_transformers_own():
    from patcher.demo.environment import build_demo_env

    python = build_demo_env(progress=lambda message: None)
    proc = subprocess.run(
        [str(python), "-c", f"FALLBACK = {FALLBACK!r}\n" + PROBE], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.strip().splitlines()[-1]) == 24
