"""The files of speculators 0.3.0 that the patches rewrite."""

from patcher.model import TargetFile

GENERATOR = TargetFile("speculators", "speculators/data_generation/vllm_hidden_states_generator.py")
WORKER = TargetFile("speculators", "speculators/data_generation/custom_worker.py")

# speculators 0.4.0 carries upstream's own fix; 0.5.0 no longer ships these files.
SPECULATORS_0_3 = {"speculators": ">=0.3.0,<0.4.0"}
# transformers 5 breaks `import speculators` itself (v16, v17): these two files are on its import path.
PYDANTIC_UTILS = TargetFile("speculators", "speculators/utils/pydantic_utils.py")
EAGLE = TargetFile("speculators", "speculators/models/eagle.py")
# Imported by `import speculators` (its model registry): the module that decorates with torch.compile.
EAGLE3_CORE = TargetFile("speculators", "speculators/models/eagle3/core.py")
