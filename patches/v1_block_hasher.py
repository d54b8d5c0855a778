"""v1: give every Request a block hasher, now that prefix caching is on by default.

vLLM 0.12.0: vllm/config/cache.py (CacheConfig.enable_prefix_caching defaults to True), so the
KV block pool hashes every full block of a Request and needs its block_hasher (vllm/v1/request.py);
get_hash_fn_by_name lives in vllm.utils.hashing since https://github.com/vllm-project/vllm/pull/27151
(vLLM 0.11.1). Upstream fix: https://github.com/vllm-project/speculators/pull/225
"""

from __future__ import annotations

import bisect
import textwrap

import libcst as cst
from libcst.helpers import get_full_name_for_node

from patcher import shapes as m
from patcher.codemod import PatchCodemod, append_arg, has_keyword, imported_names, keyword_arg
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch, Symptom

from .targets import GENERATOR, SPECULATORS_0_3

HASHING_MODULE = "vllm.utils.hashing"
KV_CACHE_UTILS = "vllm.v1.core.kv_cache_utils"
NEEDED_IMPORTS = (
    (HASHING_MODULE, "get_hash_fn_by_name"),
    (KV_CACHE_UTILS, "get_request_block_hasher"),
    (KV_CACHE_UTILS, "init_none_hash"),
)


def self_attribute(name: str) -> m.Shape:
    return m.Attribute(value=m.Name("self"), attr=m.Name(name))


SCHEDULER_ASSIGNMENT = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(target=self_attribute("scheduler"))],
            value=m.Call(func=m.Name("Scheduler")),
        )
    ]
)
HASHER_ASSIGNMENT = m.Assign(
    targets=[m.AssignTarget(target=self_attribute("block_hasher"))],
    value=m.Call(func=m.Name("get_request_block_hasher")),
)

# speculators 0.4.0's text (it places it after initialize_from_config; any place in __init__
# after the config exists will do), made only with prefix caching on, as vLLM's EngineCore makes
# its hasher (v1/engine/core.py): with caching off (v6) nothing reads the hashes, and hashing every
# prompt's blocks cost 0.021 s of a profiled call of 64 x 1024 tokens on the CPU build
# (bench/results/extract/extract-cpu-tiny-profile-0.16.0.md).
HASHER_SETUP = """\

# Create block hasher for request KV cache management
# Following vLLM's pattern in v1/engine/core.py
self.block_hasher = None
if self.vllm_config.cache_config.enable_prefix_caching:
    caching_hash_fn = get_hash_fn_by_name(
        self.vllm_config.cache_config.prefix_caching_hash_algo
    )
    init_none_hash(caching_hash_fn)
    self.block_hasher = get_request_block_hasher(
        self.vllm_config.cache_config.block_size,
        caching_hash_fn,
    )
"""


def hasher_setup() -> list[cst.BaseStatement]:
    # Parsed inside a block so that the leading blank line and comments stay with the
    # first statement (at module level they would become the module header).
    block = cst.parse_module("if True:\n" + textwrap.indent(HASHER_SETUP, "    ")).body[0]
    assert isinstance(block, cst.If) and isinstance(block.body, cst.IndentedBlock)
    return list(block.body.body)


def with_names(node: cst.ImportFrom, names: list[str]) -> cst.ImportFrom:
    """Add `names` to a from-import in its own layout, in sorted place if it is sorted."""
    assert not isinstance(node.names, cst.ImportStar)
    aliases = list(node.names)
    separator = next(
        (a.comma for a in aliases if isinstance(a.comma, cst.Comma)),
        cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")),
    )
    last_comma = aliases[-1].comma
    keep_sorted = [a.evaluated_name for a in aliases] == sorted(a.evaluated_name for a in aliases)
    for name in names:
        current = [a.evaluated_name for a in aliases]
        index = bisect.bisect(current, name) if keep_sorted else len(aliases)
        if index == len(aliases):
            aliases[-1] = aliases[-1].with_changes(comma=separator)
            aliases.append(cst.ImportAlias(name=cst.Name(name), comma=last_comma))
        else:
            aliases.insert(index, cst.ImportAlias(name=cst.Name(name), comma=separator))
    return node.with_changes(names=aliases)


