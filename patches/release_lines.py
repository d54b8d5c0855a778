"""The speculators release lines patcher answers for (RELEASE_LINES, read by
patcher.patchset.registry.release_lines): a target on a release in none of them is refused."""

from patcher.model import ReleaseLine

from .targets import SPECULATORS_0_3, SPECULATORS_0_4

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
