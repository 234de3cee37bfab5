"""The byte-level tokenizer shipped for the tiny recipes (llmtrain/assets/tokenizer).

Every byte is one token (a BPE with the 256-byte alphabet and no merges), so any text encodes,
the vocabulary stays tiny (263), and character-level tasks such as string reversal are learnable
by a two-layer model in a minute. It deliberately has no pad token: the loader gives it one the
standard way, the same path a Llama tokenizer takes. Rebuild with
`python -m llmtrain.models.tiny_tokenizer`.
"""

from pathlib import Path

# Plain messages render as `<|role|>\ncontent<|end|>\n`. Tools, tool calls and tool results render in Qwen3's format
# (a `<tools>` block of JSON schemas in the system turn, `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` in
# the assistant's turn, consecutive results as `<tool_response>` blocks in one user turn), so TRL's Qwen3 response
# parser reads the calls (stages/ppo/tools/parsing.py); a conversation without tools renders as it always did.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|system|>\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|user|>' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] | string + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|assistant|>\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if call['function'] is defined %}{%- set call = call['function'] %}{%- endif %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{%- if call['arguments'] is string %}{{- call['arguments'] }}"
    "{%- else %}{{- call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|end|>\\n' }}"
    "{%- else %}"
    "{{- '<|' + message['role'] + '|>\\n' }}{{- message['content'] }}{{- '<|end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
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