def with_new_imports(body: list[cst.BaseStatement], missing: list[tuple[str, str]]) -> list[cst.BaseStatement]:
    """`from module import a, b` per module, after the last top-level import (else after the
    docstring and __future__ imports)."""
    by_module: dict[str, list[str]] = {}
    for module, name in missing:
        by_module.setdefault(module, []).append(name)
    new = [cst.parse_statement(f"from {module} import {', '.join(names)}\n") for module, names in by_module.items()]
    imports = [i for i, s in enumerate(body) if m.matches(s, m.SimpleStatementLine(body=[m.ImportFrom() | m.Import()]))]
    if imports:
        at = imports[-1] + 1
    else:
        docstring = m.SimpleStatementLine(body=[m.Expr(value=m.SimpleString() | m.ConcatenatedString())])
        at = 1 if body and m.matches(body[0], docstring) else 0
    return [*body[:at], *new, *body[at:]]


# vLLM 0.12.0: prefix caching on by default makes the hasher mandatory (0.11.1 already has
# every function it calls).
BLOCK_HASHER_SINCE = {"vllm": ">=0.12.0"}


class BlockHasherSetup(PatchCodemod):
    """In __init__, after `self.scheduler = Scheduler(...)`, build `self.block_hasher` once
    (None unless prefix caching is on, as vLLM's EngineCore does).

    Imports `get_hash_fn_by_name` (a new from-import placed before the kv_cache_utils one)
    and adds `get_request_block_hasher, init_none_hash` to the existing
    `from vllm.v1.core.kv_cache_utils import (...)`; names already imported are left alone.
    Patched: `self.block_hasher = get_request_block_hasher(...)` anywhere in __init__.
    """

    ANCHOR = "a statement self.scheduler = Scheduler(...) in __init__"

    def __init__(self, filename: str = "<source>") -> None:
        super().__init__(filename)
        self.needs_imports = False

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        if updated.name.value != "__init__" or not isinstance(updated.body, cst.IndentedBlock):
            return updated
        if m.findall(updated, HASHER_ASSIGNMENT):
            self.found_patched()
            self.needs_imports = True
            return updated
        body = list(updated.body.body)
        index = next((i for i, s in enumerate(body) if m.matches(s, SCHEDULER_ASSIGNMENT)), None)
        if index is None:
            return updated
        self.rewrote()
        self.needs_imports = True
        body[index + 1 : index + 1] = hasher_setup()
        return updated.with_changes(body=updated.body.with_changes(body=body))

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        if not self.needs_imports:
            return updated
        present = imported_names(updated.body)
        missing = [(module, name) for module, name in NEEDED_IMPORTS if (module, name) not in present]
        if not missing:
            return updated
        self.rewrote()
        body = list(updated.body)
        anchor = next(
            (
                i
                for i, s in enumerate(body)
                if m.matches(s, m.SimpleStatementLine(body=[m.ImportFrom(relative=[])]))
                and get_full_name_for_node(s.body[0].module) == KV_CACHE_UTILS
                and not isinstance(s.body[0].names, cst.ImportStar)
            ),
            None,
        )
        if anchor is None:  # no from-import of kv_cache_utils to extend: new ones after the last import
            return updated.with_changes(body=with_new_imports(body, missing))
        statement = body[anchor]
        kv_names = [name for module, name in missing if module == KV_CACHE_UTILS]
        if kv_names:
            statement = statement.with_changes(body=[with_names(statement.body[0], kv_names)])
        body[anchor] = statement
        if (HASHING_MODULE, "get_hash_fn_by_name") in missing:
            new_import = cst.parse_statement(f"from {HASHING_MODULE} import get_hash_fn_by_name\n")
            # The new import takes over the comments/blank lines above the kv_cache_utils one.
            body[anchor] = statement.with_changes(leading_lines=())
            body.insert(anchor, new_import.with_changes(leading_lines=statement.leading_lines))
        return updated.with_changes(body=body)


REQUEST_CALL = m.Call(func=m.Name("Request"))


