"""The files of speculators that the patches rewrite, and the speculators releases patcher covers."""

from patcher.model import ConnectorDrift, ReleaseLine, Symptom, TargetFile

GENERATOR = TargetFile("speculators", "speculators/data_generation/vllm_hidden_states_generator.py")
WORKER = TargetFile("speculators", "speculators/data_generation/custom_worker.py")

# The patch sets: speculators 0.3.0's, and 0.4.0's and 0.4.0.1's (the same data-generation code;
# they differ in eagle3_converter.py only). A patch whose codemods answer the same drift in both
# releases' files requires either (SPECULATORS_0_3_OR_0_4). 0.5.0 and later no longer ship these files.
SPECULATORS_0_3 = {"speculators": ">=0.3.0,<0.4.0"}
SPECULATORS_0_4 = {"speculators": ">=0.4.0,<0.5.0"}
SPECULATORS_0_3_OR_0_4 = {"speculators": ">=0.3.0,<0.5.0"}
# Every vLLM release the patch sets cover (an edit whose drift is speculators' own, or torch's)
EVERY_RELEASE = {"vllm": ">=0.11.0"}
# transformers 5 breaks `import speculators` itself (v16, v17): these two files are on its import path.
PYDANTIC_UTILS = TargetFile("speculators", "speculators/utils/pydantic_utils.py")
EAGLE = TargetFile("speculators", "speculators/models/eagle.py")
# Imported by `import speculators` (its model registry): the module that decorates with torch.compile.
EAGLE3_CORE = TargetFile("speculators", "speculators/models/eagle3/core.py")

# Every speculators release patcher answers for (docs/speculators-releases.md): a release in none
# of these lines is refused with exit 7, never "ok". Each patched line is served by the patches
# whose `requires` holds on its releases (tests/test_coverage.py checks both ways).
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
        SPECULATORS_0_4["speculators"],
        ("0.4.0", "0.4.0.1"),
        patched=True,
        path="VllmHiddenStatesGenerator drives vLLM's engine in-process: speculators 0.4.0's patch set",
        # written for vLLM 0.12's engine API (block hasher, SchedulerConfig(is_encoder_decoder=...)):
        # on 0.11 its own calls do not bind, and no patch takes it back there
        requires={"vllm": ">=0.12.0"},
        requires_why={"vllm>=0.12.0": "it is written for vLLM 0.12's engine API, and no patch takes it back to 0.11"},
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

# speculators 0.5+ patches nothing: `vllm serve` loads a KV connector, vLLM's own or one of
# hs-connectors' (speculators 0.8+ requires hs-connectors; 0.7 vendors its transfer.py only, which
# imports nothing of vLLM). check-upstream binds every hs-connectors module that imports vLLM on
# every vLLM release with extract_hidden_states (0.17.0 on); what they meet is upstream's, declared
# here for exactly the releases it is met on (docs/check-upstream.md). Read, not run.
HS_FP8 = "hs_connectors/fp8_hidden_states_connector.py"
HS_MOONCAKE = "hs_connectors/mooncake_hidden_states_connector.py"
CONNECTOR_DRIFT = (
    ConnectorDrift(
        "hs-connectors",
        HS_FP8,
        "FP8HiddenStatesConnector._write_tensors overrides nothing",
        ">=0.17.0,<0.22.0",
        "ExampleHiddenStatesConnector gains _write_tensors in vLLM 0.22.0; before, it saves in save_kv_layer and "
        "the override is never called: the FP8 backend writes hidden states unquantized (FP8Transfer reads them "
        "as they are: twice the size, silently)",
    ),
    ConnectorDrift(
        "hs-connectors",
        HS_MOONCAKE,
        "from vllm.v1.kv_cache_interface import HiddenStateCacheSpec:",
        ">=0.17.0,<0.22.0",
        "HiddenStateCacheSpec first appears in vLLM 0.22.0; before, the import in _find_cache_kv_group_id, called "
        "by __init__ with the kv_cache_config vLLM passes, raises ImportError: the Mooncake connector cannot start",
    ),
    ConnectorDrift(
        "hs-connectors",
        HS_MOONCAKE,
        "MooncakeHiddenStatesConnector.prefer_cross_layer_blocks overrides nothing",
        ">=0.29.0",
        "vLLM 0.29.0 removes cross-layer KV blocks (prefer_cross_layer_blocks, register_cross_layers_kv_cache): "
        "the override, there to keep them off, is never read; harmless",
    ),
)

# Shared symptoms: a worker started by fork after CUDA was initialised in the generator's process
# (torch.compile at import: v18 for 0.3.0, v24 for 0.4.x).
CUDA_IN_FORKED_WORKER = Symptom("init", messages=("Cannot re-initialize CUDA in forked subprocess",))
