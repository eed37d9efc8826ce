"""Attention as a device runs it, on meta and fake tensors.

`scaled_dot_product_attention` picks its kernel by device type. Meta and fake tensors have no fused kernel registered,
so there it falls back to the math path, which materialises and saves the (T x T) attention weights: an activation
trace then counts memory no real run holds (the fused kernels save q, k, v, the output and one log-sum-exp row per
query) and misses what op-level checkpointing keeps. Within `fused_attention()`, every call runs the fused kernel's
own meta function instead: CPU's flash kernel, whose saved tensors match CUDA's flash and efficient kernels.

Checkpointed blocks run their forward again in backward, where function modes do not reach: there the module
attribute `F.scaled_dot_product_attention` is the fused kernel's for as long as the mode is on.
"""

from __future__ import annotations

from torch.overrides import TorchFunctionMode

from lightning_dist._compat.torch import attention_function_replaced, cpu_flash_attention, cuda_flash_attention


class fused_attention(TorchFunctionMode):
    """Within: `F.scaled_dot_product_attention`, however it was imported, runs a fused kernel (in backward's
    recomputation: called as `F.scaled_dot_product_attention`). `calls`, when given, gets each call's (query heads,
    key/value heads, sequence length)."""

    def __init__(self, calls: list[tuple[int, int, int]] | None = None) -> None:
        super().__init__()
        self.calls = calls

    def __enter__(self):
        self._replaced = attention_function_replaced(self._fused)
        self._original = self._replaced.__enter__()
        return super().__enter__()

    def __exit__(self, *exc_info):
        self._replaced.__exit__(*exc_info)
        return super().__exit__(*exc_info)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is self._original:
            return self._fused(*args, **kwargs)
        return func(*args, **kwargs)

    def _fused(self, query, key, value, *args, **kwargs):
        if self.calls is not None:  # (B, H, T, D)
            self.calls.append((query.shape[-3], key.shape[-3], query.shape[-2]))
        return _flash(query, key, value, *args, **kwargs)


def _flash(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    from torch.distributed.tensor import DTensor

    if enable_gqa and key.shape[-3] != query.shape[-3]:  # grouped queries: the fused kernels read shared heads
        repeats = query.shape[-3] // key.shape[-3]
        key, value = (t.repeat_interleave(repeats, dim=-3) for t in (key, value))
    if isinstance(query, DTensor) and attn_mask is None:  # torch's ring attention: its rule is for CUDA's kernels
        return cuda_flash_attention(query, key, value, dropout_p, is_causal, scale)
    return cpu_flash_attention(query, key, value, attn_mask, dropout_p, is_causal, scale)

