"""The language model of a multimodal checkpoint (Gemma 3 from 4B up, Gemma 4, Mistral Small
3.1 and later, Qwen3.5, Llama 4: ``...ForConditionalGeneration``), trained on text here as the
causal LM its ``text_config`` describes. The vision tower and the projector (Gemma 4's audio
tower too) are not trained, not served and not held: export copies them from the source as
they are, beside the trained language model, so the result is the whole multimodal model
again.

Names: inside this package the language model has its text model's names (``model.layers.0.``,
``lm_head.``). The library keeps it as ``model.language_model.layers.0.`` (PEFT's adapter
names follow these); ``save_pretrained`` writes Gemma 3's and Mistral 3's as
``language_model.model.layers.0.`` and ``language_model.lm_head.`` (the LLaVA layout their
conversion mapping reverses on save), Qwen3.5's and Gemma 4's as the library keeps them.
Llama 4 keeps its language model as ``language_model.model.layers.0.`` in memory too. A
checkpoint is read in either form.
"""

from __future__ import annotations

import copy

LLAVA = ("gemma3", "mistral3", "llama4")  # saved in the LLaVA layout
HELD_AS_SAVED = ("llama4",)  # held in memory in it too
TYPES = (*LLAVA, "qwen3_5", "qwen3_5_moe", "gemma4")


def of(config):
    """``config``'s language model's config and a ``Wrapper``; (config, None) if it is no
    multimodal model of ``TYPES``."""
    if config.model_type not in TYPES or getattr(config, "text_config", None) is None:
        return config, None
    text = copy.deepcopy(config.text_config)
    if getattr(text, "dtype", None) is None:
        text.dtype = getattr(config, "dtype", None)
    if hasattr(config, "tie_word_embeddings"):  # the whole model's says (as the library ties)
        text.tie_word_embeddings = config.tie_word_embeddings
    return text, Wrapper(config)


class Wrapper:
    def __init__(self, config):
        self.config = config

    @staticmethod
    def checkpoint(name: str) -> list[str]:
        """Where a checkpoint may hold the language model's tensor ``name``."""
        if name.startswith("model."):
            rest = name[len("model."):]
            return [f"language_model.model.{rest}", f"model.language_model.{rest}"]
        return [f"language_model.{name}", name]

    def saved(self, name: str) -> str:
        """The name save_pretrained writes for the language model's ``name``."""
        return Wrapper.checkpoint(name)[0 if self.config.model_type in LLAVA else 1]

    def in_memory(self, name: str) -> str:
        """The library's (and PEFT's) name for the language model's ``name``."""
        return Wrapper.checkpoint(name)[0 if self.config.model_type in HELD_AS_SAVED else 1]

    def lora_pattern(self, modules: list[str], layers: list[int] = ()) -> str:
        """PEFT's target_modules for ``modules`` of the language model alone (a pattern, so
        that PEFT leaves the vision tower be), of its blocks ``layers`` (empty: all)."""
        held = self.in_memory("model.").replace(".", r"\.")
        if layers:
            held += rf"layers\.({'|'.join(map(str, layers))})\."
        return rf"{held}.*\.({'|'.join(modules)})"

    @staticmethod
    def is_language(checkpoint_name: str) -> bool:
        return checkpoint_name.startswith(("language_model.", "model.language_model.",
                                           "lm_head."))

    def export_config(self, dtype):
        """The whole model's config, as written beside the trained language model."""
        config = copy.deepcopy(self.config)
        config.dtype = dtype
        config.text_config.dtype = dtype
        return config
