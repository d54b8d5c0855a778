"""v20: the worker finds the decoder of a multimodal wrapper (Kimi-K2.5) through get_language_model(),
and the supports_eagle3 guard lets in every model whose decoder it can find.

speculators 0.3.0's `_setup_hidden_states_capture` replaces the forward of `model.model`. vLLM's
multimodal wrappers keep the decoder inside their language model instead: Kimi-K2.5
(`KimiK25ForConditionalGeneration`, vLLM 0.16 and later, vllm/model_executor/models/kimi_k25.py)
holds a `DeepseekV2ForCausalLM` as `self.language_model`, whose `.model` is the `DeepseekV2Model`
with `.layers`; it has no `model` attribute at all. Every wrapper vLLM marks SupportsEagle3 (from
vLLM 0.18 Kimi-K2.5 among them, Qwen3-VL, ...) gets past the guard and then fails with
AttributeError "'KimiK25ForConditionalGeneration' object has no attribute 'model'", on every
vLLM release. vLLM finds the language model through `SupportsMultiModal.get_language_model()`
(vllm/model_executor/models/interfaces.py; every multimodal model has it, no text-only model
does) and so does speculators 0.4.0 (`model.get_language_model().model`); the first edit does
the same and keeps `model.model` for everything else.

Before vLLM 0.18.0 neither `DeepseekV2ForCausalLM` (DeepSeek-V2/V3) nor
`KimiK25ForConditionalGeneration` declares SupportsEagle3, so 0.3.0's `if not
supports_eagle3(model): raise ValueError(...)` refuses both although the replacement forward
walks their decoders exactly as vLLM's own EAGLE-3 support does from 0.18. The second edit
accepts any model whose decoder the first edit finds: a wrapper with get_language_model(), or a
model whose `.model` has `layers` (speculators 0.4.0 dropped the guard for that lookup). This
patch owns the guard; v8 only passes DeepSeek's layers their llama_4_scaling. The guard's
condition is "<=0.18.0,!=0.18.0": every release before 0.18.0 including 0.18.0's own
pre-releases and nightlies (PEP 440's "<0.18.0" excludes 0.18.0rc1 and 0.18.0rc2.dev45, which
may predate the change); where the marker exists the relaxed guard changes nothing.

What else the wrapper meets on this path, read in vLLM 0.16.0-0.20.0 and run (docs/models.md):
the model runner embeds every prompt itself for a multimodal model
(`self.model.embed_input_ids(...)`, the wrapper's SupportsMultiModal.embed_input_ids through
its language model) and passes inputs_embeds, so the replacement forward never embeds (v7's
embed_input_ids stays for text models); `llama_4_scaling` is read from the decoder's own config
(the text config; Kimi-K2.5 sets none, v8 handles the models that do); the multimodal budget is
computed from the checkpoint's own processor when the runner starts, and no image is encoded
for text prompts: nothing to patch there.
"""

from __future__ import annotations

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch, Symptom

from .targets import EVERY_RELEASE, SPECULATORS_0_3, WORKER

SETUP = "_setup_hidden_states_capture"
BASE_MODEL = "base_model"
LANGUAGE_MODEL = "get_language_model"

# `base_model = X.model`, the lookup of 0.3.0.
OWN_DECODER = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(target=m.Name(BASE_MODEL))],
            value=m.Attribute(value=m.Name(), attr=m.Name("model")),
        )
    ]
)
# `if hasattr(X, "get_language_model"):` assigning base_model: this edit's shape and 0.4.0's.
HAS_LANGUAGE_MODEL = m.Call(
    func=m.Name("hasattr"),
    args=[m.Arg(value=m.Name()), m.Arg(value=m.SimpleString(f'"{LANGUAGE_MODEL}"'))],
)
WRAPPER_LOOKUP = m.If(test=HAS_LANGUAGE_MODEL)

LOOKUP_SOURCE = """\
# Multimodal wrappers (Kimi-K2.5: language_model.model) keep the decoder in their language
# model; vLLM and speculators 0.4.0 find it through get_language_model().
if hasattr({model}, "get_language_model"):
    base_model = {model}.get_language_model().model
else:
    {own}
"""


def assigns_base_model(node: cst.CSTNode) -> bool:
    return bool(m.findall(node, m.AssignTarget(target=m.Name(BASE_MODEL))))


# when=EVERY_RELEASE: every release speculators 0.3.0 runs on: vLLM's multimodal models all have it.


