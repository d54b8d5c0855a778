"""A tiny Llama made on the spot, never downloaded: random weights (fixed seed), a local tokenizer.

`python tiny_model.py OUT_DIR [PARAMS_JSON]` runs inside the demo environment or a target
(transformers, tokenizers, torch): it writes a model that both transformers and vLLM's CPU build
load. Standard library only at module level, so the run check sends it as text
(patcher/run_check/request.py); patcher's interpreter makes it once and reuses it through
patcher/demo/model_cache.py (ensure_tiny_model).

Shape: head size 64 (vLLM's CPU attention takes 32, 64, 80, ...; not 16); weights in bfloat16,
because speculators builds its ModelConfig with dtype="auto" and vLLM's "auto" downcasts a float32
checkpoint to bfloat16 anyway: saving bfloat16 puts exactly the same weights on both sides of the
comparison (transformers then runs them in float32); 4 layers so the driver can ask for
non-final layers and the final one; max_position_embeddings 2048 so prompts of ~1000 tokens fit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PARAMS: dict = {
    "recipe": 1,  # bump when build() changes what it writes
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "initializer_range": 0.1,  # larger than Llama's 0.02, so attention is not near-uniform
    "torch_dtype": "bfloat16",
    "seed": 20240611,
}
# The same Llama with 8 attention and KV heads (head size 64, which vLLM's CPU attention needs):
# tensor parallel 4 and 8 split its heads, its MLP and its vocabulary evenly (bench/releases.py
# --tensor-parallel). The default model's 2 heads allow TP 2 at most.
WIDE_PARAMS: dict = {
    **PARAMS,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
}
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2
# --- inside the demo environment or a target ----------------------------------------------------------


def synthetic_corpus(seed: int, sentences: int = 400) -> list[str]:
    import random

    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "de", "po", "gu", "fe", "zi", "ba"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(300)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 20))) + "." for _ in range(sentences)]


def build_tokenizer(out_dir: Path, params: dict = PARAMS):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=params["vocab_size"], special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    tok.train_from_iterator(synthetic_corpus(params["seed"]), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=params["max_position_embeddings"],
    )
    fast.save_pretrained(out_dir)
    return fast


def build(out_dir: Path, params: dict = PARAMS) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir, params)
    if len(tokenizer) > params["vocab_size"]:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, more than the model's vocabulary")
    config = LlamaConfig(
        vocab_size=params["vocab_size"],
        hidden_size=params["hidden_size"],
        intermediate_size=params["intermediate_size"],
        num_hidden_layers=params["num_hidden_layers"],
        num_attention_heads=params["num_attention_heads"],
        num_key_value_heads=params["num_key_value_heads"],
        head_dim=params["head_dim"],
        max_position_embeddings=params["max_position_embeddings"],
        rms_norm_eps=params["rms_norm_eps"],
        rope_theta=params["rope_theta"],
        initializer_range=params["initializer_range"],
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype=params["torch_dtype"],
    )
    torch.manual_seed(params["seed"])
    model = LlamaForCausalLM(config).to(getattr(torch, params["torch_dtype"]))
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(f"usage: {sys.argv[0]} OUT_DIR [PARAMS_JSON]")
    build(Path(sys.argv[1]), json.loads(sys.argv[2]) if len(sys.argv) == 3 else PARAMS)
