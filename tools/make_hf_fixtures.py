"""Build the transformers reference fixtures under ``tests/fixtures/hf/<family>/``.

For each supported family (``qwen3_moe``, ``qwen2_moe``, ``mixtral``, ``deepseek_v2``,
``deepseek_v3``) this builds a tiny
random model with transformers, saves it with ``save_pretrained`` (safetensors), and records
what the tests compare jtbo against: transformers' float32 logits of a few fixed prompts
(``reference_logits.npz``) and its greedy ``generate`` tokens (``reference.json``, which also
records the library versions). A small byte-level BPE ``tokenizer.json``, trained with
``tokenizers`` on a few sentences, goes into every family's directory (the prompts are its
encodings; the CLI test reads it).

Weights are drawn again after construction (transformers' initialiser draws std 0.02, which
leaves every router near a tie): matrices ``N(0, 1 / fan_in)``, router gates four times wider
(clear top-k margins), DeepSeek-V3's score-correction bias ``N(0, 0.3^2)``, norms
``1 + N(0, 0.1^2)``, biases ``N(0, 0.1^2)``, embeddings ``N(0, 1)`` (``N(0, 0.1^2)`` when
tied to the LM head: a large table makes every prompt's greedy continuation repeat its last
token).

Run it outside jtbo's venv, in one that has a CPU torch and transformers::

    python3.11 -m venv /tmp/hfref
    /tmp/hfref/bin/pip install torch==2.13.0      # a CPU build
    /tmp/hfref/bin/pip install transformers==5.17.0 safetensors tokenizers
    /tmp/hfref/bin/python tools/make_hf_fixtures.py [--out tests/fixtures/hf]

The output is deterministic for fixed library versions (seeded).
"""

import argparse
import json
import platform
import shutil
from pathlib import Path

import numpy as np
import safetensors
import tokenizers
import torch
import transformers

VOCAB_SIZE = 320  # model vocabulary; the tokenizer uses the first TOKENIZER_VOCAB ids
TOKENIZER_VOCAB = 300
MAX_NEW_TOKENS = 8
SENTENCES = [
    "Two batches overlap so that one computes while the other communicates.",
    "Experts are chosen per token by a small router.",
    "The quick brown fox jumps over the lazy dog.",
    "Attention reads the keys and values of earlier tokens from the cache.",
    "Mixture of experts models grow their parameters without growing their compute.",
    "A shared expert sees every token; routed experts see only the tokens sent to them.",
]
PROMPTS = [
    "The quick brown fox",
    "Experts are chosen per token",
    "Attention reads the keys and values of earlier tokens",
    "Two batches overlap",
]
COMMON = dict(
    vocab_size=VOCAB_SIZE,
    bos_token_id=None,
    eos_token_id=None,  # greedy generate always makes MAX_NEW_TOKENS tokens
    pad_token_id=None,
    num_attention_heads=4,
    num_key_value_heads=2,
)

DEEPSEEK = dict(
    COMMON,
    num_key_value_heads=4,  # MLA: every head has its own key and value
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    moe_intermediate_size=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    max_position_embeddings=64,
)


def family_configs() -> dict[str, transformers.PreTrainedConfig]:
    """The tiny config of each family (each exercises that family's particular features)."""
    return {
        # q/k norm, norm_topk_prob, tied embeddings, a dense layer between MoE layers
        # (mlp_only_layers), head_dim != hidden / heads.
        "qwen3_moe": transformers.Qwen3MoeConfig(
            **COMMON,
            hidden_size=48,
            head_dim=8,
            intermediate_size=48,
            num_hidden_layers=3,
            moe_intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),  # fmt: skip
        # shared expert with its sigmoid gate (a width no multiple of the expert's), q/k/v
        # bias, decoder_sparse_step=2 (dense layers 0 and 2), linear RoPE scaling.
        "qwen2_moe": transformers.Qwen2MoeConfig(
            **COMMON,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=3,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=40,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=2,
            norm_topk_prob=False,
            rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
        ),  # fmt: skip
        "mixtral": transformers.MixtralConfig(
            **COMMON,
            hidden_size=32,
            intermediate_size=24,
            num_hidden_layers=2,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),  # fmt: skip
        # DeepSeek-V2-Lite style MLA: no low-rank query (q_proj), softmax router with
        # group_limited_greedy, two shared experts, a dense first layer, interleaved RoPE.
        "deepseek_v2": transformers.DeepseekV2Config(
            **DEEPSEEK,
            q_lora_rank=None,
            n_shared_experts=2,
            topk_method="group_limited_greedy",
            routed_scaling_factor=1.5,
            norm_topk_prob=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),  # fmt: skip
        # DeepSeek-V3 style: low-rank query with its norm, sigmoid router with noaux_tc and the
        # score-correction bias, YaRN RoPE whose mscale differs from mscale_all_dim (so both
        # the rotated values and the softmax scale change).
        "deepseek_v3": transformers.DeepseekV3Config(
            **DEEPSEEK,
            q_lora_rank=16,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=16,
                beta_fast=32.0,
                beta_slow=1.0,
                mscale=1.0,
                mscale_all_dim=0.8,
            ),
        ),  # fmt: skip
    }