class DecoderThroughLanguageModel(PatchCodemod):
    """In _setup_hidden_states_capture: `base_model = model.model` -> the wrapper's language
    model's decoder where the model has get_language_model(), else model.model.

    Patched (this edit's shape, or speculators 0.4.0's): an `if hasattr(model,
    "get_language_model"):` that assigns base_model.
    """

    ANCHOR = f"`{BASE_MODEL} = model.model` in {SETUP}"

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        if updated.name.value != SETUP or not isinstance(updated.body, cst.IndentedBlock):
            return updated
        if any(assigns_base_model(s.body) for s in m.findall(updated, WRAPPER_LOOKUP) if isinstance(s, cst.If)):
            self.found_patched()
            return updated
        body = list(updated.body.body)
        index = next((i for i, s in enumerate(body) if m.matches(s, OWN_DECODER)), None)
        if index is None:
            return updated
        self.rewrote()
        own = body[index]
        assert isinstance(own, cst.SimpleStatementLine)
        assign = own.body[0]
        assert isinstance(assign, cst.Assign) and isinstance(assign.value, cst.Attribute)
        model = cst.Module([]).code_for_node(assign.value.value)
        own_line = cst.Module([]).code_for_node(own.with_changes(leading_lines=[])).strip()
        lookup = cst.parse_statement(LOOKUP_SOURCE.format(model=model, own=own_line))
        body[index] = lookup.with_changes(leading_lines=[*own.leading_lines, *lookup.leading_lines])
        return updated.with_changes(body=updated.body.with_changes(body=body))


NOT_SUPPORTS_EAGLE3 = m.UnaryOperation(
    operator=m.Not(), expression=m.Call(func=m.Name("supports_eagle3"), args=[m.Arg(value=m.Name())])
)
GUARD_SOURCE = (
    'not supports_eagle3({model}) and not hasattr({model}, "get_language_model")'
    ' and not hasattr(getattr({model}, "model", None), "layers")'
)

# Until vLLM 0.18.0 DeepseekV2ForCausalLM and KimiK25ForConditionalGeneration lack SupportsEagle3;
# 0.18.0's pre-releases included.
GUARD_BEFORE = {"vllm": "<=0.18.0,!=0.18.0"}


class Eagle3GuardAcceptsFoundDecoders(PatchCodemod):
    """`if not supports_eagle3(model):` -> `if not supports_eagle3(model) and not hasattr(model,
    "get_language_model") and not hasattr(getattr(model, "model", None), "layers"):`."""

    ANCHOR = "a test `if not supports_eagle3(model):`"

    def leave_If(self, original: cst.If, updated: cst.If) -> cst.If:
        test = updated.test
        if isinstance(test, cst.BooleanOperation) and m.matches(test.left, m.BooleanOperation()):
            inner = test.left
            assert isinstance(inner, cst.BooleanOperation)
            if m.matches(inner.left, NOT_SUPPORTS_EAGLE3):
                model = self.model_of(inner.left)
                if cst.Module([]).code_for_node(test) == GUARD_SOURCE.format(model=model):
                    self.found_patched()
                return updated
        if not m.matches(test, NOT_SUPPORTS_EAGLE3):
            return updated
        self.rewrote()
        return updated.with_changes(test=cst.parse_expression(GUARD_SOURCE.format(model=self.model_of(test))))

    @staticmethod
    def model_of(test: cst.BaseExpression) -> str:
        assert isinstance(test, cst.UnaryOperation) and isinstance(test.expression, cst.Call)
        return cst.Module([]).code_for_node(test.expression.args[0].value)


BEFORE = """\
class HiddenStatesWorkerExtension:
    def _setup_hidden_states_capture(self, layer_ids: list[int]):
        model = self.model_runner.model  # type: ignore[attr-defined]

        if not supports_eagle3(model):
            raise ValueError(
                f"Model {type(model).__name__} does not support hidden state extraction"
            )

        base_model = model.model  # type: ignore[attr-defined]
        base_model._extension = self  # noqa: SLF001
"""

AFTER = """\
class HiddenStatesWorkerExtension:
    def _setup_hidden_states_capture(self, layer_ids: list[int]):
        model = self.model_runner.model  # type: ignore[attr-defined]

        if not supports_eagle3(model) and not hasattr(model, "get_language_model") and not hasattr(getattr(model, "model", None), "layers"):
            raise ValueError(
                f"Model {type(model).__name__} does not support hidden state extraction"
            )

        # Multimodal wrappers (Kimi-K2.5: language_model.model) keep the decoder in their language
        # model; vLLM and speculators 0.4.0 find it through get_language_model().
        if hasattr(model, "get_language_model"):
            base_model = model.get_language_model().model
        else:
            base_model = model.model  # type: ignore[attr-defined]
        base_model._extension = self  # noqa: SLF001
"""

