"""The speculators 0.3.0 files the patches rewrite, as the tests name them."""

from pathlib import Path

GENERATOR = "speculators/data_generation/vllm_hidden_states_generator.py"
WORKER = "speculators/data_generation/custom_worker.py"
PRISTINE_GENERATOR = "514f3f585afa335b558f98c1954a1dc5b804003cd7b08aeeac7c4cd333cd5106"


def agent_modules() -> list[Path]:
    """The agent's module files (remote/agent/), never none: a scan of them must see something."""
    paths = sorted((Path(__file__).resolve().parents[2] / "remote" / "agent").glob("*.py"))
    assert len(paths) > 5, "remote/agent/ holds the agent's modules"
    return paths