def train_tokenizer() -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer of ``TOKENIZER_VOCAB`` ids trained on ``SENTENCES``."""
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(SENTENCES, trainer=trainer)
    return tokenizer


def redraw_weights(model: torch.nn.Module, seed: int) -> None:
    """Draws every parameter again (see the module docstring for the distributions)."""
    embed_scale = 0.1 if model.config.tie_word_embeddings else 1.0
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.1 * noise
            elif name.endswith(".bias"):
                value = 0.1 * noise
            elif "embed_tokens" in name:
                value = embed_scale * noise
            else:
                scale = 4.0 if name.endswith("mlp.gate.weight") else 1.0
                value = scale * noise / param.shape[-1] ** 0.5
            param.copy_(value)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3: a buffer, not a param
                noise = torch.randn(buffer.shape, generator=generator, dtype=torch.float32)
                buffer.copy_(0.3 * noise)


def reference_outputs(model, prompt_ids: list[list[int]]) -> tuple[dict, list[list[int]]]:
    """transformers' float32 logits per prompt and its greedy continuations."""
    logits, greedy = {}, []
    with torch.no_grad():
        for index, ids in enumerate(prompt_ids):
            inputs = torch.tensor([ids])
            logits[f"prompt_{index}"] = model(inputs).logits[0].numpy().astype(np.float32)
            out = model.generate(
                inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
            )  # fmt: skip
            greedy.append(out[0, len(ids) :].tolist())
    return logits, greedy


def versions() -> dict[str, str]:
    """The versions of everything that produced the fixtures."""
    return dict(
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        tokenizers=tokenizers.__version__,
        safetensors=safetensors.__version__,
        numpy=np.__version__,
    )


def build_family(name: str, config, tokenizer, out: Path, seed: int) -> None:
    """Writes one family's model, tokenizer and reference outputs to ``out / name``."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    redraw_weights(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    target = out / name
    shutil.rmtree(target, ignore_errors=True)
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save(str(target / "tokenizer.json"))
    prompt_ids = [tokenizer.encode(text).ids for text in PROMPTS]
    logits, greedy = reference_outputs(model, prompt_ids)
    np.savez(target / "reference_logits.npz", **logits)
    record = dict(
        family=name, prompts=PROMPTS, prompt_ids=prompt_ids, greedy_tokens=greedy,
        max_new_tokens=MAX_NEW_TOKENS, seed=seed, versions=versions(),
    )  # fmt: skip
    (target / "reference.json").write_text(json.dumps(record, indent=1) + "\n")
    size = sum(f.stat().st_size for f in target.iterdir())
    print(f"{name}: {size / 1024:.0f} KiB, {len(prompt_ids)} prompts, greedy {greedy}")


def main(argv=None) -> None:
    """Builds every family's fixture."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/hf"))
    parser.add_argument("--only", nargs="*", help="families to build (default: all)")
    args = parser.parse_args(argv)
    tokenizer = train_tokenizer()
    for seed, (name, config) in enumerate(family_configs().items()):
        if not args.only or name in args.only:
            build_family(name, config, tokenizer, args.out, seed)


if __name__ == "__main__":
    main()
