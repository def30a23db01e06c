"""Engine flags shared by every command that runs a model (generate, prefill, decode, serve)."""

from __future__ import annotations

import argparse

from pdserve.engine.config import (
    KV_CACHE_DTYPES,
    QUANT_ACTIVATIONS,
    QUANTIZATIONS,
    SPEC_SWITCHES,
    SPECULATIVE_MODES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)


def add_engine_args(parser: argparse.ArgumentParser, many_models: bool = False) -> None:
    """``many_models`` (``pdserve serve``): ``--model`` may be given more than once (a list)."""
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        action="append" if many_models else "store",
        help="a Hugging Face model directory, a pulled model's name, or tiny/small (random "
        "weights) (default: smollm2-135m-instruct, pulled on first use)"
        + (
            "; again for each more model to serve behind the same endpoint (embedding models: "
            "an embed worker each; one generative model)"
            if many_models
            else ""
        ),
    )
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="cpu")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "flashinfer"])
    g.add_argument(
        "--cpu-linear",
        default="auto",
        choices=["auto", "onednn", "torch"],
        help="CPU linear layers: oneDNN with packed weights (auto, where it runs) or torch's",
    )
    g.add_argument(
        "--quantization",
        default="auto",
        choices=list(QUANTIZATIONS),
        help="linear layers' weights: auto (the checkpoint's own: a pulled model's GGUF blocks "
        "kept quantized, else float), none (float), int8 (a scale per output row) or int4 "
        "(a scale and minimum per --quant-group-size weights), quantized at load",
    )
    g.add_argument(
        "--quant-activations",
        default="auto",
        choices=list(QUANT_ACTIVATIONS),
        help="quantized layers on a CPU: int16 / int8 (activations quantized per 32 values, "
        "integer dot products: VNNI or AVX2; int8 is faster with many streams, at llama.cpp's "
        "quality), float32 (weights dequantized: transformers' tokens exactly); auto: int16 "
        "where the kernel builds",
    )
    g.add_argument(
        "--quant-group-size",
        type=int,
        default=32,
        help="int4: weights per scale and minimum (a multiple of 32 dividing the layers' widths)",
    )
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV block count")
    g.add_argument(
        "--kv-cache-memory",
        type=_bytes,
        default=None,
        help="KV cache budget, e.g. 512M or 2G (CPU default: --kv-cache-share of the memory)",
    )
    g.add_argument(
        "--kv-cache-share",
        type=float,
        default=None,
        help="on a CPU with no --kv-cache-memory: this fraction of the machine's memory "
        "(default: 0.4 for a decode or colocated worker, 0.1 for a prefill worker; "
        "pdserve serve splits it between the workers of a role)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="the KV cache's form: auto (the model's dtype) or int8 (a float32 scale per token "
        "and head: ~3.8x the tokens of float32 in the same memory; CPU only). Prefill and "
        "decode workers must use the same",
    )
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument(
        "--max-step-time",
        type=float,
        default=SchedulerConfig.max_step_time_s,
        help="seconds one step may take: at start-up the per-step token budget is lowered "
        "to what runs within it on this machine (0: off, keep --max-num-batched-tokens)",
    )
    g.add_argument(
        "--tpot-target-ms",
        type=_auto_ms,
        default="auto",
        help="milliseconds a step carrying decode streams should take: prompt chunks beside "
        "them are sized to fit it (stall-free chunked prefill). auto: 50, or twice a lone "
        "decode step here when that is longer; 0: no target",
    )
    g.add_argument(
        "--prefill-age-bound-ms",
        type=float,
        default=SchedulerConfig.prefill_age_bound_s * 1e3,
        help="prompts that go this long without a token computed (the target leaves no room) "
        "take a KV block's tokens a step past the TPOT target: slowly, but none starves",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=None, help="torch threads for this process")
    g.add_argument(
        "--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode steps"
    )
    g.add_argument(
        "--tensor-parallel-size",
        "--tp",
        type=int,
        default=1,
        help="ranks the model is split over (Megatron's split: heads and MLP rows; gloo on "
        "CPU, NCCL on CUDA, one GPU a rank); this process is rank 0 and starts the others "
        "here unless --tp-rendezvous says they are started apart (pdserve tp-rank)",
    )
    g.add_argument(
        "--tp-rendezvous",
        default="",
        help="tcp://HOST:PORT where the ranks of a group started apart meet (rank 0 serves "
        "it); unauthenticated, as the collectives are: a network only the group reaches",
    )
    g.add_argument(
        "--tp-timeout",
        type=float,
        default=30.0,
        help="seconds a tensor-parallel collective may wait before the group gives up",
    )
    g.add_argument(
        "--tp-join-timeout",
        type=float,
        default=300.0,
        help="seconds the ranks of a group wait for each other at start (pods on other nodes "
        "may take minutes to be scheduled)",
    )
    g.add_argument(
        "--tp-staging-blocks",
        type=int,
        default=0,
        help="rank 0's full-head blocks for KV moving in or out of a group (0: two "
        "max-length sequences, at most the cache's blocks)",
    )
    add_spec_args(parser)
    g.add_argument(
        "--compile",
        action="store_true",
        help="CPU: run decode steps through torch.compile (needs g++; the graphs are built "
        "at start-up, minutes on a small CPU)",
    )


