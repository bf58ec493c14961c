"""DiffusionGemma's sampler, written once for reads (the slots of a multi-step read) and for
generation (every position of a block).

One sampler step over N positions: scale the logits by the step's temperature, optionally keep
only the nucleus (top_p), draw a sample per position (Gumbel-max from a seeded generator), accept
the lowest-entropy positions whose summed entropy less the largest stays within the entropy bound,
and re-noise every other position with a uniform random id. Temperature 0 is the limit of that
step: every position takes its argmax, every entropy is 0 so everything is accepted, nothing is
drawn from the generator, and the self-conditioning signal is the one-hot argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    logits = logits.float()
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def gumbel_argmax(scaled: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A sample from softmax(scaled) per row (Gumbel-max), drawn from a seeded generator."""
    uniform = torch.rand(scaled.shape, generator=generator, device=scaled.device, dtype=torch.float32)
    exponential = (-torch.log(uniform.clamp_min(1e-20))).clamp_min(1e-20)
    gumbel = -torch.log(exponential)
    return torch.argmax(scaled + gumbel, dim=-1)


def entropy_bound_accept(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """Accept the longest run of lowest-entropy positions whose summed entropy, less the largest
    of them, stays within `bound` (the entropy-bound sampler of DiffusionGemma). 1-D input."""
    order = torch.argsort(entropy)
    ordered = entropy[order]
    accepted_sorted = (torch.cumsum(ordered, dim=0) - ordered) <= bound
    accepted = torch.zeros_like(accepted_sorted)
    accepted[order] = accepted_sorted
    return accepted


def temperature_at(step_remaining: int, steps: int, t_min: float, t_max: float) -> float:
    """Linear schedule from t_max on the first step to t_min on the last (remaining counts down)."""
    return t_min + (t_max - t_min) * (step_remaining / steps)


def nucleus(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    """`scaled` with every token outside each row's nucleus set to -inf: the nucleus is the smallest
    set of most probable tokens whose probability reaches `top_p` (the most probable always stays)."""
    if top_p >= 1.0:
        return scaled
    probs, order = torch.sort(torch.softmax(scaled, dim=-1), dim=-1, descending=True)
    before = torch.cumsum(probs, dim=-1) - probs  # probability mass ranked above each token
    keep_sorted = before < top_p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return scaled.masked_fill(~keep, float("-inf"))


def entropy_of(scaled: torch.Tensor, *, filtered: bool = False) -> torch.Tensor:
    """Entropy of softmax(scaled) per row; with `filtered`, tokens set to -inf contribute nothing
    (0 * -inf would be NaN)."""
    logp = torch.log_softmax(scaled, dim=-1)
    terms = logp.exp() * logp
    if filtered:
        terms = torch.where(torch.isfinite(logp), terms, torch.zeros_like(terms))
    return -terms.sum(dim=-1)


@dataclass
class SamplerStep:
    """What one sampler step over N positions gives back."""

    tokens: torch.Tensor  # [N] the new canvas ids: accepted samples, re-noised elsewhere
    argmax: torch.Tensor  # [N] the most probable id per position
    entropy: torch.Tensor  # [N] entropy of the distribution sampled from
    conditioning: torch.Tensor  # [N, V] the processed logits, the next pass's self-conditioning


def sample_step(
    logits: torch.Tensor,
    temperature: float,
    *,
    top_p: float,
    entropy_bound: float,
    vocab_size: int,
    generator: torch.Generator,
) -> SamplerStep:
    """One step of the entropy-bound sampler over `logits` [N, V] (softcapped, unscaled)."""
    if temperature <= 0.0:
        argmax = torch.argmax(logits, dim=-1)
        entropy = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
        onehot = torch.full_like(logits, float("-inf")).scatter(-1, argmax.unsqueeze(-1), 0.0)
        return SamplerStep(tokens=argmax, argmax=argmax, entropy=entropy, conditioning=onehot)
    scaled = nucleus(logits / temperature, top_p)
    sampled = gumbel_argmax(scaled, generator)
    entropy = entropy_of(scaled, filtered=top_p < 1.0)
    accepted = entropy_bound_accept(entropy, entropy_bound)
    noise = torch.randint(0, vocab_size, (logits.shape[0],), generator=generator, device=logits.device)
    tokens = torch.where(accepted, sampled, noise)
    return SamplerStep(tokens=tokens, argmax=torch.argmax(scaled, dim=-1), entropy=entropy, conditioning=scaled)
