"""v14: resolve the KV cache layout before sizing the KV cache, as vLLM's engine core does.

vLLM 0.29.0: the KV cache layout is resolved once, by the engine core, before the KV cache config
is computed (vllm/v1/engine/core.py: `resolve_kv_cache_layout(vllm_config,
executor.get_supported_kv_cache_layouts(), specs)` from vllm/v1/attention/backends/utils.py, then
`executor.set_kv_cache_layout(layout.name)`, which records it on every worker).
get_kv_cache_config_from_groups now reads `CacheConfig.get_resolved_kv_cache_layout()`, which
raises `ValueError: KV cache layout has not been resolved yet` when nobody did. speculators 0.3.0
drives the executor itself (no engine core), so it must do the same two steps.

vLLM 0.33.0: `Executor.set_kv_cache_layout(layout_name, cp_kv_cache_interleave_size)` also
publishes the context-parallel KV cache interleave size (vllm/v1/executor/abstract.py; each worker
stores it in `parallel_config.cp_kv_cache_interleave_size`, vllm/v1/worker/worker_base.py). The
engine core passes `vllm_config.parallel_config.cp_kv_cache_interleave_size` after
`vllm_config.adjust_dcp_kv_cache_interleave_size(groups)`, which changes it only for a KV-transfer
(NIXL P/D) instance with decode context parallelism > 1: never the generator's case, so the
configured value is what the core would pass. A second edit, gated on that release, adds the
argument. Why an edit and not a run-time look at the signature: the written file is then the one
call that release takes, which verification and check-upstream bind statically on every release
(a `*args` chosen at run time binds anywhere, so it would hide the next change), and check-upstream
checks the gate against the fact (the parameter is required exactly from 0.33.0 on).
"""

from __future__ import annotations

import textwrap

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod, has_keyword, import_after_last_vllm_import, imported_names
from patcher.model import AttributeCall, Edit, Example, Fact, LeaveOneOut, Patch, Symptom

from .targets import GENERATOR, SPECULATORS_0_3_OR_0_4

LAYOUT_MODULE = "vllm.v1.attention.backends.utils"
RESOLVE = "resolve_kv_cache_layout"
SPECS_NAME = "kv_cache_spec"  # speculators 0.3.0's per-layer specs of rank 0, bound in __init__

# vLLM 0.29.0: get_kv_cache_config_from_groups needs the layout resolved first.
LAYOUT_RESOLVED_SINCE = {"vllm": ">=0.29.0"}

KV_CACHE_CONFIG_ASSIGNMENT = m.SimpleStatementLine(
    body=[m.Assign(value=m.Call(func=m.Name("get_kv_cache_config_from_groups")))]
)
RESOLVE_CALL = m.Call(func=m.Name(RESOLVE))

# vLLM 0.33.0: Executor.set_kv_cache_layout requires cp_kv_cache_interleave_size too.
INTERLEAVE_SIZE_REQUIRED_SINCE = {"vllm": ">=0.33.0"}
SET_LAYOUT = "set_kv_cache_layout"
INTERLEAVE_SIZE = "cp_kv_cache_interleave_size"
SET_LAYOUT_STATEMENT = m.SimpleStatementLine(body=[m.Expr(value=m.Call(func=m.Attribute(attr=m.Name(SET_LAYOUT))))])

# The engine core's two steps, with the generator's names (`{config}` is the expression the
# generator passes as vllm_config); the specs narrow the candidates for hybrid models.
RESOLVE_TEXT = """\
# vLLM 0.29+: resolve the KV cache layout before sizing the KV cache (as vLLM's engine core does)
kv_cache_layout = resolve_kv_cache_layout(
    {config},
    self.executor.get_supported_kv_cache_layouts(),
    list({specs}.values()),
)
self.executor.set_kv_cache_layout(kv_cache_layout.name)
"""


