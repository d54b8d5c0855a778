"""v8: DeepSeek-V2-family models: pass their layers llama_4_scaling.

vLLM 0.12.0: DeepseekV2DecoderLayer.forward(positions, hidden_states, residual,
llama_4_scaling=None), with DeepseekV2Model.forward computing llama_4_scaling once per forward
from config.llama_4_scaling (vllm/model_executor/models/deepseek_v2.py). speculators 0.3.0's
replacement forward calls the layers with three arguments: on a model whose config sets
llama_4_scaling the query scaling is silently dropped (wrong hidden states). The edit computes
it as vLLM does and passes it only to layers whose forward takes it (Mistral-style models keep
the setting inside their attention and take no such argument). speculators 0.4.0's
replacement forward calls the layers with three arguments too (0.4.0 and 0.4.0.1 share it), so
the same edit serves both release lines. The config read is the
decoder's own (`self.config` of DeepseekV2Model): inside Kimi-K2.5's wrapper that is its text
config, so the same code serves the wrapper once v20 has found its decoder.

Until vLLM 0.18.0 the supports_eagle3 guard refuses DeepSeek-V2-family models and Kimi-K2.5:
v20 owns that guard (it accepts every model whose decoder it finds, `.model.layers` or a
multimodal wrapper's language model). This patch carried a guard edit first, testing
`model.model.layers`, which could never let Kimi-K2.5 in (its decoder is
`language_model.model`); it moved to v20 with the decoder lookup it depends on.

On vLLM's CPU build a tiny DeepSeek-V3 runs only with VLLM_MLA_DISABLE=1 ("MLA is not supported
on CPU" otherwise); docs/models.md says what that run shows and what only the GPU run shows.
"""

from __future__ import annotations

import textwrap

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch

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
"""
)

PATCH = Patch(
    id="v8-worker-deepseek",
    title="worker: DeepSeek-V2-family layers get llama_4_scaling",
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
    ),
    examples=(Example(before=BEFORE, after=AFTER),),
    satisfied=(AFTER,),
    near_misses=(
        # vLLM's own forward (not the patched one) with the same layer loop
        """
            def forward(
                self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None
            ):
                residual = None

                for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer)):
                    hidden_states, residual = layer(
                        hidden_states=hidden_states, positions=positions, residual=residual
                    )
                return hidden_states
        """,
    ),
    upstream="vLLM 0.12.0: vllm/model_executor/models/deepseek_v2.py (llama_4_scaling)",
    without_it="without it, models whose config sets llama_4_scaling (DeepSeek-V3-architecture models "
    "such as Mistral Large 3) get hidden states without that query scaling, silently. Not needed for "
    "Llama models, nor for DeepSeek-V3 and Kimi-K2.5, whose configs set none (their end-to-end runs "
    "pass without it)",
    leave_one_out=(
        LeaveOneOut("0.16.0", None, calls="all"),
        LeaveOneOut("0.16.0", None, calls="all", tensor_parallel=2),
        LeaveOneOut("0.16.0", None, calls="all", tensor_parallel=2, speculators="0.4.0.1"),
    ),
    since="0.12.0",
)
