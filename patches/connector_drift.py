"""What hs-connectors' KV connector modules are known to meet on vLLM releases (CONNECTOR_DRIFT,
read by patcher.patchset.registry.declared_drift): the speculators 0.5+ path, which patches nothing
and which check-upstream binds."""

from patcher.model import ConnectorDrift

# speculators 0.5+ patches nothing: `vllm serve` loads a KV connector, vLLM's own or one of
# hs-connectors' (speculators 0.8+ requires hs-connectors; 0.7 vendors its transfer.py only, which
# imports nothing of vLLM). check-upstream binds every hs-connectors module that imports vLLM on
# every vLLM release with extract_hidden_states (0.17.0 on); what they meet is upstream's, declared
# here for exactly the releases it is met on (docs/check-upstream.md). Read, not run.
HS_FP8 = "hs_connectors/fp8_hidden_states_connector.py"
HS_MOONCAKE = "hs_connectors/mooncake_hidden_states_connector.py"
CONNECTOR_DRIFT = (
    ConnectorDrift(
        "hs-connectors",
        HS_FP8,
        "FP8HiddenStatesConnector._write_tensors overrides nothing",
        ">=0.17.0,<0.22.0",
        "ExampleHiddenStatesConnector gains _write_tensors in vLLM 0.22.0; before, it saves in save_kv_layer and "
        "the override is never called: the FP8 backend writes hidden states unquantized (FP8Transfer reads them "
        "as they are: twice the size, silently)",
    ),
    ConnectorDrift(
        "hs-connectors",
        HS_MOONCAKE,
        "from vllm.v1.kv_cache_interface import HiddenStateCacheSpec:",
        ">=0.17.0,<0.22.0",
        "HiddenStateCacheSpec first appears in vLLM 0.22.0; before, the import in _find_cache_kv_group_id, called "
        "by __init__ with the kv_cache_config vLLM passes, raises ImportError: the Mooncake connector cannot start",
    ),
    ConnectorDrift(
        "hs-connectors",
        HS_MOONCAKE,
        "MooncakeHiddenStatesConnector.prefer_cross_layer_blocks overrides nothing",
        ">=0.29.0",
        "vLLM 0.29.0 removes cross-layer KV blocks (prefer_cross_layer_blocks, register_cross_layers_kv_cache): "
        "the override, there to keep them off, is never read; harmless",
    ),
)
