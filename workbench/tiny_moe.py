"""Tiny DeepSeek-V3 and Kimi-K2.5 checkpoints made on the spot, never downloaded: random weights
(fixed seed), the demo's local tokenizer, and beside each its transformers reference.

Three kinds, one text model (the same weights in all three):
- `deepseek-v3`: `DeepseekV3ForCausalLM`: MLA (q_lora_rank 256, kv_lora_rank 512, rope head 64:
  the shapes vLLM's FLASH_ATTN_MLA / FlashMLA kernels take), a dense first layer, then MoE layers
  of 16 routed experts (4 per token, grouped routing: 4 groups, 2 chosen, sigmoid scores with a
  correction bias, as DeepSeek-V3 routes) plus 1 shared expert. Its own reference.
- `kimi-k25`: the same text model as the `text_config` of Kimi-K2.5's wrapper config
  (`KimiK25ForConditionalGeneration`, vllm/transformers_utils/configs/kimi_k25.py: DeepSeek-V3 text
  config + MoonViT vision config), a one-layer MoonViT vision tower and projector, weights named as
  vLLM's loader expects (`language_model.model.*`, `vision_tower.*`, `mm_projector.proj.0/2.*`), a
  configuration module and an image processor of its own (remote code, as the published
  checkpoint ships), and `<|media_pad|>` in its tokenizer. Reference: `reference/`, the text
  weights as a transformers `DeepseekV3ForCausalLM`.
- `kimi-k25-int4`: the same, with the routed experts' weights in compressed-tensors
  `pack-quantized` int4 as the published Kimi-K2.5 checkpoint declares (symmetric, group size 32,
  strategy group; attention, shared experts, the dense layer, lm_head and the vision tower stay
  bfloat16). Each group's scale is a power of two, so every dequantized weight (int4 x scale) is
  exact in bfloat16: `reference/` holds exactly the weights vLLM's int4 kernels multiply.

Shapes divide by 1, 2 and 8 (a later tensor-parallel run): 16 attention heads, 8 vision heads,
hidden 256, routed-expert intermediate 512 (vLLM's Marlin MoE kernel wants hidden % 128 and
intermediate per GPU % 64), dense intermediate 1024.

The init is chosen so that bfloat16 noise stays well below the tolerance (0.25, per-row relative):
every matrix is drawn here (not by transformers) from a normal of std INIT_STD 0.02. With the tiny
Llama's 0.1 the MoE activations reach about 100 and transformers' own bfloat16 run differs from its
float32 run by up to 0.89. What remains is routing: bfloat16 flips a near-tied top-k choice on about
2% of the tokens of each MoE layer, and with independent experts each flip moved its row by up to
0.09 (transformers bf16 against fp32 on the demo's prompts). So the routed experts of a layer share
a common part and add EXPERT_OWN (0.5) of their own, as experts upcycled from one dense MLP do: a
flip then costs about half as much (0.06 measured).

A flip moves a few rows; a wrong MoE moves every row, by less than the per-row tolerance sees
(float32, these weights: routed_scaling_factor lost: largest 0.16, median 0.086; experts shifted
by one: 0.15, median 0.070; int4 nibbles in the wrong order: 0.37, median 0.22; the correction
bias ignored: 0.08, median 0.007). So tiny-model.json also sets a median tolerance, MEDIAN_TOLERANCE
(0.05), which patcher/run_check/extract.py holds every row's median to: vLLM's CPU build gave 0.022-0.024 (DeepSeek-V3
and Kimi-K2.5, VLLM_MLA_DISABLE=1), transformers' bfloat16 0.006.

In workbench/, not patcher/demo/: only the GPU bench (bench/gpu/gpu_run.py) and the tests make
these checkpoints. Standard library only at module level (like patcher/run_check/tiny_model.py;
patcher where it is installed). `python tiny_moe.py KIND OUT_DIR [TINY_MODEL]` runs inside an
environment with torch, transformers, tokenizers and safetensors, which need not have patcher (the
demo environments have not): TINY_MODEL names patcher/run_check/tiny_model.py (ensure_tiny_moe and
the GPU bench pass it; without it, the installed patcher's).
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

KINDS = ("deepseek-v3", "kimi-k25", "kimi-k25-int4")
REFERENCE_DIR = "reference"  # inside the Kimi checkpoints: the transformers reference
MARKER = "tiny-model.json"  # kind, params and where the reference is
# The tiny Llama's script, whose tokenizer this one extends: the installed patcher's (run as a
# script, this file imports it from its folder); None where patcher is not installed (a demo
# environment's python: the command line names the file).
try:
    import patcher.run_check

    TINY_MODEL: Path | None = Path(patcher.run_check.__file__).resolve().parent / "tiny_model.py"
except ImportError:
    TINY_MODEL = None

TEXT: dict = {
    "recipe": 1,  # bump when build() changes what it writes
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "moe_intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 256,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "n_group": 4,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
}
VISION: dict = {
    "patch_size": 14,
    "init_pos_emb_height": 16,
    "init_pos_emb_width": 16,
    "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed",
    "num_attention_heads": 8,
    "num_hidden_layers": 1,
    "hidden_size": 256,
    "intermediate_size": 512,
    "merge_kernel_size": [2, 2],
    "video_attn_type": "spatial_temporal",
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmerger",
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5,
}
INIT_STD = 0.02
# Routed experts: a part shared by every routed expert of the layer plus EXPERT_OWN of their own
# (module docstring).
EXPERT_OWN = 0.5
SEED = 20251202
INT4_GROUP_SIZE = 32
MEDIAN_TOLERANCE = 0.05  # module docstring
# The published Kimi-K2.5 checkpoint's quantization_config (compressed-tensors, W4A16): only the
# routed experts are quantized; every other Linear is listed as ignored.
QUANTIZATION_CONFIG: dict = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "group_size": INT4_GROUP_SIZE,
                "strategy": "group",
                "dynamic": False,
                "actorder": None,
                "observer": "minmax",
                "observer_kwargs": {},
                "block_structure": None,
            },
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": [
        "re:.*lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
        "re:.*vision_tower.*",
        "re:.*mm_projector.*",
    ],
    "kv_cache_scheme": None,
}
MEDIA_TOKENS = ("<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>")

# The checkpoint's own configuration class (transformers' AutoConfig with trust_remote_code, as
# speculators reads it); vLLM uses its own KimiK25Config for model_type kimi_k25.
CONFIGURATION_SOURCE = '''\
"""Kimi-K2.5's wrapper configuration (a DeepSeek-V3 text config and a MoonViT vision config), for
transformers' AutoConfig; written by patcher's tiny checkpoint builder."""

from transformers import DeepseekV3Config
from transformers.configuration_utils import PretrainedConfig


class KimiK25VisionConfig(PretrainedConfig):
    model_type = "kimi_k25_vision"

    def __init__(self, hidden_size=1152, mm_hidden_size=None, **kwargs):
        super().__init__(**kwargs)
        self.hidden_size = hidden_size
        self.mm_hidden_size = mm_hidden_size if mm_hidden_size is not None else hidden_size


class KimiK25Config(PretrainedConfig):
    model_type = "kimi_k25"

    def __init__(self, vision_config=None, text_config=None, media_placeholder_token_id=0, **kwargs):
        if isinstance(vision_config, dict) or vision_config is None:
            vision_config = KimiK25VisionConfig(**(vision_config or {}))
        if isinstance(text_config, dict) or text_config is None:
            text_config = DeepseekV3Config(**(text_config or {}))
        self.vision_config = vision_config
        self.text_config = text_config
        self.media_placeholder_token_id = media_placeholder_token_id
        if getattr(text_config, "quantization_config", None) is not None:
            self.quantization_config = text_config.quantization_config
        super().__init__(**kwargs)
'''

# The checkpoint's image processor (AutoImageProcessor with trust_remote_code, as vLLM's Kimi-K2.5
# processing info loads it): every image or video chunk becomes one 4x4 grid of 14-pixel patches,
# 2x2 tokens after the merge. vLLM asks it for the largest item's token count when the model
# runner starts; text prompts never reach it.
IMAGE_PROCESSOR_SOURCE = '''\
"""A tiny MoonViT image processor: every image or video chunk resized to 56x56 pixels (4x4 patches
of 14, 2x2 tokens after the 2x2 merge); written by patcher's tiny checkpoint builder."""

