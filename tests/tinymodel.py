"""Build a tiny random Llama that a real vLLM can serve on the CPU (no hub needed).

Run with the engine venv's python (it has torch, transformers and tokenizers):
    .engine-venv/bin/python tests/tinymodel.py var/tiny-model
"""
import json
import sys
from pathlib import Path

SEED = 1234
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# ChatML; a prompt ending with the assistant header lets vLLM's chat endpoint generate.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = """\
The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.
A large language model predicts the next token from the tokens before it.
vLLM serves models with paged attention, continuous batching and an OpenAI compatible API.
GPUs hold the weights and the key value cache; the scheduler decides which requests run.
Let me think step by step. First we read the question, then we reason, then we answer.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ( ) [ ] { } " ' - _ / \\
def main(): return 42  # code is text too
User: What is the capital of France? Assistant: <think>France is a country in Europe.</think> Paris.
"""
# Word forms give the BPE trainer enough distinct pairs to reach VOCAB_SIZE.
_ROOTS = ("load shard model serve token cache batch weight graph engine host node queue stream "
          "bench port health metric reason answer capital country city river ocean mountain "
          "paris berlin rome madrid europe read write start stop watch kill signal group memory "
          "tensor layer head block page prefix decode sample compile capture warm").split()
_PREFIXES = ("", "un", "re", "pre", "over", "sub")
_SUFFIXES = ("", "s", "ed", "ing", "er", "ly", "ness", "able", "ment", "ful")


def _corpus() -> list[str]:
    words = [p + r + s for p in _PREFIXES for r in _ROOTS for s in _SUFFIXES]
    return [CORPUS] * 4 + [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]


def train_tokenizer():
    """Train the byte-level BPE tokenizer on CORPUS (the `tokenizers` library alone, which the panel has)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def _tokenizer(out: Path):
    """The trained tokenizer wrapped for transformers, saved into `out`."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(),
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<think>", "</think>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def model_files(path) -> Path:
    """The tiny model's tokenizer and config without weights, written with the panel's own packages (no torch,
    no transformers): what the fast tier's tests of prompt lengths and model copies read."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    ids = {name: tok.token_to_id(name) for name in SPECIAL_TOKENS}
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    model = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": tok.get_vocab_size(),
             "hidden_size": 128, "intermediate_size": 768, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 2048, "tie_word_embeddings": False,
             "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(model, indent=2))
    return out


def build(path) -> Path:
    """Write config, safetensors weights, tokenizer and generation_config into `path`."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    tok = _tokenizer(out)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    # Every token greedy decoding can pick has visible text: the output rows of special tokens and
    # of byte tokens that are pieces of a UTF-8 character (vLLM streams those as empty deltas until
    # the character completes) are zero, and a zero logit never beats the best of ~1,000 random
    # ones. Otherwise the first token may stream without text, and "time to first token" would
    # depend on whether a client counts empty chunks (vllm bench serve does, our runner doesn't).
    texts = [tok.decode([i], skip_special_tokens=True) for i in range(len(tok))]
    silent = [i for i, text in enumerate(texts) if not text or "\ufffd" in text]
    with torch.no_grad():
        model.lm_head.weight[silent] = 0
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        do_sample=True,
        temperature=0.7,
        max_new_tokens=64,
    )
    model.save_pretrained(out, safe_serialization=True)
    # Older vLLM tokenizer code reads the template from tokenizer_config.json only.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("chat_template", CHAT_TEMPLATE)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    params = sum(p.numel() for p in model.parameters())
    print(f"tiny model: {params:,} params, vocab {len(tok)} ({len(silent)} never picked greedily), written to {out}")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/tinymodel.py OUT_DIR")
    build(sys.argv[1])
