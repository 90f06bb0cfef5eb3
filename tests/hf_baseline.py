"""Training the Hugging Face model itself (all layers resident, torch AdamW, gradient
accumulation over the same micro-batches): the reference an ``hf:`` L2L run must reproduce.
Each layer's dropout is seeded as the L2L executor seeds it, by forward pre-hooks on the
library's own submodules."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.config import DataConfig, ModelConfig
from worker.data import Sharder, build_task
from worker.models import build_model
from worker.models.base import dropout_seed, optimizer_groups


def _stage_modules(hf, model_type: str) -> list:
    """The library submodules where each L2L layer's computation (and RNG use) starts."""
    if model_type == "bert":
        b = hf.bert
        return [b.embeddings, *b.encoder.layer, b.pooler]
    if model_type in ("roberta", "xlm-roberta"):
        r = hf.roberta
        return [r.embeddings, *r.encoder.layer, hf.classifier]
    if model_type == "gpt2":
        t = hf.transformer
        return [t.wte, *t.h, t.ln_f]
    if model_type == "gpt_neox":
        m = hf.gpt_neox
        return [m.embed_in, *m.layers, m.final_layer_norm]
    m = hf.model
    return [m.embed_tokens, *m.layers, getattr(m, "norm", None) or m.final_layernorm]


def train_hf(path: str, data: DataConfig, *, steps: int, micro_batches: int, batch_size: int,
             seq_len: int, lr: float = 1e-3, seed: int = 0, weight_decay: float = 0.01,
             classes: int = 0, wrap=None) -> dict[str, torch.Tensor]:
    """``wrap(model)``: the model to train instead (a PEFT model around it: the parameters
    it leaves trainable get gradients)."""
    import transformers as tf

    mcfg = ModelConfig(model=f"hf:{path}", seq_len=seq_len, seed=seed, classes=classes)
    layered = build_model(mcfg)
    config = layered.export_config()
    cls = getattr(tf, config.architectures[0])
    hf = cls.from_pretrained(path, config=config,
                             attn_implementation=layered.config._attn_implementation).train()
    # a new head starts as the layered model's (seeded by layer); the rest is the checkpoint's
    from protocol.tensors import plan_layout

    for plan in plan_layout(layered.manifest()).layers:
        fresh = {layered.family.hf_name(plan.name, k): v
                 for k, v in layered.loader().load(plan).items()}
        missing = hf.load_state_dict(fresh, strict=False).unexpected_keys
        assert not missing, missing
    state = {"step": 0, "index": 0}
    def reseed(layer: int):
        def hook(module, args) -> None:
            torch.manual_seed(dropout_seed(seed, state["step"], layer, state["index"]))
        return hook

    for layer, module in enumerate(_stage_modules(hf, config.model_type)):
        module.register_forward_pre_hook(reseed(layer))
    if wrap is not None:
        hf = wrap(hf)
    opt = torch.optim.AdamW(optimizer_groups(hf.named_parameters(), weight_decay), lr=lr)
    task = build_task(layered, data, micro_batch_size=batch_size,
                      global_micro_batches=micro_batches)
    sharder = Sharder(task, batch_size, micro_batches)
    for step in range(steps):
        opt.zero_grad()
        for index, b in enumerate(sharder.batches(step, range(micro_batches))):
            state.update(step=step, index=index)
            kw = {"token_type_ids": b.token_types} if b.token_types is not None else {}
            out = hf(input_ids=b.inputs, attention_mask=b.mask, **kw)
            logits = out.logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                   b.targets.reshape(-1), reduction="sum") / b.norm
            if getattr(out, "aux_loss", None) is not None:  # a MoE's load-balancing loss, by
                # the micro-batch's share of the batch's loss terms (as its cross-entropy)
                loss = loss + config.router_aux_loss_coef * out.aux_loss * (
                    b.targets != -100).sum() / b.norm
            loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in hf.state_dict().items()}
