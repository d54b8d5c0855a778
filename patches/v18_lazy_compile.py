"""v18: compile EAGLE-3's forward at its first call, so `import speculators` never touches CUDA.

On a CUDA host vLLM starts the generator's workers with fork, and every worker died:
"Cannot re-initialize CUDA in forked subprocess" (gpu_worker.init_device), measured on an H200
with vLLM 0.20.0 and torch 2.11.0. vLLM forks only when `torch.cuda.is_initialized()` is False
in the parent (vllm/utils/system_utils.py `_maybe_force_spawn`), and it was False: CUDA had been
initialised behind torch's back. `import speculators` registers its models on import
(speculators/__init__.py -> speculators/models/eagle3/core.py), and that module decorates
`Eagle3DraftModel.forward` with `@torch.compile` at class definition. torch.compile imports
torch._inductor, whose runtime/benchmarking.py evaluates `torch.cuda.is_available()` at import:
`torch._C._cuda_getDeviceCount()`, which initialises the CUDA driver in the parent without
setting torch's initialised flag. The drift is torch's: it hits every CUDA host, whatever vLLM.

Two fixes were weighed:
- spawn the workers when CUDA was touched, as vLLM's own entry points decide. The parent cannot
  tell that CUDA was touched (torch's flag is the very thing that is False), so the generator
  would have to spawn always on CUDA. Spawn re-imports the user's `__main__` in every worker: a
  script without an `if __name__ == "__main__":` guard, which ran with fork, would start
  generators recursively; every worker would also import torch, vLLM and speculators again.
- (chosen) keep speculators' import from touching CUDA: `@torch.compile` becomes a decorator
  that calls torch.compile on the function at its first call. torch.compile compiles at the
  first call anyway, so training sees the same compiled forward, from the same function; only
  the import of torch._dynamo/torch._inductor moves from `import speculators` to the first
  forward of an EAGLE-3 draft model, which hidden-state extraction never runs. Nothing changes
  for the user's script, vLLM keeps fork (its default on CUDA), and on CPU builds (where vLLM
  spawns anyway) the only effect is a lighter import. No environment variable is needed.

The CPU suite shows the effect without a GPU: torch._C._cuda_getDeviceCount is there in a
CUDA-built torch with or without a device, and importing speculators calls it before the patch
and never after (tests/test_patch_v18_v24_lazy_compile.py, torch 2.10 in the demo environment).
speculators 0.4.0 does not fix it: it replaced the decorator with one that asks
`torch.cuda.is_available()` at class definition, which touches CUDA the same way.
"""

from __future__ import annotations

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod, defines_function
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch

from .targets import CUDA_IN_FORKED_WORKER, EAGLE3_CORE, SPECULATORS_0_3

HELPER = "_compile_on_first_call"

HELPER_SOURCE = '''\
def _compile_on_first_call(function):
    """torch.compile(function), made at the function's first call instead of at import.

    torch.compile imports torch._inductor, which asks CUDA for its device count at import and
    so initialises CUDA in the importing process without telling torch: vLLM then forks its
    workers, and they cannot use CUDA. Compilation itself happens at the first call either way.
    """
    import functools

    compiled = None

    @functools.wraps(function)
    def compile_and_call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(function)
        return compiled(*args, **kwargs)

    return compile_and_call
'''

TORCH_COMPILE = m.Decorator(decorator=m.Attribute(value=m.Name("torch"), attr=m.Name("compile")))
LAZY_COMPILE = m.Decorator(decorator=m.Name(HELPER))


class LazyTorchCompile(PatchCodemod):
    """A bare `@torch.compile` decorator -> `@_compile_on_first_call`, with the helper defined at
    module level (before the first top-level class).

    Patched: a function decorated with `@_compile_on_first_call` (the helper is then ensured).
    """

    ANCHOR = "a method decorated with a bare @torch.compile"

    def leave_Decorator(self, original: cst.Decorator, updated: cst.Decorator) -> cst.Decorator:
        if m.matches(updated, LAZY_COMPILE):
            self.found_patched()
            return updated
        if not m.matches(updated, TORCH_COMPILE):
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