import numpy as np
import torch
from transformers.feature_extraction_utils import BatchFeature
from transformers.image_processing_utils import BaseImageProcessor


class TinyMoonViTImageProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values", "grid_thws"]

    def __init__(self, patch_size=14, merge_kernel_size=(2, 2), side=56, num_frames_per_chunk=4, **kwargs):
        super().__init__(**kwargs)
        self.patch_size = patch_size
        self.merge_kernel_size = list(merge_kernel_size)
        self.side = side
        self.num_frames_per_chunk = num_frames_per_chunk

    def _frames(self, chunk):
        if chunk["type"] == "image":
            return [chunk["image"]]
        return list(chunk["video_chunk"])

    def media_tokens_calculator(self, chunk):
        grid = self.side // self.patch_size
        return (grid // self.merge_kernel_size[0]) * (grid // self.merge_kernel_size[1])

    def preprocess(self, vision_chunks, return_tensors=None, **kwargs):
        grid = self.side // self.patch_size
        pixels, grids = [], []
        for chunk in vision_chunks:
            frames = self._frames(chunk)
            for frame in frames:
                array = np.asarray(frame.convert("RGB").resize((self.side, self.side)), dtype=np.float32)
                tensor = torch.from_numpy(array / 127.5 - 1.0).permute(2, 0, 1)
                patches = tensor.reshape(3, grid, self.patch_size, grid, self.patch_size)
                pixels.append(patches.permute(1, 3, 0, 2, 4).reshape(-1, 3, self.patch_size, self.patch_size))
            grids.append([len(frames), grid, grid])
        return BatchFeature(
            data={"pixel_values": torch.cat(pixels), "grid_thws": torch.tensor(grids)}, tensor_type=return_tensors
        )
'''


def tiny_model_script(path: Path | None = None) -> Path:
    """patcher/run_check/tiny_model.py: `path` where given, else the installed patcher's."""
    found = path or TINY_MODEL
    if found is None:
        raise SystemExit("patcher is not installed here: name its run_check/tiny_model.py (TINY_MODEL)")
    return found


def model_key(kind: str) -> str:
    """The cache key of one kind: every input of build() (this file and the tokenizer of
    patcher/run_check/tiny_model.py)."""
    digest = hashlib.sha256(kind.encode())
    for path in (Path(__file__).resolve(), tiny_model_script()):
        digest.update(path.read_bytes())
    return f"{kind}-{digest.hexdigest()[:12]}"


def ensure_tiny_moe(
    python: Path | str, kind: str, cache_root: Path | None = None, progress: Callable[[str], None] = print
) -> Path:
    """Make (or reuse) the tiny checkpoint `kind` with `python` (torch, transformers, tokenizers,
    safetensors); return its directory, under <cache>/demo-model/ beside the tiny Llama."""
    from patcher.demo.environment import resolve_cache
    from patcher.demo.model_cache import make_in_place

    base = resolve_cache(cache_root) / "demo-model"
    final = base / model_key(kind)
    if (final / MARKER).is_file():
        progress(f"tiny {kind}: reusing {final}")
        return final
    base.mkdir(parents=True, exist_ok=True)
    progress(f"tiny {kind}: making {final}")

    def make(folder: Path) -> None:
        proc = subprocess.run(
            [str(python), str(Path(__file__).resolve()), kind, str(folder), str(tiny_model_script())],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"making the tiny {kind} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")

    make_in_place(final, MARKER, make)
    return final


def text_config_dict(params: dict = TEXT) -> dict:
    config = {k: v for k, v in params.items() if k != "recipe"}
    config.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], torch_dtype="bfloat16")
    return config


# --- inside an environment with torch, transformers, tokenizers, safetensors -----------------


def checkpoint_shapes(state_shapes: dict[str, tuple]) -> dict[str, tuple]:
    """The model's parameters as a published DeepSeek-V3 checkpoint names them: one gate_proj,
    up_proj and down_proj per routed expert. transformers 5 keeps each layer's experts fused
    (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) and converts the
    per-expert names when it loads; vLLM's loader reads only the per-expert ones."""
    shapes: dict[str, tuple] = {}
    for name, shape in state_shapes.items():
        prefix, _, last = name.rpartition(".mlp.experts.")
        if last == "gate_up_proj":
            experts, rows, cols = shape
            for e in range(experts):
                shapes[f"{prefix}.mlp.experts.{e}.gate_proj.weight"] = (rows // 2, cols)
                shapes[f"{prefix}.mlp.experts.{e}.up_proj.weight"] = (rows // 2, cols)
        elif last == "down_proj":
            experts, rows, cols = shape
            for e in range(experts):
                shapes[f"{prefix}.mlp.experts.{e}.down_proj.weight"] = (rows, cols)
        else:
            shapes[name] = shape
    return shapes


def random_text_weights(config, seed: int = SEED, std: float = INIT_STD) -> dict:
    """Every parameter of a DeepseekV3ForCausalLM of `config`, drawn here in name order (so the
    weights do not depend on transformers' own init), in bfloat16."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    shapes = checkpoint_shapes({name: tuple(p.shape) for name, p in model.state_dict().items()})
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    bases: dict[str, object] = {}  # per layer and projection: the routed experts' shared part
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):  # every RMSNorm, layernorms included
            tensor = torch.ones(shape)
        elif name.endswith("e_score_correction_bias"):
            # small, so it moves the choice between near-tied experts but decides no token alone
            tensor = torch.randn(shape, generator=generator) * 0.01
        elif is_routed_expert(name):
            layer, _, rest = name.partition(".mlp.experts.")
            key = layer + "." + rest.split(".", 1)[1]
            if key not in bases:
                bases[key] = torch.randn(shape, generator=generator) * std
            tensor = (bases[key] + EXPERT_OWN * torch.randn(shape, generator=generator) * std) / math.sqrt(
                1 + EXPERT_OWN**2
            )
        else:
            tensor = torch.randn(shape, generator=generator) * std
        weights[name] = tensor.to(torch.bfloat16)
    return weights


def quantize_int4(weight, group_size: int = INT4_GROUP_SIZE):
    """(packed int32 [out, in/8], scale bf16 [out, in/group], dequantized bf16) of a [out, in] weight:
    symmetric int4 per group of `group_size` inputs, each scale a power of two (so int4 x scale is
    exact in bfloat16), packed as compressed-tensors' pack_to_int32 does (value + 8, eight 4-bit
    values per int32, the first in the lowest bits)."""
    import torch

    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    absmax = groups.abs().amax(dim=-1, keepdim=True).clamp_min(2.0**-20)
    scale = torch.exp2(torch.ceil(torch.log2(absmax / 7.0)))
    q = torch.round(groups / scale).clamp(-8, 7)
    dequantized = (q * scale).reshape(out_features, in_features).to(torch.bfloat16)
    unsigned = (q.reshape(out_features, in_features) + 8).to(torch.int32)
    shifts = torch.arange(8, dtype=torch.int32) * 4
    packed = (unsigned.reshape(out_features, in_features // 8, 8) << shifts).sum(dim=-1, dtype=torch.int32)
    return packed, scale.reshape(out_features, -1).to(torch.bfloat16), dequantized


def is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith("_proj.weight")


def vision_weights(vision: dict, text_hidden: int, seed: int = SEED + 1, std: float = INIT_STD) -> dict:
    """MoonViT and its projector, named as vLLM's KimiK25ForConditionalGeneration loads them."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    hidden, mlp, patch = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    merged = hidden * vision["merge_kernel_size"][0] * vision["merge_kernel_size"][1]
    shapes: dict[str, tuple] = {
        "vision_tower.patch_embed.proj.weight": (hidden, 3, patch, patch),
        "vision_tower.patch_embed.proj.bias": (hidden,),
        "vision_tower.patch_embed.pos_emb.weight": (
            vision["init_pos_emb_height"],
            vision["init_pos_emb_width"],
            hidden,
        ),
        "vision_tower.encoder.final_layernorm.weight": (hidden,),
        "vision_tower.encoder.final_layernorm.bias": (hidden,),
        "mm_projector.pre_norm.weight": (hidden,),
        "mm_projector.pre_norm.bias": (hidden,),
        "mm_projector.proj.0.weight": (merged, merged),
        "mm_projector.proj.0.bias": (merged,),
        "mm_projector.proj.2.weight": (text_hidden, merged),
        "mm_projector.proj.2.bias": (text_hidden,),
    }
    for i in range(vision["num_hidden_layers"]):
        block = f"vision_tower.encoder.blocks.{i}"
        shapes.update(
            {
                f"{block}.norm0.weight": (hidden,),
                f"{block}.norm0.bias": (hidden,),
                f"{block}.norm1.weight": (hidden,),
                f"{block}.norm1.bias": (hidden,),
                f"{block}.wqkv.weight": (3 * hidden, hidden),
                f"{block}.wqkv.bias": (3 * hidden,),
                f"{block}.wo.weight": (hidden, hidden),
                f"{block}.wo.bias": (hidden,),
                f"{block}.mlp.fc0.weight": (mlp, hidden),
                f"{block}.mlp.fc0.bias": (mlp,),
                f"{block}.mlp.fc1.weight": (hidden, mlp),
                f"{block}.mlp.fc1.bias": (hidden,),
            }
        )
    weights = {}
    for name in sorted(shapes):
        if "norm" in name.rsplit(".", 2)[-2] and name.endswith(".weight"):
            tensor = torch.ones(shapes[name])
        elif name.endswith(".bias"):
            tensor = torch.zeros(shapes[name])
        else:
            tensor = torch.randn(shapes[name], generator=generator) * std
        weights[name] = tensor.to(torch.bfloat16)
    return weights


def build_tokenizer(out_dir: Path, kind: str, vocab_size: int, tiny_model: Path | None = None):
    """The demo's BPE tokenizer (tiny_model.build_tokenizer, of `tiny_model`: by default the
    installed patcher's), with Kimi's media tokens for Kimi."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    sys.path.insert(0, str(tiny_model_script(tiny_model).parent))
    from tiny_model import PARAMS, SPECIAL_TOKENS, synthetic_corpus

    specials = list(SPECIAL_TOKENS) + (list(MEDIA_TOKENS) if kind.startswith("kimi") else [])
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(synthetic_corpus(PARAMS["seed"]), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=specials[len(SPECIAL_TOKENS) :] or None,
        model_max_length=TEXT["max_position_embeddings"],
    )
    fast.save_pretrained(out_dir)
    if len(fast) > vocab_size:
        raise ValueError(f"tokenizer has {len(fast)} tokens, more than the model's vocabulary")
    return fast


def write_reference(out_dir: Path, config, weights: dict, tokenizer) -> None:
    """A transformers DeepseekV3ForCausalLM checkpoint of `weights`."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out_dir / "model.safetensors"), {"format": "pt"})


def build(out_dir: Path, kind: str, tiny_model: Path | None = None) -> None:
    from transformers import DeepseekV3Config

    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir, kind, TEXT["vocab_size"], tiny_model)
    text = text_config_dict()
    text.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = DeepseekV3Config(**text)
    weights = random_text_weights(config)
    marker = {
        "kind": kind,
        "text": TEXT,
        "init_std": INIT_STD,
        "expert_own": EXPERT_OWN,
        "seed": SEED,
        "reference": ".",
        "median_tolerance": MEDIAN_TOLERANCE,
    }

    if kind == "deepseek-v3":
        write_reference(out_dir, config, weights, tokenizer)
        (out_dir / MARKER).write_text(json.dumps(marker, indent=1, sort_keys=True) + "\n")
        return

    reference_weights = write_kimi_weights(out_dir, kind, weights)
    (out_dir / "config.json").write_text(
        json.dumps(kimi_config(config, kind, tokenizer), indent=1, sort_keys=True) + "\n"
    )
    (out_dir / "configuration_kimi_k25.py").write_text(CONFIGURATION_SOURCE)
    (out_dir / "image_processing_tiny_moonvit.py").write_text(IMAGE_PROCESSOR_SOURCE)
    (out_dir / "preprocessor_config.json").write_text(
        json.dumps(kimi_processor_config(), indent=1, sort_keys=True) + "\n"
    )
    write_reference(out_dir / REFERENCE_DIR, config, reference_weights, tokenizer)
    marker["reference"] = REFERENCE_DIR
    if kind == "kimi-k25-int4":
        marker["int4"] = {"group_size": INT4_GROUP_SIZE, "symmetric": True, "scales": "powers of two"}
    (out_dir / MARKER).write_text(json.dumps(marker, indent=1, sort_keys=True) + "\n")


def write_kimi_weights(out_dir: Path, kind: str, weights: dict) -> dict:
    """Kimi-K2.5's served weights: the text weights under language_model. (the routed experts packed
    int4 for kimi-k25-int4), the vision tower beside them; the reference's weights (the int4
    experts as they dequantize)."""
    from safetensors.torch import save_file

    reference_weights = dict(weights)
    served: dict = {}
    for name, tensor in weights.items():
        served_name = "language_model." + name
        if kind == "kimi-k25-int4" and is_routed_expert(name):
            packed, scale, dequantized = quantize_int4(tensor)
            base = served_name[: -len(".weight")]
            served[base + ".weight_packed"] = packed
            served[base + ".weight_scale"] = scale
            import torch

            served[base + ".weight_shape"] = torch.tensor(list(tensor.shape))
            reference_weights[name] = dequantized
        else:
            served[served_name] = tensor
    served.update(vision_weights(VISION, TEXT["hidden_size"]))
    save_file({k: v.contiguous() for k, v in served.items()}, str(out_dir / "model.safetensors"), {"format": "pt"})
    return reference_weights


def kimi_config(config, kind: str, tokenizer) -> dict:
    """Kimi-K2.5's config.json: the DeepSeek-V3 text config inside its wrapper, with the vision tower's."""
    text_json = config.to_dict()
    if kind == "kimi-k25-int4":
        text_json["quantization_config"] = QUANTIZATION_CONFIG
    media_pad = tokenizer.convert_tokens_to_ids("<|media_pad|>")
    wrapper = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
        "torch_dtype": "bfloat16",
        "media_placeholder_token_id": media_pad,
        "pad_token_id": tokenizer.unk_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "tie_word_embeddings": False,
        "text_config": text_json,
        "vision_config": {**VISION, "mm_hidden_size": TEXT["hidden_size"], "model_type": "kimi_k25_vision"},
    }
    if kind == "kimi-k25-int4":
        wrapper["quantization_config"] = QUANTIZATION_CONFIG
    return wrapper


def kimi_processor_config() -> dict:
    """The tiny vision tower's preprocessor_config.json (the remote code's and vLLM's own keys)."""
    grid = 56 // VISION["patch_size"]
    return {
        "auto_map": {"AutoImageProcessor": "image_processing_tiny_moonvit.TinyMoonViTImageProcessor"},
        "image_processor_type": "TinyMoonViTImageProcessor",
        "patch_size": VISION["patch_size"],
        "merge_kernel_size": VISION["merge_kernel_size"],
        "side": grid * VISION["patch_size"],
        "num_frames_per_chunk": 4,
        # What vLLM 0.26+'s own Kimi-K2.5 processor reads instead of the remote code (the published
        # checkpoint's keys), sized to the same 4x4 patches: every item is 2x2 tokens either way.
        "media_proc_cfg": {
            "patch_size": VISION["patch_size"],
            "merge_kernel_size": VISION["merge_kernel_size"],
            "temporal_merge_kernel_size": 4,
            "in_patch_limit": grid * grid,
            "in_patch_limit_each_frame": grid * grid,
            "in_patch_limit_video": grid * grid,
            "patch_limit_on_one_side": grid,
            "fixed_output_tokens": None,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
    }


def reference_of(model_dir: Path) -> Path:
    """Where a tiny checkpoint's transformers reference is (the directory itself otherwise)."""
    try:
        marker = json.loads((Path(model_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return Path(model_dir)
    return Path(model_dir) / marker.get("reference", ".")


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[1] not in KINDS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(KINDS)}}} OUT_DIR [TINY_MODEL]")
    build(Path(sys.argv[2]), sys.argv[1], tiny_model_script(Path(sys.argv[3]) if len(sys.argv) == 4 else None))