class RequestBlockHasher(PatchCodemod):
    """Request(...) -> Request(..., block_hasher=self.block_hasher)."""

    ANCHOR = "a call Request(...)"

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if not m.matches(updated, REQUEST_CALL):
            return updated
        if has_keyword(updated, "block_hasher"):
            self.found_patched()
            return updated
        self.rewrote()
        return append_arg(updated, keyword_arg("block_hasher", cst.parse_expression("self.block_hasher")))


BEFORE = """\
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import (
    _get_kv_cache_groups_uniform_spec,
    get_kv_cache_config_from_groups,
    unify_hybrid_kv_cache_specs,
)
from vllm.v1.request import Request


class Generator:
    def __init__(self, vllm_config, kv_cache_config, structured_output_manager):
        self.vllm_config = vllm_config
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=structured_output_manager,
        )

        self.executor.initialize_from_config([kv_cache_config])

    def add(self, ids):
        req = Request(
            request_id="req_0_0",
            prompt_token_ids=ids,
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            eos_token_id=2,
            arrival_time=0.0,
        )
        self.scheduler.add_request(req)
"""

AFTER = """\
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


class Generator:
    def __init__(self, vllm_config, kv_cache_config, structured_output_manager):
        self.vllm_config = vllm_config
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=structured_output_manager,
        )

        # Create block hasher for request KV cache management
        # Following vLLM's pattern in v1/engine/core.py
        self.block_hasher = None
        if self.vllm_config.cache_config.enable_prefix_caching:
            caching_hash_fn = get_hash_fn_by_name(
                self.vllm_config.cache_config.prefix_caching_hash_algo
            )
            init_none_hash(caching_hash_fn)
            self.block_hasher = get_request_block_hasher(
                self.vllm_config.cache_config.block_size,
                caching_hash_fn,
            )

        self.executor.initialize_from_config([kv_cache_config])

    def add(self, ids):
        req = Request(
            request_id="req_0_0",
            prompt_token_ids=ids,
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            eos_token_id=2,
            arrival_time=0.0,
            block_hasher=self.block_hasher,
        )
        self.scheduler.add_request(req)
"""