# speculators 0.4.0's lookup (no guard at all): the first edit sees its own work done.
LOOKUP_0_4_0 = """\
class HiddenStatesWorkerExtension:
    def _setup_hidden_states_capture(self, layer_ids: list[int]):
        model = self.model_runner.model  # type: ignore[attr-defined]

        # Vision-language models
        if hasattr(model, "get_language_model"):
            base_model = model.get_language_model().model
        # Text models
        elif hasattr(model, "model") and hasattr(model.model, "layers"):
            base_model = model.model
        else:
            raise AttributeError("Could not find base model with 'layers' attribute.")

        base_model._extension = self  # noqa: SLF001
"""

# other code that reads model.model: left alone
OTHER_READER = """\
def other(model):
    base_model = model.model
    return base_model
"""

PATCH = Patch(
    id="v20-wrapper-decoder",
    title="worker: find a multimodal wrapper's decoder (Kimi-K2.5) through get_language_model(); "
    "the supports_eagle3 guard lets in every model whose decoder is found",
    target=WORKER,
    requires=SPECULATORS_0_3,
    edits=(
        Edit(
            DecoderThroughLanguageModel,
            when=EVERY_RELEASE,
            answers="vLLM's multimodal models (KimiK25ForConditionalGeneration: language_model.model) "
            "keep their decoder in the language model that SupportsMultiModal.get_language_model() returns",
            fact=Fact("defines", "vllm.model_executor.models.interfaces", "SupportsMultiModal", LANGUAGE_MODEL),
        ),
        Edit(
            Eagle3GuardAcceptsFoundDecoders,
            when=GUARD_BEFORE,
            answers="DeepseekV2ForCausalLM and KimiK25ForConditionalGeneration do not declare "
            "SupportsEagle3 (they do from 0.18.0)",
            fact=Fact(
                "lacks-base", "vllm.model_executor.models.deepseek_v2", "DeepseekV2ForCausalLM", "SupportsEagle3"
            ),
        ),
    ),
    examples=(
        Example(before=BEFORE, after=AFTER),
        Example(before=OTHER_READER + BEFORE, after=OTHER_READER + AFTER),
    ),
    satisfied=(AFTER,),
    near_misses=(
        # the decoder already found through get_language_model() (speculators 0.4.0's form)
        """
            class HiddenStatesWorkerExtension:
                def _setup_hidden_states_capture(self, layer_ids: list[int]):
                    model = self.model_runner.model  # type: ignore[attr-defined]
                    base_model = model.get_language_model().model
                    base_model._extension = self  # noqa: SLF001
        """,
    ),
    upstream="vLLM 0.16.0: KimiK25ForConditionalGeneration (vllm/model_executor/models/kimi_k25.py) keeps "
    "its decoder at language_model.model; vLLM 0.18.0: DeepseekV2ForCausalLM and "
    "KimiK25ForConditionalGeneration declare SupportsEagle3; speculators 0.4.0 looks through "
    "get_language_model() and dropped the guard",
    fixed_in="speculators 0.4.0",
    without_it="without it Kimi-K2.5 (and every multimodal wrapper) cannot extract on any vLLM release: "
    "AttributeError \"'KimiK25ForConditionalGeneration' object has no attribute 'model'\" when the "
    "capture is set up (vLLM 0.18 and later), and before 0.18 the guard refuses DeepSeek-V2/V3 and "
    "Kimi-K2.5 first: ValueError 'Model DeepseekV2ForCausalLM does not support hidden state "
    "extraction'. Not needed for Llama or Qwen3 models",
    leave_one_out=(
        # the tiny Llama of the end-to-end tests needs no wrapper lookup
        LeaveOneOut("0.16.0", None, calls="all"),
        # tiny Kimi-K2.5 and Kimi-K2.5 INT4 (workbench/tiny_moe.py) on an H200
        LeaveOneOut(
            "0.20.0",
            Symptom("init", messages=("'KimiK25ForConditionalGeneration' object has no attribute 'model'",)),
            device="cuda",
            record="bench/gpu/results/0.20.0-moe-h200x1/log.txt",
        ),
        LeaveOneOut("0.16.0", None, calls="all", tensor_parallel=2),
    ),
    since="any / <0.18.0",
    on_fixed_in="anchor-missing",
)
