"""v17: speculators' EAGLE model without transformers.modeling_attn_mask_utils.

transformers 5.24.0 removed src/transformers/modeling_attn_mask_utils.py (5.25.0 brought it back,
deprecated). speculators 0.3.0's
speculators/models/eagle.py imports `_prepare_4d_causal_attention_mask` from it at module level,
and `import speculators` imports that module (its model registry), so nothing of speculators
imports any more. The function is used in one place, `EagleSpeculator.forward`, for a 2-D padding
mask. The import stays where it works; where it fails, a local function builds the same mask:
causal (and, as transformers counts it, no further back than `sliding_window`), padded positions masked, the dtype's minimum where masked
and 0 elsewhere, shape (batch, 1, query length, past + query length).
"""

from __future__ import annotations

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch, Symptom

from .targets import EAGLE, SPECULATORS_0_3_OR_0_4

MODULE = "transformers.modeling_attn_mask_utils"
FUNCTION = "_prepare_4d_causal_attention_mask"

# transformers 5.24.0 removed the module; 5.25.0 has it again.
MODULE_GONE_SINCE = {"transformers": ">=5.24.0,<5.25.0"}

FALLBACK = f"""\
try:
    from {MODULE} import {FUNCTION}
except ImportError:  # transformers 5.24 removed the module: the same mask, built here

    def {FUNCTION}(
        attention_mask, input_shape, inputs_embeds, past_key_values_length, sliding_window=None
    ):
        batch_size, query_length = input_shape
        key_length = past_key_values_length + query_length
        dtype, device = inputs_embeds.dtype, inputs_embeds.device
        query = torch.arange(past_key_values_length, key_length, device=device)[:, None]
        key = torch.arange(key_length, device=device)[None, :]
        allowed = key <= query
        if sliding_window is not None:
            allowed = allowed & (key >= query - sliding_window)
        allowed = allowed[None, None].expand(batch_size, 1, query_length, key_length)
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, None, None, :].to(torch.bool)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        return mask.masked_fill(~allowed, torch.finfo(dtype).min)
"""

THE_IMPORT = m.SimpleStatementLine(
    body=[m.ImportFrom(relative=[], names=[m.ImportAlias(name=m.Name(FUNCTION), asname=None)])]
)


def fallback() -> cst.Try:
    statement = cst.parse_statement(FALLBACK)
    assert isinstance(statement, cst.Try)
    return statement


def is_the_import(statement: cst.BaseStatement) -> bool:
    if not m.matches(statement, THE_IMPORT):
        return False
    module = statement.body[0].module
    return cst.Module([]).code_for_node(module) == MODULE


class ImportOrBuildCausalMask(PatchCodemod):
    """Top-level `from transformers.modeling_attn_mask_utils import _prepare_4d_causal_attention_mask`
    -> try that import, else define the function. Patched: the import inside a top-level try."""

    ANCHOR = f"a top-level from {MODULE} import {FUNCTION}"

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        body = list(updated.body)
        for statement in body:
            if isinstance(statement, cst.Try) and any(is_the_import(s) for s in statement.body.body):
                self.found_patched()
                return updated
        index = next((i for i, s in enumerate(body) if is_the_import(s)), None)
        if index is None:
            return updated
        self.rewrote()
        body[index] = fallback().with_changes(leading_lines=body[index].leading_lines)
        return updated.with_changes(body=body)


BEFORE = f"""\
import torch
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
from {MODULE} import {FUNCTION}
from transformers.modeling_outputs import CausalLMOutputWithPast
"""

AFTER = (
    "import torch\n"
    "from transformers import AutoConfig, PretrainedConfig, PreTrainedModel\n"
    + FALLBACK
    + "from transformers.modeling_outputs import CausalLMOutputWithPast\n"
)

PATCH = Patch(
    id="v17-attn-mask-utils",
    title="speculators' EAGLE model builds its causal mask itself where transformers.modeling_attn_mask_utils is gone",
    target=EAGLE,
    requires=SPECULATORS_0_3_OR_0_4,
    edits=(
        Edit(
            ImportOrBuildCausalMask,
            when=MODULE_GONE_SINCE,
            answers="transformers has no module modeling_attn_mask_utils",
            fact=Fact("lacks-module", MODULE, distribution="transformers"),
        ),
    ),
    examples=(Example(before=BEFORE, after=AFTER),),
    satisfied=(AFTER,),
    near_misses=(
        # transformers 5's own causal-mask helper, already imported from masking_utils
        """
            import torch
            from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
            from transformers.masking_utils import create_causal_mask
            from transformers.modeling_outputs import CausalLMOutputWithPast
        """,
    ),
    upstream="transformers 5.24.0: src/transformers/modeling_attn_mask_utils.py removed; 5.25.0: restored",
    without_it="without it with transformers 5.24.0: `import speculators` fails, `ModuleNotFoundError: No module named 'transformers.modeling_attn_mask_utils'` (the patch defines a local causal-mask function where the import fails)",
    leave_one_out=(
        LeaveOneOut(
            "0.30.0",
            Symptom("verify", "ModuleNotFoundError", ("No module named 'transformers.modeling_attn_mask_utils'",)),
        ),
        LeaveOneOut(
            "0.30.0",
            Symptom("verify", "ModuleNotFoundError", ("No module named 'transformers.modeling_attn_mask_utils'",)),
            speculators="0.4.0.1",
        ),
    ),
    since="transformers 5.24.0",
)
