"""``--lora-init DIR``: a PEFT adapter directory's ``adapter_config.json`` as l2l's LoRA options.

``PeftModel.from_pretrained(base, DIR, is_trainable=True)`` builds the adapter its config
describes, and so does l2l: the config decides the rank, alpha, rank stabilisation, DoRA, the
targeted modules and parameters and the modules trained whole; an option given beside it must
agree with it (left at its default, it takes the config's value). Dropout, which shapes nothing,
may be given anew. What l2l does not build (biases, an initialisation that rewrites the base,
...) is refused by name. The adapter's tensors are read by the model (models/hf/adapter.py).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import fields

from .spelled import lora_layers, patterns

ADAPTER_CONFIG = "adapter_config.json"
# PEFT's options that build something l2l does not: refused unless at PEFT's default
UNSUPPORTED = ("megatron_config", "trainable_token_indices", "alora_invocation_tokens",
               "use_qalora", "layer_replication", "lora_bias", "use_bdlora", "arrow_config",
               "kasa_config", "velora_config", "monteclora_config")
# PEFT's initialisations that leave the base weights be (the others, PiSSA, OLoRA, CorDA,
# LoftQ, LoRA-GA, rewrite them as they start the adapter, and so does loading such an adapter)
PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal", "mica")
# the modules a sequence classifier's adapter trains whole by default (PEFT's SEQ_CLS, and
# --lora-modules-to-save auto's): models/lora.py CLASSIFIER_HEADS
HEADS = ("classifier", "score")
# what --save writes for a multimodal model's language model (hf/multimodal.py lora_pattern)
_LANGUAGE_PATTERN = re.compile(r"(?:model\\\.language_model|language_model\\\.model)\\\."
                               r"(?:layers\\\.\((\d+(?:\|\d+)*)\)\\\.)?"
                               r"\.\*\\\.\((\w+(?:\|\w+)*)\)")
# where PEFT finds a block's index for layers_to_transform (its default: any of these)
LAYERS_PATTERNS = ("layers", "h", "layer", "blocks", "block")


def read(path: str) -> dict:
    """The adapter config of the PEFT adapter directory ``path``."""
    file = os.path.join(path, ADAPTER_CONFIG)
    try:
        with open(file) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"--lora-init {path}: no {ADAPTER_CONFIG} there (give a PEFT adapter "
                         "directory, as save_pretrained or --save writes one)") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"--lora-init {path}: cannot read {ADAPTER_CONFIG}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--lora-init {path}: {ADAPTER_CONFIG} is not a JSON object")
    return config


def _names(value, key: str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"its {key} is {value!r}: expected a list of names")
    return sorted(set(value))


def _layers(config: dict) -> str:
    """--lora-layers for PEFT's layers_to_transform (with target_modules a list)."""
    value = config.get("layers_to_transform")
    if value is None or value == []:
        return ""
    pattern = config.get("layers_pattern")
    patterns = [pattern] if isinstance(pattern, str) else pattern or []
    if any(p not in LAYERS_PATTERNS for p in patterns):
        raise ValueError(f"its layers_pattern ({pattern!r}) is not one of the blocks' names "
                         f"({', '.join(LAYERS_PATTERNS)})")
    value = [value] if isinstance(value, int) else value
    if not isinstance(value, list) or not all(isinstance(i, int) and i >= 0 for i in value):
        raise ValueError(f"its layers_to_transform is {value!r}: expected block indices")
    return ",".join(map(str, sorted(set(value))))


def _targets(config: dict) -> tuple[str, str]:
    """--lora-targets and --lora-layers for PEFT's target_modules and layers_to_transform."""
    value = config.get("target_modules")
    if not value:
        return "none", ""
    if value == "all-linear":
        return value, _layers(config)
    if isinstance(value, str):  # (PEFT's layers_to_transform does not apply to a pattern)
        m = _LANGUAGE_PATTERN.fullmatch(value)
        if not m:
            raise ValueError(f"its target_modules is the pattern {value!r}: l2l targets "
                             "modules by their names (a list in the config)")
        layers = sorted(map(int, m.group(1).split("|"))) if m.group(1) else []
        return ",".join(sorted(m.group(2).split("|"))), ",".join(map(str, layers))
    names = _names(value, "target_modules")
    dotted = [n for n in names if "." in n]
    if dotted:
        raise ValueError(f"its target_modules names {dotted[0]!r}, a path: l2l targets modules "
                         "by their last name (e.g. q_proj)")
    return ",".join(names), _layers(config)


def _saved(value) -> str:
    """--lora-modules-to-save for PEFT's modules_to_save (None: PEFT's default, which is
    l2l's auto: a sequence classifier's head, nothing for a causal LM)."""
    if not value:
        return "auto"
    names = _names(value, "modules_to_save")
    return "auto" if set(names) == set(HEADS) else ",".join(names)


