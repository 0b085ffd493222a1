"""Tiny, deterministic causal LMs with a real tokenizer, built offline.

Tests and benchmarks need Hugging Face checkpoints without access to the Hub. This module trains
a small byte-level BPE tokenizer on an embedded corpus and writes randomly initialised models of
eight architectures (and ``phi3_longrope``, Phi-3 with LongRoPE) with ``save_pretrained``, so ``AutoModelForCausalLM.from_pretrained(path)``
and ``AutoTokenizer.from_pretrained(path)`` load them like downloaded ones. The same arguments
give byte-identical files; without an explicit output directory, models are built once into a
per-machine cache (``$AIPC_CACHE_DIR``, default ``~/.cache/aipc-plugins``) and reused.

CLI::

    python -m aipc_kernels.tools.tiny_model [OUT] --arch llama --hidden 256 --layers 4
    python -m aipc_kernels.tools.tiny_model /tmp/llama-1b --preset llama-3.2-1b

transformers and tokenizers are imported inside the functions that need them.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# Bump whenever the bytes that the builder writes for the same arguments change.
BUILDER_VERSION = 1
MANIFEST = "aipc_tiny_model.json"

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "phi3", "phi3_longrope", "gemma", "gpt_neox", "opt", "bitnet")
_CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "mistral": "MistralConfig",
    "phi3": "Phi3Config",
    "phi3_longrope": "Phi3Config",
    "gemma": "GemmaConfig",
    "gpt_neox": "GPTNeoXConfig",
    "opt": "OPTConfig",
    "bitnet": "BitNetConfig",
}
_NO_GQA = ("gpt_neox", "opt")  # multi-head attention only: kv_heads must equal heads
# Tied input/output embeddings unless told otherwise, as the published models of the architecture
# (microsoft/bitnet-b1.58-2B-4T). bitnet: float weights and no quantization_config (the "bf16
# master" layout); relu2 MLP and the attention/FFN sub-norms come from transformers' BitNetConfig.
_TIED_BY_DEFAULT = ("bitnet",)
# phi3_longrope: Phi-3.5-style LongRoPE (short and long factor lists; transformers switches to the
# long factors once a sequence is longer than original_max_position_embeddings). The switch is
# placed at LONGROPE_ORIGINAL_MAX tokens so that tests generate across it.
LONGROPE_ORIGINAL_MAX = 32
DTYPES = ("bfloat16", "float16", "float32")

# Real model geometries for benchmarks: random weights; the tokenizer's 1024 trained tokens are
# padded with reserved ones up to the model's vocabulary.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-150m": dict(
        arch="llama", hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048,
        vocab=49152, max_position=4096,
    ),
    "llama-3.2-1b": dict(
        arch="llama", hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192,
        vocab=128256, max_position=131072, tie_embeddings=True,
    ),
    "llama-3-8b": dict(
        arch="llama", hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336,
        vocab=128256, max_position=8192,
    ),
}

TOKENIZER_VOCAB = 1024
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, IM_START, IM_END)  # ids 0..5, in this order
_TOKEN_IDS = dict(bos_token_id=SPECIAL_TOKENS.index(BOS), eos_token_id=SPECIAL_TOKENS.index(EOS),
                  pad_token_id=SPECIAL_TOKENS.index(PAD))
# Qwen2's pre-tokenizer: transformers loads qwen2 checkpoints with Qwen2Tokenizer whatever
# tokenizer_config.json says, and that class rebuilds the pipeline (keeping vocab, merges and
# post-processor); using its pipeline here makes every architecture tokenize alike.
_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Weight init: N(0, 1/fan_in) for every matrix, so activations keep unit scale through the layers
# and attention is not uniform, except the output embedding, scaled for logits with a std of about
# _LOGIT_STD as in trained models (a greedy token then has a clear margin). 0.02-like stds at
# tiny widths give flat logits, and tied embeddings then make greedy decoding repeat one token.
_LOGIT_STD = 2.0
_SHARD_SIZE = "5GB"


def _corpus() -> list[str]:
    """A deterministic English-ish training corpus (about 50 KB) for the tokenizer."""
    rng = random.Random(20240611)
    subjects = ["the model", "a small cat", "my neighbour", "the old engineer", "every student",
                "our team", "the quiet river", "a tired traveller", "this kernel", "the compiler",
                "she", "he", "they", "we", "the red fox", "a young doctor", "the city council",
                "the weather", "your computer", "the scheduler", "a curious child", "the baker"]
    verbs = ["reads", "writes", "finds", "builds", "carries", "measures", "remembers", "opens",
             "explains", "follows", "watches", "prepares", "quantizes", "loads", "computes",
             "paints", "sells", "answers", "moves", "checks", "borrows", "describes", "repairs"]
    objects = ["a long letter", "the morning news", "three green apples", "the hidden door",
               "a simple answer", "the matrix", "every token", "the blue notebook", "a warm coat",
               "the weights", "a cache of keys", "the last train", "an honest question",
               "the garden gate", "a bowl of soup", "the broken clock", "a map of the town",
               "the final report", "two cups of tea", "the shared memory", "a strange story"]
    adverbs = ["quickly", "slowly", "carefully", "again", "today", "at night", "before lunch",
               "without a word", "with great care", "every morning", "in silence", "on Monday",
               "after the storm", "during the summer", "for a while", "once more"]
    places = ["in the kitchen", "near the station", "at the office", "on the hill", "by the sea",
              "inside the box", "under the bridge", "in the library", "across the street",
              "behind the school", "along the valley", "over the mountains", "at the market"]
    questions = ["What time is it?", "How does attention work?", "Where is the station?",
                 "Why is the sky blue?", "Can you help me?", "Which file did you open?",
                 "Is the cache warm?", "Who wrote this code?", "How many layers are there?",
                 "Would you like some coffee?", "When does the concert start?"]
    replies = ["Yes.", "No.", "Maybe.", "I think so.", "Not yet.", "Of course!", "Sure, why not?",
               "I don't know.", "It depends on the weather.", "Let me check."]
    code = ["def forward(self, x):", "    return x + 1", "for i in range(10):", "import torch",
            "x = torch.zeros(4, 8)", "if value is None:", "print('hello, world')",
            "result = [a * b for a, b in zip(xs, ys)]", "class Model:", "    pass",
            "while not done:", "    y = self.linear(x).relu()", "assert len(items) > 0",
            "with open(path) as f:", "    data = json.load(f)", "return {'key': value}"]
    words = ("people history way art world information map family government health system "
             "computer meat year thanks music person reading method data food understanding "
             "theory law bird literature problem software control knowledge power ability "
             "economics love internet television science library nature fact product idea "
             "temperature investment area society activity story industry media thing oven "
             "community definition safety quality development language management player "
             "variety video week security country exam movie organization equipment physics "
             "analysis policy series thought basis boyfriend direction strategy technology army "
             "camera freedom paper environment child instance month truth marketing university "
             "writing article department difference goal news audience fishing growth income "
             "marriage user combination failure meaning medicine philosophy teacher night "
             "chemistry disease disk energy nation road role soup advertising location success "
             "addition apartment education math moment painting politics attention decision "
             "event property shopping student wood competition distribution entertainment office "
             "population president unit category cigarette context introduction opportunity "
             "performance driver flight length magazine newspaper relationship teaching cell "
             "dealer debate finding lake member message phone scene appearance association "
             "concept customer death discussion housing inflation insurance mood woman advice "
             "blood effort expression importance opinion payment reality responsibility "
             "situation skill statement wealth application city county depth estate foundation "
             "grandmother heart perspective photo recipe studio topic collection depression "
             "imagination passion percentage resource setting ad agency college connection "
             "criticism debt description memory patience secretary solution administration "
             "aspect attitude director personality psychology recommendation response selection "
             "storage version alcohol argument complaint contract emphasis highway loss "
             "membership possession preparation steak union agreement cancer currency "
             "employment engineering entry interaction mixture preference region republic "
             "tradition virus actor classroom delivery device difficulty drama election engine "
             "football guidance hotel owner priority protection suggestion tension variation "
             "anxiety atmosphere awareness bath bread candidate climate comparison confusion "
             "construction elevator emotion employee employer guest height leadership mall "
             "manager operation recording sample transportation charity cousin disaster editor "
             "efficiency excitement extent feedback guitar homework leader mom outcome "
             "permission presentation promotion reflection refrigerator resolution revenue "
             "session singer tennis basket bonus cabinet childhood church clothes coffee dinner "
             "drawing hair hearing initiative judgment lab measurement mode mud orange poetry "
             "police possibility procedure queen ratio relation restaurant satisfaction sector "
             "signature significance song tooth town vehicle volume wife accident airport "
             "appointment arrival assumption baseball chapter committee conversation database "
             "enthusiasm error explanation farmer gate girl hall historian hospital injury "
             "instruction maintenance manufacturer meal perception pie poem presence proposal "
             "reception replacement revolution river son speech tea village warning winner "
             "worker writer assistance breath buyer chest chocolate conclusion contribution "
             "cookie courage dad desk drawer establishment examination garbage grocery honey "
             "impression improvement independence insect inspection inspector king ladder menu "
             "penalty piano potato profession professor quantity reaction requirement salad "
             "sister supermarket tongue weakness wedding affair ambition analyst apple "
             "assignment assistant bathroom bedroom beer birthday celebration championship "
             "cheek client consequence departure diamond dirt ear fortune friendship funeral "
             "gene girlfriend hat indication intention lady midnight negotiation obligation "
             "passenger pizza platform poet pollution recognition reputation shirt sir speaker "
             "stranger surgery sympathy tale throat trainer uncle youth").split()
    lines = []
    for i in range(900):
        kind = i % 9
        if kind < 3:
            s = f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}"
            s = f"{s} {rng.choice(adverbs)} {rng.choice(places)}."
            lines.append(s[0].upper() + s[1:])
        elif kind < 6:
            s = " ".join(rng.choice(words) for _ in range(rng.randrange(4, 12)))
            lines.append(s[0].upper() + s[1:] + rng.choice([".", "!", "?", ",", ";", ":"]))
        elif kind == 6:
            lines.append(f"{rng.choice(questions)} {rng.choice(replies)}")
        elif kind == 7:
            lines.append(rng.choice(code))
        else:
            a, b = rng.randrange(1000), rng.randrange(1000)
            lines.append(f"On day {rng.randrange(1, 31)}, {a} plus {b} is {a + b}; "
                         f"{a} times 3 is {a * 3}.")
    return lines


def _train_tokenizer(vocab_size: int):
    """Train the byte-level BPE tokenizer (a ``tokenizers.Tokenizer``), deterministically.

    Ids past the trained vocabulary up to ``vocab_size`` become ``<|reserved_ID|>`` entries of
    the BPE vocabulary: never produced by encoding, but decodable, so that every id a model with
    a larger (real-geometry) vocabulary generates turns into text.
    """
    from tokenizers import (Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                            processors, trainers)

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if vocab_size > tok.get_vocab_size():
        data = json.loads(tok.to_str())
        vocab = data["model"]["vocab"]
        vocab.update({f"<|reserved_{i}|>": i for i in range(tok.get_vocab_size(), vocab_size)})
        tok = Tokenizer.from_str(json.dumps(data))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, SPECIAL_TOKENS.index(BOS))],
    )
    return tok


def build_tokenizer(out_dir: str | os.PathLike, vocab_size: int = TOKENIZER_VOCAB) -> Path:
    """Train the tiny tokenizer and ``save_pretrained`` it into ``out_dir``; return the path.

    Byte-level BPE with 1024 trained tokens, ``<s>``/``</s>``/``<pad>``/``<unk>`` and a
    ChatML-like chat template on the special tokens ``<|im_start|>``/``<|im_end|>``; a larger
    ``vocab_size`` pads the vocabulary with reserved tokens (see ``_train_tokenizer``).
    """
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(vocab_size),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(out)
    return out


def _resolve(arch: str, hidden: int, layers: int, heads: int, kv_heads: int | None,
             intermediate: int | None, vocab: int | None, max_position: int, seed: int,
             dtype: str, tie_embeddings: bool | None) -> dict[str, Any]:
    """Validate the arguments and fill the derived defaults; the result names one model."""
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not supported; use one of {', '.join(ARCHS)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    if hidden % heads:
        raise ValueError(f"hidden={hidden} is not divisible by heads={heads}; "
                         "choose hidden as a multiple of heads (e.g. heads * 32)")
    if kv_heads is None:
        kv_heads = heads if arch in _NO_GQA or heads % 2 else heads // 2
    if arch in _NO_GQA and kv_heads != heads:
        raise ValueError(f"arch={arch!r} has no grouped-query attention, but kv_heads={kv_heads} "
                         f"!= heads={heads}; pass kv_heads={heads} (or leave it out)")
    if heads % kv_heads:
        raise ValueError(f"heads={heads} is not divisible by kv_heads={kv_heads}; "
                         "choose kv_heads as a divisor of heads")
    if intermediate is None:
        intermediate = 4 * hidden if arch in _NO_GQA else 2 * hidden
    if vocab is None:
        vocab = TOKENIZER_VOCAB
    if tie_embeddings is None:
        tie_embeddings = arch in _TIED_BY_DEFAULT
    if vocab < TOKENIZER_VOCAB:
        raise ValueError(f"vocab={vocab} is smaller than the tokenizer's {TOKENIZER_VOCAB} trained "
                         "tokens; pass vocab >= that (or leave it out)")
    return dict(arch=arch, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                intermediate=intermediate, vocab=vocab, max_position=max_position, seed=seed,
                dtype=dtype, tie_embeddings=tie_embeddings)


def _make_config(spec: dict[str, Any]):
    """The transformers config object for a resolved spec."""
    import transformers

    arch = spec["arch"]
    kwargs: dict[str, Any] = dict(
        vocab_size=spec["vocab"],
        hidden_size=spec["hidden"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        max_position_embeddings=spec["max_position"],
        tie_word_embeddings=spec["tie_embeddings"],
        **_TOKEN_IDS,
    )
    if arch == "opt":
        kwargs.update(ffn_dim=spec["intermediate"], word_embed_proj_dim=spec["hidden"])
    else:
        kwargs["intermediate_size"] = spec["intermediate"]
    if arch not in _NO_GQA:
        kwargs["num_key_value_heads"] = spec["kv_heads"]
    if arch in ("gemma", "qwen3"):
        kwargs["head_dim"] = spec["hidden"] // spec["heads"]  # GemmaConfig defaults to 256, Qwen3Config to 128
    if arch == "phi3_longrope":
        kwargs.update(original_max_position_embeddings=LONGROPE_ORIGINAL_MAX,
                      rope_scaling=longrope_scaling(spec["hidden"] // spec["heads"]))
    return getattr(transformers, _CONFIG_CLASSES[arch])(**kwargs)


def longrope_scaling(head_dim: int) -> dict[str, Any]:
    """Phi-3.5-style ``rope_scaling``: one short and one long factor per rotary frequency (short
    near 1, long growing to ~head_dim, as in the released models' lists)."""
    n = head_dim // 2
    return dict(type="longrope", short_factor=[round(1.0 + 0.05 * i, 4) for i in range(n)],
                long_factor=[round(1.0 + 2.0 * i, 4) for i in range(n)])


def model_type(arch: str) -> str:
    """The transformers ``model_type`` of a builder architecture (a variant's base type)."""
    return "phi3" if arch == "phi3_longrope" else arch


def _param_seed(seed: int, name: str) -> int:
    """A 64-bit seed per parameter, so values do not depend on creation order.

    Names are those of the installed transformers: where they differ between versions (gpt_neox's
    output layer is ``embed_out`` in 5.5 and ``lm_head`` in 5.19+), so do the weights.
    """
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little")


def _write_model(spec: dict[str, Any], out: Path) -> None:
    """Build the model on the meta device, fill it in place and save it with the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    build_tokenizer(out, spec["vocab"])
    config = _make_config(spec)
    dtype = getattr(torch, spec["dtype"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to_empty(device="cpu")  # uninitialised storage, one copy, already in `dtype`
    model.tie_weights()
    # Gemma's RMSNorm scales by (1 + weight): its identity weight is 0, everyone else's is 1.
    norm_weight = 0.0 if spec["arch"] == "gemma" else 1.0
    lm_head = model.get_output_embeddings().weight

    @torch.no_grad()
    def fill(item: tuple[str, torch.nn.Parameter]) -> None:
        name, param = item
        if param.ndim >= 2:
            std = (_LOGIT_STD if param is lm_head else 1.0) / param.shape[1] ** 0.5
            generator = torch.Generator().manual_seed(_param_seed(spec["seed"], name))
            param.normal_(0.0, std, generator=generator)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.fill_(norm_weight)

    # One generator per parameter: filling them in parallel keeps the result deterministic.
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        list(pool.map(fill, model.named_parameters()))
    model.generation_config = GenerationConfig(**_TOKEN_IDS)
    model.save_pretrained(out, max_shard_size=_SHARD_SIZE)


def _cache_root() -> Path:
    """The per-machine cache directory."""
    return Path(os.environ.get("AIPC_CACHE_DIR", Path.home() / ".cache" / "aipc-plugins"))


def _spec_hash(spec: dict[str, Any]) -> str:
    """Hash of everything that decides the files: arguments, builder and library versions."""
    import tokenizers
    import torch
    import transformers

    key = dict(spec, builder=BUILDER_VERSION, transformers=transformers.__version__,
               tokenizers=tokenizers.__version__, torch=torch.__version__)
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _is_complete(path: Path) -> bool:
    """Whether ``path`` holds a finished build: the manifest (written last) and its files."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return all((path / f).is_file() for f in manifest.get("files", ()))


def build_tiny_model(
    arch: str = "llama",
    out_dir: str | os.PathLike | None = None,
    *,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    vocab: int | None = None,
    max_position: int = 2048,
    seed: int = 0,
    dtype: str = "bfloat16",
    tie_embeddings: bool | None = None,
) -> Path:
    """Build (or reuse from the cache) a random ``arch`` model with the tiny tokenizer beside it.

    ``kv_heads`` defaults to ``heads // 2`` (grouped-query attention) where the architecture has
    it and to ``heads`` otherwise; ``intermediate`` to 2x ``hidden`` (4x for gpt_neox/opt);
    ``vocab`` to the tokenizer's 1024 trained tokens (a larger one, as in the ``PRESETS``, pads the
    tokenizer with reserved tokens). ``tie_embeddings`` ties the output projection to the input
    embedding (random tied models tend to repeat tokens under greedy decoding); it defaults to
    the published models' choice: tied for bitnet, untied otherwise. With
    ``out_dir=None`` the model goes into the per-machine cache and is reused when already there.
    Returns the model directory.
    """
    spec = _resolve(arch, hidden, layers, heads, kv_heads, intermediate, vocab, max_position,
                    seed, dtype, tie_embeddings)
    digest = _spec_hash(spec)
    if out_dir is None:
        final = _cache_root() / "tiny-models" / f"{arch}-{digest}"
        if _is_complete(final):
            return final
    else:
        final = Path(out_dir)
        if final.exists() and any(final.iterdir()) and not (final / MANIFEST).exists():
            raise ValueError(f"out_dir={str(final)!r} is a non-empty directory that holds no tiny "
                             "model; pass a new or empty directory")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        _write_model(spec, tmp)
        files = sorted(p.name for p in tmp.iterdir())
        manifest = dict(builder_version=BUILDER_VERSION, hash=digest, args=spec, files=files)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private
        if final.exists() and (out_dir is not None or not _is_complete(final)):
            shutil.rmtree(final, ignore_errors=True)  # an earlier build, or a damaged cache entry
        try:
            tmp.rename(final)  # atomic; fails if a concurrent build got there first
        except OSError:
            if not _is_complete(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> None:
    """Command line: build a tiny model and print its directory."""
    parser = argparse.ArgumentParser(
        prog="aipc-tiny-model", description=__doc__.split("\n\n")[0],
        epilog="Presets: " + ", ".join(PRESETS) + ". Explicit options override the preset.",
    )
    parser.add_argument("out", nargs="?", help="output directory (default: the per-machine cache)")
    parser.add_argument("--preset", choices=sorted(PRESETS))
    parser.add_argument("--arch", choices=ARCHS)
    for flag in ("hidden", "layers", "heads", "kv-heads", "intermediate", "vocab",
                 "max-position", "seed"):
        parser.add_argument(f"--{flag}", type=int)
    parser.add_argument("--dtype", choices=DTYPES)
    parser.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None)
    args = vars(parser.parse_args(argv))
    out, preset = args.pop("out"), args.pop("preset")
    kwargs = dict(PRESETS[preset]) if preset else {}
    kwargs.update({k: v for k, v in args.items() if v is not None})
    try:
        path = build_tiny_model(out_dir=out, **kwargs)
    except ValueError as e:
        parser.error(str(e))
    print(path)


if __name__ == "__main__":
    main()
