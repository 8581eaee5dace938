"""The fastest stock attention kernels a machine has, for the benchmarks to time the invariant ones
against. Each is looked up when a row needs it; one whose library is not importable here, or that
cannot run on this device, comes back with the reason instead of a function, so that row is skipped
and the section goes on.

    sdpa_flash               torch SDPA forced onto its flash backend (``SDPBackend.FLASH_ATTENTION``)
    flash_attn_func          FlashAttention's prefill (``flash_attn``)
    flashinfer_decode        FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` on the invariant kernel's paged cache
    flash_attn_with_kvcache  FlashAttention's decode on a dense KV cache
    sdpa                     torch SDPA as transformers calls it at decode (``enable_gqa``, no mask)

Every function returns its output as ``[B, Lq, Hq, D]`` (a view where the kernel's own layout
differs), the invariant ``attention``'s layout. ``fp8_scaled_mm_refusal`` says why
``torch._scaled_mm`` cannot be the FP8 baseline here (None where it can)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

NOT_IMPORTABLE = "not importable"
FP8_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada and Hopper
FLASHINFER_WORKSPACE_BYTES = 128 << 20


@dataclass(frozen=True)
class Stock:
    """One stock kernel for one item: ``fn() -> [B, Lq, Hq, D]``, or ``skipped`` with the reason."""
    name: str
    fn: Callable[[], torch.Tensor] | None = None
    skipped: str | None = None


def importable(module: str):
    """(the module, None), or (None, why not): "<module> not importable" (with the error when the
    package is there but fails to import, e.g. built for another torch)."""
    try:
        return importlib.import_module(module), None
    except ModuleNotFoundError:
        return None, f"{module} {NOT_IMPORTABLE}"
    except Exception as exc:  # noqa: BLE001  (installed, but its import raised)
        return None, f"{module} {NOT_IMPORTABLE}: {type(exc).__name__}: {exc}"[:300]


def device_label(device: torch.device) -> str:
    """What rows say the device is: the GPU's name, or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _probed(name: str, fn: Callable[[], torch.Tensor]) -> Stock:
    """``fn`` run once (the warm-up); an error there (an API or device this kernel does not take)
    skips the row with the error as the reason."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001  (a third-party kernel's own refusal)
        return Stock(name, skipped=f"{name} raised {type(exc).__name__}: {exc}"[:300])
    return Stock(name, fn)


def sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Stock:
    """Causal SDPA on its flash backend, q [B, Hq, L, D], k, v [B, Hkv, L, D] (unpadded); the KV
    heads repeated beforehand where this torch's flash backend does not take ``enable_gqa``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    def run(kk, vv, **kw):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, **kw).transpose(1, 2)
    stock = _probed("sdpa_flash", lambda: run(k, v, enable_gqa=True))
    if stock.fn is not None:
        return stock
    group = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    repeated = _probed("sdpa_flash (KV heads repeated)", lambda: run(kr, vr))
    return repeated if repeated.fn is not None else stock


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Stock:
    """FlashAttention's causal prefill on the same rows, in its [B, L, H, D] layout (made beforehand)."""
    module, why = importable("flash_attn")
    if module is None:
        return Stock("flash_attn_func", skipped=why)
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    return _probed("flash_attn_func", lambda: module.flash_attn_func(qt, kt, vt, causal=True))


@dataclass(frozen=True)
class PagedCache:
    """The invariant ``paged_attention``'s cache: k, v [pages, page_size, Hkv, D]; block_tables
    int32 [B, pages per sequence]; seq_lens int32 [B]."""
    k: torch.Tensor
    v: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    page_size: int


