"""v8: DeepSeek-V2-family models: pass their layers llama_4_scaling, and let them past the
supports_eagle3 guard.

vLLM 0.12.0: DeepseekV2DecoderLayer.forward(positions, hidden_states, residual,
llama_4_scaling=None), with DeepseekV2Model.forward computing llama_4_scaling once per forward
from config.llama_4_scaling (vllm/model_executor/models/deepseek_v2.py). speculators 0.3.0's
replacement forward calls the layers with three arguments: on a model whose config sets
llama_4_scaling the query scaling is silently dropped (wrong hidden states). The edit computes
it as vLLM does and passes it only to layers whose forward takes it (Mistral-style models keep
the setting inside their attention and take no such argument).

Until vLLM 0.18.0, DeepseekV2ForCausalLM (and KimiK25ForConditionalGeneration) do not declare
SupportsEagle3, so 0.3.0's `if not supports_eagle3(model): raise ValueError(...)` rejects them
although their `model.model.layers` is exactly what the replacement forward walks. The guard is
relaxed to accept any model whose `.model` has `layers` (speculators 0.4.0 dropped it for that
test, so that edit is for 0.3.0 only; 0.4.0's forward drops llama_4_scaling as 0.3.0's does, so the
first edit is for both). Kimi-K2.5 keeps its decoder under `language_model`, not `model`: past the guard, 0.3.0's
`model.model` fails for it on every vLLM release (0.4.0 looks through get_language_model()); this
patch does not add that.

On vLLM 0.16's CPU build a tiny DeepSeek-V2 model cannot show more than the guard: its MLA
attention raises NotImplementedError("MLA is not supported on CPU."); with VLLM_MLA_DISABLE=1 the
unpatched guard raises "Model DeepseekV2ForCausalLM does not support hidden state extraction",
and with this patch extraction runs and returns every prompt's full rows (llama_4_scaling set
or not), but vLLM's own CPU output for that model (its pooling runner) differs from
transformers' and from itself across batch compositions, so no numbers can be checked there.

The guard's condition is "<=0.18.0,!=0.18.0": every release before 0.18.0 including 0.18.0's
own pre-releases and nightlies (PEP 440's "<0.18.0" excludes 0.18.0rc1 and 0.18.0rc2.dev45,
which may predate the change). Where the marker already exists the relaxed guard changes
nothing, so erring towards applying it is safe.
"""

from __future__ import annotations

import textwrap

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod
from patcher.model import Edit, Example, Fact, Patch

from .targets import SPECULATORS_0_3_OR_0_4, WORKER

PATCHED_FORWARD = "_patched_forward"
KWARGS = "layer_kwargs"

SCALING_SOURCE = """\
# DeepSeek-V2-family layers take llama_4_scaling, computed once per forward from
# config.llama_4_scaling as vLLM's DeepseekV2Model.forward does; other layers do not.
layer_kwargs = {}
llama_4_scaling = getattr(getattr(self, "config", None), "llama_4_scaling", None)
if llama_4_scaling is not None:
    import inspect

    first_layer = self.layers[self.start_layer]
    if "llama_4_scaling" in inspect.signature(first_layer.forward).parameters:
        scaling = 1 + llama_4_scaling["beta"] * torch.log(
            1
            + torch.floor(
                positions / llama_4_scaling["original_max_position_embeddings"]
            )
        )
        layer_kwargs["llama_4_scaling"] = scaling[..., None, None]
"""

LAYER_CALL = m.Call(func=m.Name("layer"))
KWARGS_INIT = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name(KWARGS))])])


def block_statements(source: str) -> list[cst.BaseStatement]:
    wrapper = cst.parse_module("if True:\n" + textwrap.indent(source, "    ")).body[0]
    assert isinstance(wrapper, cst.If) and isinstance(wrapper.body, cst.IndentedBlock)
    return list(wrapper.body.body)


def has_double_star(call: cst.Call, name: str) -> bool:
    return any(a.star == "**" and m.matches(a.value, m.Name(name)) for a in call.args)


