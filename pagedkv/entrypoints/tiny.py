"""A tiny model and tokenizer for serving on a laptop CPU, built offline in a fraction of a second.

``pagedkv serve tiny`` serves lesson 7's tiny Llama (:data:`pagedkv.grading.lessons.l07_serving_engine.TINY_CONFIG`,
random seeded weights, no EOS, so every completion runs to ``max_tokens``) with a byte-level BPE tokenizer
trained here on a fixed paragraph (every text encodes, every id decodes) and a plain chat template. Nothing is
downloaded. The outputs are noise: the model is untrained; what the lab serves it for is timing and memory.
"""

from __future__ import annotations

from typing import Any

#: ``max_position_embeddings`` of the served tiny model: room for ShareGPT-like prompt and output lengths.
TINY_MAX_MODEL_LEN = 1024

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = (
    "PagedAttention stores the keys and values of every sequence in fixed-size blocks. A block table maps each "
    "logical block of a request to a physical block of the pool, as a page table maps virtual pages to frames. "
    "The scheduler admits requests while free blocks remain, preempts the newest when the pool runs dry, and "
    "finds shared prefixes in the cache by hashing full blocks. Time to first token grows with the queue; time "
    "per output token grows with the batch. The quick brown fox jumps over the lazy dog. Hello, world! "
    "What is the capital of France? Paris is the capital of France. Tell me a story about a robot who learns to "
    "paint. Once upon a time there was a small robot that lived in a workshop full of colours. "
) * 4


def tiny_tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer of ``vocab_size`` ids (the 256 bytes, 3 special tokens, merges for the rest),
    trained on a fixed paragraph: deterministic, offline, with ``CHAT_TEMPLATE`` and no EOS token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|pad|>", "<|unk|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    # no EOS token: the engine stops on the tokenizer's EOS, as vLLM does, and the tiny model is served without one
    # (every completion runs to max_tokens); <|endoftext|> stays a special token, skipped in decoded text
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", unk_token="<|unk|>",
                                   additional_special_tokens=["<|endoftext|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_model(seed: int = 0, max_position_embeddings: int = TINY_MAX_MODEL_LEN, **overrides: Any) -> Any:
    """Lesson 7's tiny Llama (``seeded_tiny_model``) with ``max_position_embeddings`` positions and any other
    config field in ``overrides`` (``--hf-overrides``: a larger random model for timing)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedkv.grading.lessons.l07_serving_engine import seeded_tiny_model

    def config(**kw: Any) -> LlamaConfig:
        return LlamaConfig(**{**kw, "max_position_embeddings": max_position_embeddings, **overrides})

    return seeded_tiny_model(config, LlamaForCausalLM, seed)
