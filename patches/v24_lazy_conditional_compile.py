"""v24: decide speculators 0.4's conditional_torch_compile at the first call, so `import speculators`
never touches CUDA.

v18's cause, in 0.4.0's form. speculators 0.4.0 decorates `Eagle3DraftModel.forward` with its own
`conditional_torch_compile`, which evaluates `torch.cuda.is_available() and hasattr(torch,
"compile")` at class definition, i.e. on `import speculators` (its model registry imports
speculators/models/eagle3/core.py). `torch.cuda.is_available()` calls
`torch._C._cuda_getDeviceCount()`, which initialises the CUDA driver in the importing process
without setting `torch.cuda.is_initialized()`: on a CUDA host vLLM then keeps fork for the
generator's workers, and they die with "Cannot re-initialize CUDA in forked subprocess" (seen with
0.3.0 on an H200; 0.4.0 asks the same question at the same moment). On a GPU host it also calls
torch.compile at import, which imports torch._inductor (whose benchmarking module asks again).

The decorator becomes one that asks speculators' own conditional_torch_compile at the function's
first call: the same decision, the same compiled (or plain) forward for training, only later;
hidden-state extraction never calls it. Not a vLLM change: torch's behaviour, every release.
"""

from __future__ import annotations

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod, defines_function
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch

from .targets import CUDA_IN_FORKED_WORKER, EAGLE3_CORE, SPECULATORS_0_4

UPSTREAM = "conditional_torch_compile"
HELPER = "_conditional_compile_on_first_call"

HELPER_SOURCE = '''\
def _conditional_compile_on_first_call(function):
    """conditional_torch_compile(function), decided at the function's first call instead of at import.

    Deciding asks torch.cuda.is_available(), which initialises CUDA in the importing process without
    telling torch: vLLM then forks its workers, and they cannot use CUDA. Compilation itself happens
    at the first call either way.
    """
    import functools

    chosen = None

    @functools.wraps(function)
    def decide_and_call(*args, **kwargs):
        nonlocal chosen
        if chosen is None:
            chosen = conditional_torch_compile(function)
        return chosen(*args, **kwargs)

    return decide_and_call
'''


class LazyConditionalCompile(PatchCodemod):
    """`@conditional_torch_compile` -> `@_conditional_compile_on_first_call`, with the helper defined at
    module level (before the first top-level class).

    Patched: a function decorated with `@_conditional_compile_on_first_call` (the helper is then ensured).
    """

    ANCHOR = "a method decorated with @conditional_torch_compile"

    def leave_Decorator(self, original: cst.Decorator, updated: cst.Decorator) -> cst.Decorator:
        if m.matches(updated, m.Decorator(decorator=m.Name(HELPER))):
            self.found_patched()
            return updated
        if not m.matches(updated, m.Decorator(decorator=m.Name(UPSTREAM))):
            return updated
        self.rewrote()
        return updated.with_changes(decorator=cst.Name(HELPER))

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        if not (self.rewrites or self.patched_seen) or defines_function(updated.body, HELPER):
            return updated
        self.rewrote()
        helper = cst.parse_statement(HELPER_SOURCE)
        helper = helper.with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
        body = list(updated.body)
        index = next((i for i, s in enumerate(body) if isinstance(s, cst.ClassDef)), len(body))
        body.insert(index, helper)
        return updated.with_changes(body=body)


BEFORE = """\
import torch
from speculators.model import SpeculatorModel


def conditional_torch_compile(func):
    if torch.cuda.is_available() and hasattr(torch, "compile"):
        return torch.compile(func)
    else:
        return func


@SpeculatorModel.register("eagle3")
class Eagle3DraftModel(SpeculatorModel):
    @conditional_torch_compile
    def forward(self, hidden_states, input_ids, ttt_steps: int = 3):
        return hidden_states
"""

AFTER = (
    """\
import torch
from speculators.model import SpeculatorModel


def conditional_torch_compile(func):
    if torch.cuda.is_available() and hasattr(torch, "compile"):
        return torch.compile(func)
    else:
        return func


"""
    + HELPER_SOURCE
    + """

@SpeculatorModel.register("eagle3")
class Eagle3DraftModel(SpeculatorModel):
    @_conditional_compile_on_first_call
    def forward(self, hidden_states, input_ids, ttt_steps: int = 3):
        return hidden_states
"""
)

# what a forked vLLM worker dies of once `import speculators` has initialised CUDA (v18's symptom too)

PATCH = Patch(
    id="v24-lazy-conditional-compile",
    title="decide 0.4's conditional_torch_compile at the first call: importing speculators leaves CUDA alone",
    target=EAGLE3_CORE,
    requires=SPECULATORS_0_4,
    edits=(
        Edit(
            LazyConditionalCompile,
            # as v18: torch's behaviour on every release; the fact is vLLM's side of the symptom
            when={"torch": ">=2.0", "vllm": ">=0.11.0"},
            answers="torch.cuda.is_available() initialises CUDA without setting torch.cuda.is_initialized(), "
            "and vLLM then starts its workers with fork",
            fact=Fact("defines", ("vllm.utils.system_utils", "vllm.utils"), name="_maybe_force_spawn"),
        ),
    ),
    examples=(Example(before=BEFORE, after=AFTER),),
    satisfied=(AFTER,),
    near_misses=(
        # the bare @torch.compile of speculators 0.3.0 (v18's), not @conditional_torch_compile
        """
            import torch
            from speculators.model import SpeculatorModel


            @SpeculatorModel.register("eagle3")
            class Eagle3DraftModel(SpeculatorModel):
                @torch.compile
                def forward(self, hidden_states, input_ids, ttt_steps: int = 3):
                    return hidden_states
        """,
    ),
    upstream="speculators 0.4.0 speculators/models/eagle3/core.py conditional_torch_compile (asks "
    "torch.cuda.is_available() at class definition); vLLM: get_mp_context() forces spawn only when "
    "torch.cuda.is_initialized() (vllm/utils/system_utils.py _maybe_force_spawn)",
    without_it="without it, on a CUDA host `import speculators` initialises CUDA behind torch's back "
    "(`torch.cuda.is_available()` at class definition) and vLLM's forked workers can die at start: "
    "`RuntimeError: Cannot re-initialize CUDA in forked subprocess` (v18's symptom with 0.3.0; seen with "
    "0.4.0.1 on an H200, vLLM 0.22.0 and 0.26.0, every model). `tests/test_patch_v18_v24_lazy_compile.py` "
    "counts the device-count calls of `import speculators` without a GPU: 1 before, 0 after",
    leave_one_out=(
        LeaveOneOut("0.16.0", None, calls="all", speculators="0.4.0.1"),
        LeaveOneOut(
            "0.22.0",
            CUDA_IN_FORKED_WORKER,
            device="cuda",
            record="bench/gpu/results/0.22.0-speculators-0.4.0.1-h200x1/log.txt",
            speculators="0.4.0.1",
        ),
        LeaveOneOut(
            "0.26.0",
            CUDA_IN_FORKED_WORKER,
            device="cuda",
            record="bench/gpu/results/0.26.0-speculators-0.4.0.1-h200x1/log.txt",
            speculators="0.4.0.1",
        ),
        LeaveOneOut("0.16.0", None, calls="all", tensor_parallel=2, speculators="0.4.0.1"),
    ),
    since="any (torch >=2.0: a condition on torch)",
)
