"""What the parallel module needs to know of the Hugging Face model besides its shards and graphs, read
once from the meta model by ``parallelize`` (api.py) and handed to the module whole."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class ModelFacts:
    sequence_parallel: bool = False  # sequences of every call must then divide by tp
    # token ids index this many embedding rows, labels this many logits (None: unchecked)
    vocab_rows: Optional[int] = None
    label_classes: Optional[int] = None
    position_limit: Optional[int] = None  # rows of a learned position table: longest generation
    takes_position_ids: bool = True  # the model's forward has position_ids (else: positions from its cache)
    takes_logits_to_keep: bool = False  # the model's forward has logits_to_keep (generate's prefill keeps 1)
    hf_loss_type: Optional[str] = "ForCausalLM"  # the Hugging Face model's loss_type (None: a class name unmapped)
    hf_class_name: Optional[str] = None  # the Hugging Face model's class name (LlamaForCausalLM): _get_name()
    # the model's forward has output_router_logits (a mixture of experts), and the load-balancing loss's weight
    takes_router_logits: bool = False
    router_aux_loss_coef: float = 0.0
    # (transformers' load_balancing_loss_func of the model's module, num_experts, top_k): the term recomputed over
    # the whole sequences under context parallelism (router_outputs.py); None: the model has no such function
    load_balancing: Optional[tuple] = None
    # transformers' cache for it keeps linear-attention / state-space states (generation: GraphSpec.fresh_cache)
    recurrent_cache: bool = False
    # why transformers' generate feeds the model more than tokens, mask and positions (XLNet's permutation mask):
    # then no generate without a cache (generation/recompute.py); None: it feeds just those
    inputs_beyond_tokens: Optional[str] = None
    moe_layers: int = 0  # transformers' experts modules (output_tokens_per_expert counts for each)
    generation_config: object = None  # the checkpoint's GenerationConfig, as transformers loads it
    embedding_modules: dict = field(default_factory=dict)  # "input"/"output" -> (module path, class, bias)
    embedding_weights: tuple = ()  # the nn.Embedding tables' weights
    dropout_rates: dict = field(default_factory=dict)  # the model's dropout rates above 0: masks in train()
