"""Turn a step's last-position logits into tokens (and logprobs).

Order per row: penalties (repetition, then frequency/presence) and min_tokens masking; greedy
rows take the argmax; others are scaled by temperature, cut by top-k, top-p and min-p, then
sampled by the exponential race ``argmax(p / q), q ~ Exp(1)`` with the request's own generator
when it has a seed, so a seeded request draws the same numbers whatever batch it is in.
Logprobs are of the raw model distribution (before any processing), as vLLM reports them.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from engine.sequence import Sequence, TokenLogprob


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    def __init__(self, device: torch.device, seed: int, eos_token_ids: Seq[int]) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.eos_token_ids = list(eos_token_ids)

    def make_generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    def skip_draw(self, generator: torch.Generator, vocab_size: int) -> None:
        """Advance a request's generator past one sampling step taken elsewhere."""
        torch.empty(vocab_size, device=self.device).exponential_(generator=generator)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        # logits: [B, V] float32, row i belongs to seqs[i]
        raw = logits
        logits = self._apply_penalties(logits.clone(), seqs)
        greedy = torch.tensor([s.params.greedy for s in seqs], device=logits.device)
        tokens = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            sampled = self._sample(logits, seqs)
            tokens = torch.where(greedy, tokens, sampled)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(raw, seqs, tokens, token_list))

    # ---- logits processing --------------------------------------------------------------
    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        vocab = logits.shape[-1]
        for i, seq in enumerate(seqs):
            p = seq.params
            if seq.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
                banned = [t for t in banned if t < vocab]
                logits[i, banned] = float("-inf")
            if not p.has_penalties:
                continue
            out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.zeros(vocab, device=logits.device).index_add_(
                0, out, torch.ones_like(out, dtype=torch.float32)
            )
            row = logits[i]
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                prompt = torch.tensor(seq.prompt_token_ids, dtype=torch.long, device=row.device)
                seen[prompt] = True
                penalised = torch.where(
                    row > 0, row / p.repetition_penalty, row * p.repetition_penalty
                )
                row = torch.where(seen, penalised, row)
            row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
            logits[i] = row
        return logits

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        temps = torch.tensor(
            [s.params.temperature if not s.params.greedy else 1.0 for s in seqs],
            device=logits.device,
        )
        logits = logits / temps[:, None]
        top_k = [s.params.top_k for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([s.params.min_p for s in seqs], device=logits.device)
        if bool((min_p > 0).any()):
            floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(probs < floor, torch.zeros_like(probs), probs)
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.generator is not None and not seq.params.greedy:
                q[i].exponential_(generator=seq.generator)
        return (probs / q).argmax(dim=-1)

    # ---- logprobs -------------------------------------------------------------------------
    def _logprobs(
        self,
        raw: torch.Tensor,
        seqs: list[Sequence],
        tokens: torch.Tensor,
        token_list: list[int],
    ) -> list[TokenLogprob | None]:
        wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        result: list[TokenLogprob | None] = [None] * len(seqs)
        if not wanted:
            return result
        rows = torch.tensor(wanted, device=raw.device)
        logprobs = raw[rows].log_softmax(dim=-1)  # [W, V]
        chosen = logprobs.gather(1, tokens[rows][:, None])  # [W, 1]
        ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
        max_k = max(seqs[i].params.logprobs or 0 for i in wanted)
        top_vals, top_ids = logprobs.topk(max_k, dim=-1) if max_k else (None, None)
        chosen_list = chosen[:, 0].tolist()
        for j, i in enumerate(wanted):
            k = seqs[i].params.logprobs or 0
            top: list[tuple[int, float]] = []
            if k and top_ids is not None and top_vals is not None:
                top = list(zip(top_ids[j, :k].tolist(), top_vals[j, :k].tolist(), strict=True))
            result[i] = TokenLogprob(token_list[i], chosen_list[j], ranks[j], top)
        return result


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor([t if t > 0 else vocab for t in top_k], device=logits.device)
    position = torch.arange(vocab, device=logits.device)[None, :]
    cut = position >= k[:, None]
    probs = sorted_logits.masked_fill(cut, float("-inf")).softmax(dim=-1)
    p = torch.tensor([v if v < 1.0 else float("inf") for v in top_p], device=logits.device)
    # drop a token once the mass before it already reaches top_p (the first always stays)
    cut |= (probs.cumsum(dim=-1) - probs) >= p[:, None]
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