def paged_cache(k: torch.Tensor, v: torch.Tensor, page_size: int, seed: int = 0) -> PagedCache:
    """Dense k, v [B, Hkv, L, D] copied into pages scattered over the cache, as an engine's are."""
    batch, hkv, length, d = k.shape
    per = -(-length // page_size)
    order = torch.randperm(batch * per, generator=torch.Generator().manual_seed(seed)).to(k.device)
    caches = []
    for dense in (k, v):
        padded = dense.new_zeros(batch, per * page_size, hkv, d)
        padded[:, :length] = dense.transpose(1, 2)
        cache = dense.new_zeros(batch * per, page_size, hkv, d)
        cache[order] = padded.view(batch * per, page_size, hkv, d)
        caches.append(cache)
    tables = order.view(batch, per).to(torch.int32)
    lens = torch.full((batch,), length, dtype=torch.int32, device=k.device)
    return PagedCache(caches[0], caches[1], tables, lens, page_size)


def flashinfer_decode(q: torch.Tensor, cache: PagedCache) -> Stock:
    """FlashInfer's batch decode over ``cache`` (its NHD layout is the invariant cache's), q [B, Hq, 1, D]."""
    module, why = importable("flashinfer")
    if module is None:
        return Stock("flashinfer_decode", skipped=why)
    batch, hq, _, d = q.shape
    try:
        pages = (cache.seq_lens + cache.page_size - 1) // cache.page_size
        indptr = F.pad(pages.cumsum(0), (1, 0)).to(torch.int32)
        indices = torch.cat([cache.block_tables[s, :int(pages[s])] for s in range(batch)]).to(torch.int32)
        last_page_len = ((cache.seq_lens - 1) % cache.page_size + 1).to(torch.int32)
        workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
        wrapper = module.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        q3 = q[:, :, 0].contiguous()
        shape = (indptr, indices, last_page_len, hq, cache.k.shape[2], d, cache.page_size)
        if hasattr(wrapper, "plan"):  # flashinfer >= 0.2
            wrapper.plan(*shape, q_data_type=q.dtype, kv_data_type=cache.k.dtype)
            def run():
                return wrapper.run(q3, (cache.k, cache.v)).unsqueeze(1)
        else:  # flashinfer 0.1: begin_forward / forward on k and v stacked
            wrapper.begin_forward(*shape, data_type=q.dtype)
            kv = torch.stack((cache.k, cache.v), dim=1)
            def run():
                return wrapper.forward(q3, kv).unsqueeze(1)
    except Exception as exc:  # noqa: BLE001  (an API this code does not know)
        return Stock("flashinfer_decode", skipped=f"flashinfer_decode raised {type(exc).__name__}: {exc}"[:300])
    return _probed("flashinfer_decode", run)


def flash_attn_with_kvcache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor) -> Stock:
    """FlashAttention's decode: q [B, Hq, 1, D] against dense caches [B, L, Hkv, D] (made beforehand)."""
    module, why = importable("flash_attn")
    if module is None:
        return Stock("flash_attn_with_kvcache", skipped=why)
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    return _probed("flash_attn_with_kvcache",
                   lambda: module.flash_attn_with_kvcache(qt, kt, vt, cache_seqlens=seq_lens, causal=True))


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Stock:
    """SDPA as transformers calls it for a one-token query without padding (torch picks the backend)."""
    def run():
        try:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2)
        except TypeError:  # torch < 2.5: no enable_gqa
            group = q.shape[1] // k.shape[1]
            return F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1),
                                                  v.repeat_interleave(group, dim=1)).transpose(1, 2)
    return _probed("sdpa", run)


def prefill_stocks(q, k, v) -> list[Stock]:
    """The prefill baselines of one unpadded causal batch, fastest first."""
    return [sdpa_flash(q, k, v), flash_attn_func(q, k, v)]


def decode_stocks(q, k, v, cache: PagedCache) -> list[Stock]:
    """The decode baselines, in the order preferred: FlashInfer, else FlashAttention, else SDPA;
    every one importable here is timed, and SDPA always is."""
    return [flashinfer_decode(q, cache), flash_attn_with_kvcache(q, k, v, cache.seq_lens), sdpa_decode(q, k, v)]


def fp8_scaled_mm_refusal(device: torch.device) -> str | None:
    """Why ``torch._scaled_mm`` is not this device's FP8 baseline (None where it is)."""
    if device.type != "cuda":
        return f"torch._scaled_mm needs a CUDA GPU (running on {device.type})"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        return (f"torch._scaled_mm needs compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} "
                f"(found {capability[0]}.{capability[1]})")
    return None