def resolve_statements(config: str) -> list[cst.BaseStatement]:
    text = RESOLVE_TEXT.format(config=config, specs=SPECS_NAME)
    # Parsed inside a block so that the comment stays with the first statement.
    block = cst.parse_module("if True:\n" + textwrap.indent(text, "    ")).body[0]
    assert isinstance(block, cst.If) and isinstance(block.body, cst.IndentedBlock)
    return list(block.body.body)


def config_argument(statement: cst.SimpleStatementLine) -> str:
    """The source of the vllm_config argument of `... = get_kv_cache_config_from_groups(...)`."""
    call = statement.body[0].value
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == "vllm_config":
            return cst.Module([]).code_for_node(arg.value)
    first = call.args[0] if call.args and call.args[0].keyword is None else None
    return cst.Module([]).code_for_node(first.value) if first is not None else "self.vllm_config"


def binds_name(body, name: str) -> bool:
    target = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name(name))])])
    return any(m.matches(s, target) for s in body)


class ResolveKvCacheLayout(PatchCodemod):
    """Before `kv_cache_config = get_kv_cache_config_from_groups(...)`, in a function that binds
    `kv_cache_spec` earlier: resolve the layout and hand it to the executor; import
    resolve_kv_cache_layout. Patched: a resolve_kv_cache_layout(...) call before that statement."""

    ANCHOR = (
        f"a statement kv_cache_config = get_kv_cache_config_from_groups(...) after {SPECS_NAME} = ... "
        "in the same function body"
    )

    def __init__(self, filename: str = "<source>") -> None:
        super().__init__(filename)
        self.needs_import = False

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        if not isinstance(updated.body, cst.IndentedBlock):
            return updated
        body = list(updated.body.body)
        index = next((i for i, s in enumerate(body) if m.matches(s, KV_CACHE_CONFIG_ASSIGNMENT)), None)
        if index is None:
            return updated
        if any(m.findall(s, RESOLVE_CALL) for s in body[:index]):
            self.found_patched()
            self.needs_import = True
            return updated
        if not binds_name(body[:index], SPECS_NAME):
            return updated
        self.rewrote()
        self.needs_import = True
        statement = body[index]
        new = resolve_statements(config_argument(statement))
        # The new lines take over the blank lines/comments above the kv_cache_config statement.
        new[0] = new[0].with_changes(leading_lines=(*statement.leading_lines, *new[0].leading_lines))
        body[index : index + 1] = [*new, statement.with_changes(leading_lines=())]
        return updated.with_changes(body=updated.body.with_changes(body=body))

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        if not self.needs_import or (LAYOUT_MODULE, RESOLVE) in imported_names(updated.body):
            return updated
        self.rewrote()
        statement = cst.parse_statement(f"from {LAYOUT_MODULE} import {RESOLVE}\n")
        return updated.with_changes(body=import_after_last_vllm_import(list(updated.body), statement))


def resolve_config_argument(body) -> str | None:
    """The source of the vllm_config given to the first resolve_kv_cache_layout(...) in `body`."""
    for statement in body:
        for call in m.findall(statement, RESOLVE_CALL):
            for arg in call.args:
                if arg.keyword is not None and arg.keyword.value == "vllm_config":
                    return cst.Module([]).code_for_node(arg.value)
            if call.args and call.args[0].keyword is None:
                return cst.Module([]).code_for_node(call.args[0].value)
    return None


class PassInterleaveSize(PatchCodemod):
    """`X.set_kv_cache_layout(name)` after a resolve_kv_cache_layout(config, ...) in the same
    function body: pass `config.parallel_config.cp_kv_cache_interleave_size` as the second
    argument (what vLLM 0.33's engine core passes). Patched: the call with two arguments, or
    with cp_kv_cache_interleave_size= (a layout call not preceded by a resolve is not ours)."""

    ANCHOR = f"a statement X.{SET_LAYOUT}(layout_name) after {RESOLVE}(vllm_config, ...) in the same function body"

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        if not isinstance(updated.body, cst.IndentedBlock):
            return updated
        body = list(updated.body.body)
        for index, statement in enumerate(body):
            if not m.matches(statement, SET_LAYOUT_STATEMENT):
                continue
            config = resolve_config_argument(body[:index])
            if config is None:
                continue
            call = statement.body[0].value
            if len(call.args) >= 2 or has_keyword(call, INTERLEAVE_SIZE):
                self.found_patched()
                continue
            if len(call.args) != 1:
                continue
            self.rewrote()
            body[index] = with_interleave_size(statement, call, config)
        return updated.with_changes(body=updated.body.with_changes(body=body))


