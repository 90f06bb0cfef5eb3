"""Configuration of an l2l-worker: the model, its data, the process and its job.

Each field's docstring is its --help text (``protocol.cli`` builds l2l-worker's and
l2l-launch's options from these classes); ``__post_init__`` validates.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from protocol.endpoints import default_endpoint

from .faults import Fault, parse_delays
from .spelled import lora_layers, patterns, size_bytes

BUILTIN_MODELS = ("bert", "gpt")


@dataclass(kw_only=True)
class ModelConfig:
    """A layered network: ``pre`` (embeddings) -> ``layers`` blocks -> ``post`` (head + loss)."""

    model: str = "bert"
    """bert (post-LN encoder classifier), gpt (pre-LN causal decoder LM), hf:PATH (a local
    Hugging Face directory: BERT/RoBERTa/XLM-RoBERTa classifiers, GPT-2, Llama, Mistral,
    Qwen2/3, Phi-3, OLMo 2/3, SmolLM3, Gemma 1/2/3, Granite, Ministral 3, EXAONE 4, Seed-OSS,
    Hunyuan, Helium, Apertus, Arcee, and the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE,
    OLMoE, DeepSeek-V2/V3, GLM-4.5, gpt-oss, MiniMax-M2, dots.llm1: causal LMs, or
    classifiers; FP8 and MXFP4 checkpoints read dequantized; the language model of a Gemma 3
    or Mistral 3 multimodal checkpoint),
    or package.module:Class,
    a worker.models.LayeredModel of your own built from this config."""
    layers: int = 4
    """Number of transformer blocks (the layers between pre and post)."""
    hidden: int = 64
    """Hidden size (width of the boundary activations)."""
    heads: int = 4
    """Attention heads per block (must divide hidden)."""
    ffn: int = 0
    """Feed-forward width; 0 means 4 x hidden."""
    seq_len: int = 32
    """Tokens per sample (also the size of the position table)."""
    vocab: int = 128
    """Vocabulary size."""
    classes: int = 0
    """Number of classes of a classifier head; 0: the model's own (built-in bert: 4; a Hugging
    Face sequence classifier: its labels; a base checkpoint needs it; on a Hugging Face causal
    LM it makes a sequence classifier with a new head)."""
    dropout: float = 0.1
    """Dropout probability (masks are replayed exactly in the recompute)."""
    tie_embeddings: bool = False
    """gpt: the LM head reads the token embedding (one tensor, trained by both layers)."""
    seed: int = 0
    """Seeds initial weights, data and dropout (all pure functions of it)."""
    freeze: str = ""
    """Tensors not to train, as comma-separated globs over the assembled model's parameter
    names ("<layer>.<tensor>", e.g. "pre.*", "*embed*", "blocks.0.*"): served to the workers
    and back-propagated through, never given a weight gradient, pushed or updated; the EPS
    holds only their served copy (no master, no optimizer state). A tied tensor follows its
    owner."""
    lora_rank: int = 0
    """LoRA on a Hugging Face model: the rank r of the adapters added to the blocks' targeted
    linear layers; the base model is frozen (as --freeze freezes) and the adapters train
    (with --lora-modules-to-save), initialised as PEFT does. --save writes the adapter PEFT
    loads (--merge: the merged model). 0: off."""
    lora_alpha: float = 8.0
    """LoRA's scale: the update is (alpha / r) B A x (PEFT's lora_alpha)."""
    lora_rslora: bool = False
    """Rank-stabilised LoRA (Kalajdzievski, 2023; PEFT's use_rslora): the update is scaled by
    alpha / sqrt(r), not alpha / r, so that a higher rank still learns at the same rate."""
    lora_dora: bool = False
    """DoRA (Liu et al., 2024; PEFT's use_dora): each adapted layer also trains a magnitude
    per output, which scales its weight with the adapter's update normalised (slower: the
    weight's norm is computed in every forward)."""
    lora_targets: str = "auto"
    """The linear layers of the blocks that get adapters: their names (the last part of the
    module's name, e.g. q_proj,k_proj,v_proj,o_proj), all-linear (GPT-2's Conv1D layers
    included), or auto: PEFT's default where it has one (query,value for BERT and RoBERTa,
    c_attn for GPT-2, q_proj,v_proj,fc1,fc2 for Phi, query_key_value for GPT-NeoX,
    q_proj,v_proj for Llama, Mistral, Qwen and Gemma), else qkv_proj for Phi-3 and
    q_proj,v_proj; none: no linear layer (with --lora-target-parameters). A module of the
    embeddings or the head (embed_tokens, lm_head) is refused: --lora-modules-to-save."""
    lora_layers: str = ""
    """With LoRA: the blocks whose targeted linear layers get adapters (PEFT's
    layers_to_transform), their indices from 0: e.g. 0-3,20 (ranges inclusive); empty: every
    block. Not with --lora-target-parameters (PEFT's layers_to_transform leaves them be)."""
    lora_rank_pattern: str = ""
    """With LoRA: other ranks for some adapted modules (PEFT's rank_pattern): PATTERN=RANK
    pairs, e.g. q_proj=16,layers\\.0\\.mlp\\.down_proj=4; a module whose name (PEFT's)
    a pattern matches whole, or from just after a '.' to its end, gets the first such
    pattern's rank (a pattern cannot hold ',' or '=')."""
    lora_alpha_pattern: str = ""
    """With LoRA: other alphas for some adapted modules (PEFT's alpha_pattern), as
    --lora-rank-pattern."""
    lora_exclude_modules: str = ""
    """With LoRA: modules --lora-targets would adapt that get no adapter (PEFT's
    exclude_modules): names, or their ends after a '.', e.g. layers.0.self_attn.q_proj."""
    lora_target_parameters: str = ""
    """With LoRA: a mixture of experts' stacked expert weights that get adapters too, as PEFT's
    target_parameters (parameter names, or their last parts: gate_up_proj,down_proj adapts
    every expert's projections; one rank-r adapter per expert). As in PEFT, not with
    --lora-dropout or --lora-dora."""
    lora_modules_to_save: str = "auto"
    """With LoRA: modules trained whole beside the adapters, as PEFT's modules_to_save (a module
    whose name ends with one of them, e.g. classifier, or embed_tokens,lm_head where they are
    not tied), saved with the adapter; auto: a sequence classifier's head (classifier, score;
    PEFT's SEQ_CLS task), so a new head learns; none: nothing."""
    lora_dropout: float = -1.0
    """Dropout on the adapters' input (PEFT's lora_dropout); -1: the --lora-init adapter's,
    else 0."""
    lora_init: str = ""
    """Start LoRA from this PEFT adapter directory (adapter_config.json and
    adapter_model.safetensors, as PEFT's save_pretrained or --save write them), as
    PeftModel.from_pretrained(base, DIR, is_trainable=True) does: its config sets the LoRA
    options (--lora-rank and the others may be left out; given, they must agree; a
    --lora-dropout given, 0 too, replaces the adapter's), its tensors are the adapters' (and modules
    to save's) initial values."""
    merge: bool = False
    """With LoRA: --save (and l2l-export) write the whole model with the adapter merged into
    its weights (W + alpha/r B A), not the adapter."""
    save_dtype: Literal["fp32", "bf16", "fp16", "auto"] = "fp32"
    """The dtype --save and l2l-export write the weights in: fp32 (the FP32 master, exact),
    bf16 or fp16 (rounded to nearest: half the bytes), or auto (an hf: model's source dtype,
    as save_pretrained writes a model loaded with dtype="auto"; fp32 for the others). An hf:
    directory's config.json names the dtype, so from_pretrained loads what was written; the
    tensors the library keeps in fp32 in that dtype (a router's) are written in fp32."""
    save_max_shard_size: str = "50GB"
    """An hf: model is saved in safetensors files of at most this size, as save_pretrained's
    max_shard_size splits them (e.g. 5GB, 500MB, 2GiB): model-00001-of-0000N.safetensors ...
    and model.safetensors.index.json; one model.safetensors when they fit."""
    init_from: str = ""
    """Initial weights from this safetensors file (the assembled model's names, as --save
    writes them), read one layer at a time; empty: random initialisation from --seed."""

    def __post_init__(self) -> None:
        if self.model not in BUILTIN_MODELS and ":" not in self.model:
            raise ValueError(f"model must be one of {BUILTIN_MODELS}, hf:PATH or "
                             f"package.module:Class, got {self.model!r}")
        if self.layers < 1 or self.hidden < 1 or self.seq_len < 2 or self.heads < 1:
            raise ValueError("layers, hidden and heads must be >= 1 and seq_len >= 2")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if not 0 <= self.dropout < 1:
            raise ValueError("dropout must be in [0, 1)")
        if self.lora_init:
            if not self.model.startswith("hf:") or self.init_from:
                raise ValueError("--lora-init starts an adapter of a Hugging Face model "
                                 "(--model hf:DIR), not with --init-from")
            from .lora_options import resolve

            resolve(self)
        if self.lora_dropout == -1:  # not given, and no adapter to take it from
            self.lora_dropout = 0.0
        if self.lora_rank < 0 or not 0 < self.lora_alpha < float("inf") or not (
                0 <= self.lora_dropout < 1):
            raise ValueError("lora_rank must be >= 0, lora_alpha > 0 (finite), lora_dropout in "
                             "[0, 1)" + (f" (--lora-init {self.lora_init}'s)" if self.lora_init
                                         else ""))
        if self.lora_rank and not self.model.startswith("hf:"):
            raise ValueError("--lora-rank needs a Hugging Face model (--model hf:DIR)")
        if self.merge and not self.lora_rank:
            raise ValueError("--merge merges a LoRA adapter: give --lora-rank")
        if self.lora_target_parameters.strip() and not self.lora_rank:
            raise ValueError("--lora-target-parameters adapts parameters: give --lora-rank")
        if self.lora_target_parameters.strip() and (self.lora_dropout > 0 or self.lora_dora):
            raise ValueError("--lora-target-parameters does not go with --lora-dropout or "
                             "--lora-dora (PEFT's target_parameters refuses them too)")
        if self.lora_layers.strip() and (not self.lora_rank or
                                         self.lora_target_parameters.strip()):
            raise ValueError("--lora-layers picks the blocks --lora-targets adapts: give "
                             "--lora-rank, and not --lora-target-parameters (PEFT's "
                             "layers_to_transform does not apply to them)" + (
                                 f"; --lora-init {self.lora_init}'s adapter has both"
                                 if self.lora_init else ""))
        lora_layers(self.lora_layers)  # (its error, now)
        per_module = [patterns(self.lora_rank_pattern, "--lora-rank-pattern", True),
                      patterns(self.lora_alpha_pattern, "--lora-alpha-pattern", False),
                      self.lora_exclude_modules.strip()]  # (each parsed: its error, now)
        if any(per_module) and (not self.lora_rank or self.lora_target_parameters.strip()):
            raise ValueError("--lora-rank-pattern, --lora-alpha-pattern and "
                             "--lora-exclude-modules shape the adapters of --lora-targets: "
                             "give --lora-rank, and not --lora-target-parameters")
        if (self.lora_rslora or self.lora_dora) and not self.lora_rank:
            raise ValueError("--lora-rslora and --lora-dora shape a LoRA adapter: give "
                             "--lora-rank")
        size_bytes(self.save_max_shard_size)  # (its error, now)
        # Filled-in values are written back as given (0), so a saved config replayed with
        # another --hidden gets its own ffn (protocol/cli.py to_dict reads as_given).
        self.as_given: dict = {}
        if self.ffn == 0:
            self.ffn, self.as_given["ffn"] = 4 * self.hidden, 0
        if self.classes == 0 and not self.model.startswith("hf:"):
            self.classes, self.as_given["classes"] = 4, 0
        if self.classes < 0 or self.classes == 1:
            raise ValueError("classes must be 0 (the model's own) or at least 2")


@dataclass(kw_only=True)
class DataConfig:
    """What the model is trained (and evaluated) on, chosen apart from the model."""

    task: Literal["auto", "trigger", "markov", "text"] = "auto"
    """text: the file --data names; trigger: planted-rule classification; markov: a synthetic
    Markov language (next-token prediction); auto: text when --data is given, else the
    model's own (bert: trigger, gpt: markov)."""
    data: str = ""
    """Training data: .tsv/.csv (GLUE layout: classification), .jsonl ("text" + "label", or
    for language modelling "text" alone, "prompt" + "completion" (loss on the completion) or
    "messages" (the chat template; loss on the assistant turns)), .parquet (the columns of
    .tsv for classification, the keys of .jsonl for language modelling), .txt (language
    modelling), .bin (token ids)."""
    data_format: Literal["auto", "tsv", "csv", "jsonl", "parquet", "txt", "tokens"] = "auto"
    """Format of --data and --eval-data; auto: from the file extension."""
    text_column: str = "sentence"
    """TSV/CSV/Parquet classification: the column holding the text."""
    text_pair_column: str = ""
    """TSV/CSV/Parquet: a second text column (sentence pairs), or empty."""
    label_column: str = "label"
    """TSV/CSV/Parquet: the column holding the integer label in [0, classes). A language
    model refuses JSONL records and Parquet rows that have it (labelled text: --classes N
    makes a causal LM a classifier); '' trains on their text alone."""
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    """Element type of a token-id file."""
    shuffle: bool = True
    """Shuffle the samples anew each epoch, by (seed, epoch)."""
    eval_data: str = ""
    """Evaluation data (same formats): accuracy, or loss and perplexity, after training and
    every --eval-every steps."""
    eval_every: int = 0
    """With --eval-data: evaluate before training, every N steps and after the last step (0:
    before and after only)."""

    def __post_init__(self) -> None:
        if self.eval_every < 0:
            raise ValueError("eval_every must be >= 0")
        if self.eval_every and not self.eval_data:
            raise ValueError("--eval-every needs --eval-data (the data to evaluate on)")


@dataclass(kw_only=True)
class WorkerConfig:
    """One l2l-worker process (one device) and its share of the job."""

    endpoint: str = field(default_factory=default_endpoint)
    """The eps-server's ZeroMQ endpoint."""
    curve_server_key: str = ""
    """CURVE: the EPS's public key file (NAME.key from l2l-ctl keygen), for a tcp endpoint
    that requires CURVE; with --curve-key."""
    curve_key: str = ""
    """CURVE: this worker's secret key file (NAME.key_secret, mode 0600); its public half must
    be in the EPS's --curve-clients directory."""
    rank: int = 0
    """This worker's rank in [0, world_size): it runs global micro-batches [rank*u, (rank+1)*u).
    -1: the EPS assigns the lowest free rank (identical replicas, e.g. containers)."""
    world_size: int = 1
    """Number of workers of this worker's EPS (its box)."""
    box: int = 0
    """This worker's box in a job over several (--nodes): its global rank is
    box*world_size + rank, which decides its micro-batches."""
    boxes: int = 1
    """Boxes in the job, each with world_size workers (the data-parallel size is the
    product)."""
    device: str = "cpu"
    """cpu, cuda or cuda:K; cuda: rank r runs on cuda:(r mod the number of GPUs it sees)."""
    steps: int = 10
    """Train until the model has taken this many optimizer steps (a resumed server continues)."""
    micro_batches: int = 2
    """u: micro-batches per worker per step, all run through a layer per visit."""
    micro_batch_size: int = 8
    """Samples per micro-batch."""
    layer_drop: float = 0.0
    """LayerDrop (stochastic depth): skip each block with this probability per step. Which
    blocks a step skips is a pure function of (seed, step), the same on every worker; a
    skipped block is neither fetched nor pushed and the EPS leaves its weights and optimizer
    state as they are."""
    grad_dtype: Literal["compute", "float32"] = "compute"
    """Dtype of pushed gradients: compute (the EPS's compute precision) or float32. Sums over
    micro-batches are always accumulated in fp32; the EPS reduces across workers in fp32."""
    transport: Literal["shm", "frames"] = "shm"
    """shm: tensors through shared memory (same box); frames: tensor bytes over ZeroMQ."""
    stash: Literal["device", "host", "eps"] = "device"
    """Where boundary activations live between forward and backward: device, host (pinned
    host memory; the device itself on CPU) or eps (EPS-owned shared memory)."""
    activation_budget_gib: float = -1.0
    """Device memory (GiB) the worker may spend keeping the forward graphs of the last blocks
    so their backward skips the recompute (worker/keep.py); 0: recompute every block but the
    last (constant memory in depth); -1: auto, on CUDA the memory free at start shared by the
    job's ranks on the device (or the --device-memory-gib cap) less the first step's peak and
    a margin, on the CPU 0."""
    copy_weights: bool = False
    """On CPU, copy each layer into worker buffers instead of reading shared memory in place
    (what CUDA does; for tests and measurements)."""
    overlap: bool = True
    """L2Lp: prefetch the next layer and push gradients asynchronously (--no-overlap waits for
    every fetch and push in turn, for comparison)."""
    threads: int = 1
    """torch intra-op threads of this process."""
    eps_timeout: float = 600.0
    """Seconds to wait for any single EPS reply before giving up."""
    stall_timeout: float = 600.0
    """Stop sending heartbeats once the loop has made no progress (no request, no layer
    visit) for this long, so the EPS declares this worker dead: a deadlock or a hung device
    (0: never)."""
    device_memory_gib: float = 0.0
    """CUDA: cap this process's device memory at this many GiB (the caching allocator refuses
    more, torch.cuda.set_per_process_memory_fraction), e.g. to act as a smaller GPU; 0: none."""
    cuda_delay: str = ""
    """Testing: POINT:MICROSECONDS[,...] makes a CUDA stream spin before its work at POINT:
    copy (each weight copy), compute (each layer visit), d2h (each copy out: gradients,
    stash), copy-back (each stash entry's copy back to the device), to show that no stream
    misses an event wait (worker/streams.py)."""
    fault: str = ""
    """Testing: RANK:STEP:POINT[:stop] makes rank RANK kill (or stop) itself at POINT of step
    STEP (F<l>, H<l>, B<l>: a visit of layer l; P: pushed, not reported; E: after the step);
    see worker/faults.py."""
    save: str = ""
    """Rank 0 writes the trained model here: a built-in model or your own as one safetensors
    file (the assembled nn.Module's names), an hf: model as a save_pretrained directory
    (config.json, model.safetensors, tokenizer files) that from_pretrained loads."""
    summary_json: str = ""
    """Write this worker's summary (losses, throughput, peak memory) here; {rank} in it is
    replaced by the rank (useful with --rank -1)."""
    trace: str = ""
    """Write a Chrome/Perfetto trace of this worker here; {rank} in it is replaced by the
    rank."""
    events: str = ""
    """Write typed events (one per step) as JSON lines here: a file path ({rank} in it is
    replaced by the rank), or fd:N for a pipe inherited from l2l-launch."""
    log_level: str = "INFO"
    """Log level on stderr (DEBUG, INFO, WARNING, ERROR)."""

    def __post_init__(self) -> None:
        if not -1 <= self.rank < self.world_size:
            raise ValueError("rank must be in [0, world_size), or -1 (any free rank)")
        if not 0 <= self.box < self.boxes:
            raise ValueError("box must be in [0, boxes)")
        if self.micro_batches < 1 or self.micro_batch_size < 1 or self.steps < 0:
            raise ValueError("micro_batches and micro_batch_size must be >= 1, steps >= 0")
        if self.grad_dtype not in ("compute", "float32"):
            raise ValueError("grad_dtype must be compute or float32")
        if self.transport not in ("shm", "frames"):
            raise ValueError("transport must be shm or frames")
        if self.stash not in ("device", "host", "eps"):
            raise ValueError("stash must be device, host or eps")
        if not 0 <= self.layer_drop < 1:
            raise ValueError("layer_drop must be in [0, 1)")
        if self.threads < 1 or not self.eps_timeout > 0 or self.stall_timeout < 0:
            raise ValueError("threads must be >= 1, eps_timeout > 0 and stall_timeout >= 0")
        if re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is None:  # (torch said so in each worker)
            raise ValueError(f"device must be cpu, cuda or cuda:K, got {self.device!r}")
        Fault.parse(self.fault)
        parse_delays(self.cuda_delay)
        if self.device_memory_gib < 0:
            raise ValueError("device_memory_gib must be >= 0")
        if self.activation_budget_gib < 0 and self.activation_budget_gib != -1:
            raise ValueError("activation_budget_gib must be >= 0, or -1 (auto)")
        if bool(self.curve_server_key) != bool(self.curve_key):
            raise ValueError("CURVE needs both curve_server_key and curve_key")

    @property
    def global_micro_batches(self) -> int:
        return self.boxes * self.world_size * self.micro_batches

    @property
    def global_rank(self) -> int:
        return self.box * self.world_size + self.rank

    def my_micro_batches(self) -> range:
        """Global indices of this worker's micro-batches: global rank g has [g*u, (g+1)*u)."""
        g = self.global_rank
        return range(g * self.micro_batches, (g + 1) * self.micro_batches)


@dataclass(kw_only=True)
class WorkerArgs:
    """Everything l2l-worker takes (the root of its command line and config file)."""

    worker: WorkerConfig = field(default_factory=WorkerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self) -> None:
        check_save(self.model, self.worker.save)


def check_save(model: ModelConfig, save: str, flag: str = "--save") -> None:
    """An hf: model is saved as a directory: ``--save NAME.safetensors`` would quietly make a
    directory of that name (``flag``: the option that names it)."""
    if save.endswith(".safetensors") and model.model.startswith("hf:"):
        raise ValueError(f"{flag} {save}: a Hugging Face model (--model hf:...) is saved as a "
                         "save_pretrained directory (config.json, model.safetensors, tokenizer "
                         f"files); give a directory, e.g. {flag} {save[:-len('.safetensors')]}")
