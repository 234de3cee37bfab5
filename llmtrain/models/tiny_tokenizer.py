"""The byte-level tokenizer shipped for the tiny recipes (llmtrain/assets/tokenizer).

Every byte is one token (a BPE with the 256-byte alphabet and no merges), so any text encodes,
the vocabulary stays tiny (263), and character-level tasks such as string reversal are learnable
by a two-layer model in a minute. It deliberately has no pad token: the loader gives it one the
standard way, the same path a Llama tokenizer takes. Rebuild with
`python -m llmtrain.models.tiny_tokenizer`.
"""

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<unk>"]
TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "tokenizer"


def build_tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()  # 256 printable stand-ins for bytes
    vocab = {char: i for i, char in enumerate(sorted(byte_alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        additional_special_tokens=SPECIAL_TOKENS[2:6],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


if __name__ == "__main__":
    build_tiny_tokenizer().save_pretrained(TOKENIZER_DIR)
    print(f"wrote {TOKENIZER_DIR}")
