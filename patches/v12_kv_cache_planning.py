"""v12: import the KV cache planning helpers from vllm.v1.core.kv_cache_planning, where they moved.

vLLM 0.33.0: vllm/v1/core/kv_cache_planning.py now defines get_kv_cache_config_from_groups,
_get_kv_cache_groups_uniform_spec and unify_hybrid_kv_cache_specs (same signatures as in 0.32.0);
vllm/v1/core/kv_cache_utils.py no longer has them, nor re-exports them. get_request_block_hasher
and init_none_hash (v1) stay in kv_cache_utils.
"""

from __future__ import annotations

import libcst as cst
from libcst.helpers import get_full_name_for_node

from patcher import shapes as m
from patcher.codemod import PatchCodemod
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch, Symptom

from .targets import GENERATOR, SPECULATORS_0_3_OR_0_4

KV_CACHE_UTILS = "vllm.v1.core.kv_cache_utils"
KV_CACHE_PLANNING = "vllm.v1.core.kv_cache_planning"
MOVED = ("_get_kv_cache_groups_uniform_spec", "get_kv_cache_config_from_groups", "unify_hybrid_kv_cache_specs")

# vLLM 0.33.0 moved them (kv_cache_utils keeps the hashing helpers).
KV_CACHE_PLANNING_SINCE = {"vllm": ">=0.33.0"}


def from_import_of(statement: cst.BaseStatement, module: str) -> cst.ImportFrom | None:
    """The `from <module> import a, b` a top-level statement is, if it is one (no star, absolute)."""
    if not m.matches(statement, m.SimpleStatementLine(body=[m.ImportFrom(relative=[])])):
        return None
    node = statement.body[0]
    if node.module is None or isinstance(node.names, cst.ImportStar):
        return None
    return node if get_full_name_for_node(node.module) == module else None


def planning_import(aliases: list[cst.ImportAlias], like: cst.ImportFrom) -> cst.SimpleStatementLine:
    """`from kv_cache_planning import ...` with `aliases`, one per line if `like` is parenthesized."""
    names = [a.name.value if a.asname is None else f"{a.name.value} as {a.asname.name.value}" for a in aliases]
    if like.lpar is not None:
        text = f"from {KV_CACHE_PLANNING} import (\n" + "".join(f"    {n},\n" for n in names) + ")\n"
    else:
        text = f"from {KV_CACHE_PLANNING} import {', '.join(names)}\n"
    statement = cst.parse_statement(text)
    assert isinstance(statement, cst.SimpleStatementLine)
    return statement


class ImportFromKvCachePlanning(PatchCodemod):
    """`from vllm.v1.core.kv_cache_utils import (...)`: the moved names go to a new
    `from vllm.v1.core.kv_cache_planning import (...)` just above it, in the same layout; the
    kv_cache_utils import keeps the others (v1's hashing helpers) or goes if none is left.
    Patched: no moved name imported from kv_cache_utils, and one imported from kv_cache_planning.
    """

    ANCHOR = f"a top-level from {KV_CACHE_UTILS} import of {', '.join(MOVED)}"

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        body = list(updated.body)
        planning = [from_import_of(s, KV_CACHE_PLANNING) for s in body]
        planned = any(a.evaluated_name in MOVED for node in planning if node is not None for a in node.names)
        out: list[cst.BaseStatement] = []
        for statement in body:
            node = from_import_of(statement, KV_CACHE_UTILS)
            moved = [a for a in node.names if a.evaluated_name in MOVED] if node is not None else []
            if not moved:
                out.append(statement)
                continue
            self.rewrote()
            kept = [a for a in node.names if a.evaluated_name not in MOVED]
            new_import = planning_import(moved, node)
            out.append(new_import.with_changes(leading_lines=statement.leading_lines))
            if kept:
                last = node.names[-1]
                if kept[-1] is not last:  # the old last took the closing comma (or none) with it
                    kept[-1] = kept[-1].with_changes(comma=last.comma)
                rest = statement.with_changes(body=[node.with_changes(names=kept)], leading_lines=())
                out.append(rest)
        if not self.rewrites:
            if planned:
                self.found_patched()
            return updated
        return updated.with_changes(body=out)


