"""What the patches share and is not a patch: the files of speculators they rewrite, the gates of
the patch sets (which speculators releases each serves) and shared symptoms. The release lines
patcher answers for are release_lines.py; the drift of hs-connectors' KV connectors that
check-upstream keeps exact is connector_drift.py."""

from patcher.model import Symptom, TargetFile

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

# Shared symptoms: a worker started by fork after CUDA was initialised in the generator's process
# (torch.compile at import: v18 for 0.3.0, v24 for 0.4.x).
CUDA_IN_FORKED_WORKER = Symptom("init", messages=("Cannot re-initialize CUDA in forked subprocess",))
