"""gpu.py's attention row: flashinfer against the torch backend on random ragged bf16
batches (prefill chunks after prefix hits, whole prompts and decode rows together; decode rows
alone), relative error of the outputs and equality of the K/V writes. NOT yet run on a GPU.
"""

from __future__ import annotations

import torch

from pdserve.engine.attention import AttentionMetadata, TorchAttentionBackend

DEV = torch.device("cuda")


def make_metadata(
    query_lens: list[int], seq_lens: list[int], tables: list[list[int]], bs: int
) -> AttentionMetadata:
    starts, slots = [0], []
    for q, s, table in zip(query_lens, seq_lens, tables, strict=True):
        starts.append(starts[-1] + q)
        slots += [table[p // bs] * bs + p % bs for p in range(s - q, s)]
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEV
        ),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=DEV),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        block_tables_cpu=tables,
        block_size=bs,
    )


def attention_errors() -> dict[str, str]:
    from pdserve.engine.attention.flashinfer_backend import FlashInferBackend

    heads, kv_heads, dim, bs = 32, 8, 128, 16
    cases = {  # (query lens, context lens): prefix hits, whole prompts, decode rows together
        "mixed": ([1, 1, 300, 512, 1, 7], [100, 2000, 1000, 512, 17, 7]),
        "decode": ([1] * 8, [37, 100, 513, 1024, 2048, 5, 16, 17]),
    }
    g = torch.Generator(device=DEV).manual_seed(0)
    out = []
    for name, (q_lens, s_lens) in cases.items():
        pages = [-(-s // bs) for s in s_lens]
        perm = torch.randperm(sum(pages) + 8, device="cpu").tolist()
        tables = [perm[sum(pages[:i]) : sum(pages[: i + 1])] for i in range(len(pages))]
        meta = make_metadata(q_lens, s_lens, tables, bs)
        shape = (len(perm), 2, bs, kv_heads, dim)
        cache = torch.randn(shape, generator=g, device=DEV, dtype=torch.bfloat16)
        t = sum(q_lens)
        q = torch.randn(t, heads, dim, generator=g, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(t, kv_heads, dim, generator=g, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(t, kv_heads, dim, generator=g, device=DEV, dtype=torch.bfloat16)
        results = []
        for backend in (TorchAttentionBackend(DEV), FlashInferBackend(DEV)):
            c = cache.clone()
            backend.plan(meta)
            with torch.inference_mode():
                results.append((backend.forward(q, k, v, c, dim**-0.5).float(), c))
        (ref, c_ref), (got, c_got) = results
        err = ((got - ref).norm() / ref.norm()).item()
        same_cache = "" if torch.equal(c_ref, c_got) else ", KV WRITES DIFFER"
        out.append(f"{name} {err:.1e}{same_cache}")
    return {"attention": ", ".join(out) + " (bf16, 32/8 heads, head 128)"}