BEFORE = """\
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    _get_kv_cache_groups_uniform_spec,
    get_kv_cache_config_from_groups,
    get_request_block_hasher,
    init_none_hash,
    unify_hybrid_kv_cache_specs,
)
from vllm.v1.request import Request
"""

AFTER = """\
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_planning import (
    _get_kv_cache_groups_uniform_spec,
    get_kv_cache_config_from_groups,
    unify_hybrid_kv_cache_specs,
)
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.request import Request
"""

PATCH = Patch(
    id="v12-kv-cache-planning",
    title="import get_kv_cache_config_from_groups and its helpers from vllm.v1.core.kv_cache_planning",
    target=GENERATOR,
    requires=SPECULATORS_0_3_OR_0_4,
    edits=(
        Edit(
            ImportFromKvCachePlanning,
            when=KV_CACHE_PLANNING_SINCE,
            answers="vllm.v1.core.kv_cache_planning defines get_kv_cache_config_from_groups, "
            "_get_kv_cache_groups_uniform_spec and unify_hybrid_kv_cache_specs",
            fact=Fact(
                "defines",
                KV_CACHE_PLANNING,
                name="get_kv_cache_config_from_groups",
                needs=(
                    Fact("defines", KV_CACHE_PLANNING, name="_get_kv_cache_groups_uniform_spec"),
                    Fact("defines", KV_CACHE_PLANNING, name="unify_hybrid_kv_cache_specs"),
                ),
            ),
        ),
    ),
    examples=(
        # after v1, as on vLLM 0.33 (v1 runs first)
        Example(before=BEFORE, after=AFTER),
        # speculators 0.3.0's own import, v1 left out: nothing stays in kv_cache_utils
        Example(
            before="""
                import torch

                # kv cache
                from vllm.v1.core.kv_cache_utils import (
                    _get_kv_cache_groups_uniform_spec,
                    get_kv_cache_config_from_groups,
                    unify_hybrid_kv_cache_specs,
                )
                from vllm.v1.request import Request
            """,
            after="""
                import torch

                # kv cache
                from vllm.v1.core.kv_cache_planning import (
                    _get_kv_cache_groups_uniform_spec,
                    get_kv_cache_config_from_groups,
                    unify_hybrid_kv_cache_specs,
                )
                from vllm.v1.request import Request
            """,
        ),
        # one line; a name that did not move stays
        Example(
            before="""
                from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, init_none_hash
            """,
            after="""
                from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
                from vllm.v1.core.kv_cache_utils import init_none_hash
            """,
        ),
    ),
    satisfied=(
        AFTER,
        "from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups\n",
    ),
    near_misses=(
        # only v1's hashing helpers, which stay in kv_cache_utils: none of the planning helpers
        """
            from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        """,
    ),
    upstream="vLLM 0.33.0: vllm/v1/core/kv_cache_planning.py (get_kv_cache_config_from_groups, "
    "_get_kv_cache_groups_uniform_spec, unify_hybrid_kv_cache_specs moved out of "
    "vllm/v1/core/kv_cache_utils.py)",
    without_it="without it on vLLM 0.33: `ImportError: cannot import name '_get_kv_cache_groups_uniform_spec' from 'vllm.v1.core.kv_cache_utils'` when the generator is imported (the three planning helpers moved to `vllm.v1.core.kv_cache_planning`; v1's hashing helpers stay)",
    leave_one_out=(
        LeaveOneOut(
            "0.33.0", Symptom("verify", "ImportError", ("cannot import name '_get_kv_cache_groups_uniform_spec'",))
        ),
        LeaveOneOut(
            "0.33.0",
            Symptom("verify", "ImportError", ("cannot import name '_get_kv_cache_groups_uniform_spec'",)),
            speculators="0.4.0.1",
        ),
    ),
)
