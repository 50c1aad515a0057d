"""Small Hugging Face models and tokenizers made on the spot (no downloads), saved with
``save_pretrained`` for the tests of ``axon4d prepare-data`` and ``axon4d train --hf``, or built in
memory (``llama_config``) for the tests of ``auto_parallelize``."""

from __future__ import annotations

from typing import Any

import torch

#: the text a byte-level BPE tokenizer is trained on (non-ASCII included: bytes must round-trip)
TEXT = (
    "The quick brown fox jumps over the lazy dog. Grids split tokens over data and z.\n"
    "Héllo wörld — naïve café, 4D hybrid parallelism!\n"
)


def bpe_tokenizer(directory: str, vocab: int = 300) -> str:
    """A byte-level BPE tokenizer of ``vocab`` ids with EOS ``<eos>``, trained on ``TEXT``; saved to ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TEXT] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(directory)
    return directory


def word_tokenizer(directory: str, words: int) -> str:
    """A whitespace word-level tokenizer of ``words`` + 2 ids (``<unk>`` 0, ``<eos>`` 1, ``w<i>`` i + 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(directory)
    return directory


def llama_config(
    vocab: int = 320, tied: bool = False, attn: str | None = None, heads: int = 4, kv_heads: int = 2
) -> Any:
    """The tests' Llama: 2 layers, hidden 64, FFN 128, grouped-query attention (``heads`` heads,
    ``kv_heads`` key/value heads), 64 positions; ``tied``: the head shares the embedding; ``attn``:
    the attention implementation (e.g. "eager", the plain reference; None: transformers' default)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    if attn is not None:
        cfg._attn_implementation = attn
    return cfg


def save_llama(directory: str, vocab: int = 320, seed: int = 0) -> str:
    """The tests' Llama (``llama_config``) with random weights, saved to ``directory``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(llama_config(vocab)).save_pretrained(directory)
    return directory


def save_gpt2(directory: str, vocab: int = 320, seed: int = 0) -> str:
    """A 2-layer GPT-2 (tied head, packed q|k|v, dropout as GPT-2's defaults), random weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(cfg).save_pretrained(directory)
    return directory


def mixtral_config(vocab: int = 320, experts: int = 4, top_k: int = 2, attn: str | None = None) -> Any:
    """The tests' Mixtral: 2 layers, hidden 64, ``experts`` experts of FFN 32 (top-``top_k``),
    grouped-query attention (4 heads, 2 key/value heads), 64 positions."""
    from transformers import MixtralConfig

    cfg = MixtralConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        max_position_embeddings=64,
    )
    if attn is not None:
        cfg._attn_implementation = attn
    return cfg


def qwen3_moe_config(vocab: int = 320, norm_topk_prob: bool = False, attn: str | None = None) -> Any:
    """The tests' Qwen3-MoE: 3 layers — layer 1 a dense MLP (``mlp_only_layers``) — hidden 64, 4
    experts of FFN 32 (top-2, gates renormalised if ``norm_topk_prob``), per-head q/k norms,
    grouped-query attention (4 heads of 16, 2 key/value heads), 64 positions."""
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=[1],
        max_position_embeddings=64,
    )
    if attn is not None:
        cfg._attn_implementation = attn
    return cfg


def save_moe(directory: str, family: str = "mixtral", vocab: int = 320, seed: int = 0) -> str:
    """The tests' Mixtral or Qwen3-MoE with random weights, saved to ``directory`` as
    ``save_pretrained`` writes it (per-expert tensors)."""
    from transformers import MixtralForCausalLM, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    if family == "mixtral":
        model: Any = MixtralForCausalLM(mixtral_config(vocab))
    else:
        model = Qwen3MoeForCausalLM(qwen3_moe_config(vocab))
    model.save_pretrained(directory)
    return directory