def with_interleave_size(statement: cst.SimpleStatementLine, call: cst.Call, config: str) -> cst.SimpleStatementLine:
    """The statement with the interleave size as the call's second argument, one argument per line
    (the line would be over 120 characters otherwise), its comments and blank lines above kept."""
    code = cst.Module([]).code_for_node
    text = f"{code(call.func)}(\n    {code(call.args[0].value)},\n    {config}.parallel_config.{INTERLEAVE_SIZE},\n)\n"
    return cst.parse_statement(text).with_changes(leading_lines=statement.leading_lines)


BEFORE = """\
from vllm.config import CacheConfig
from vllm.v1.request import Request, RequestStatus

from .logging_utils import PipelineLogger


class VllmHiddenStatesGenerator:
    def __init__(self):
        kv_cache_spec_list = self.executor.collective_rpc("get_kv_cache_spec")
        kv_cache_spec = kv_cache_spec_list[0]
        kv_cache_groups = _get_kv_cache_groups_uniform_spec(kv_cache_spec)

        kv_cache_config = get_kv_cache_config_from_groups(
            vllm_config=self.vllm_config,
            kv_cache_groups=kv_cache_groups,
            available_memory=cache_memory,
        )
"""

AFTER = """\
from vllm.config import CacheConfig
from vllm.v1.request import Request, RequestStatus
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

from .logging_utils import PipelineLogger


class VllmHiddenStatesGenerator:
    def __init__(self):
        kv_cache_spec_list = self.executor.collective_rpc("get_kv_cache_spec")
        kv_cache_spec = kv_cache_spec_list[0]
        kv_cache_groups = _get_kv_cache_groups_uniform_spec(kv_cache_spec)

        # vLLM 0.29+: resolve the KV cache layout before sizing the KV cache (as vLLM's engine core does)
        kv_cache_layout = resolve_kv_cache_layout(
            self.vllm_config,
            self.executor.get_supported_kv_cache_layouts(),
            list(kv_cache_spec.values()),
        )
        self.executor.set_kv_cache_layout(
            kv_cache_layout.name,
            self.vllm_config.parallel_config.cp_kv_cache_interleave_size,
        )
        kv_cache_config = get_kv_cache_config_from_groups(
            vllm_config=self.vllm_config,
            kv_cache_groups=kv_cache_groups,
            available_memory=cache_memory,
        )
"""

