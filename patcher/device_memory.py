"""The device-memory helper v9 and v23 write into speculators' generator: one definition, so
the two patches write the same bytes (and a target patched by either reads the same)."""

MEM_GET_INFO_HELPER = "_device_mem_get_info"
MEM_GET_INFO_SOURCE = '''\
def _device_mem_get_info() -> tuple[int, int]:
    """(free, total) bytes of the memory the model and its KV cache live in.

    CUDA (and ROCm) as before; another accelerator through its torch module; no
    accelerator at all (vLLM's CPU build): the host's available and total memory.
    """
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        module = torch.get_device_module(accelerator.current_accelerator())
        if hasattr(module, "mem_get_info"):
            return module.mem_get_info()
    import psutil

    memory = psutil.virtual_memory()
    return memory.available, memory.total
'''