def with_star_kwargs(call: cst.Call, name: str) -> cst.Call:
    """call(..., **name), in the call's own layout."""
    if has_double_star(call, name):
        return call
    args = list(call.args)
    new = cst.Arg(value=cst.Name(name), star="**")
    if not args:
        return call.with_changes(args=[new])
    last = args[-1]
    if isinstance(last.comma, cst.Comma):
        # one argument per line with a trailing comma: the new one inherits it
        others = [a.comma for a in args[:-1] if isinstance(a.comma, cst.Comma)]
        separator = others[0] if others else cst.Comma(whitespace_after=call.whitespace_before_args)
        args[-1] = last.with_changes(comma=separator)
        args.append(new.with_changes(comma=last.comma))
    else:
        # the space before ")" (a newline, say) moves behind the new last argument
        args[-1] = last.with_changes(
            comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")),
            whitespace_after_arg=cst.SimpleWhitespace(""),
        )
        args.append(new.with_changes(whitespace_after_arg=last.whitespace_after_arg))
    return call.with_changes(args=args)


def loop_calling_layer(statement: cst.CSTNode) -> bool:
    return isinstance(statement, cst.For) and bool(m.findall(statement, LAYER_CALL))


# vLLM 0.12.0: DeepSeek-V2-family decoder layers take llama_4_scaling.
LLAMA_4_SCALING_SINCE = {"vllm": ">=0.12.0"}


class DeepseekLayerScaling(PatchCodemod):
    """In _patched_forward: compute layer_kwargs before the loop over the layers and call
    layer(..., **layer_kwargs). Patched: the layer call passes **layer_kwargs."""

    ANCHOR = f"a loop calling layer(...) in {PATCHED_FORWARD}"

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        if updated.name.value != PATCHED_FORWARD or not isinstance(updated.body, cst.IndentedBlock):
            return updated
        calls = m.findall(updated, LAYER_CALL)
        if not calls:
            return updated
        if all(has_double_star(c, KWARGS) for c in calls) and m.findall(updated, KWARGS_INIT):
            self.found_patched()
            return updated
        body = list(updated.body.body)
        index = next((i for i, s in enumerate(body) if loop_calling_layer(s)), None)
        if index is None:
            return updated
        self.rewrote()
        loop = body[index]
        new_block = block_statements(SCALING_SOURCE)
        new_block[0] = new_block[0].with_changes(leading_lines=[*loop.leading_lines, *new_block[0].leading_lines])
        loop = loop.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        loop = m.replace(loop, LAYER_CALL, lambda call, extracted: with_star_kwargs(call, KWARGS))
        body[index : index + 1] = [*new_block, loop]
        return updated.with_changes(body=updated.body.with_changes(body=body))


NOT_SUPPORTS_EAGLE3 = m.UnaryOperation(
    operator=m.Not(), expression=m.Call(func=m.Name("supports_eagle3"), args=[m.Arg(value=m.Name())])
)
RELAXED_GUARD = m.BooleanOperation(left=NOT_SUPPORTS_EAGLE3, operator=m.And())

# Until vLLM 0.18.0 DeepseekV2ForCausalLM lacks SupportsEagle3; 0.18.0's pre-releases included.
GUARD_BEFORE = {"vllm": "<=0.18.0,!=0.18.0"}
# speculators 0.4.0 has no supports_eagle3 guard (it looks for `layers` through get_language_model()
# or `.model`): only 0.3.0's is relaxed. Its replacement forward drops llama_4_scaling as 0.3.0's does.
GUARD_RELEASES = {"speculators": "<0.4.0"}