PATCH = Patch(
    id="v14-kv-cache-layout",
    title="resolve the KV cache layout (and tell the workers) before get_kv_cache_config_from_groups",
    target=GENERATOR,
    requires=SPECULATORS_0_3_OR_0_4,
    edits=(
        Edit(
            ResolveKvCacheLayout,
            when=LAYOUT_RESOLVED_SINCE,
            answers="vllm.v1.attention.backends.utils defines resolve_kv_cache_layout, and the executor "
            "publishes the layout with set_kv_cache_layout",
            fact=Fact(
                "defines",
                LAYOUT_MODULE,
                name=RESOLVE,
                needs=(
                    Fact("defines", "vllm.v1.executor.abstract", "Executor", "set_kv_cache_layout"),
                    Fact("defines", "vllm.v1.executor.abstract", "Executor", "get_supported_kv_cache_layouts"),
                ),
            ),
        ),
        Edit(
            PassInterleaveSize,
            when=INTERLEAVE_SIZE_REQUIRED_SINCE,
            answers="Executor.set_kv_cache_layout requires cp_kv_cache_interleave_size (the engine core "
            "passes parallel_config's)",
            fact=Fact(
                "required-param",
                "vllm.v1.executor.abstract",
                "Executor.set_kv_cache_layout",
                INTERLEAVE_SIZE,
                needs=(Fact("defines", "vllm.config.parallel", "ParallelConfig", INTERLEAVE_SIZE),),
            ),
        ),
    ),
    examples=(
        Example(before=BEFORE, after=AFTER),
        # the config passed positionally; no vllm import to follow: after the last import
        Example(
            before="""
                import torch

                def build(self, kv_cache_spec_list):
                    kv_cache_spec = kv_cache_spec_list[0]
                    kv_cache_config = get_kv_cache_config_from_groups(cfg, groups, memory)
            """,
            after="""
                import torch
                from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

                def build(self, kv_cache_spec_list):
                    kv_cache_spec = kv_cache_spec_list[0]
                    # vLLM 0.29+: resolve the KV cache layout before sizing the KV cache (as vLLM's engine core does)
                    kv_cache_layout = resolve_kv_cache_layout(
                        cfg,
                        self.executor.get_supported_kv_cache_layouts(),
                        list(kv_cache_spec.values()),
                    )
                    self.executor.set_kv_cache_layout(
                        kv_cache_layout.name,
                        cfg.parallel_config.cp_kv_cache_interleave_size,
                    )
                    kv_cache_config = get_kv_cache_config_from_groups(cfg, groups, memory)
            """,
        ),
    ),
    satisfied=(
        AFTER,
        # the interleave size by keyword, the layout resolved with another name
        (
            "from vllm.v1.attention.backends.utils import resolve_kv_cache_layout\n"
            "def build(self):\n"
            "    layout = resolve_kv_cache_layout(vllm_config=self.vllm_config, supported=[['NHD']])\n"
            "    self.executor.set_kv_cache_layout(layout.name, cp_kv_cache_interleave_size=1)\n"
            "    kv_cache_config = get_kv_cache_config_from_groups(self.vllm_config, groups, memory)\n"
        ),
    ),
    near_misses=(
        # kv_cache_spec a parameter, not assigned before the call in the same body
        """
            import torch

            def build(self, kv_cache_spec):
                kv_cache_config = get_kv_cache_config_from_groups(cfg, groups, memory)
        """,
    ),
    attribute_calls=(
        AttributeCall(
            "self.executor",
            "get_supported_kv_cache_layouts",
            "vllm.v1.executor.multiproc_executor:MultiprocExecutor.get_supported_kv_cache_layouts",
        ),
        AttributeCall(
            "self.executor",
            "set_kv_cache_layout",
            "vllm.v1.executor.multiproc_executor:MultiprocExecutor.set_kv_cache_layout",
        ),
    ),
    upstream="vLLM 0.29.0: vllm/v1/engine/core.py (resolve_kv_cache_layout, then "
    "Executor.set_kv_cache_layout, before the KV cache config), vllm/config/cache.py "
    "(CacheConfig.get_resolved_kv_cache_layout); vLLM 0.33.0: vllm/v1/executor/abstract.py "
    "(Executor.set_kv_cache_layout(layout_name, cp_kv_cache_interleave_size))",
    without_it="without it on vLLM 0.29 and later: `ValueError: KV cache layout has not been resolved yet` from `get_kv_cache_config_from_groups()` while the generator is constructed (the engine core resolves the layout first; the generator drives the executor itself)",
    leave_one_out=(
        LeaveOneOut("0.32.0", Symptom("init", "ValueError", ("KV cache layout has not been resolved yet",))),
        LeaveOneOut("0.29.0", Symptom("init", "ValueError", ("KV cache layout has not been resolved yet",))),
        LeaveOneOut(
            "0.32.0",
            Symptom("init", "ValueError", ("KV cache layout has not been resolved yet",)),
            speculators="0.4.0.1",
        ),
    ),
)