@SpeculatorModel.register("eagle3")
class Eagle3DraftModel(SpeculatorModel):
    @torch.compile
    def forward(self, hidden_states, input_ids, ttt_steps: int = 3):
        return hidden_states
"""

AFTER = (
    """\
import torch
from speculators.model import SpeculatorModel


"""
    + HELPER_SOURCE
    + """

@SpeculatorModel.register("eagle3")
class Eagle3DraftModel(SpeculatorModel):
    @_compile_on_first_call
    def forward(self, hidden_states, input_ids, ttt_steps: int = 3):
        return hidden_states
"""
)

PATCH = Patch(
    id="v18-lazy-compile",
    title="compile EAGLE-3's forward at its first call: importing speculators leaves CUDA alone",
    target=EAGLE3_CORE,
    requires=SPECULATORS_0_3,
    edits=(
        Edit(
            LazyTorchCompile,
            # torch: every release with torch.compile (measured on 2.10 here and 2.11 on an H200;
            # the change is correct on any). vllm: every release the patches cover; the fact is
            # vLLM's side of the symptom (it keeps fork unless torch says CUDA is initialised).
            when={"torch": ">=2.0", "vllm": ">=0.11.0"},
            answers="importing torch._inductor (torch.compile) initialises CUDA without setting "
            "torch.cuda.is_initialized(), and vLLM then starts its workers with fork",
            fact=Fact("defines", ("vllm.utils.system_utils", "vllm.utils"), name="_maybe_force_spawn"),
        ),
    ),
    examples=(Example(before=BEFORE, after=AFTER),),
    satisfied=(AFTER,),
    near_misses=(
        # a configured @torch.compile(...), not the bare decorator
        """
            import torch
            from speculators.model import SpeculatorModel


            @SpeculatorModel.register("eagle3")
            class Eagle3DraftModel(SpeculatorModel):
                @torch.compile(dynamic=True)
                def forward(self, hidden_states, input_ids, ttt_steps: int = 3):
                    return hidden_states
        """,
    ),
    upstream="torch: torch/_inductor/runtime/benchmarking.py evaluates torch.cuda.is_available() at "
    "import (module-level use_experimental_benchmarker); vLLM: get_mp_context() forces spawn only "
    "when torch.cuda.is_initialized() (vllm/utils/system_utils.py _maybe_force_spawn)",
    fixed_in=None,
    without_it="without it, on a CUDA host every vLLM worker dies at start: `RuntimeError: Cannot re-initialize CUDA in forked subprocess` (`gpu_worker.init_device`; seen on an H200, vLLM 0.20.0, torch 2.11.0): `import speculators` ran `@torch.compile`, which initialised CUDA unseen, and vLLM kept fork. The decorator now compiles at the first call",
    # the H200 runs of 2026-11-30 numbered this patch v14 (their files keep that name)
    leave_one_out=(
        LeaveOneOut(
            "0.20.0",
            CUDA_IN_FORKED_WORKER,
            device="cuda",
            record="bench/gpu/results/0.20.0-h200x2/without-v14-worker-error.txt",
        ),
        LeaveOneOut(
            "0.22.1",
            CUDA_IN_FORKED_WORKER,
            device="cuda",
            record="bench/gpu/results/0.22.1-h200x2/log.txt",
        ),
        LeaveOneOut("0.16.0", None, calls="all", tensor_parallel=2),
    ),
    since="any (torch >=2.0: a condition on torch)",
    # 0.4.0 decorates with its own conditional_torch_compile (which asks torch.cuda.is_available()
    # at class definition: it touches CUDA as 0.3.0 does), so not fixed upstream; the codemod must
    # still leave that file alone
    on_fixed_in="anchor-missing",
)