def _split(names: str) -> set[str]:
    return {t.strip() for t in str(names).split(",") if t.strip()}


def _pattern(value, key: str) -> str:
    """--lora-rank-pattern / --lora-alpha-pattern for PEFT's rank_pattern / alpha_pattern."""
    if not value:
        return ""
    if not isinstance(value, dict) or any(not isinstance(k, str) or "," in k or "=" in k
                                          for k in value):
        raise ValueError(f"its {key} is {value!r}: expected a map of patterns (without ',' "
                         "or '=') to values")
    spelled = ",".join(f"{k}={v}" for k, v in value.items())
    patterns(spelled, f"its {key}", key == "rank_pattern")  # (its error, naming it)
    return spelled


def _excluded(value) -> str:
    """--lora-exclude-modules for PEFT's exclude_modules (names; not a pattern)."""
    if isinstance(value, str) and value:
        raise ValueError(f"its exclude_modules is the pattern {value!r}: l2l excludes modules "
                         "by their names (a list in the config)")
    return ",".join(_names(value or [], "exclude_modules"))


def _same(name: str, given, value) -> bool:
    if name == "lora_layers":
        return lora_layers(given) == lora_layers(value)
    if name == "lora_modules_to_save":  # (auto: a classifier's heads, nothing for an LM)
        if {given, value} == {"none", "auto"}:
            return True
        expand = {"auto": ",".join(HEADS), "none": ""}
        return _split(expand.get(given, given)) == _split(expand.get(value, value))
    if name in ("lora_rank_pattern", "lora_alpha_pattern"):  # (in order: the first wins)
        rank = name == "lora_rank_pattern"
        return list(patterns(given, name, rank).items()) == list(
            patterns(value, name, rank).items())
    if name in ("lora_targets", "lora_target_parameters", "lora_exclude_modules"):
        return _split(given) == _split(value)
    return given == value


def resolve(cfg) -> None:
    """Fill ``cfg``'s (a ModelConfig's) LoRA options from ``cfg.lora_init``'s config; raise
    ValueError where they disagree or where the adapter is one l2l does not build."""
    path = cfg.lora_init
    if cfg.lora_rank and not os.path.exists(path):
        return  # (a job's options replayed, resolved, after the adapter went: l2l-export)
    config = read(path)
    try:
        if config.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"it is a {config['peft_type']} adapter (l2l trains LoRA)")
        for key in UNSUPPORTED:
            if config.get(key) not in (None, False, {}, [], ""):
                raise ValueError(f"its {key} ({config[key]!r}) is not supported")
        if config.get("bias", "none") != "none":
            raise ValueError(f"its bias ({config['bias']!r}) is not supported (only 'none')")
        if config.get("init_lora_weights", True) not in PLAIN_INITS:
            raise ValueError(f"its init_lora_weights ({config['init_lora_weights']!r}) rewrites "
                             "the base weights as PEFT loads it: convert it to a plain LoRA "
                             "adapter first (PEFT's path_initial_model_for_weight_conversion)")
        targets, layers = _targets(config)
        want = {"lora_rank": int(config.get("r", 8)),
                "lora_alpha": float(config.get("lora_alpha", 8)),
                "lora_rslora": bool(config.get("use_rslora")),
                "lora_dora": bool(config.get("use_dora")),
                "lora_targets": targets, "lora_layers": layers,
                "lora_target_parameters": ",".join(_names(
                    config.get("target_parameters") or [], "target_parameters")),
                "lora_modules_to_save": _saved(config.get("modules_to_save")),
                "lora_rank_pattern": _pattern(config.get("rank_pattern"), "rank_pattern"),
                "lora_alpha_pattern": _pattern(config.get("alpha_pattern"), "alpha_pattern"),
                "lora_exclude_modules": _excluded(config.get("exclude_modules"))}
        dropout = float(config.get("lora_dropout") or 0.0)
    except (TypeError, ValueError, KeyError, ArithmeticError) as e:
        raise ValueError(f"--lora-init {path}: {e}") from None
    if want["lora_rank"] < 1:
        raise ValueError(f"--lora-init {path}: its rank r is {want['lora_rank']}")
    defaults = {f.name: f.default for f in fields(cfg)}
    for name, value in want.items():
        given = getattr(cfg, name)
        if given != defaults[name] and not _same(name, given, value):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {given} disagrees with the adapter {path} ({value}): "
                             "its adapter_config.json decides; leave the option out")
        if given == defaults[name]:
            setattr(cfg, name, value)
    if cfg.lora_dropout == -1:  # not given: the adapter's (a given 0 turns it off)
        cfg.lora_dropout = dropout
