"""v7: the worker's patched forward embeds with embed_input_ids() and accepts extra keyword arguments.

vLLM 0.11.1 renamed the models' get_input_embeddings() to embed_input_ids() (vllm/model_executor/
models/*.py, interfaces.py). The forward that speculators binds in place of the base model's calls
the old name whenever no inputs_embeds are passed, which is every text prompt: AttributeError, in
the worker, already during vLLM's warm-up. Base models' forward() also takes extra keyword
arguments in newer vLLM (LlamaModel.forward(..., **extra_layer_kwargs); multimodal models pass
deepstack_input_embeds): the replacement must accept them. Upstream fix (the same two changes):
https://github.com/vllm-project/speculators/pull/225
"""

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch, Symptom

from .targets import SPECULATORS_0_3, WORKER

PATCHED_FORWARD = "_patched_forward"
OLD_NAME = "get_input_embeddings"
NEW_NAME = "embed_input_ids"


def self_method_call(name: str) -> "m.Shape":
    return m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(name)))


class _InPatchedForward(PatchCodemod):
    """Tracks whether the visitor is inside `def _patched_forward(...)`."""

    def __init__(self, filename: str = "<source>") -> None:
        super().__init__(filename)
        self.depth = 0

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        if node.name.value == PATCHED_FORWARD:
            self.depth += 1
        return True

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        if original.name.value == PATCHED_FORWARD:
            self.depth -= 1
            return self.leave_patched_forward(updated)
        return updated

    def leave_patched_forward(self, node: cst.FunctionDef) -> cst.FunctionDef:
        return node


# vLLM 0.11.1: get_input_embeddings -> embed_input_ids.
EMBED_INPUT_IDS_SINCE = {"vllm": ">=0.11.1"}


class EmbedInputIds(_InPatchedForward):
    """In _patched_forward: self.get_input_embeddings(x) -> self.embed_input_ids(x)."""

    ANCHOR = f"a call self.{OLD_NAME}(...) in {PATCHED_FORWARD}"

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if not self.depth:
            return updated
        if m.matches(updated, self_method_call(NEW_NAME)):
            self.found_patched()
            return updated
        if not m.matches(updated, self_method_call(OLD_NAME)):
            return updated
        self.rewrote()
        func = updated.func
        assert isinstance(func, cst.Attribute)
        return updated.with_changes(func=func.with_changes(attr=cst.Name(NEW_NAME)))


# Harmless on every release: a keyword catch-all the body never reads.
EXTRA_KWARGS_SINCE = {"vllm": ">=0.11.0"}
KWARGS_NAME = "_kwargs"


class PatchedForwardAcceptsKwargs(_InPatchedForward):
    """def _patched_forward(self, ...) -> def _patched_forward(self, ..., **_kwargs).

    Patched: the function has a ** parameter (of any name).
    """

    ANCHOR = f"a function {PATCHED_FORWARD}(...) without a ** parameter"

    @staticmethod
    def separator(params: cst.Parameters, node: cst.FunctionDef) -> cst.Comma:
        """The comma (and line break with indent) between two parameters of this layout."""
        items = list(params.params) + ([params.star_arg] if isinstance(params.star_arg, cst.Param) else [])
        items += list(params.kwonly_params)
        for item in items[:-1]:
            if isinstance(item.comma, cst.Comma):
                return item.comma
        return cst.Comma(whitespace_after=node.whitespace_before_params)

    def leave_patched_forward(self, node: cst.FunctionDef) -> cst.FunctionDef:
        params = node.params
        if params.star_kwarg is not None:
            self.found_patched()
            return node
        self.rewrote()
        star_kwarg = cst.Param(name=cst.Name(KWARGS_NAME), star="**")
        # The parameter the new one follows: the last keyword-only one, *args, or the last plain one.
        if params.kwonly_params:
            field, index = "kwonly_params", len(params.kwonly_params) - 1
            last = params.kwonly_params[-1]
        elif isinstance(params.star_arg, cst.Param):
            field, index, last = "star_arg", None, params.star_arg
        elif params.params:
            field, index = "params", len(params.params) - 1
            last = params.params[-1]
        else:
            return node.with_changes(params=params.with_changes(star_kwarg=star_kwarg))
        if isinstance(last.comma, cst.Comma):
            # one parameter per line with a trailing comma: the new one takes the same layout
            star_kwarg = star_kwarg.with_changes(comma=last.comma)
            new_last = last.with_changes(comma=self.separator(params, node))
        else:
            # the space before ")" (a newline, say) moves behind the new last parameter
            star_kwarg = star_kwarg.with_changes(whitespace_after_param=last.whitespace_after_param)
            new_last = last.with_changes(
                comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")),
                whitespace_after_param=cst.SimpleWhitespace(""),
            )
        if index is None:
            params = params.with_changes(star_arg=new_last)
        else:
            items = list(getattr(params, field))
            items[index] = new_last
            params = params.with_changes(**{field: items})
        return node.with_changes(params=params.with_changes(star_kwarg=star_kwarg))