def add_spec_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("speculative decoding")
    g.add_argument(
        "--speculative",
        default="off",
        choices=list(SPECULATIVE_MODES),
        help="decode workers: ngram (drafts looked up in the prompt and the output so far) or "
        "draft (a small model with the same tokenizer, --draft-model, drafts greedily); one "
        "forward pass verifies them, keeping exactly what the model would have produced. A "
        "prefill worker with draft computes the draft's prompt KV and sends it with the "
        "target's",
    )
    g.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=SpeculativeConfig.num_tokens,
        help="drafts a step verifies per sequence, at most",
    )
    g.add_argument("--ngram-min", type=int, default=SpeculativeConfig.ngram_min)
    g.add_argument("--ngram-max", type=int, default=SpeculativeConfig.ngram_max)
    g.add_argument(
        "--draft-model",
        default=None,
        help="the draft model: a directory or a pulled model's name (its KV heads and head "
        "size must be the target's)",
    )
    g.add_argument(
        "--draft-quantization",
        default="auto",
        choices=list(QUANTIZATIONS),
        help="the draft's weights, as --quantization (int4: a quantized copy of the target "
        "drafts for it)",
    )
    g.add_argument(
        "--spec-switch",
        default="auto",
        choices=list(SPEC_SWITCHES),
        help="auto: a step speculates only where the step-time model says it pays (off at "
        "large batches and low acceptance); on: whenever there are drafts; off: never",
    )


def spec_config_from_args(args: argparse.Namespace) -> SpeculativeConfig:
    from pdserve.models.store import resolve_model

    draft = args.draft_model
    return SpeculativeConfig(
        mode=args.speculative,
        num_tokens=args.num_speculative_tokens,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        draft_model=resolve_model(draft, args.dtype) if draft else None,
        draft_quantization=args.draft_quantization,
        switch=args.spec_switch,
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    from pdserve.models.store import resolve_model

    model = resolve_model(args.model, args.dtype)
    return EngineConfig(
        model=model,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        cpu_linear=args.cpu_linear,
        max_model_len=args.max_model_len,
        seed=args.seed,
        threads=args.threads,
        enforce_eager=args.enforce_eager,
        compile=args.compile,
        quantization=args.quantization,
        quant_group_size=args.quant_group_size,
        quant_activations=args.quant_activations,
        tensor_parallel_size=args.tensor_parallel_size,
        tp_rendezvous=args.tp_rendezvous,
        tp_timeout_s=args.tp_timeout,
        tp_staging_blocks=args.tp_staging_blocks,
        tp_join_timeout_s=args.tp_join_timeout,
        speculative=spec_config_from_args(args),
        cache=CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_kv_blocks,
            kv_cache_memory=args.kv_cache_memory,
            cpu_memory_share=args.kv_cache_share or CacheConfig.cpu_memory_share,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=not args.no_prefix_caching,
            kv_cache_dtype=args.kv_cache_dtype,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_step_time_s=args.max_step_time,
            tpot_target_s=None if args.tpot_target_ms == "auto" else args.tpot_target_ms / 1e3,
            prefill_age_bound_s=args.prefill_age_bound_ms / 1e3,
        ),
    )


def _auto_ms(text: str) -> str | float:
    """``auto`` or a number of milliseconds."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or milliseconds, got {text!r}") from None


def _bytes(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)