class Eagle3GuardAcceptsDecoderModels(PatchCodemod):
    """`if not supports_eagle3(model):` -> `if not supports_eagle3(model) and not
    hasattr(getattr(model, "model", None), "layers"):`."""

    ANCHOR = "a test `if not supports_eagle3(model):`"

    def leave_If(self, original: cst.If, updated: cst.If) -> cst.If:
        if m.matches(updated.test, RELAXED_GUARD):
            self.found_patched()
            return updated
        if not m.matches(updated.test, NOT_SUPPORTS_EAGLE3):
            return updated
        self.rewrote()
        test = updated.test
        assert isinstance(test, cst.UnaryOperation) and isinstance(test.expression, cst.Call)
        model = cst.Module([]).code_for_node(test.expression.args[0].value)
        return updated.with_changes(
            test=cst.parse_expression(
                f'not supports_eagle3({model}) and not hasattr(getattr({model}, "model", None), "layers")'
            )
        )


BEFORE = """\
def _patched_forward(
    self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None
):
    residual = None

    for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer)):
        hidden_states, residual = layer(
            hidden_states=hidden_states, positions=positions, residual=residual
        )
    return hidden_states


class HiddenStatesWorkerExtension:
    def _setup_hidden_states_capture(self, layer_ids: list[int]):
        model = self.model_runner.model  # type: ignore[attr-defined]

        if not supports_eagle3(model):
            raise ValueError(
                f"Model {type(model).__name__} does not support hidden state extraction"
            )
"""

AFTER = (
    """\
def _patched_forward(
    self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None
):
    residual = None

"""
    + textwrap.indent(SCALING_SOURCE, "    ").replace("\n    \n", "\n\n")
    + """
    for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer)):
        hidden_states, residual = layer(
            hidden_states=hidden_states, positions=positions, residual=residual, **layer_kwargs
        )
    return hidden_states


class HiddenStatesWorkerExtension:
    def _setup_hidden_states_capture(self, layer_ids: list[int]):
        model = self.model_runner.model  # type: ignore[attr-defined]

        if not supports_eagle3(model) and not hasattr(getattr(model, "model", None), "layers"):
            raise ValueError(
                f"Model {type(model).__name__} does not support hidden state extraction"
            )
"""
)

PATCH = Patch(
    id="v8-worker-deepseek",
    title="worker: DeepSeek-V2-family layers get llama_4_scaling; the supports_eagle3 guard lets them in",
    target=WORKER,
    requires=SPECULATORS_0_3_OR_0_4,
    edits=(
        Edit(
            DeepseekLayerScaling,
            when=LLAMA_4_SCALING_SINCE,
            answers="DeepseekV2DecoderLayer.forward takes llama_4_scaling, computed by the base "
            "model's forward from config.llama_4_scaling",
            fact=Fact(
                "has-param",
                "vllm.model_executor.models.deepseek_v2",
                "DeepseekV2DecoderLayer.forward",
                "llama_4_scaling",
            ),
        ),
        Edit(
            Eagle3GuardAcceptsDecoderModels,
            when={**GUARD_BEFORE, **GUARD_RELEASES},
            answers="DeepseekV2ForCausalLM does not declare SupportsEagle3 (it does from 0.18.0)",
            fact=Fact(
                "lacks-base", "vllm.model_executor.models.deepseek_v2", "DeepseekV2ForCausalLM", "SupportsEagle3"
            ),
        ),
    ),
    examples=(Example(before=BEFORE, after=AFTER),),
    satisfied=(AFTER,),
    upstream="vLLM 0.12.0: vllm/model_executor/models/deepseek_v2.py (llama_4_scaling); vLLM "
    "0.18.0: DeepseekV2ForCausalLM and KimiK25ForConditionalGeneration declare SupportsEagle3; "
    "speculators 0.4.0 removed the supports_eagle3 guard",
    without_it="without it DeepSeek-V2-family models are refused (ValueError 'Model DeepseekV2ForCausalLM "
    "does not support hidden state extraction'), and with the guard relaxed alone, models whose "
    "config sets llama_4_scaling get hidden states without that scaling. Not needed for Llama "
    "models (the end-to-end run passes without it)",
    readme="DeepSeek-V2-family models: `llama_4_scaling` not passed to their layers (0.12.0) and `supports_eagle3` rejecting them (before 0.18.0); not needed for Llama",
    since="0.12.0 / <0.18.0",
)