BEFORE = """\
def _patched_forward(
    self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None
):
    if get_pp_group().is_first_rank:
        hidden_states = (
            inputs_embeds
            if inputs_embeds is not None
            else self.get_input_embeddings(input_ids)
        )
        residual = None
    return hidden_states
"""

AFTER = """\
def _patched_forward(
    self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **_kwargs
):
    if get_pp_group().is_first_rank:
        hidden_states = (
            inputs_embeds
            if inputs_embeds is not None
            else self.embed_input_ids(input_ids)
        )
        residual = None
    return hidden_states
"""

PATCH = Patch(
    id="v7-worker-embed-input-ids",
    title="worker: the patched forward embeds with embed_input_ids() and takes **kwargs",
    target=WORKER,
    requires=SPECULATORS_0_3,
    edits=(
        Edit(
            EmbedInputIds,
            when=EMBED_INPUT_IDS_SINCE,
            answers="models' get_input_embeddings() is named embed_input_ids()",
            fact=Fact(
                "lacks",
                "vllm.model_executor.models.llama",
                "LlamaModel",
                "get_input_embeddings",
                needs=(Fact("defines", "vllm.model_executor.models.llama", "LlamaModel", "embed_input_ids"),),
            ),
        ),
        Edit(
            PatchedForwardAcceptsKwargs,
            when=EXTRA_KWARGS_SINCE,
            answers="base models' forward() may be called with extra keyword arguments",
            fact=Fact(
                "has-param", "vllm.model_executor.models.qwen3_vl", "Qwen3LLMModel.forward", "deepstack_input_embeds"
            ),
        ),
    ),
    examples=(
        Example(before=BEFORE, after=AFTER),
        Example(
            before="""
                def _patched_forward(self, input_ids, positions):
                    return self.get_input_embeddings(input_ids)


                def other(self, input_ids):
                    return self.get_input_embeddings(input_ids)
            """,
            after="""
                def _patched_forward(self, input_ids, positions, **_kwargs):
                    return self.embed_input_ids(input_ids)


                def other(self, input_ids):
                    return self.get_input_embeddings(input_ids)
            """,
        ),
    ),
    satisfied=(
        # speculators 0.4.0's shape
        (
            "def _patched_forward(\n"
            "    self,\n"
            "    input_ids,\n"
            "    positions,\n"
            "    intermediate_tensors=None,\n"
            "    inputs_embeds=None,\n"
            "    **_kwargs,\n"
            "):\n"
            "    hidden_states = (\n"
            "        inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)\n"
            "    )\n"
            "    return hidden_states\n"
        ),
    ),
    near_misses=(
        # a model whose forward embeds through its own embed_tokens: no get_input_embeddings() call
        """
            def _patched_forward(self, input_ids, positions):
                return self.embed_tokens(input_ids)
        """,
    ),
    upstream="vLLM 0.11.1: models' get_input_embeddings() renamed embed_input_ids() "
    "(vllm/model_executor/models/interfaces.py); speculators fix "
    "https://github.com/vllm-project/speculators/pull/225",
    fixed_in="speculators 0.4.0",
    without_it="without it the worker fails during vLLM's warm-up, before any prompt: `AttributeError: 'LlamaModel' object has no attribute 'get_input_embeddings'`; the patched forward also accepts extra keyword arguments",
    leave_one_out=(
        LeaveOneOut("0.16.0", Symptom("init", "RuntimeError", ("has no attribute 'get_input_embeddings'",))),
        LeaveOneOut(
            "0.16.0",
            Symptom("init", "RuntimeError", ("has no attribute 'get_input_embeddings'",)),
            calls="all",
            tensor_parallel=2,
        ),
    ),
    since="0.11.1",
    on_fixed_in="already-satisfied",
)
