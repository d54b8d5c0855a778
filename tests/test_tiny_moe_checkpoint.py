"""The tiny DeepSeek-V3 checkpoint is the same file whichever transformers makes it, named as the
published checkpoints are (one gate/up/down projection per routed expert, what vLLM's loader
reads), and transformers 5 (which holds the experts fused) loads it to the same forward as
transformers 4. vLLM 0.26 on CUDA runs transformers 5 and refused the fused names
(`KeyError: 'layers.1.mlp.experts.down_proj'`).

Both demo environments are the suite's own (vLLM 0.16.0 with transformers 4.57, vLLM 0.32.0 with
transformers 5), cached.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from workbench import tiny_moe
from workbench.envs import demo_env

pytestmark = pytest.mark.vllm

TINY_MOE = Path(tiny_moe.__file__).resolve()

# Each python loads the checkpoint with its own transformers, runs one prompt in float32 and saves
# every layer's hidden states.
FORWARD = """
import sys, torch
from transformers import DeepseekV3ForCausalLM
model = DeepseekV3ForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
with torch.no_grad():
    out = model(torch.arange(3, 40).unsqueeze(0), output_hidden_states=True)
torch.save(list(out.hidden_states), sys.argv[2])
"""

COMPARE = """
import json, sys, torch
from safetensors.torch import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
same = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
h4, h5 = torch.load(sys.argv[3]), torch.load(sys.argv[4])
spread = max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(h5, h4))
print(json.dumps({"same": same, "names": sorted(a), "layers": len(h4), "spread": spread}))
"""


@pytest.fixture(scope="module")
def pythons() -> tuple[Path, Path]:
    return demo_env(), demo_env("0.32.0")


def run(python: Path, *args: str) -> str:
    done = subprocess.run([str(python), *args], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_one_checkpoint_under_transformers_4_and_5(pythons, tmp_path: Path):
    import json

    v4, v5 = pythons
    for name, python in (("t4", v4), ("t5", v5)):
        # run as a script in the demo environment, which has no patcher: given the tiny Llama's script
        run(python, str(TINY_MOE), "deepseek-v3", str(tmp_path / name), str(tiny_moe.tiny_model_script()))
        (tmp_path / f"forward-{name}.py").write_text(FORWARD)
        run(python, str(tmp_path / f"forward-{name}.py"), str(tmp_path / name), str(tmp_path / f"{name}.pt"))
    result = json.loads(
        run(
            v5,
            "-c",
            COMPARE,
            str(tmp_path / "t4" / "model.safetensors"),
            str(tmp_path / "t5" / "model.safetensors"),
            str(tmp_path / "t4.pt"),
            str(tmp_path / "t5.pt"),
        )
    )
    assert result["same"], "the checkpoint's tensors differ between transformers 4 and 5"
    names = result["names"]
    assert "model.layers.1.mlp.experts.15.down_proj.weight" in names
    assert not [n for n in names if n.endswith(("experts.gate_up_proj", "experts.down_proj"))], names
    assert result["layers"] > 1
    assert result["spread"] < 1e-5, result["spread"]  # float32 round-off only (measured 3e-7)