PATCH = Patch(
    id="v1-block-hasher",
    title="build a request block hasher in __init__ and pass it to every Request",
    target=GENERATOR,
    requires=SPECULATORS_0_3,
    edits=(
        Edit(
            BlockHasherSetup,
            when=BLOCK_HASHER_SINCE,
            answers="vllm.utils.hashing.get_hash_fn_by_name exists, and "
            "vllm.v1.core.kv_cache_utils has init_none_hash and get_request_block_hasher",
            fact=Fact(
                "default-value",
                "vllm.config.cache",
                "CacheConfig",
                "enable_prefix_caching",
                value="True",
                needs=(
                    Fact("defines", "vllm.utils.hashing", name="get_hash_fn_by_name"),
                    Fact("defines", "vllm.v1.core.kv_cache_utils", name="get_request_block_hasher"),
                    Fact("defines", "vllm.v1.core.kv_cache_utils", name="init_none_hash"),
                ),
            ),
        ),
        Edit(
            RequestBlockHasher,
            when=BLOCK_HASHER_SINCE,
            answers="Request.__init__ accepts block_hasher (needed: enable_prefix_caching defaults to True)",
            fact=Fact(
                "default-value",
                "vllm.config.cache",
                "CacheConfig",
                "enable_prefix_caching",
                value="True",
                needs=(Fact("has-param", "vllm.v1.request", "Request.__init__", "block_hasher"),),
            ),
        ),
    ),
    examples=(
        Example(before=BEFORE, after=AFTER),
        Example(
            before="""
                from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups


                class G:
                    def __init__(self):
                        self.scheduler = Scheduler(vllm_config=self.vllm_config)

                    def add(self):
                        return Request(request_id="r", prompt_token_ids=[1], sampling_params=None)
            """,
            after="""
                from vllm.utils.hashing import get_hash_fn_by_name
                from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_request_block_hasher, init_none_hash


                class G:
                    def __init__(self):
                        self.scheduler = Scheduler(vllm_config=self.vllm_config)

                        # Create block hasher for request KV cache management
                        # Following vLLM's pattern in v1/engine/core.py
                        self.block_hasher = None
                        if self.vllm_config.cache_config.enable_prefix_caching:
                            caching_hash_fn = get_hash_fn_by_name(
                                self.vllm_config.cache_config.prefix_caching_hash_algo
                            )
                            init_none_hash(caching_hash_fn)
                            self.block_hasher = get_request_block_hasher(
                                self.vllm_config.cache_config.block_size,
                                caching_hash_fn,
                            )

                    def add(self):
                        return Request(request_id="r", prompt_token_ids=[1], sampling_params=None, block_hasher=self.block_hasher)
            """,
        ),
        Example(
            before='''
                """Generator."""
                import torch


                class G:
                    def __init__(self):
                        self.scheduler = Scheduler(vllm_config=self.vllm_config)

                    def add(self):
                        return Request(request_id="r")
            ''',
            after='''
                """Generator."""
                import torch
                from vllm.utils.hashing import get_hash_fn_by_name
                from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash


                class G:
                    def __init__(self):
                        self.scheduler = Scheduler(vllm_config=self.vllm_config)

                        # Create block hasher for request KV cache management
                        # Following vLLM's pattern in v1/engine/core.py
                        self.block_hasher = None
                        if self.vllm_config.cache_config.enable_prefix_caching:
                            caching_hash_fn = get_hash_fn_by_name(
                                self.vllm_config.cache_config.prefix_caching_hash_algo
                            )
                            init_none_hash(caching_hash_fn)
                            self.block_hasher = get_request_block_hasher(
                                self.vllm_config.cache_config.block_size,
                                caching_hash_fn,
                            )

                    def add(self):
                        return Request(request_id="r", block_hasher=self.block_hasher)
            ''',
        ),
    ),
    satisfied=(
        AFTER,
        # speculators 0.4.0's shape: the hasher after initialize_from_config, not after Scheduler
        (
            "from vllm.utils.hashing import get_hash_fn_by_name\n"
            "from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash\n"
            "\n"
            "\n"
            "class G:\n"
            "    def __init__(self):\n"
            "        self.scheduler = Scheduler(vllm_config=self.vllm_config, block_size=16)\n"
            "        self.executor.initialize_from_config(kv_cache_configs)\n"
            "        caching_hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)\n"
            "        init_none_hash(caching_hash_fn)\n"
            "        self.block_hasher = get_request_block_hasher(16, caching_hash_fn)\n"
            "\n"
            "    def add(self):\n"
            '        return Request(request_id="r", block_hasher=self.block_hasher)\n'
        ),
    ),
    near_misses=(
        # the scheduler built in a helper method, not assigned in __init__: nowhere to set up the hasher
        '''
            """Generator."""
            import torch


            class G:
                def __init__(self):
                    self.scheduler = self._build_scheduler()

                def _build_scheduler(self):
                    return Scheduler(vllm_config=self.vllm_config)
        ''',
    ),
    upstream="vLLM 0.12.0: vllm/config/cache.py (enable_prefix_caching defaults to True), "
    "vllm/v1/request.py (block_hasher); https://github.com/vllm-project/vllm/pull/27151 "
    "(vllm.utils.hashing, 0.11.1); speculators fix https://github.com/vllm-project/speculators/pull/225",
    fixed_in="speculators 0.4.0",
    without_it="without it a bare `AssertionError` in `block_pool.cache_full_blocks` once a prompt fills a 16-token KV block, but only when v6 is left out too: with prefix caching off, no block is cached. With prefix caching on, prompts sharing a prefix of 16+ tokens come back short or wrong (0.4.0 turns it off too)",
    leave_one_out=(
        LeaveOneOut("0.16.0", None, calls="all"),
        LeaveOneOut(
            "0.16.0",
            Symptom("generate 1", "AssertionError", where="block_pool.py:cache_full_blocks"),
            also_skip=("v6",),
        ),
        LeaveOneOut("0.16.0", None, calls="all", tensor_parallel=2),
    ),
    on_fixed_in="already-satisfied",
)
