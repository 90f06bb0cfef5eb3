"""A mixture of experts' load-balancing loss, layer by layer.

With ``output_router_logits`` a causal LM of Mixtral, Qwen-MoE or OLMoE adds
``router_aux_loss_coef * aux`` to its loss, where (the library's ``load_balancing_loss_func``)

    aux = experts * sum_e (tokens_e / rows) * (probability_e / rows)

over every MoE layer's routing of the micro-batch's tokens (padding left out): ``tokens_e``
counts the times expert e is among a token's top k, ``probability_e`` sums its softmax
probability, ``rows`` counts tokens once per layer. The sums span all layers, so no layer can
add its share alone; but they are sums: the boundary between layers carries them (a running
total per micro-batch, beside the hidden states), each MoE block adds its own routing, and the
head turns them into the loss. The probabilities' total keeps its autograd history, so each
block's backward gets the gradient of the loss with respect to its router, as the library's
model gets it; counts have none (top-k), as there.

Each micro-batch's loss is weighted by its share of the global batch's loss terms, as its
cross-entropy is, so micro-batches and workers add up to the batch's mean. Training only: an
evaluation's loss is the cross-entropy alone (a perplexity).
"""

from __future__ import annotations

import torch
from torch import nn


class Balance:
    """The load-balancing loss of a MoE config that trains with it (``balance_of``)."""

    def __init__(self, config):
        self.experts = getattr(config, "num_local_experts", None) or config.num_experts
        self.top_k = config.num_experts_per_tok
        self.coef = config.router_aux_loss_coef

    def start(self, x: torch.Tensor) -> tuple:
        """The embedding's boundary: hidden states, and empty totals (counts, probabilities,
        rows)."""
        return (x, torch.zeros(self.experts, dtype=torch.long, device=x.device),
                torch.zeros(self.experts, dtype=torch.float32, device=x.device),
                torch.zeros((), dtype=torch.long, device=x.device))

    def add(self, totals: tuple, logits: torch.Tensor, mask: torch.Tensor | None) -> tuple:
        """``totals`` with one layer's routing (its router's logits, one row per token) added,
        computed as the library computes them."""
        counts, probs, rows = totals
        routing = torch.softmax(logits, dim=-1)
        _, chosen = torch.topk(routing, self.top_k, dim=-1)
        chosen = chosen.reshape(-1)
        if mask is None:  # (a scatter: bincount would wait for the device to size its output)
            return (counts + torch.zeros_like(counts).scatter_add_(0, chosen,
                                                                    torch.ones_like(chosen)),
                    probs + routing.float().sum(dim=0), rows + routing.shape[0])
        flat = mask.reshape(-1)
        per_choice = flat.to(torch.long).repeat_interleave(self.top_k)
        return (counts + torch.zeros_like(counts).scatter_add_(0, chosen, per_choice),
                probs + (routing.float() * flat.to(torch.float32).unsqueeze(-1)).sum(dim=0),
                rows + flat.to(torch.long).sum())

    def loss(self, totals: tuple, batch) -> torch.Tensor:
        """``router_aux_loss_coef * aux``, weighted by the micro-batch's share of the global
        batch's loss terms."""
        counts, probs, rows = totals
        rows = rows.to(torch.float32)
        aux = torch.sum((counts.to(torch.float32) / rows) * (probs / rows)) * self.experts
        return self.coef * aux * (batch.targets != -100).sum() / batch.norm


def balance_of(config, lm: bool) -> Balance | None:
    """The config's load-balancing loss; None where it does not train with one, or the model
    is not a causal LM (the library's classifiers do not add it)."""
    return Balance(config) if lm and getattr(config, "output_router_logits", False) else None


class RouterLogits:
    """Collects the logits of the routers in ``module`` (the library's ``...TopKRouter``: its
    first output, as the library's own recorder takes it) during one call."""

    def __init__(self, module: nn.Module):
        self.logits: list[torch.Tensor] = []
        self.routers = [m for m in module.modules() if type(m).__name__.endswith("TopKRouter")]
        for router in self.routers:
            router.register_forward_hook(lambda m, args, out: self.logits.append(out[0]))

    def take(self) -> list[torch.Tensor]:
        out, self.logits = self.logits, []
        return out
