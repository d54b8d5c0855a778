"""The files of speculators that the patches rewrite, and the speculators releases patcher covers."""

from patcher.model import ReleaseLine, TargetFile

GENERATOR = TargetFile("speculators", "speculators/data_generation/vllm_hidden_states_generator.py")
WORKER = TargetFile("speculators", "speculators/data_generation/custom_worker.py")

# speculators 0.3.0's patch set. 0.5.0 and later no longer ship these files.
SPECULATORS_0_3 = {"speculators": ">=0.3.0,<0.4.0"}
# transformers 5 breaks `import speculators` itself (v16, v17): these two files are on its import path.
PYDANTIC_UTILS = TargetFile("speculators", "speculators/utils/pydantic_utils.py")
EAGLE = TargetFile("speculators", "speculators/models/eagle.py")
# Imported by `import speculators` (its model registry): the module that decorates with torch.compile.
EAGLE3_CORE = TargetFile("speculators", "speculators/models/eagle3/core.py")

# Every speculators release patcher answers for (docs/speculators-releases.md): a release in none
# of these lines is refused with exit 7, never "ok". The patched lines are the patch sets: the
# patches whose `requires` is exactly the line's spec (tests/test_targets.py keeps them equal).
RELEASE_LINES = (
    ReleaseLine(
        "speculators",
        SPECULATORS_0_3["speculators"],
        ("0.3.0",),
        patched=True,
        path="VllmHiddenStatesGenerator drives vLLM's engine in-process: speculators 0.3.0's patch set",
    ),
    ReleaseLine(
        "speculators",
        ">=0.5.0,<0.10.0",
        ("0.5.0", "0.6.0", "0.6.0.1", "0.6.0.2", "0.7.0", "0.7.0.1", "0.7.0.2", "0.8.0", "0.8.1", "0.9.0"),
        patched=False,
        path=(
            "extraction goes through `vllm serve` (speculative method extract_hidden_states, vLLM 0.17+) and "
            "a KV connector; speculators imports nothing of vLLM, so no speculators file is patched"
        ),
    ),
)
